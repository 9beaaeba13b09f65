"""Shared fixtures: small synthetic saev directories written through the real writer."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from actlake.batch import Batch  # noqa: E402
from actlake.formats.saev import SaevMetadata, SaevWriter, encode_data  # noqa: E402


def write_saev(root: Path, acts_bltd: np.ndarray, *, layers: tuple[int, ...], lengths: np.ndarray | None = None,
               patches_per_shard: int | None = None, cls_token: bool = False, family: str = "gpt2",
               batch_size: int = 3, texts: list[str] | None = None, labels: np.ndarray | None = None,
               token_labels: np.ndarray | None = None, sample_ids: np.ndarray | None = None) -> Path:
    """Write `acts_bltd` (N, L, T, D) to a saev directory under `root` in batches; return its path."""
    n, n_layers, t, d = acts_bltd.shape
    lengths = np.full(n, t) if lengths is None else lengths
    sample_ids = np.arange(n) if sample_ids is None else sample_ids
    md = SaevMetadata(
        family=family, ckpt="test-model", layers=layers, patches_per_ex=t - (1 if cls_token else 0),
        cls_token=cls_token, d_model=d, n_examples=n,
        patches_per_shard=patches_per_shard or t * n_layers * 4, data=encode_data({"name": "synthetic"}),
        dataset="/tmp/synthetic",
    )
    writer = SaevWriter(root, md, token_labels=token_labels is not None)
    for s in range(0, n, batch_size):
        sl = slice(s, min(s + batch_size, n))
        writer.write_batch(Batch(
            acts_bltd=acts_bltd[sl], lengths=lengths[sl], sample_ids=sample_ids[sl],
            texts=None if texts is None else texts[sl], labels=None if labels is None else labels[sl],
            token_labels=None if token_labels is None else token_labels[sl],
        ))
    return writer.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def flip_bit(path: Path, offset: int) -> None:
    """Flip the lowest bit of one byte of `path` (size, names and structure unchanged)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
