"""PyTorch loaders over the Reader protocol: map-style datasets and a shuffled token loader."""

from __future__ import annotations

import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import ConfigError, SampleIndexError
from .reader import Reader, TokenSegment


class _PerProcessReader:
    """Holds a path and opens one Reader per process, so DataLoader workers never share handles."""

    def __init__(self, source: str | Path | Reader, format: str | None) -> None:
        if isinstance(source, Reader):
            self.path, self.format = source.path, source.format
            self._reader: Reader | None = source
        else:
            self.path, self.format, self._reader = Path(source), format, None
        self._pid = os.getpid() if self._reader is not None else -1

    def get(self) -> Reader:
        if self._reader is None or self._pid != os.getpid():
            from . import open as open_store

            self._reader = open_store(self.path, self.format)
            self._pid = os.getpid()
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "_reader": None, "_pid": -1}


class TokenDataset(Dataset):
    """Map-style dataset: item `i` is the i-th real token vector (D,) of one layer, in (sample, token) order."""

    def __init__(self, source: str | Path | Reader, layer: int, *, format: str | None = None) -> None:
        self._source = _PerProcessReader(source, format)
        reader = self._source.get()
        reader.layer_index(layer)
        self.layer = int(layer)
        lengths = reader.lengths.astype(np.int64)
        self._ends = np.cumsum(lengths)
        self._n = int(self._ends[-1]) if len(self._ends) else 0

    def __len__(self) -> int:
        return self._n

    def locate(self, index: int) -> tuple[int, int]:
        """(sample, token) of flat token index `index`."""
        if not 0 <= index < self._n:
            raise SampleIndexError(f"token index {index} out of range [0, {self._n})", self._source.path)
        sample = int(np.searchsorted(self._ends, index, side="right"))
        start = int(self._ends[sample - 1]) if sample else 0
        return sample, index - start

    def __getitem__(self, index: int) -> torch.Tensor:
        sample, token = self.locate(int(index))
        row = self._source.get().get(sample, self.layer)[token]
        return torch.from_numpy(np.array(row, dtype=np.float32))


class SequenceDataset(Dataset):
    """Map-style dataset: item `i` is one (sample, layer) sequence, zero-padded to `max_tokens`.

    Returns a dict `{"acts": (T, D) float tensor, "length": int, "sample": int, "layer": int}`,
    which the default collate stacks; `acts[:length]` are the real tokens.
    """

    def __init__(self, source: str | Path | Reader, layers: list[int] | None = None, *,
                 format: str | None = None) -> None:
        self._source = _PerProcessReader(source, format)
        reader = self._source.get()
        self.layers = list(reader.layers if layers is None else layers)
        for layer in self.layers:
            reader.layer_index(layer)
        self.n_samples = reader.n_samples
        self.max_tokens = reader.max_tokens
        self.d_model = reader.d_model

    def __len__(self) -> int:
        return self.n_samples * len(self.layers)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        if not 0 <= index < len(self):
            raise SampleIndexError(f"item {index} out of range [0, {len(self)})", self._source.path)
        sample, j = divmod(index, len(self.layers))
        x = self._source.get().get(sample, self.layers[j])
        acts = np.zeros((self.max_tokens, self.d_model), dtype=np.float32)
        acts[: x.shape[0]] = x
        return {"acts": torch.from_numpy(acts), "length": int(x.shape[0]), "sample": sample, "layer": self.layers[j]}


class Plan(NamedTuple):
    """One batch to gather: global token positions and their rows, sorted by (segment, row)."""

    positions: np.ndarray
    rows: np.ndarray


class ShuffledTokenLoader:
    """Shuffled batches of token vectors of one layer, for SAE training.

    Each epoch: the real tokens are cut into blocks of `block_tokens` consecutive rows, the
    blocks are shuffled, taken `window_blocks` at a time, and the rows of a window are permuted
    and cut into batches. Every real token appears exactly once per epoch. Rows are gathered
    straight from the memmaps with one vectorised `np.take` per segment (sorted rows, so reads
    are near-sequential within a batch), by `n_threads` background threads that keep
    `prefetch` batches ready. Seeded by `(seed, epoch)`.
    """

    def __init__(self, source: str | Path | Reader, layer: int, *, batch_size: int = 4096, seed: int = 0,
                 block_tokens: int = 256, window_blocks: int = 256, n_threads: int = 2, prefetch: int = 4,
                 drop_last: bool = False, return_index: bool = False, device: str | torch.device | None = None,
                 format: str | None = None) -> None:
        if batch_size < 1 or block_tokens < 1 or window_blocks < 1 or n_threads < 1 or prefetch < 1:
            raise ConfigError("batch_size, block_tokens, window_blocks, n_threads and prefetch must be >= 1")
        self._source = _PerProcessReader(source, format)
        reader = self._source.get()
        self.layer = int(layer)
        reader.layer_index(layer)
        self.batch_size = batch_size
        self.seed = seed
        self.block_tokens = block_tokens
        self.window_blocks = window_blocks
        self.n_threads = n_threads
        self.prefetch = prefetch
        self.drop_last = drop_last
        self.return_index = return_index
        self.device = None if device is None else torch.device(device)
        self.epoch = 0
        self.d_model = reader.d_model
        self._segments: list[TokenSegment] = reader.token_segments(layer)
        # per-sample tables (not per-token): a window's token positions are mapped to rows at once
        sizes = np.array([seg.n_tokens for seg in self._segments], dtype=np.int64)
        self._seg_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        lengths = [seg.lengths.astype(np.int64) for seg in self._segments]
        self._sample_starts = np.concatenate(
            [self._seg_starts[k] + np.cumsum(n) - n for k, n in enumerate(lengths)] or [np.zeros(0, np.int64)])
        self._sample_rows = np.concatenate([seg.base_rows.astype(np.int64) for seg in self._segments]
                                           or [np.zeros(0, np.int64)])
        self.n_tokens = int(sizes.sum())

    def __len__(self) -> int:
        full, rest = divmod(self.n_tokens, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation the next iteration yields."""
        self.epoch = int(epoch)

    def _blocks(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) global positions of every block, in shuffled order; blocks never cross segments."""
        starts, stops = [], []
        for k in range(len(self._segments)):
            a, b = int(self._seg_starts[k]), int(self._seg_starts[k + 1])
            s = np.arange(a, b, self.block_tokens, dtype=np.int64)
            starts.append(s)
            stops.append(np.minimum(s + self.block_tokens, b))
        if not starts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        start, stop = np.concatenate(starts), np.concatenate(stops)
        order = rng.permutation(len(start))
        return start[order], stop[order]

    def plans(self, epoch: int | None = None) -> Iterator[Plan]:
        """The batches of one epoch as row plans (indices only; sorted by segment and row)."""
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        start, stop = self._blocks(rng)
        carry_pos, carry_rows = np.zeros(0, np.int64), np.zeros(0, np.int64)
        for w in range(0, len(start), self.window_blocks):
            wa, wb = start[w : w + self.window_blocks], stop[w : w + self.window_blocks]
            sizes = wb - wa
            offsets = np.cumsum(sizes) - sizes
            pos = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(offsets - wa, sizes)
            pos = pos[rng.permutation(len(pos))]
            pos, rows = np.concatenate([carry_pos, pos]), np.concatenate([carry_rows, self._rows_of(pos)])
            n_full = len(pos) // self.batch_size
            for b in range(n_full):
                yield self._plan(pos[b * self.batch_size : (b + 1) * self.batch_size],
                                 rows[b * self.batch_size : (b + 1) * self.batch_size])
            carry_pos, carry_rows = pos[n_full * self.batch_size :], rows[n_full * self.batch_size :]
        if len(carry_pos) and not self.drop_last:
            yield self._plan(carry_pos, carry_rows)

    def _rows_of(self, positions: np.ndarray) -> np.ndarray:
        """Row (within its segment's rows_2d) of each global token position."""
        sample = np.searchsorted(self._sample_starts, positions, side="right") - 1
        return self._sample_rows[sample] + (positions - self._sample_starts[sample])

    @staticmethod
    def _plan(positions: np.ndarray, rows: np.ndarray) -> Plan:
        order = np.argsort(positions, kind="stable")  # by segment, then row: near-sequential reads
        return Plan(positions[order], rows[order])

    def _segment_slices(self, positions: np.ndarray) -> Iterator[tuple[int, int, int]]:
        """(segment, a, b): positions[a:b] lie in that segment (positions sorted)."""
        cuts = np.searchsorted(positions, self._seg_starts)
        for k in range(len(self._segments)):
            if cuts[k + 1] > cuts[k]:
                yield k, int(cuts[k]), int(cuts[k + 1])

    def gather(self, plan: Plan) -> np.ndarray:
        """The (B, D) float32 rows of a plan, one vectorised take per segment."""
        out = np.empty((len(plan.rows), self.d_model), dtype=np.float32)
        for k, a, b in self._segment_slices(plan.positions):
            np.take(self._segments[k].rows_2d, plan.rows[a:b], axis=0, out=out[a:b])
        return out

    def _index(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = np.empty(len(positions), dtype=np.int64)
        tokens = np.empty(len(positions), dtype=np.int64)
        for k, a, b in self._segment_slices(positions):
            samples[a:b], tokens[a:b] = self._segments[k].locate(positions[a:b] - self._seg_starts[k])
        return samples, tokens

    def _finish(self, plan: Plan, rows: np.ndarray) -> Any:
        x = torch.from_numpy(rows)
        if self.device is not None and self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
        elif self.device is not None:
            x = x.to(self.device)
        if not self.return_index:
            return x
        samples, tokens = self._index(plan.positions)
        return x, torch.from_numpy(samples), torch.from_numpy(tokens)

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1
        plans = self.plans(epoch)
        with ThreadPoolExecutor(max_workers=self.n_threads, thread_name_prefix="actlake-read") as pool:
            pending: "queue.SimpleQueue[tuple[Plan, Future[np.ndarray]]]" = queue.SimpleQueue()
            in_flight = 0
            for plan in plans:
                pending.put((plan, pool.submit(self.gather, plan)))
                in_flight += 1
                if in_flight > self.prefetch:
                    done_plan, fut = pending.get()
                    in_flight -= 1
                    yield self._finish(done_plan, fut.result())
            while in_flight:
                done_plan, fut = pending.get()
                in_flight -= 1
                yield self._finish(done_plan, fut.result())


__all__ = ["SequenceDataset", "ShuffledTokenLoader", "TokenDataset"]
