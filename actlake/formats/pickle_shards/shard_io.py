"""Shard files of the gzip-pickle format: write with an inline sha256, load with the restricted unpickler, check."""

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
from .layout import CHECKSUM_RE, CHUNK_BYTES, PickleOptions, is_int, layer_key
from .metadata import ShardInfo


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


class _HashingReader:
    """A read-only file wrapper that hashes every byte read from it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self.sha256.update(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self._raw.readinto(buf)
        self.sha256.update(memoryview(buf)[:n])
        return n

    def readline(self, limit: int = -1) -> bytes:
        data = self._raw.readline(limit)
        self.sha256.update(data)
        return data

    def drain(self) -> None:
        """Read (and hash) whatever the unpickler left unread."""
        while self.read(CHUNK_BYTES):
            pass


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
                    verify_checksum: bool = False) -> Any:
    """Load one shard with the restricted unpickler; typed errors for truncation and corruption."""
    want = None
    if verify_checksum:
        m = CHECKSUM_RE.match(checksum or "")
        if m is None:
            raise MetadataError(f"shard has no sha256 checksum to verify (got {checksum!r})", path)
        want = m.group(1)
    if not path.is_file():
        raise MissingFileError("shard listed in metadata.json is missing", path)
    with open(path, "rb") as raw:
        reader = _HashingReader(raw) if want is not None else None
        stream: Any = raw if reader is None else reader
        try:
            if compressed:
                with gzip.GzipFile(fileobj=stream, mode="rb") as gz:
                    obj = safe_load(gz, source=path)  # type: ignore[arg-type]
            else:
                obj = safe_load(stream, source=path)
        except UnsafePickleError as exc:
            cause = exc.__cause__
            if isinstance(cause, EOFError) or "truncated" in str(cause):
                raise TruncatedFileError(f"shard ends early ({cause})", path) from exc
            if isinstance(cause, (gzip.BadGzipFile, zlib.error, OSError)):
                raise FormatError(f"not a valid gzip stream ({cause})", path) from exc
            raise
        if reader is not None:
            reader.drain()
            got = reader.sha256.hexdigest()
            if got != want:
                raise HashMismatchError(f"checksum sha256:{got} does not match metadata.json sha256:{want}", path)
    return obj


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
