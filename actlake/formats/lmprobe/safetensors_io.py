"""safetensors files without the library: a streamed (reserved-header) shard writer, and a checked header parser."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actlake.errors import (
    ConfigError,
    FormatError,
    MissingFileError,
    TruncatedFileError,
)
from actlake.formats.lmprobe.layout import MAX_HEADER_BYTES, ST_NUMPY
from actlake.jsonio import parse_json


def _round8(n: int) -> int:
    """`n` rounded up to a multiple of 8 (safetensors aligns the data region)."""
    return (n + 7) // 8 * 8


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a safetensors file being written: key, dtype code, element size, row shape."""

    key: str
    code: str
    itemsize: int
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the first axis is the row axis)."""
        return self.itemsize * math.prod(self.row_shape)


def _header_json(slots: Sequence[TensorSlot], n_rows: int, tensor_bytes: Sequence[int]) -> str:
    """The header JSON of `slots` stored back to back, each with `n_rows` rows."""
    obj: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for slot, nbytes in zip(slots, tensor_bytes):
        obj[slot.key] = {"dtype": slot.code, "shape": [n_rows, *slot.row_shape], "data_offsets": [start, start + nbytes]}
        start += nbytes
    return json.dumps(obj, separators=(",", ":"))


class SafetensorsShard:
    """A safetensors file streamed row by row.

    With `n_rows` known, every tensor's region is fixed and rows are written at their offsets
    (several tensors per file). With `n_rows=None` (one tensor only) rows are appended. The
    header region is reserved up front and written on `finish()`, padded with spaces.
    """

    def __init__(self, path: Path, slots: Sequence[TensorSlot], n_rows: int | None) -> None:
        if n_rows is None and len(slots) != 1:
            raise ConfigError("a safetensors shard of unknown row count holds exactly one tensor", path)
        self.path = path
        self.slots = tuple(slots)
        self.n_rows = n_rows
        worst = 10**15 if n_rows is None else n_rows
        worst_bytes = [10**19 if n_rows is None else worst * s.row_bytes for s in self.slots]
        self.header_size = _round8(len(_header_json(self.slots, worst, worst_bytes)))
        self.data_start = 8 + self.header_size
        self.appended = 0
        self.written = [0] * len(self.slots)
        bases, base = [], self.data_start
        for s in self.slots:
            bases.append(base)
            base += (n_rows or 0) * s.row_bytes
        self._bases = tuple(bases)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * self.data_start)
            if n_rows is not None:
                f.truncate(base)

    def write_rows(self, slot_index: int, first_row: int, rows: np.ndarray) -> None:
        """Write `rows` (C-contiguous, row shape of the slot) at row `first_row` of tensor `slot_index`."""
        slot = self.slots[slot_index]
        data = np.ascontiguousarray(rows)
        if self.n_rows is None:
            offset = self.data_start + self.appended * slot.row_bytes
            self.appended += len(data)
        else:
            if first_row + len(data) > self.n_rows:
                raise ConfigError(f"{len(data)} rows at {first_row} overflow {self.n_rows} rows", self.path)
            offset = self._bases[slot_index] + first_row * slot.row_bytes
        self.written[slot_index] += len(data)
        if data.size:
            with open(self.path, "r+b") as f:
                f.seek(offset)
                f.write(memoryview(data).cast("B"))

    def append(self, rows: np.ndarray) -> None:
        """Append rows to the single tensor of an unknown-length shard."""
        self.write_rows(0, self.appended, rows)

    @property
    def rows(self) -> int:
        """Rows per tensor: fixed, or appended so far."""
        return self.appended if self.n_rows is None else self.n_rows

    def finish(self) -> None:
        """Write the real header (checking every row was written)."""
        n = self.rows
        for slot, count in zip(self.slots, self.written):
            if count != n:
                raise FormatError(f"tensor {slot.key!r} got {count} rows, expected {n}", self.path)
        text = _header_json(self.slots, n, [n * s.row_bytes for s in self.slots])
        if len(text) > self.header_size:
            raise FormatError("safetensors header outgrew its reserved space", self.path)
        with open(self.path, "r+b") as f:
            f.write(struct.pack("<Q", self.header_size) + text.ljust(self.header_size).encode("utf-8"))
            f.truncate(self.data_start + sum(n * s.row_bytes for s in self.slots))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a parsed safetensors header: dtype code, shape, absolute byte range."""

    key: str
    code: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype that maps the bytes (bfloat16 as uint16)."""
        return ST_NUMPY[self.code]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors file's header (8-byte length + JSON) and check the file's size against it."""
    if not path.is_file():
        raise MissingFileError("safetensors shard is missing", path)
    size = path.stat().st_size
    if size < 8:
        raise TruncatedFileError(f"{size} bytes: too short for a safetensors header", path)
    with open(path, "rb") as f:
        header_len = header_length(f.read(8), size, path)
        return parse_safetensors_header(f.read(header_len), size, path)


def header_length(first8: bytes, size: int, path: Path | str) -> int:
    """The header length a safetensors file of `size` bytes declares in its first 8 bytes, checked against the
    cap (MAX_HEADER_BYTES) and the file size before anything of that length is read."""
    if size < 8 or len(first8) < 8:
        raise TruncatedFileError(f"{size} bytes: too short for a safetensors header", path)
    (header_len,) = struct.unpack("<Q", first8[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise TruncatedFileError(f"header length {header_len} does not fit in the file ({size} bytes)", path)
    return int(header_len)


def parse_safetensors_header(raw: bytes, size: int, path: Path | str) -> dict[str, TensorInfo]:
    """The tensors of a header JSON `raw` (read after the 8 length bytes) of a file of `size` bytes, each checked
    against its dtype, shape and the file's size."""
    header_len = len(raw)
    header = parse_json(raw, path, "the safetensors header")
    if not isinstance(header, dict):
        raise FormatError("safetensors header is not a JSON object", path)
    data_start = 8 + header_len
    out: dict[str, TensorInfo] = {}
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            code = entry["dtype"]
            shape = tuple(int(x) for x in entry["shape"])
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"tensor {key!r} has a malformed header entry: {exc!r}", path) from None
        if not isinstance(code, str) or code not in ST_NUMPY:
            raise FormatError(f"tensor {key!r} has unsupported dtype {code!r}", path)
        if any(d < 0 for d in shape) or begin < 0 or stop < begin:
            raise FormatError(f"tensor {key!r} has a negative shape or byte range", path)
        want = math.prod(shape) * ST_NUMPY[code].itemsize  # Python ints: an absurd shape cannot wrap around
        if stop - begin != want:
            raise FormatError(f"tensor {key!r} spans {stop - begin} bytes, its shape {list(shape)} needs {want}", path)
        out[key] = TensorInfo(key, code, shape, data_start + begin, want)
        end = max(end, stop)
    if data_start + end != size:
        raise TruncatedFileError(f"file is {size} bytes, its header describes {data_start + end}", path)
    return out


def map_tensor(path: Path, info: TensorInfo) -> np.ndarray:
    """A read-only memmap of one tensor (np.empty for zero-size tensors)."""
    if info.nbytes == 0:
        return np.empty(info.shape, dtype=info.np_dtype)
    return np.memmap(path, dtype=info.np_dtype, mode="r", offset=info.start, shape=info.shape)
