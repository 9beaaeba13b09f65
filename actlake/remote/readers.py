"""Readers of remote stores, read in place through fsspec: zarr through zarr's FsspecStore, lmprobe through
pyarrow (the parquet index) and byte-range reads (safetensors tensors), pickle shard by shard (sha256 checked
before anything is decompressed). saev is read from its local cache (`cache.cached_saev`)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IncompleteUploadError, MetadataError, MissingFileError, TruncatedFileError, UnknownFormatError
from ..formats.lmprobe.index import read_index_metadata, read_index_table
from ..formats.lmprobe.layout import INDEX_PATH
from ..formats.lmprobe.reader import LmprobeReader
from ..formats.lmprobe.safetensors_io import TensorInfo, header_length, parse_safetensors_header
from ..formats.pickle_shards.metadata import PickleMetadata, ShardInfo
from ..formats.pickle_shards.reader import PickleReader
from ..formats.pickle_shards.shard_io import check_sha256, expected_sha256, load_shard_stream
from ..formats.zarr_logger.chunks import FdCache, missing_chunk
from ..formats.zarr_logger.layout import ACT_ARRAYS, STORE_NAME, zarr_module
from ..formats.zarr_logger.meta import StoreMeta
from ..formats.zarr_logger.reader import ZarrReader
from ..jsonio import parse_jsonl
from ..reader import Reader
from .url import CHECKSUMS, RemoteStore, relative


class _Remote:
    """What every remote reader carries: the store (filesystem, root, listing) and its URL."""

    remote: RemoteStore
    url: str
    path: Path

    def _attach(self, store: RemoteStore) -> None:
        self.remote, self.url, self.path = store, store.url, Path(store.root)

    def _rel(self, f: Path | str) -> str:
        """The relative POSIX path of a path under the store root."""
        return Path(f).relative_to(self.path).as_posix()

    def summary(self) -> dict[str, Any]:
        out = super().summary()  # type: ignore[misc]
        out["path"] = self.url
        return out


class RemoteZarrReader(_Remote, ZarrReader):
    """A Zarr v2 store read through `zarr.storage.FsspecStore` (zarr-python's own reads, one request per chunk);
    a chunk holding real tokens that the listing lacks is a MissingFileError, never read as the fill value."""

    def __init__(self, store: RemoteStore) -> None:
        self._attach(store)
        self.read_threads = 1
        self.meta = meta = StoreMeta.from_consolidated(self.path, store.json(".zmetadata"), store.has)
        self._fds = FdCache()
        self.layers, self.d_model, self.n_samples = meta.layers, meta.hidden_size, meta.n_samples
        self.max_tokens, self.r_max = meta.p_max, meta.r_max
        self._pid, self._root, self._cache = -1, None, {}
        self._direct = {name: None for name in ACT_ARRAYS}
        self._load_columns(store.where("arrays"))

    @property
    def root(self) -> Any:
        """The zarr group on an FsspecStore, opened read-only from consolidated metadata, once per process."""
        if self._root is None or self._pid != os.getpid():
            from zarr.storage import FsspecStore

            zstore = FsspecStore.from_url(self.url, read_only=True)
            try:
                self._root = zarr_module().open_consolidated(zstore, mode="r", zarr_format=2)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                raise MetadataError(f"zarr could not open the store: {exc}", self.remote.where(".zmetadata")) from exc
            self._pid = os.getpid()
        return self._root

    def _require_chunks(self, part: str, reads: list[tuple[int, int, int, int]]) -> None:
        meta = self.meta.arrays[part]
        sep, ch = meta.separator, meta.chunks
        for sample, li, t0, t1 in reads:
            for c in range(t0 // ch[2], -(-t1 // ch[2])):
                for h in range(-(-meta.shape[3] // ch[3])):
                    rel = f"arrays/{part}/" + sep.join(map(str, (sample // ch[0], li // ch[1], c, h)))
                    if not self.remote.has(rel):
                        raise missing_chunk(self.remote.where(rel), sample, li, c, ch[2])  # type: ignore[arg-type]

    def _load_jsonl(self, f: Path) -> list[dict[str, Any]] | None:
        rel = self._rel(f)
        if not self.remote.has(rel):
            return None
        where = self.remote.where(rel)
        rows = parse_jsonl(self.remote.cat(rel), where)  # type: ignore[arg-type]
        for lineno, row in enumerate(rows):
            if not isinstance(row, dict) or row.get("i") != lineno:
                raise MetadataError(f"line {lineno + 1} is not an object with \"i\": {lineno}", where)
        if len(rows) != self.n_samples:
            raise MetadataError(f"{len(rows)} lines, expected {self.n_samples}", where)
        return rows


class RangeRows:
    """The rows of one safetensors tensor of a remote file, fetched by byte range on indexing (a slice: one
    request; an index array: one request spanning its rows)."""

    def __init__(self, store: RemoteStore, rel: str, info: TensorInfo) -> None:
        self.store, self.rel, self.info = store, rel, info
        self.shape, self.dtype = tuple(info.shape), info.np_dtype
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def _rows(self, a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.empty((0, *self.shape[1:]), dtype=self.dtype)
        start = self.info.start + a * self.row_bytes
        data = self.store.cat(self.rel, start, start + (b - a) * self.row_bytes)
        if len(data) != (b - a) * self.row_bytes:
            raise TruncatedFileError(f"{len(data)} bytes returned for rows [{a}, {b})", self.store.where(self.rel))
        return np.frombuffer(data, dtype=self.dtype).reshape(b - a, *self.shape[1:])

    def __getitem__(self, key: Any) -> np.ndarray:
        n = self.shape[0]
        if isinstance(key, slice):
            a, b, step = key.indices(n)
            return self._rows(a, max(a, b))[::step] if step > 0 else self._rows(0, n)[key]
        idx = np.asarray(key, dtype=np.int64)
        if idx.ndim == 0:
            i = int(idx) + n if int(idx) < 0 else int(idx)
            return self._rows(i, i + 1)[0]
        if idx.size == 0:
            return np.empty((0, *self.shape[1:]), dtype=self.dtype)
        idx = np.where(idx < 0, idx + n, idx)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        return self._rows(lo, hi)[idx - lo]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        rows = self._rows(0, self.shape[0])
        return rows if dtype is None else rows.astype(dtype)


class RemoteLmprobeReader(_Remote, LmprobeReader):
    """An lmprobe dataset: the parquet index read by pyarrow on the fsspec filesystem, tensors by byte range."""

    _process_local = ("_maps",)

    def __init__(self, store: RemoteStore) -> None:
        self._attach(store)
        self.index_path = self.path / INDEX_PATH
        if not store.has(INDEX_PATH):
            raise MissingFileError("parquet index is missing", store.where(INDEX_PATH))
        fs = store.fs
        self._open_index(lambda p: read_index_metadata(p, fs), lambda p: read_index_table(p, fs))

    def _shard_file(self, rel: str) -> Path:
        return self.path / relative(rel, self.remote.where(INDEX_PATH))

    def _file_size(self, f: Path) -> int | None:
        return self.remote.sizes.get(self._rel(f))

    def _header(self, f: Path) -> dict[str, TensorInfo]:
        rel, size = self._rel(f), self._file_size(f) or 0
        where = self.remote.where(rel)
        n = header_length(self.remote.cat(rel, 0, 8) if size >= 8 else b"", size, where)
        return parse_safetensors_header(self.remote.cat(rel, 8, 8 + n), size, where)

    def _map(self, f: Path, info: TensorInfo) -> Any:
        return RangeRows(self.remote, self._rel(f), info)

    def _read_rows_into(self, layer: int, shard: int, first_row: int, dest: np.ndarray) -> None:
        dest[...] = self.tensor(layer, shard)[first_row : first_row + len(dest)]

    def token_segments(self, layer: int) -> list[Any]:
        """Every token row of the layer in memory: each shard's tensor fetched in one request (not one per sample)."""
        self.layer_index(layer)
        saved = dict(self._maps)
        try:
            for key in [k for k in self._files if k[0] == layer]:
                rows, info = self._mapped(*key)
                self._maps[key] = (np.asarray(rows), info)
            return Reader.token_segments(self, layer)
        finally:
            self._maps.clear()
            self._maps.update(saved)


class RemotePickleReader(_Remote, PickleReader):
    """A pickle-shard store: each shard fetched whole, its sha256 checked against metadata.json before it is
    decompressed (capped) and unpickled with the restricted unpickler."""

    def __init__(self, store: RemoteStore, *, verify_checksums: bool = True) -> None:
        self._attach(store)
        md = PickleMetadata.from_json(store.json("metadata.json"), store.where("metadata.json"))  # type: ignore[arg-type]
        self._open_store(md, verify_checksums)

    def _shard_file(self, info: ShardInfo) -> Path:
        rel = relative(info.filename, self.remote.where("metadata.json"))
        where = self.remote.where(rel)
        size = self.remote.sizes.get(rel)
        if "/" in rel:
            from ..errors import UnsafePathError

            raise UnsafePathError(f"shard filename {info.filename!r} must name a file directly in the store", where)
        if size is None:
            raise MissingFileError("shard listed in metadata.json is missing", where)
        if size != info.size_bytes:
            raise TruncatedFileError(f"size {size} bytes, metadata.json says {info.size_bytes}", where)
        return self.path / rel

    def _load_shard(self, k: int, info: ShardInfo) -> Any:
        rel = self._rel(self.files[k])
        where = self.remote.where(rel)
        want = expected_sha256(info.checksum, where) if self.verify_checksums and info.checksum is not None else None
        data = self.remote.cat(rel)
        if want is not None:
            check_sha256(hashlib.sha256(data).hexdigest(), want, where)
        return load_shard_stream(io.BytesIO(data), where, compressed=info.compressed,  # type: ignore[arg-type]
                                 max_inflated=self.inflate_cap(info))


def detect(store: RemoteStore) -> tuple[str, RemoteStore]:
    """(format, the store root to read) of what lies at a remote URL."""
    has = store.has
    if has("metadata.json") and has("shards.json"):
        return "saev", store
    if has(".zgroup"):
        return "zarr", store
    if has(f"{STORE_NAME}/.zgroup"):
        return "zarr", store.under(STORE_NAME)
    if has(INDEX_PATH):
        return "lmprobe", store
    if has("metadata.json"):
        return "pickle", store
    raise UnknownFormatError("not an activation store actlake reads remotely (saev, a single zarr store, lmprobe, "
                             "pickle; run directories of machine slices and sharded zarr runs are merged first)",
                             store.url)


def require_marker(store: RemoteStore) -> None:
    """IncompleteUploadError unless the store root holds checksums.json (uploaded last, the commit marker)."""
    if not store.has(CHECKSUMS):
        raise IncompleteUploadError(f"no {CHECKSUMS}: an incomplete upload ({CHECKSUMS} is uploaded last, as the "
                                    "commit marker); refused", store.where(CHECKSUMS))


def open_remote(url: str, format: str | None = None, *, verify: bool = False) -> Reader:
    """The Reader of the remote store at `url`; `verify=True` first checks every byte against checksums.json
    (a typed error naming the first file that does not match)."""
    from .cache import cached_by_name

    cached = cached_by_name(url) if format in (None, "saev") else None
    if cached is not None:  # a saev store's second open: a pure local read
        from ..formats import open_store

        return open_store(cached, "saev", verify=verify)
    store = RemoteStore.open(url)
    name, root = detect(store)
    if format is not None and format != name:
        raise UnknownFormatError(f"holds a {name} store, not {format}", url)
    require_marker(root)
    if name == "saev":
        from ..formats import open_store
        from .cache import cached_saev

        return open_store(cached_saev(url), "saev")  # the cached copy was checked when it was downloaded
    if verify:
        from .verify import check_remote

        check_remote(root)
    cls = {"zarr": RemoteZarrReader, "lmprobe": RemoteLmprobeReader, "pickle": RemotePickleReader}[name]
    return cls(root)
