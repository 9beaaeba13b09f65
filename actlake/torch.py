"""PyTorch loaders over the Reader protocol: map-style datasets and a shuffled token loader."""

from __future__ import annotations

import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

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


@dataclass(frozen=True)
class _Plan:
    """One batch to gather: positions into the epoch's row tables."""

    segment: np.ndarray  # int32 segment id per row
    row: np.ndarray  # int64 row number within that segment's rows_2d
    position: np.ndarray  # int64 token position within its segment (for return_index)


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
        self._row_index = [seg.row_index() for seg in self._segments]
        self.n_tokens = int(sum(len(r) for r in self._row_index))

    def __len__(self) -> int:
        full, rest = divmod(self.n_tokens, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation the next iteration yields."""
        self.epoch = int(epoch)

    def _blocks(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(segment, start, stop) of every block, in shuffled order."""
        segs, starts, stops = [], [], []
        for k, rows in enumerate(self._row_index):
            n = len(rows)
            s = np.arange(0, n, self.block_tokens, dtype=np.int64)
            segs.append(np.full(len(s), k, dtype=np.int32))
            starts.append(s)
            stops.append(np.minimum(s + self.block_tokens, n))
        if not segs:
            return (np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))
        seg, start, stop = np.concatenate(segs), np.concatenate(starts), np.concatenate(stops)
        order = rng.permutation(len(seg))
        return seg[order], start[order], stop[order]

    def plans(self, epoch: int | None = None) -> Iterator[_Plan]:
        """The batches of one epoch as row plans (cheap: indices only)."""
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        seg, start, stop = self._blocks(rng)
        carry_seg = np.zeros(0, np.int32)
        carry_pos = np.zeros(0, np.int64)
        for w in range(0, len(seg), self.window_blocks):
            ws, wa, wb = seg[w : w + self.window_blocks], start[w : w + self.window_blocks], stop[w : w + self.window_blocks]
            sizes = wb - wa
            total = int(sizes.sum())
            offsets = np.cumsum(sizes) - sizes
            pos = np.arange(total, dtype=np.int64) - np.repeat(offsets, sizes) + np.repeat(wa, sizes)
            sid = np.repeat(ws, sizes)
            perm = rng.permutation(total)
            sid = np.concatenate([carry_seg, sid[perm]])
            pos = np.concatenate([carry_pos, pos[perm]])
            n_full = len(sid) // self.batch_size
            for b in range(n_full):
                sl = slice(b * self.batch_size, (b + 1) * self.batch_size)
                yield self._plan(sid[sl], pos[sl])
            carry_seg, carry_pos = sid[n_full * self.batch_size :], pos[n_full * self.batch_size :]
        if len(carry_seg) and not self.drop_last:
            yield self._plan(carry_seg, carry_pos)

    def _plan(self, sid: np.ndarray, pos: np.ndarray) -> _Plan:
        row = np.empty(len(pos), dtype=np.int64)
        for k in np.unique(sid):
            m = sid == k
            row[m] = self._row_index[int(k)][pos[m]]
        order = np.lexsort((row, sid))  # group by segment, ascending rows: near-sequential reads
        return _Plan(sid[order], row[order], pos[order])

    def gather(self, plan: _Plan) -> np.ndarray:
        """The (B, D) float32 rows of a plan, one vectorised take per segment."""
        out = np.empty((len(plan.row), self.d_model), dtype=np.float32)
        bounds = np.flatnonzero(np.diff(plan.segment)) + 1
        edges = np.concatenate([[0], bounds, [len(plan.row)]])
        for a, b in zip(edges[:-1], edges[1:]):
            if b > a:
                seg = self._segments[int(plan.segment[a])]
                np.take(seg.rows_2d, plan.row[a:b], axis=0, out=out[a:b])
        return out

    def _index(self, plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
        samples = np.empty(len(plan.row), dtype=np.int64)
        tokens = np.empty(len(plan.row), dtype=np.int64)
        for k in np.unique(plan.segment):
            m = plan.segment == k
            samples[m], tokens[m] = self._segments[int(k)].locate(plan.position[m])
        return samples, tokens

    def _finish(self, plan: _Plan, rows: np.ndarray) -> Any:
        x = torch.from_numpy(rows)
        if self.device is not None and self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
        elif self.device is not None:
            x = x.to(self.device)
        if not self.return_index:
            return x
        samples, tokens = self._index(plan)
        return x, torch.from_numpy(samples), torch.from_numpy(tokens)

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1
        plans = self.plans(epoch)
        with ThreadPoolExecutor(max_workers=self.n_threads, thread_name_prefix="actlake-read") as pool:
            pending: "queue.SimpleQueue[tuple[_Plan, Future[np.ndarray]]]" = queue.SimpleQueue()
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
