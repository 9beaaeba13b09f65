"""Machine slices, length-bucketed batch plans, tokenisation with recorded truncation, padding.

Bucketing sorts samples by length inside a window of `batch_size * bucket_batches` consecutive
samples, so batches waste little on padding while the engine can still hand samples to the
writer in dataset order (it holds at most one window). The plan is a pure function of the
lengths and the sizes, so a resumed run recomputes exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError

PADDING_SIDES = ("right", "left")
TOKENIZE_CHUNK = 1024


def machine_slice(n_total: int, machine_id: int, num_machines: int) -> tuple[int, int, int]:
    """(start, stop, samples_per_machine): machine m owns dataset positions [m*spm, min((m+1)*spm, n)).

    `spm = ceil(n / num_machines)`; global sample_idx = machine_id * spm + local_idx (= the dataset
    position), so the machines' slices are disjoint and their union is the dataset exactly once.
    """
    if num_machines < 1:
        raise ConfigError(f"num_machines must be >= 1, got {num_machines}")
    if not 0 <= machine_id < num_machines:
        raise ConfigError(f"machine_id {machine_id} not in [0, {num_machines})")
    if n_total < 0:
        raise ConfigError(f"n_total must be >= 0, got {n_total}")
    spm = -(-n_total // num_machines)
    start = min(machine_id * spm, n_total)
    return start, min(start + spm, n_total), spm


@dataclass(frozen=True)
class Window:
    """Consecutive local positions [start, stop) and the batches (position arrays) that cover them."""

    start: int
    stop: int
    batches: tuple[np.ndarray, ...]


def plan_windows(lengths: np.ndarray, batch_size: int, bucket_batches: int = 4) -> list[Window]:
    """Split positions 0..n-1 into windows; inside each, batches of similar length (longest first)."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if bucket_batches < 1:
        raise ConfigError(f"bucket_batches must be >= 1, got {bucket_batches}")
    lengths = np.asarray(lengths, dtype=np.int64)
    size = batch_size * bucket_batches
    windows = []
    for start in range(0, len(lengths), size):
        stop = min(start + size, len(lengths))
        order = start + np.argsort(-lengths[start:stop], kind="stable")
        batches = tuple(order[i : i + batch_size] for i in range(0, len(order), batch_size))
        windows.append(Window(start, stop, batches))
    return windows


@dataclass(frozen=True)
class Tokenized:
    """Token ids of n samples, stored flat: sample i is `ids_flat[offsets[i]:offsets[i+1]]`.

    prompt_lengths: tokens of the prompt part (= lengths when there is no response part).
    truncated: whether max_seq_len (or the response cap) cut the sample.
    """

    ids_flat: np.ndarray
    offsets: np.ndarray
    prompt_lengths: np.ndarray
    truncated: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def ids(self, i: int) -> np.ndarray:
        return self.ids_flat[self.offsets[i] : self.offsets[i + 1]]


def _pack(seqs: list[Sequence[int]], prompt_lengths: list[int], truncated: list[bool]) -> Tokenized:
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(offsets[-1]))
    return Tokenized(flat, offsets, np.asarray(prompt_lengths, dtype=np.int64), np.asarray(truncated, dtype=bool))


def _check_max_len(max_len: int) -> None:
    if max_len < 2:
        raise ConfigError(f"max_seq_len must be >= 2, got {max_len}")


def tokenize_texts(tokenizer: Any, texts: Sequence[str], max_len: int) -> Tokenized:
    """Tokenise with special tokens, truncating to `max_len` the tokenizer's way; record who was cut.

    Each chunk is tokenised with `max_length=max_len + 1`: a sample that reaches max_len + 1
    tokens was truncated, and only those are tokenised again at `max_len`.
    """
    _check_max_len(max_len)
    seqs: list[Sequence[int]] = []
    truncated: list[bool] = []
    for s in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = list(texts[s : s + TOKENIZE_CHUNK])
        ids = tokenizer(chunk, add_special_tokens=True, truncation=True, max_length=max_len + 1)["input_ids"]
        cut = [i for i, x in enumerate(ids) if len(x) > max_len]
        if cut:
            again = tokenizer([chunk[i] for i in cut], add_special_tokens=True, truncation=True,
                              max_length=max_len)["input_ids"]
            for i, x in zip(cut, again):
                ids[i] = x
        cutset = set(cut)
        seqs.extend(ids)
        truncated.extend(i in cutset for i in range(len(chunk)))
    for i, s in enumerate(seqs):
        if len(s) == 0:
            raise ConfigError(f"sample {i} tokenises to no tokens")
    return _pack(seqs, [len(s) for s in seqs], truncated)


def token_lengths(tokenizer: Any, texts: Sequence[str], max_len: int) -> np.ndarray:
    """[n] token counts (special tokens included, cut at `max_len`) without keeping the ids: equal to
    `tokenize_texts(...).lengths`, so every machine of a run computes the same fixed shapes."""
    _check_max_len(max_len)
    out = np.empty(len(texts), dtype=np.int64)
    for s in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = list(texts[s : s + TOKENIZE_CHUNK])
        ids = tokenizer(chunk, add_special_tokens=True, truncation=True, max_length=max_len,
                        return_attention_mask=False)["input_ids"]
        out[s : s + len(chunk)] = [len(x) for x in ids]
    return out


def tokenize_pairs(tokenizer: Any, prompts: Sequence[str], responses: Sequence[str], max_len: int,
                   response_max: int | None = None) -> Tokenized:
    """Prompt (with special tokens) followed by response (without): teacher-forced sequences.

    The response is cut to `response_max` first; then, over `max_len`, the response is cut,
    and the prompt only if it alone exceeds `max_len`.
    """
    _check_max_len(max_len)
    seqs: list[list[int]] = []
    prompt_lengths: list[int] = []
    truncated: list[bool] = []
    for s in range(0, len(prompts), TOKENIZE_CHUNK):
        p_ids = tokenizer(list(prompts[s : s + TOKENIZE_CHUNK]), add_special_tokens=True)["input_ids"]
        r_ids = tokenizer(list(responses[s : s + TOKENIZE_CHUNK]), add_special_tokens=False)["input_ids"]
        for p, r in zip(p_ids, r_ids):
            p, r = list(p), list(r)
            cut = False
            if response_max is not None and len(r) > response_max:
                r, cut = r[:response_max], True
            if len(p) > max_len:
                p, r, cut = p[:max_len], [], True
            elif len(p) + len(r) > max_len:
                r, cut = r[: max_len - len(p)], True
            if not p:
                raise ConfigError(f"prompt {len(seqs)} tokenises to no tokens")
            seqs.append(p + r)
            prompt_lengths.append(len(p))
            truncated.append(cut)
    return _pack(seqs, prompt_lengths, truncated)


@dataclass(frozen=True)
class PaddedBatch:
    """Model input for one batch: ids, mask and position ids [B, T]; `starts` = first real column."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def pad_batch(seqs: Sequence[np.ndarray], pad_id: int, side: str = "right") -> PaddedBatch:
    """Pad sequences to the longest; position ids count real tokens only, so left = right padding."""
    if side not in PADDING_SIDES:
        raise ConfigError(f"padding side must be one of {PADDING_SIDES}, got {side!r}")
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    t = int(lengths.max())
    ids = np.full((len(seqs), t), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), t), dtype=np.int64)
    starts = (t - lengths) if side == "left" else np.zeros_like(lengths)
    for b, s in enumerate(seqs):
        ids[b, starts[b] : starts[b] + len(s)] = s
        mask[b, starts[b] : starts[b] + len(s)] = 1
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return PaddedBatch(ids, mask, positions, starts, lengths)
