"""ZarrReaderBase: the Reader protocol over a prompt/response fp16 store, built on two read primitives."""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import Any, Callable, Sequence

import numpy as np

from ...batch import Batch
from ...errors import ConfigError, MetadataError
from ...reader import Reader, TokenSegment
from .layout import FORMAT, PROMPT, RESPONSE

#: one read: (sample position, layer position, n tokens, (T, H) destination whose first n rows are filled)
ReadTask = tuple[int, int, int, np.ndarray]


def read_threads_for(value: int | None) -> int:
    """Read threads for gathers: `value`, else min(4, CPU count)."""
    if value is None:
        return max(1, min(4, os.cpu_count() or 1))
    if value < 1:
        raise ConfigError(f"read_threads must be >= 1, got {value}")
    return int(value)


class ZarrReaderBase(Reader):
    """The Reader protocol for a prompt/response fp16 store; `get` is the prompt part.

    Subclasses provide the per-sample arrays, `_read(part, sample, li, t0, t1, out)` and
    `_read_rows(part, samples, li, tokens, out)` (one token row per sample).
    """

    format = FORMAT
    dtype = np.dtype(np.float16)
    r_max: int
    read_threads: int = 1
    _prompt_len: np.ndarray
    _response_len: np.ndarray

    @abstractmethod
    def _read(self, part: str, sample: int, li: int, t0: int, t1: int, out: np.ndarray) -> None:
        """Fill `out` ((t1 - t0, H) float16) with tokens [t0, t1) of (sample position, layer position)."""

    @abstractmethod
    def _read_rows(self, part: str, samples: np.ndarray, li: int, tokens: np.ndarray, out: np.ndarray) -> None:
        """Fill `out` ((n, H) C-contiguous float16) with token `tokens[k]` of sample `samples[k]` at one layer."""

    # ---- per-sample metadata ----
    @property
    def lengths(self) -> np.ndarray:
        """[N] stored prompt tokens per sample (true lengths capped at P_max)."""
        return self._prompt_len

    @property
    def response_lengths(self) -> np.ndarray:
        """[N] stored response tokens per sample (true lengths capped at R_max)."""
        return self._response_len

    @property
    def cls_token(self) -> bool:
        """The root attr `cls_token` actlake writes: token 0 of every prompt is CLS (absent: False)."""
        value = self.attrs.get("cls_token", False)
        if not isinstance(value, bool):
            raise MetadataError(f"attr cls_token must be true or false, got {value!r}", self.path / ".zattrs")
        return value

    @property
    def max_response_tokens(self) -> int:
        """R_max (the response token axis)."""
        return self.r_max

    # ---- single reads ----
    def get(self, sample: int, layer: int) -> np.ndarray:
        """(p_i, H) float16 prompt activations of one sample at one layer."""
        s, li = self.check_sample(sample), self.layer_index(layer)
        out = np.empty((int(self._prompt_len[s]), self.d_model), dtype=np.float16)
        self._read(PROMPT, s, li, 0, out.shape[0], out)
        return out

    def get_response(self, sample: int, layer: int) -> np.ndarray:
        """(r_i, H) float16 response activations of one sample at one layer."""
        s, li = self.check_sample(sample), self.layer_index(layer)
        out = np.empty((int(self._response_len[s]), self.d_model), dtype=np.float16)
        self._read(RESPONSE, s, li, 0, out.shape[0], out)
        return out

    def get_pair(self, sample: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt (p_i, H), response (r_i, H)) of one sample at one layer."""
        return self.get(sample, layer), self.get_response(sample, layer)

    # ---- gathers ----
    def gather(self, samples: Sequence[int] | np.ndarray, layers: Sequence[int] | np.ndarray,
               part: str = "prompt") -> np.ndarray:
        """(n, T, H) float16 for n arbitrary (sample, layer) pairs, zero-padded to P_max (or R_max).

        The training pattern of the spec (b samples x 2 random layers each) is one call.
        """
        name, cap, lens = self._part(part)
        idx = self.check_samples(samples)
        lis = [self.layer_index(x) for x in np.asarray(layers).reshape(-1)]
        if len(lis) != len(idx):
            raise ConfigError(f"gather needs one layer per sample, got {len(idx)} samples and {len(lis)} layers")
        out = np.empty((len(idx), cap, self.d_model), dtype=np.float16)  # _read_many zeroes the padding
        n_tokens = lens[idx].tolist()
        self._read_many(name, [(s, li, n, out[k]) for k, (s, li, n) in enumerate(zip(idx.tolist(), lis, n_tokens))])
        return out

    def _part(self, part: str) -> tuple[str, int, np.ndarray]:
        if part == "prompt":
            return PROMPT, self.max_tokens, self._prompt_len
        if part == "response":
            return RESPONSE, self.r_max, self._response_len
        raise ConfigError(f"part must be 'prompt' or 'response', got {part!r}")

    def _block(self, name: str, idx: np.ndarray, lis: list[int]) -> np.ndarray:
        """(len(idx), len(lis), cap, H) float16 of samples x layer positions, zero-padded."""
        cap, lens = (self.max_tokens, self._prompt_len) if name == PROMPT else (self.r_max, self._response_len)
        out = np.empty((len(idx), len(lis), cap, self.d_model), dtype=np.float16)  # _read_many zeroes the padding
        n_tokens = lens[idx].tolist()
        self._read_many(name, [(s, li, n, out[b, j]) for b, (s, n) in enumerate(zip(idx.tolist(), n_tokens))
                               for j, li in enumerate(lis)])
        return out

    # ---- parallel reads ----
    def _parallel_ok(self) -> bool:
        """Whether reads may run on several threads (direct chunk-file reads only)."""
        return False

    def _in_threads(self, fn: Callable[[Any], None], groups: list[Any]) -> None:
        """Run `fn` on each group, on the reader's thread pool."""
        list(self._pool().map(fn, groups))

    def _read_many(self, name: str, tasks: list[ReadTask]) -> None:
        """Run (sample, layer position, n tokens, (T, H) destination) reads, on `read_threads` threads.

        Chunk-file reads release the GIL in the kernel copy, so a gather of many (sample, layer)
        pairs overlaps them; zarr-API reads stay on the calling thread.
        """
        def run(group: list[ReadTask]) -> None:
            for s, li, n, view in group:
                if n:
                    self._read(name, s, li, 0, n, view[:n])
                if n < len(view):
                    view[n:] = 0  # destinations are uninitialised (fresh zeroed pages cost a fault each)

        threads = self.read_threads
        if threads <= 1 or len(tasks) < 2 * threads or not self._parallel_ok():
            run(tasks)
        else:
            self._in_threads(run, [tasks[k::threads] for k in range(threads)])

    def _pool(self) -> Any:
        """A thread pool per process (never inherited through fork or pickling)."""
        pool = self.__dict__.get("_pool_obj")
        if pool is None or self.__dict__.get("_pool_pid") != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(max_workers=self.read_threads, thread_name_prefix="actlake-zarr")
            self.__dict__["_pool_obj"], self.__dict__["_pool_pid"] = pool, os.getpid()
        return pool

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_pool_obj", None)
        state.pop("_pool_pid", None)
        return state

    def batch(self, samples: Sequence[int] | np.ndarray, layers: Sequence[int] | None = None) -> Batch:
        """Prompt part as acts_bltd (P_max tokens), response part as response_bltd (R_max), metadata attached."""
        idx = self.check_samples(samples)
        lis = [self.layer_index(x) for x in (self.layers if layers is None else layers)]
        positions = idx.tolist()
        responses, texts, labels = self.response_texts, self.texts, self.labels
        return Batch(
            acts_bltd=self._block(PROMPT, idx, lis), lengths=self._prompt_len[idx].astype(np.int64),
            sample_ids=self.sample_ids[idx], texts=None if texts is None else [texts[i] for i in positions],
            labels=None if labels is None else labels[idx],
            response_bltd=self._block(RESPONSE, idx, lis), response_lengths=self._response_len[idx].astype(np.int64),
            response_texts=None if responses is None else [responses[i] for i in positions],
            extra=self._extra(idx),
        )

    def _extra(self, idx: np.ndarray) -> dict[str, list[Any]]:
        """Batch.extra of positions `idx`: sample_key, hallu_label, split and the extra JSONL columns."""
        out: dict[str, list[Any]] = {}
        positions = idx.tolist()
        keys = self.sample_keys
        if keys is not None:
            out["sample_key"] = [keys[i] for i in positions]
        for name in ("hallu_label", "split"):
            values = getattr(self, name)
            if values is not None:
                out[name] = np.asarray(values)[idx].astype(np.int64).tolist()
        rows = self.extra_rows
        if rows is not None:
            for key in self._extra_keys():
                out[key] = [rows[i].get(key) for i in positions]
        return out

    def _extra_keys(self) -> list[str]:
        """The sorted union of the extra columns' names (computed once, not once per batch)."""
        keys = self.__dict__.get("_extra_keys_cache")
        if keys is None:
            rows = self.extra_rows or []
            keys = self.__dict__["_extra_keys_cache"] = sorted({k for r in rows for k in r})
        return keys

    def last_token(self, layer: int) -> np.ndarray:
        """(N, H) prompt activation at the last stored prompt token (zeros for an empty prompt).

        One vectorised gather of one row per non-empty sample (`_read_rows`).
        """
        li = self.layer_index(layer)
        out = np.zeros((self.n_samples, self.d_model), dtype=np.float16)
        samples = np.flatnonzero(self._prompt_len)
        if len(samples):
            rows = np.empty((len(samples), self.d_model), dtype=np.float16)
            self._read_rows(PROMPT, samples, li, self._prompt_len[samples] - 1, rows)
            out[samples] = rows
        return out

    def token_segments(self, layer: int) -> list[TokenSegment]:
        """The prompt tokens of one layer read straight into one (n_tokens, H) array (threaded reads)."""
        li = self.layer_index(layer)
        lengths = self._prompt_len.astype(np.int64)
        rows = np.empty((int(lengths.sum()), self.d_model), dtype=np.float16)
        base = np.cumsum(lengths) - lengths
        self._read_many(PROMPT, [(s, li, n, rows[b0 : b0 + n]) for s, (b0, n) in
                                 enumerate(zip(base.tolist(), lengths.tolist())) if n])
        return [TokenSegment(rows, base, lengths, 0)]

    # ---- optional per-sample metadata (subclasses fill) ----
    @property
    def response_texts(self) -> list[str] | None:
        """Per-sample response text where stored."""
        return None

    @property
    def sample_keys(self) -> list[str] | None:
        """Per-sample `sample_key` strings where stored."""
        return None

    @property
    def hallu_label(self) -> np.ndarray | None:
        """[N] int8 hallucination labels (-1 unknown) where stored."""
        return None

    @property
    def split(self) -> np.ndarray | None:
        """[N] int8 split codes (0 train, 1 val, 2 test, -1 unknown) where stored."""
        return None

    @property
    def extra_rows(self) -> list[dict[str, Any]] | None:
        """Per-sample extra columns (text/extra_metadata.jsonl) where stored."""
        return None

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(P_max=self.max_tokens, R_max=self.r_max,
                   n_response_tokens=int(self._response_len.sum()), has_response_texts=self.response_texts is not None)
        return out
