"""Publishing to a URL: the store is built and published locally first (the writers' atomic publish: temporary
directory, fsync, rename, checksums.json sealed and verified), then uploaded file by file with every
checksums.json last, the commit marker an object store offers in place of a rename."""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Callable
from pathlib import Path

from ..errors import FormatError
from .url import CHECKSUMS, filesystem, join


def cache_root() -> Path:
    """`$ACTLAKE_CACHE`, default `~/.cache/actlake`: the saev cache and the staging area of uploads."""
    return Path(os.environ.get("ACTLAKE_CACHE") or "~/.cache/actlake").expanduser()


def staging_dir(url: str) -> Path:
    """The local root a store bound for `url` is built under: one per destination, so a rerun with the same
    arguments resumes (or finds) the local store as it would under a local --out."""
    return cache_root() / "staging" / hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]


def _files(local: Path) -> list[str]:
    """Every file under `local` as a relative POSIX path, checksums.json files last."""
    out = []
    for dirpath, _, names in os.walk(local):
        for name in names:
            out.append(Path(dirpath, name).relative_to(local).as_posix())
    return sorted(out, key=lambda p: (posixpath.basename(p) == CHECKSUMS, p))


def upload_store(local: Path, url: str) -> str:
    """Upload the published store `local` to `url`, every checksums.json after every other file.

    Remote stores are immutable: a destination that already holds a checksums.json is left alone when its
    checksums.json equals ours (published before: nothing to do) and refused otherwise (FormatError). Objects
    left by an upload that never finished (no checksums.json) are overwritten."""
    local = Path(local)
    fs, root = filesystem(url)
    files = _files(local)
    markers = [p for p in files if posixpath.basename(p) == CHECKSUMS]
    if not markers:
        raise FormatError(f"has no {CHECKSUMS}: only stores actlake published can be uploaded", local)
    present = [p for p in markers if fs.exists(posixpath.join(root, p))]
    if present:
        if all(fs.cat_file(posixpath.join(root, p)) == (local / p).read_bytes() for p in present) \
                and len(present) == len(markers):
            return url
        raise FormatError("a different store is already published here; published remote stores are immutable "
                          "(upload to another URL)", join(url, present[0]))
    for rel in files:
        fs.put_file(str(local / rel), posixpath.join(root, rel))
    return url


def publish_to(url: str, build: Callable[[Path], Path]) -> str:
    """Build a store with `build(local_root) -> published path` under the staging directory of `url`, upload it
    to `url/<its name>` and return that URL; the staged copy is removed once uploaded."""
    from ..atomic import remove_tree

    stage = staging_dir(url)
    stage.mkdir(parents=True, exist_ok=True)
    local = Path(build(stage))
    remote = join(url, local.resolve().relative_to(stage.resolve()).as_posix())
    upload_store(local, remote)
    remove_tree(stage)
    return remote
