"""Activation dtype codecs: float32 <-> bfloat16 bit patterns, and rows in a storage dtype's layout."""

from __future__ import annotations

import numpy as np


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """Activations in the storage dtype's bit layout (C-contiguous)."""
    if dtype == "bfloat16":
        return to_bfloat16_bits(np.asarray(x, dtype=np.float32))
    return np.ascontiguousarray(x, dtype=np.dtype(dtype))
