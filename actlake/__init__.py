"""actlake: transformer activations on disk, in the layouts downstream work wants."""

from __future__ import annotations

from pathlib import Path

from . import errors
from .batch import Batch
from .reader import Reader, TokenSegment
from .spec import StoreSpec
from .writer import Writer

__version__ = "0.1.0"


def open(path: str | Path, format: str | None = None) -> Reader:  # noqa: A001 - the public name
    """Open any stored layout (saev, zarr, lmprobe, pickle) with the one Reader protocol."""
    from .formats import open_store

    return open_store(path, format)


def verify(path: str | Path, format: str | None = None) -> list[str]:
    """Every problem found checking a store against its spec (empty: valid)."""
    from .formats import verify_store

    return verify_store(path, format)


__all__ = ["Batch", "Reader", "StoreSpec", "TokenSegment", "Writer", "errors", "open", "verify", "__version__"]
