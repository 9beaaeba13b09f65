"""Non-finite values (NaN, Inf) in raw little-endian float data on disk, found while a file streams past.

A `FiniteCheck` is an inspector of the checksums scan (`actlake.checksums`): verify reads every data byte
once, for its checksum and for its values, block by block in bounded memory. Formats say where their
floats are (`FloatRegion`: byte range, element kind, what to call it in a message).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .store_walk import open_regular

#: element kinds: numpy dtype of the bytes, and for bfloat16 (no numpy dtype) the exponent mask of its bits
KINDS: dict[str, tuple[str, int | None]] = {"f2": ("<f2", None), "f4": ("<f4", None), "f8": ("<f8", None),
                                            "bf16": ("<u2", 0x7F80)}


@dataclass(frozen=True)
class FloatRegion:
    """Floats of one kind at bytes [start, stop) of a file; `label` names them and `row_bytes` (when > 0) turns a
    byte offset into the number of a `row_name` (row, example, token) in messages."""

    start: int
    stop: int
    kind: str
    label: str = "values"
    row_bytes: int = 0
    row_name: str = "row"

    @property
    def itemsize(self) -> int:
        return 2 if self.kind in ("f2", "bf16") else int(self.kind[1])

    def describe(self, pos: int) -> str:
        where = f"{self.row_name} {(pos - self.start) // self.row_bytes}" if self.row_bytes else f"byte {pos}"
        return f"{self.label} hold a non-finite value (NaN or Inf) at {where}"


def _bad_index(data: memoryview, kind: str) -> int | None:
    """Index of the first non-finite element of `data` (whole elements of `kind`), or None."""
    dtype, mask = KINDS[kind]
    values = np.frombuffer(data, dtype=dtype)
    if mask is None:
        ok = np.isfinite(values)
    else:
        ok = (values & np.uint16(mask)) != np.uint16(mask)
    if ok.all():
        return None
    return int(np.argmin(ok))


class FiniteCheck:
    """Inspector: called with (file offset, bytes) of each data block; returns (offset, message) of the first
    non-finite value in the block, or None. Regions should start on an element boundary of the block grid;
    an element straddling two blocks is read on its own (`os.pread`)."""

    def __init__(self, path: Path, regions: Sequence[FloatRegion]) -> None:
        self.path = Path(path)
        self.regions = tuple(r for r in regions if r.stop > r.start)

    def __call__(self, offset: int, data: memoryview) -> tuple[int, str] | None:
        end = offset + len(data)
        found: tuple[int, str] | None = None
        for r in self.regions:
            lo, hi = max(r.start, offset), min(r.stop, end)
            if lo >= hi:
                continue
            size = r.itemsize
            first = r.start + -(-(lo - r.start) // size) * size
            last = r.start + (hi - r.start) // size * size
            pos = None
            if last > first:
                k = _bad_index(data[first - offset : last - offset], r.kind)
                pos = None if k is None else first + k * size
            if pos is None and last < hi == end and last + size <= r.stop:  # one element spans the block end
                pos = last if _bad_index(memoryview(self._element(last, size)), r.kind) is not None else None
            if pos is not None and (found is None or pos < found[0]):
                found = (pos, r.describe(pos))
        return found

    def _element(self, pos: int, size: int) -> bytes:
        fd = open_regular(self.path)
        try:
            return os.pread(fd, size, pos).ljust(size, b"\0")
        finally:
            os.close(fd)
