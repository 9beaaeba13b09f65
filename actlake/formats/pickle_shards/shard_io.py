"""Shard files of the gzip-pickle format: write with an inline sha256; load after checking that sha256 over the
bytes on disk, decompressing at most what metadata.json allows, with the restricted unpickler; check."""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from ... import hashing
from ...errors import (
    FormatError,
    HashMismatchError,
    MetadataError,
    MissingFileError,
    TruncatedFileError,
    UnsafePickleError,
)
from ...safe_pickle import safe_load
from .layout import CHECKSUM_RE, PickleOptions, is_int, layer_key
from .metadata import ShardInfo

#: inflate_cap's allowances: per item (keys, shape, 200-character preview, metadata), per sample (its full
#: text, stored once), per shard; and the cap for a store whose metadata.json gives no row count or width
ITEM_BYTES = 4 << 10
SAMPLE_BYTES = 1 << 20
SHARD_BYTES = 1 << 20
UNKNOWN_SHAPE_BYTES = 8 << 30


class _HashingWriter:
    """A write-only file wrapper that hashes and counts every byte as it is written."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._raw.flush()


class _Capped:
    """A read-only stream that delivers at most `cap` bytes in all: a decompression bomb is refused as soon as the
    unpickler asks for more, before those bytes are inflated (and before a buffer is filled for them)."""

    def __init__(self, raw: IO[bytes], cap: int, path: Path) -> None:
        self._raw = raw
        self._cap = cap
        self._path = path
        self.used = 0

    def _refuse(self) -> FormatError:
        return FormatError(f"decompresses to more than {self._cap} bytes, the most its metadata.json entry "
                           f"allows (num_samples x layers x rows x hidden, docs/formats/pickle.md); not inflated "
                           f"further", self._path)

    def _count(self, n: int) -> None:
        self.used += n
        if self.used > self._cap:
            raise self._refuse()

    def read(self, n: int | None = -1) -> bytes:
        left = self._cap - self.used
        if n is None or n < 0:
            n = left + 1  # all of it: at most one byte past the cap, to see whether there is more
        elif n > left:
            raise self._refuse()
        data = self._raw.read(n)
        self._count(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        if memoryview(buf).nbytes > self._cap - self.used:
            raise self._refuse()
        n = self._raw.readinto(buf)  # type: ignore[attr-defined]
        self._count(n)
        return n

    def readline(self, limit: int = -1) -> bytes:
        left = self._cap - self.used + 1
        data = self._raw.readline(left if limit is None or limit < 0 else min(limit, left))
        self._count(len(data))
        return data


def write_shard(path: Path, shard: dict[str, Any], options: PickleOptions) -> tuple[int, str]:
    """Pickle (and gzip) `shard` to `path`, fsynced; return (size in bytes, "sha256:<hex>").

    The checksum is computed over the bytes as they are written (no second pass).
    """
    with open(path, "wb") as raw:
        out = _HashingWriter(raw)
        if options.compressed:
            with gzip.GzipFile(filename="", mode="wb", compresslevel=options.compresslevel,
                               fileobj=out, mtime=0) as gz:  # type: ignore[arg-type]
                _dump(shard, gz, options.pickle_protocol)
        else:
            _dump(shard, out, options.pickle_protocol)
        raw.flush()
        os.fsync(raw.fileno())
    return out.size, f"sha256:{out.sha256.hexdigest()}"


def _dump(obj: Any, f: Any, protocol: int) -> None:
    """Pickle `obj` into the file-like `f` (the hashing wrapper or the gzip stream over it)."""
    pickle.Pickler(f, protocol=protocol).dump(obj)


def load_shard_file(path: Path, *, compressed: bool, checksum: str | None = None,
                    verify_checksum: bool = False, max_inflated: int | None = None) -> Any:
    """Load one shard with the restricted unpickler; typed errors for truncation and corruption.

    `verify_checksum`: the sha256 of the bytes on disk (the compressed ones) must equal `checksum`, checked
    in one streaming pass before anything is decompressed or unpickled. `max_inflated`: the most bytes
    the (decompressed) pickle stream may hold; a stream asking for more is refused there, unread beyond it.
    """
    want = expected_sha256(checksum, path) if verify_checksum else None
    if not path.is_file():
        raise MissingFileError("shard listed in metadata.json is missing", path)
    if want is not None:
        check_sha256(hashing.file_sha256(path), want, path)
    with open(path, "rb") as raw:
        return load_shard_stream(raw, path, compressed=compressed, max_inflated=max_inflated)


def expected_sha256(checksum: str | None, path: Path | str) -> str:
    """The hex digest of a shard entry's `sha256:<hex>` checksum (MetadataError when it has none)."""
    m = CHECKSUM_RE.match(checksum or "")
    if m is None:
        raise MetadataError(f"shard has no sha256 checksum to verify (got {checksum!r})", path)
    return m.group(1)


def check_sha256(got: str, want: str, path: Path | str) -> None:
    """HashMismatchError naming the shard when the sha256 of its bytes is not the one metadata.json records."""
    if got != want:
        raise HashMismatchError(f"checksum sha256:{got} does not match metadata.json sha256:{want}; "
                                f"not decompressed or unpickled", path)


def load_shard_stream(raw: IO[bytes], path: Path, *, compressed: bool, max_inflated: int | None = None) -> Any:
    """Decompress (capped at `max_inflated`) and unpickle, with the restricted unpickler, one shard's bytes
    read from `raw` (a file, or the checked bytes of a remote shard); typed errors name `path`."""
    try:
        if compressed:
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                return safe_load(_capped(gz, max_inflated, path), source=path)  # type: ignore[arg-type]
        return safe_load(_capped(raw, max_inflated, path), source=path)  # type: ignore[arg-type]
    except UnsafePickleError as exc:
        cause = exc.__cause__
        if isinstance(cause, EOFError) or "truncated" in str(cause):
            raise TruncatedFileError(f"shard ends early ({cause})", path) from exc
        if isinstance(cause, (gzip.BadGzipFile, zlib.error, OSError)):
            raise FormatError(f"not a valid gzip stream ({cause})", path) from exc
        if isinstance(cause, MemoryError):
            raise FormatError("the pickle declares an object larger than this process may allocate; "
                              "refused", path) from None
        raise


def _capped(stream: IO[bytes], cap: int | None, path: Path) -> IO[bytes] | _Capped:
    return stream if cap is None else _Capped(stream, cap, path)


def inflate_cap(num_samples: int, n_layers: int, rows: int | None, d_model: int | None) -> int:
    """The most bytes one shard's pickle may hold: per item its activation (rows x hidden, at 8 bytes a value
    so float64 items fit too) and ITEM_BYTES of keys, shape and preview; per sample SAMPLE_BYTES for its full
    text; SHARD_BYTES in all. Without a row count or width from metadata.json: UNKNOWN_SHAPE_BYTES."""
    if rows is None or d_model is None:
        return UNKNOWN_SHAPE_BYTES
    return num_samples * (n_layers * (rows * d_model * 8 + ITEM_BYTES) + SAMPLE_BYTES) + SHARD_BYTES


def file_sha256(path: Path) -> str:
    """`sha256:<hex>` of a file's bytes (the spec's checksum notation)."""
    return f"sha256:{hashing.file_sha256(path)}"


@dataclass(frozen=True)
class ShardContent:
    """What one loaded shard says about its samples (first layer's item order)."""

    sample_ids: np.ndarray
    rows: np.ndarray  # activation rows per sample
    token_counts: np.ndarray
    labels: np.ndarray | None
    texts: list[str]
    d_model: int | None  # activation width (None: the shard holds no samples)


def check_shard(data: Any, info: ShardInfo, layers: Sequence[int], d_model: int | None, path: Path) -> ShardContent:
    """Validate the structure of a loaded shard against its metadata entry; raise FormatError."""
    if not isinstance(data, dict):
        raise FormatError(f"shard must hold a dict, got {type(data).__name__}", path)
    if set(info.layers) != set(layers):
        raise MetadataError(f"shard {info.filename} holds layers {list(info.layers)}, expected every extracted "
                            f"layer {list(layers)}", path)
    first: list[int] | None = None
    rows: list[int] = []
    counts: list[int] = []
    labels: list[int] = []
    texts: list[str] = []
    for layer in layers:
        key = layer_key(layer)
        items = data.get(key)
        if not isinstance(items, list):
            raise FormatError(f"key {key!r} is missing or not a list", path)
        if len(items) != info.num_samples:
            raise FormatError(f"{key} has {len(items)} items, metadata.json says num_samples={info.num_samples}", path)
        ids = []
        layer_rows = []
        for j, item in enumerate(items):
            if not isinstance(item, dict) or "activation" not in item or not is_int(item.get("sample_idx")):
                raise FormatError(f"{key}[{j}] must be a dict with an integer sample_idx and an activation", path)
            act = item["activation"]
            if not isinstance(act, np.ndarray) or act.ndim != 2 or act.dtype.kind != "f":
                raise FormatError(f"{key}[{j}].activation must be a 2-D float array", path)
            if d_model is None:
                d_model = int(act.shape[1])  # a store without hidden_size: the first activation sets it
            if act.shape[1] != d_model:
                raise FormatError(f"{key}[{j}].activation has width {act.shape[1]}, expected {d_model}", path)
            ids.append(int(item["sample_idx"]))
            layer_rows.append(act.shape[0])
            if first is None:
                meta = item.get("metadata") if isinstance(item.get("metadata"), dict) else {}
                count = meta.get("token_count")
                rows.append(act.shape[0])
                counts.append(int(count) if is_int(count) and 0 <= count <= act.shape[0] else act.shape[0])
                label = meta.get("label")
                labels.append(int(label) if is_int(label) else -1)
                text = meta.get("text")
                preview = item.get("text_preview")
                texts.append(text if isinstance(text, str) else preview if isinstance(preview, str) else "")
        if first is None:
            first = ids
        elif ids != first:
            raise FormatError(f"{key} lists samples in another order than {layer_key(layers[0])}", path)
        elif layer_rows != rows:
            j = next(j for j, (a, b) in enumerate(zip(layer_rows, rows)) if a != b)
            raise FormatError(f"{key}[{j}].activation has {layer_rows[j]} rows, {layer_key(layers[0])}[{j}] has "
                              f"{rows[j]}: every layer of a sample must hold the same tokens", path)
    has_labels = any(x != -1 for x in labels)
    return ShardContent(np.asarray(first or [], dtype=np.int64), np.asarray(rows, dtype=np.int64),
                        np.asarray(counts, dtype=np.int64),
                        np.asarray(labels, dtype=np.int64) if has_labels else None, texts, d_model)
