"""The writer's per-prompt index columns, gathered batch by batch and built into the parquet table at close."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from actlake.batch import Batch
from actlake.errors import ConfigError
from actlake.formats.lmprobe.layout import (
    EXTRA_MAPPED,
    EXTRA_TOKEN_PERPLEXITY,
    EXTRA_TOKEN_STRINGS,
    is_int,
    shard_of,
)
from actlake.formats.lmprobe.metadata import to_plain

INT32_MAX = (1 << 31) - 1


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """[n+1] int32 list offsets of lists with `lengths` entries (one batch stays far below 2**31)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] > INT32_MAX:
        raise ConfigError(f"one batch holds {out[-1]} tokens; split it (list offsets are int32)")
    return out.astype(np.int32)


def _int_list_array(lengths: np.ndarray, flat: np.ndarray) -> Any:
    """A list<int64> pyarrow array of consecutive runs of `flat` with the given lengths."""
    import pyarrow as pa

    return pa.ListArray.from_arrays(pa.array(_offsets(lengths), type=pa.int32()), pa.array(flat, type=pa.int64()))


def _int32_labels(chunk: np.ndarray | list[Any]) -> Any:
    """An int32 label array: int arrays use -1 for null, lists use None."""
    import pyarrow as pa

    if isinstance(chunk, np.ndarray):
        if len(chunk) and chunk.max() > INT32_MAX:
            raise ConfigError(f"label {int(chunk.max())} does not fit the spec's int32 label column")
        return pa.array(chunk.astype(np.int32), mask=chunk < 0, type=pa.int32())
    try:
        return pa.array(chunk, type=pa.int32())
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise ConfigError(f"labels do not fit the spec's int32 label column: {exc}") from None


def _string_labels(chunk: np.ndarray | list[Any]) -> list[str | None]:
    """Labels as strings (None stays null; -1 in int arrays is null)."""
    if isinstance(chunk, np.ndarray):
        return [None if x < 0 else str(x) for x in chunk.tolist()]
    return [None if x is None else str(x) for x in chunk]


def perplexity_stats(token_ppl: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(mean, min, max, valid) per row of a list<float64> array; rows with no values are not valid."""
    import pyarrow.compute as pc

    lengths = np.asarray(pc.list_value_length(token_ppl).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    flat = np.asarray(pc.list_flatten(token_ppl).to_numpy(zero_copy_only=False), dtype=np.float64)
    valid = lengths > 0
    out = [np.full(len(lengths), np.nan) for _ in range(3)]
    if valid.any():
        starts = (np.cumsum(lengths) - lengths)[valid]
        out[0][valid] = np.add.reduceat(flat, starts) / lengths[valid]
        out[1][valid] = np.minimum.reduceat(flat, starts)
        out[2][valid] = np.maximum.reduceat(flat, starts)
    return out[0], out[1], out[2], valid


class IndexColumns:
    """Per-prompt metadata (no activations) of the prompts written so far, in row order."""

    def __init__(self, lt_counts: list[int], full_sequence: bool) -> None:
        self.lt_starts = np.cumsum([0] + list(lt_counts)).astype(np.int64)
        self.n_lt = len(lt_counts)
        self.full_sequence = full_sequence
        self.n = 0
        self._texts: list[str] = []
        self._lengths: list[np.ndarray] = []
        self._sample_ids: list[np.ndarray] = []
        self._labels: list[np.ndarray | list[Any]] = []  # int64 arrays (-1 = null) or plain values
        self._token_ids: list[Any] = []  # one list<int64> array per batch (all-null when absent)
        self._any_token_ids = False
        self._tok_ids: list[Any] = []
        self._tok_offs: list[Any] = []
        self._token_ppl: list[list[float] | None] = []
        self._token_strings: list[list[str] | None] = []
        self._extra: dict[str, list[Any]] = {}

    def add(self, batch: Batch, lengths: np.ndarray, rest_shard: np.ndarray, rest_row: np.ndarray) -> None:
        """Record one batch; `rest_shard`/`rest_row` [B] locate each prompt's non-last tokens (full_sequence)."""
        import pyarrow as pa

        b = batch.size
        texts = batch.texts if batch.texts is not None else batch.extra.get("text")
        self._texts += [""] * b if texts is None else [str(x) for x in texts]
        self._lengths.append(lengths)
        self._sample_ids.append(np.asarray(batch.sample_ids, dtype=np.int64))
        if batch.labels is not None:
            self._labels.append(np.asarray(batch.labels, dtype=np.int64))
        elif "label" in batch.extra:
            self._labels.append([to_plain(x) for x in batch.extra["label"]])
        else:
            self._labels.append(np.full(b, -1, dtype=np.int64))
        if batch.token_ids is not None:
            self._any_token_ids = True
            ids = np.asarray(batch.token_ids, dtype=np.int64)
            real = np.arange(ids.shape[1]) < lengths[:, None]
            self._token_ids.append(_int_list_array(lengths, ids[real]))
        else:
            self._token_ids.append(pa.nulls(b, type=pa.list_(pa.int64())))
        if self.full_sequence:
            self._add_token_addressing(lengths, rest_shard, rest_row)
        for key, store in ((EXTRA_TOKEN_PERPLEXITY, self._token_ppl), (EXTRA_TOKEN_STRINGS, self._token_strings)):
            column = batch.extra.get(key)
            store += [None] * b if column is None else [None if x is None else to_plain(list(x)) for x in column]
        for key, column in batch.extra.items():
            if key not in EXTRA_MAPPED:
                self._extra.setdefault(key, [None] * self.n).extend(to_plain(x) for x in column)
        self.n += b
        for values in self._extra.values():
            values += [None] * (self.n - len(values))

    def _add_token_addressing(self, lengths: np.ndarray, rest_shard: np.ndarray, rest_row: np.ndarray) -> None:
        """token_shard_ids / token_shard_offsets of one batch: non-last tokens in sequence shards, then the last."""
        lt_shard, lt_row = shard_of(self.lt_starts, np.arange(self.n, self.n + len(lengths), dtype=np.int64))
        starts = np.cumsum(lengths) - lengths
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        ids = np.repeat(self.n_lt + rest_shard, lengths)
        offs = np.repeat(rest_row, lengths) + within
        has = lengths > 0
        last = (starts + lengths - 1)[has]
        ids[last] = lt_shard[has]
        offs[last] = lt_row[has]
        self._tok_ids.append(_int_list_array(lengths, ids))
        self._tok_offs.append(_int_list_array(lengths, offs))

    def _label_column(self) -> Any:
        """int32 labels when every label is an integer (or null), else string labels."""
        import pyarrow as pa

        all_int = all(isinstance(c, np.ndarray) or all(x is None or is_int(x) for x in c) for c in self._labels)
        if all_int:
            return pa.chunked_array([_int32_labels(c) for c in self._labels], type=pa.int32())
        return pa.chunked_array([pa.array(_string_labels(c), type=pa.string()) for c in self._labels], type=pa.string())

    def table(self, logits_counts: list[int] | None) -> Any:
        """The index table: spec columns in the spec's order, then `sample_id` and the user columns."""
        import pyarrow as pa

        n = self.n
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        lt_shard, lt_row = shard_of(self.lt_starts, np.arange(n, dtype=np.int64))
        cols: dict[str, Any] = {
            "text": pa.array(self._texts, type=pa.string()),
            "label": self._label_column() if self._labels else pa.array([], type=pa.int32()),
            "num_tokens": pa.array(lengths.astype(np.int32), type=pa.int32()),
            "shard_index": pa.array(lt_shard.astype(np.int32), type=pa.int32()),
            "row_offset": pa.array(lt_row.astype(np.int32), type=pa.int32()),
        }
        list_int = pa.list_(pa.int64())
        if self.full_sequence:
            cols["token_offset"] = pa.array(lt_row, type=pa.int64())
            cols["token_shard_ids"] = pa.chunked_array(self._tok_ids, type=list_int)
            cols["token_shard_offsets"] = pa.chunked_array(self._tok_offs, type=list_int)
        if logits_counts:
            shard, row = shard_of(np.cumsum([0] + logits_counts).astype(np.int64), np.arange(n, dtype=np.int64))
            cols["shard_index_logits"] = pa.array(shard.astype(np.int32), type=pa.int32())
            cols["row_offset_logits"] = pa.array(row.astype(np.int32), type=pa.int32())
        has_ppl = any(x is not None for x in self._token_ppl)
        if has_ppl:
            ppl = pa.array([None if x is None else [float(v) for v in x] for x in self._token_ppl],
                           type=pa.list_(pa.float64()))
            mean, low, high, valid = perplexity_stats(ppl)
            for name, values in (("perplexity_mean", mean), ("perplexity_min", low), ("perplexity_max", high)):
                cols[name] = pa.array(values, mask=~valid, type=pa.float64())
        if self._any_token_ids:
            cols["token_ids"] = pa.chunked_array(self._token_ids, type=list_int)
        if has_ppl:
            cols["token_perplexity"] = ppl
        if any(x is not None for x in self._token_strings):
            cols["token_strings"] = pa.array(
                [None if x is None else [str(v) for v in x] for x in self._token_strings], type=pa.list_(pa.string()))
        cols["sample_id"] = pa.array(np.concatenate(self._sample_ids) if self._sample_ids else [], type=pa.int64())
        for key, values in self._extra.items():
            try:
                cols[key] = pa.array(values)
            except (pa.ArrowException, OverflowError):
                cols[key] = pa.array([None if v is None else json.dumps(v) for v in values], type=pa.string())
        return pa.table(cols)
