"""actlake.finite: NaN / Inf found by their bits in raw little-endian floats, block by block (the checksums pass)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from actlake.finite import FiniteCheck, FloatRegion


def _blocks(data: bytes, size: int):
    for off in range(0, len(data), size):
        yield off, memoryview(data[off : off + size])


def _scan(check: FiniteCheck, data: bytes, size: int):
    hits = [h for off, view in _blocks(data, size) if (h := check(off, view)) is not None]
    return min(hits) if hits else None


@pytest.mark.parametrize("kind, dtype", [("f2", "<f2"), ("f4", "<f4"), ("f8", "<f8")])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_first_non_finite_value_is_found(tmp_path: Path, kind: str, dtype: str, bad: float) -> None:
    values = np.random.default_rng(0).standard_normal(300).astype(dtype)
    values[[123, 200]] = bad
    data = b"HEAD" + values.tobytes()
    f = tmp_path / "x.bin"
    f.write_bytes(data)
    size = values.itemsize
    check = FiniteCheck(f, [FloatRegion(4, len(data), kind, "values", 10 * size, "row")])
    for block in (7, 64, 1 << 20):  # block ends inside elements: straddling ones are read on their own
        pos, message = _scan(check, data, block)
        assert pos == 4 + 123 * size and "row 12" in message and "non-finite" in message


def test_bfloat16_bits_and_clean_data(tmp_path: Path) -> None:
    bits = (np.random.default_rng(1).standard_normal(64).astype("<f4").view("<u4") >> 16).astype("<u2")
    f = tmp_path / "bf16.bin"
    f.write_bytes(bits.tobytes())
    check = FiniteCheck(f, [FloatRegion(0, bits.nbytes, "bf16")])
    assert _scan(check, bits.tobytes(), 16) is None
    bits[40] = 0x7F80  # +Inf
    f.write_bytes(bits.tobytes())
    assert _scan(check, bits.tobytes(), 16)[0] == 80


def test_only_the_regions_are_checked(tmp_path: Path) -> None:
    values = np.array([np.nan, 1.0, 2.0, np.nan], "<f4")
    f = tmp_path / "r.bin"
    f.write_bytes(values.tobytes())
    assert FiniteCheck(f, [FloatRegion(4, 12, "f4")])(0, memoryview(values.tobytes())) is None
    assert FiniteCheck(f, [FloatRegion(4, 16, "f4")])(0, memoryview(values.tobytes()))[0] == 12
