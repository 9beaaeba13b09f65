"""Batch: what an extractor (or a reader, when converting) hands to a writer.

A writer never knows which model produced a Batch; the engine never knows which format it
feeds. Arrays are numpy, host memory, in the writer's layer order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError


@dataclass(frozen=True)
class Batch:
    """One batch of activations for `B` samples, all stored layers, padded to `T` tokens.

    acts_bltd: [B, L, T, D] activations; the real tokens of sample b are `acts_bltd[b, :, :lengths[b]]`.
    lengths: [B] number of real tokens per sample (<= T).
    sample_ids: [B] global sample ids (int64).
    texts: optional per-sample text.
    labels: optional [B] int64 per-sample class labels (-1 = unlabelled).
    token_labels: optional [B, T] uint8 per-token labels (saev `labels.bin`).
    token_ids: optional [B, T] int64 token ids (0 in padding).
    response_bltd / response_lengths / response_texts: optional second part of a prompt/response
        pair (the Zarr logger stores the two apart); `acts_bltd` is then the prompt part.
    logits_topk_values / logits_topk_indices: optional [B, k] top-k logits at the last token.
    extra: optional per-sample columns, each a sequence of length B (lmprobe user columns).
    """

    acts_bltd: np.ndarray
    lengths: np.ndarray
    sample_ids: np.ndarray
    texts: Sequence[str] | None = None
    labels: np.ndarray | None = None
    token_labels: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    response_bltd: np.ndarray | None = None
    response_lengths: np.ndarray | None = None
    response_texts: Sequence[str] | None = None
    logits_topk_values: np.ndarray | None = None
    logits_topk_indices: np.ndarray | None = None
    extra: dict[str, Sequence[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        acts = self.acts_bltd
        if acts.ndim != 4:
            raise ConfigError(f"acts_bltd must be 4-D [batch, layer, token, dim], got shape {acts.shape}")
        b, _, t, _ = acts.shape
        lengths = np.asarray(self.lengths)
        if lengths.shape != (b,):
            raise ConfigError(f"lengths must have shape ({b},), got {lengths.shape}")
        if b and (lengths.min() < 0 or lengths.max() > t):
            raise ConfigError(f"lengths must lie in [0, {t}], got {lengths.min()}..{lengths.max()}")
        if np.asarray(self.sample_ids).shape != (b,):
            raise ConfigError(f"sample_ids must have shape ({b},)")
        for name in ("texts", "labels", "response_texts"):
            value = getattr(self, name)
            if value is not None and len(value) != b:
                raise ConfigError(f"{name} must have {b} entries, got {len(value)}")
        if self.token_labels is not None and self.token_labels.shape != (b, t):
            raise ConfigError(f"token_labels must have shape ({b}, {t}), got {self.token_labels.shape}")
        if self.token_ids is not None and self.token_ids.shape != (b, t):
            raise ConfigError(f"token_ids must have shape ({b}, {t}), got {self.token_ids.shape}")
        if (self.response_bltd is None) != (self.response_lengths is None):
            raise ConfigError("response_bltd and response_lengths come together")
        if self.response_bltd is not None:
            r = self.response_bltd
            if r.ndim != 4 or r.shape[:2] != acts.shape[:2] or r.shape[3] != acts.shape[3]:
                raise ConfigError(f"response_bltd shape {r.shape} does not match acts_bltd {acts.shape}")
        for key, column in self.extra.items():
            if len(column) != b:
                raise ConfigError(f"extra column {key!r} must have {b} entries, got {len(column)}")

    @property
    def size(self) -> int:
        """Number of samples in the batch."""
        return int(self.acts_bltd.shape[0])

    def select(self, index: slice | np.ndarray) -> "Batch":
        """The sub-batch of the samples at `index` (a slice or an integer array)."""

        def pick(value: Any) -> Any:
            if value is None:
                return None
            if isinstance(value, np.ndarray):
                return value[index]
            if isinstance(index, slice):
                return list(value)[index]
            return [value[int(i)] for i in index]

        return Batch(
            acts_bltd=self.acts_bltd[index],
            lengths=np.asarray(self.lengths)[index],
            sample_ids=np.asarray(self.sample_ids)[index],
            texts=pick(self.texts),
            labels=pick(self.labels),
            token_labels=pick(self.token_labels),
            token_ids=pick(self.token_ids),
            response_bltd=pick(self.response_bltd),
            response_lengths=pick(self.response_lengths),
            response_texts=pick(self.response_texts),
            logits_topk_values=pick(self.logits_topk_values),
            logits_topk_indices=pick(self.logits_topk_indices),
            extra={k: pick(v) for k, v in self.extra.items()},
        )
