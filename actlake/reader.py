"""The Reader protocol every format implements, and `open()` which picks the format."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .batch import Batch
from .errors import LayerNotStoredError, SampleIndexError


@dataclass(frozen=True)
class TokenSegment:
    """A run of samples whose real tokens for one layer are rows of one 2-D array.

    rows_2d: (R, D) array (usually a memmap); sample k's token t is row `base_rows[k] + t`.
    base_rows: [n] first row of each sample; lengths: [n] real tokens per sample.
    first_sample: position (0..N-1) of the segment's first sample in the reader.
    """

    rows_2d: np.ndarray
    base_rows: np.ndarray
    lengths: np.ndarray
    first_sample: int

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def row_index(self) -> np.ndarray:
        """Row numbers of every real token, in (sample, token) order (int64)."""
        lengths = self.lengths.astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        return np.repeat(self.base_rows.astype(np.int64), lengths) + within

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample position, token index) of token positions within this segment."""
        ends = np.cumsum(self.lengths.astype(np.int64))
        k = np.searchsorted(ends, positions, side="right")
        starts = ends - self.lengths
        return self.first_sample + k, positions - starts[k]


class Reader(ABC):
    """One read API for every layout. Subclasses fill the attributes and implement `get`."""

    format: str = "?"
    path: Path
    layers: tuple[int, ...]
    d_model: int
    n_samples: int
    dtype: np.dtype
    max_tokens: int

    # ---- per-sample metadata -------------------------------------------------------------
    @property
    @abstractmethod
    def lengths(self) -> np.ndarray:
        """[N] number of real tokens per sample (int64)."""

    @property
    def sample_ids(self) -> np.ndarray:
        """[N] global sample ids (int64); positions when the format stores none."""
        return np.arange(self.n_samples, dtype=np.int64)

    @property
    def texts(self) -> list[str] | None:
        """Per-sample text where the format stores it."""
        return None

    @property
    def labels(self) -> np.ndarray | None:
        """[N] per-sample class labels (int64, -1 = none) where stored."""
        return None

    @property
    def token_labels(self) -> np.ndarray | None:
        """[N, T] per-token labels (uint8) where stored."""
        return None

    @property
    def provenance(self) -> dict[str, Any]:
        """Where the data came from (model, checkpoint hash, dataset, versions)."""
        return {}

    @property
    def cls_token(self) -> bool:
        """Whether token 0 of every sample is a CLS token (vision models); False where the store records none.

        Part of the protocol so conversion carries it through every format (a saev target splits
        `max_tokens` into CLS + `patches_per_ex` with it)."""
        return False

    # ---- addressing ----------------------------------------------------------------------
    def layer_index(self, layer: int) -> int:
        """Position of `layer` on the stored layer axis; raises if it is not stored."""
        try:
            return self.layers.index(int(layer))
        except ValueError:
            raise LayerNotStoredError(
                f"layer {layer} is not stored; stored layers are {list(self.layers)}", self.path
            ) from None

    def check_sample(self, sample: int) -> int:
        """Validate a sample position (negative counts from the end) and return it."""
        s = int(sample)
        if s < 0:
            s += self.n_samples
        if not 0 <= s < self.n_samples:
            raise SampleIndexError(f"sample {sample} out of range [0, {self.n_samples})", self.path)
        return s

    def check_samples(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """Vectorised `check_sample` for an index array (int64)."""
        idx = np.asarray(samples, dtype=np.int64).reshape(-1)
        idx = np.where(idx < 0, idx + self.n_samples, idx)
        bad = (idx < 0) | (idx >= self.n_samples)
        if bad.any():
            raise SampleIndexError(
                f"sample {int(np.asarray(samples).reshape(-1)[bad.argmax()])} out of range [0, {self.n_samples})",
                self.path,
            )
        return idx

    # ---- reading -------------------------------------------------------------------------
    @abstractmethod
    def get(self, sample: int, layer: int) -> np.ndarray:
        """The (T_i, D) activations of one sample at one layer (real tokens only)."""

    def batch(self, samples: Sequence[int] | np.ndarray, layers: Sequence[int] | None = None) -> Batch:
        """A Batch of the given samples and layers, padded to `max_tokens`."""
        idx = self.check_samples(samples)
        layer_list = list(self.layers if layers is None else layers)
        for layer in layer_list:
            self.layer_index(layer)
        acts = np.zeros((len(idx), len(layer_list), self.max_tokens, self.d_model), dtype=self.dtype)
        lengths = self.lengths[idx]
        for b, s in enumerate(idx):
            for j, layer in enumerate(layer_list):
                x = self.get(int(s), layer)
                acts[b, j, : x.shape[0]] = x
        return self._batch_meta(idx, acts, lengths)

    def _batch_meta(self, idx: np.ndarray, acts: np.ndarray, lengths: np.ndarray) -> Batch:
        """Attach the per-sample metadata of positions `idx` to an activation array."""
        texts = self.texts
        labels = self.labels
        token_labels = self.token_labels
        return Batch(
            acts_bltd=acts,
            lengths=np.asarray(lengths, dtype=np.int64),
            sample_ids=self.sample_ids[idx],
            texts=None if texts is None else [texts[int(i)] for i in idx],
            labels=None if labels is None else labels[idx],
            token_labels=None if token_labels is None else token_labels[idx],
        )

    def last_token(self, layer: int) -> np.ndarray:
        """(N, D) activation at the last real token of every sample for one layer."""
        out = np.empty((self.n_samples, self.d_model), dtype=self.dtype)
        for s in range(self.n_samples):
            x = self.get(s, layer)
            out[s] = x[-1] if x.shape[0] else 0
        return out

    def iter_batches(self, batch_size: int = 64, layers: Sequence[int] | None = None) -> Iterator[Batch]:
        """Every sample in order, as Batches of at most `batch_size` (used by convert)."""
        for start in range(0, self.n_samples, batch_size):
            yield self.batch(np.arange(start, min(start + batch_size, self.n_samples)), layers)

    def token_segments(self, layer: int) -> list[TokenSegment]:
        """The real tokens of one layer as row segments (for the shuffled loader).

        Formats with a memory-mappable layout override this to return memmap views; this
        default materialises the tokens in RAM, a block of samples at a time.
        """
        self.layer_index(layer)
        lengths = self.lengths.astype(np.int64)
        total = int(lengths.sum())
        rows = np.empty((total, self.d_model), dtype=self.dtype)
        pos = 0
        for s in range(self.n_samples):
            x = self.get(s, layer)
            rows[pos : pos + x.shape[0]] = x
            pos += x.shape[0]
        base = np.cumsum(lengths) - lengths
        return [TokenSegment(rows, base, lengths, 0)]

    @property
    def n_tokens(self) -> int:
        """Total number of real tokens (per layer)."""
        return int(self.lengths.sum())

    def summary(self) -> dict[str, Any]:
        """A JSON-able summary (used by `actlake info`)."""
        lengths = self.lengths
        return {
            "format": self.format,
            "path": str(self.path),
            "n_samples": int(self.n_samples),
            "layers": list(self.layers),
            "d_model": int(self.d_model),
            "max_tokens": int(self.max_tokens),
            "n_tokens": int(lengths.sum()),
            "mean_tokens": float(lengths.mean()) if len(lengths) else 0.0,
            "dtype": str(np.dtype(self.dtype)),
            "has_texts": self.texts is not None,
            "has_labels": self.labels is not None,
            "has_token_labels": self.token_labels is not None,
            "provenance": self.provenance,
        }

    #: attributes holding per-process dicts of handles (memmaps): emptied by close() and when pickled,
    #: so each DataLoader worker opens its own
    _process_local: tuple[str, ...] = ()

    def close(self) -> None:
        """Release file handles (memmaps are dropped)."""
        for name in self._process_local:
            getattr(self, name).clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._process_local:
            state[name] = {}
        return state

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self.n_samples

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.path} n_samples={self.n_samples} "
                f"layers={list(self.layers)} d_model={self.d_model}>")
