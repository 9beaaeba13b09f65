"""URLs: which strings are object-storage URLs, their fsspec filesystem, and a remote store's listing."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import IncompleteUploadError, MetadataError, MissingFileError, UnsafePathError
from ..jsonio import MAX_JSON_BYTES, parse_json

CHECKSUMS = "checksums.json"
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_url(value: object) -> bool:
    """A string of the form `scheme://...` other than file:// (which is a local path)."""
    if not isinstance(value, str):
        return False
    m = _SCHEME.match(value)
    return m is not None and m.group(1).lower() != "file"


def local_path(value: str | Path) -> str | Path:
    """`file:///x/y` as the local path `/x/y`; anything else unchanged."""
    if isinstance(value, str) and value.lower().startswith("file://"):
        return value[len("file://"):]
    return value


def join(url: str, *parts: str) -> str:
    """`url` with relative POSIX `parts` appended."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path on it) of a URL. s3:// takes its endpoint from AWS_ENDPOINT_URL and its
    credentials from the usual AWS_* variables (botocore reads both); nothing actlake-specific."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return fs, path.rstrip("/")


def relative(relative_path: str, source: str) -> str:
    """A relative POSIX path read from a store's metadata, refused (UnsafePathError) if it leaves the store."""
    norm = posixpath.normpath(relative_path) if relative_path else ""
    if not relative_path or norm.startswith(("/", "../")) or norm in (".", "..") or "\\" in relative_path:
        raise UnsafePathError(f"path {relative_path!r} leaves the store or is empty", source)
    return norm


def listed_key(path: str, root: str, url: str) -> str:
    """The relative path of a listed object. An object key is any string: one with an empty, `.` or `..`
    component or a backslash (which a download would write outside its folder) is refused, UnsafePathError."""
    raw = path.rstrip("/")
    rel = raw[len(root) + 1 :] if raw.startswith(root + "/") else posixpath.relpath(raw, root)
    if not rel or "\\" in rel or any(part in ("", ".", "..") for part in rel.split("/")):
        raise UnsafePathError(f"object key {rel!r} leaves the store or has an empty, '.' or '..' component; "
                              "refused", url)
    return rel


@dataclass
class RemoteStore:
    """One store at a URL: its filesystem, its root on it, and the sizes of every object under the root."""

    url: str
    fs: Any
    root: str
    sizes: dict[str, int] = field(default_factory=dict)  # relative POSIX path -> bytes

    @classmethod
    def open(cls, url: str, *, require_checksums: bool = True) -> "RemoteStore":
        """List the store at `url` (one listing); MissingFileError when nothing is there; IncompleteUploadError
        when no checksums.json lies at the root or at a nested store root (an upload that never finished)."""
        fs, root = filesystem(url)
        store = cls(url.rstrip("/"), fs, root)
        fs.invalidate_cache()  # a listing cached earlier in this process may predate an upload
        try:
            found = fs.find(root, detail=True)
        except FileNotFoundError:
            found = {}
        for path, info in found.items():
            if info.get("type", "file") == "file":
                store.sizes[listed_key(path, root, store.url)] = int(info.get("size") or 0)
        if not store.sizes:
            raise MissingFileError("nothing is stored at this URL", store.url)
        if require_checksums and not store.checksum_roots():
            raise IncompleteUploadError(f"no {CHECKSUMS}: an incomplete upload ({CHECKSUMS} is uploaded last, "
                                        f"as the commit marker); refused", join(store.url, CHECKSUMS))
        return store

    def checksum_roots(self) -> list[str]:
        """Relative folders ("" for the root) that hold a checksums.json."""
        return sorted(posixpath.dirname(p) for p in self.sizes if posixpath.basename(p) == CHECKSUMS)

    def has(self, rel: str) -> bool:
        return rel in self.sizes

    def path(self, rel: str) -> str:
        """Path on the filesystem of a relative path."""
        return posixpath.join(self.root, rel) if rel else self.root

    def where(self, rel: str) -> str:
        """URL of a relative path (for messages)."""
        return join(self.url, rel)

    def cat(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of one object (all of it by default); MissingFileError naming its URL."""
        if rel not in self.sizes:
            raise MissingFileError(f"required file {posixpath.basename(rel)} is missing", self.where(rel))
        return self.fs.cat_file(self.path(rel), start=start, end=end)

    def json(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
        """Parsed JSON of one object, its size checked against `max_bytes` before it is fetched."""
        size = self.sizes.get(rel)
        if size is not None and size > max_bytes:
            raise MetadataError(f"{size} bytes is more than a metadata file may hold ({max_bytes}); refused unread",
                                self.where(rel))
        return parse_json(self.cat(rel), self.where(rel))  # type: ignore[arg-type]

    def under(self, rel: str) -> "RemoteStore":
        """The store at a sub-folder (same listing, re-rooted)."""
        prefix = rel.rstrip("/") + "/"
        return RemoteStore(self.where(rel), self.fs, self.path(rel),
                           {p[len(prefix):]: n for p, n in self.sizes.items() if p.startswith(prefix)})
