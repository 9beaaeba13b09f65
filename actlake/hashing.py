"""sha256 of a file, read in blocks: the identity of weights, datasets, checkpoints and shards."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK_BYTES = 8 << 20


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK_BYTES), b""):
            h.update(block)
    return h.hexdigest()
