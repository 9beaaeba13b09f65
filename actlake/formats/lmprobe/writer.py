"""LmprobeWriter: streams Batches into per-layer safetensors shards and publishes the dataset atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from actlake.atomic import WriterLock, remove_tree
from actlake.batch import Batch
from actlake.errors import ConfigError, FormatError
from actlake.formats.lmprobe.codec import encode_rows
from actlake.formats.lmprobe.index_columns import IndexColumns
from actlake.formats.lmprobe.layout import (
    EXTRA_MAPPED,
    HIDDEN_DTYPES,
    INDEX_PATH,
    LOGITS_FILE_PATTERN,
    LOGITS_INDICES_KEY,
    LOGITS_VALUES_KEY,
    RESERVED_COLUMNS,
    UPSTREAM_INDICES_KEY,
    UPSTREAM_VALUES_KEY,
    LmprobeOptions,
    fixed_shard_counts,
    logits_row_bytes,
)
from actlake.formats.lmprobe.metadata import schema_metadata
from actlake.formats.lmprobe.safetensors_io import SafetensorsShard, TensorSlot
from actlake.spec import StoreSpec
from actlake.writer import Writer


def pooled_rows(acts_btd: np.ndarray, lengths: np.ndarray, pooling: str) -> np.ndarray:
    """[B, D] float32 pooled vectors (last real token, or the float64-accumulated mean of the real tokens).

    A prompt with no real token pools to zeros.
    """
    b, t, _ = acts_btd.shape
    if pooling == "mean":
        real = (np.arange(t) < lengths[:, None])[:, :, None]
        sums = np.add.reduce(acts_btd, axis=1, dtype=np.float64, where=real)
        return (sums / np.maximum(lengths, 1)[:, None]).astype(np.float32)
    out = np.asarray(acts_btd[np.arange(b), np.maximum(lengths - 1, 0)], dtype=np.float32)
    out[lengths == 0] = 0
    return out


class LmprobeWriter(Writer):
    """Streams Batches into `<out_root>/lmprobe-<hash16>` (built under `.tmp-lmprobe-<hash16>`); machine k
    of M > 1 into `<out_root>/lmprobe-<runhash16>/machine_kkkk` (one run directory for every slice).

    Per-layer shard files are open only while their shard fills (rows written at their final
    offsets, nothing buffered beyond one batch); the parquet index (per-prompt metadata, no
    activations) is written at close. An interrupted run restarts from the first sample.
    """

    def __init__(self, out_root: str | Path, spec: StoreSpec) -> None:
        self.spec = spec
        self.options = opts = LmprobeOptions.from_spec(spec)
        if spec.dtype not in HIDDEN_DTYPES:
            raise ConfigError(f"lmprobe stores {sorted(HIDDEN_DTYPES)}, not dtype {spec.dtype!r}")
        self.code, self.itemsize = HIDDEN_DTYPES[spec.dtype]
        self.row_bytes = spec.d_model * self.itemsize
        self.root = Path(out_root)
        if spec.num_machines > 1:  # machine k of M: `<out_root>/lmprobe-<runhash16>/machine_kkkk`
            run_dir = self.root / f"lmprobe-{spec.run_hash()[:16]}"
            self.final_path = run_dir / f"machine_{spec.machine_id:04d}"
            self.tmp_path = run_dir / f".tmp-machine_{spec.machine_id:04d}-{spec.content_hash()[:16]}"
            self.root = run_dir
        else:
            digest = spec.content_hash()[:16]
            self.final_path = self.root / f"lmprobe-{digest}"
            self.tmp_path = self.root / f".tmp-lmprobe-{digest}"
        self._closed = False
        self._lock: WriterLock | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        if self.final_path.exists():
            self.resume_from = self._next = spec.n_samples
            self._closed = True
            return
        self._lock = WriterLock(self.tmp_path)
        remove_tree(self.tmp_path)
        self.tmp_path.mkdir(parents=True)
        self.resume_from = 0
        self.full_sequence = opts.storage == "full_sequence"
        self.lt_counts = fixed_shard_counts(spec.n_samples, self.row_bytes, opts.shard_bytes)
        self.lt_starts = np.cumsum([0] + self.lt_counts).astype(np.int64)
        self.index = IndexColumns(self.lt_counts, self.full_sequence)
        self._next = 0
        self._lt_files: dict[int, SafetensorsShard] = {}  # layer position -> file of current lt shard
        self._lt_shard = -1
        self._rest_files: dict[int, SafetensorsShard] = {}
        self._rest_shard = -1  # index among rest (sequence) shards
        self._rest_counts: list[int] = []  # prompts per rest shard
        self._rest_tokens: list[int] = []  # tokens per rest shard
        self._rest_bytes = 0
        self._logits_k: int | None = None if opts.logits_topk in (None, 0) else opts.logits_topk
        self._logits_wanted = opts.logits_topk != 0
        self._logits_counts: list[int] = []
        self._logits_starts = np.zeros(1, dtype=np.int64)
        self._logits_file: SafetensorsShard | None = None
        self._logits_shard = -1

    # ---- file naming ----
    def _hidden_path(self, layer: int, shard: int) -> Path:
        return self.tmp_path / self.options.file_pattern.format(layer=layer, shard=shard)

    def _hidden_slot(self, layer: int) -> TensorSlot:
        return TensorSlot(self.options.key_pattern.format(layer=layer), self.code, self.itemsize, (self.spec.d_model,))

    def _open_hidden(self, shard: int, n_rows: int | None) -> dict[int, SafetensorsShard]:
        """One new shard file per stored layer (fixed `n_rows`, or appended when None)."""
        return {li: SafetensorsShard(self._hidden_path(layer, shard), [self._hidden_slot(layer)], n_rows)
                for li, layer in enumerate(self.spec.layers)}

    def _logits_slots(self, k: int) -> list[TensorSlot]:
        slots = [TensorSlot(LOGITS_VALUES_KEY, "F32", 4, (k,)), TensorSlot(LOGITS_INDICES_KEY, "I64", 8, (k,))]
        if self.options.upstream_aliases:
            slots += [TensorSlot(UPSTREAM_VALUES_KEY, "F32", 4, (k,)), TensorSlot(UPSTREAM_INDICES_KEY, "I32", 4, (k,))]
        return slots

    # ---- writing ----
    def write_batch(self, batch: Batch) -> None:
        """Write one batch's pooled/last-token rows, sequence rows and logits; record its index rows."""
        spec = self.spec
        if not self.accepts(batch, n_layers=len(spec.layers), d_model=spec.d_model, max_tokens=spec.max_tokens,
                            written=self._next, n_samples=spec.n_samples):
            return
        b = batch.size
        if b == 0:
            return
        for key in batch.extra:
            if key in RESERVED_COLUMNS and key not in EXTRA_MAPPED:
                raise ConfigError(f"extra column {key!r} collides with an lmprobe index column", self.tmp_path)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        logits = self._batch_logits(batch)
        self._write_last_token(batch, lengths)
        if self.full_sequence:
            rest_shard, rest_row = self._write_rest(batch, lengths)
        else:
            rest_shard = rest_row = np.full(b, -1, dtype=np.int64)
        if logits is not None:
            self._write_logits(*logits)
        self.index.add(batch, lengths, rest_shard, rest_row)
        self._next += b

    def _batch_logits(self, batch: Batch) -> tuple[np.ndarray, np.ndarray] | None:
        """(values [B, k] float32, indices [B, k] int64), top-k sorted descending, or None."""
        has = batch.logits_topk_values is not None and batch.logits_topk_indices is not None
        if not self._logits_wanted:
            return None
        if not self._logits_counts:  # the first batch decides whether logits are stored
            if not has:
                if self.options.logits_topk:
                    raise ConfigError("options['logits_topk'] is set but the batch carries no logits_topk_values/indices",
                                      self.tmp_path)
                self._logits_wanted = False
                return None
            k = self._logits_k or int(np.shape(batch.logits_topk_values)[-1])
            if k < 1:
                raise ConfigError("logits_topk must be >= 1 when logits are stored", self.tmp_path)
            self._logits_k = k
            self._logits_counts = fixed_shard_counts(self.spec.n_samples, logits_row_bytes(k), self.options.shard_bytes)
            self._logits_starts = np.cumsum([0] + self._logits_counts).astype(np.int64)
        if not has:
            raise ConfigError("the first batch carried logits; every batch must carry logits_topk_values/indices",
                              self.tmp_path)
        values = np.asarray(batch.logits_topk_values, dtype=np.float32)
        indices = np.asarray(batch.logits_topk_indices, dtype=np.int64)
        k = self._logits_k
        assert k is not None
        if values.shape != indices.shape or values.ndim != 2 or values.shape[0] != batch.size:
            raise ConfigError(f"logits_topk_values {values.shape} and indices {indices.shape} must both be [B, k]",
                              self.tmp_path)
        if values.shape[1] < k:
            raise ConfigError(f"batch carries top-{values.shape[1]} logits, the store keeps top-{k}", self.tmp_path)
        order = np.argsort(-values, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(values, order, 1), np.take_along_axis(indices, order, 1)

    def _write_last_token(self, batch: Batch, lengths: np.ndarray) -> None:
        """Pooled (or last-token) rows at their final offsets in the last-token shards."""
        pos = 0
        while pos < batch.size:
            g = self._next + pos
            shard = int(np.searchsorted(self.lt_starts, g, side="right") - 1)
            if shard != self._lt_shard:
                for f in self._lt_files.values():
                    f.finish()
                self._lt_files = self._open_hidden(shard, self.lt_counts[shard])
                self._lt_shard = shard
            first = g - int(self.lt_starts[shard])
            take = min(batch.size - pos, self.lt_counts[shard] - first)
            sel = slice(pos, pos + take)
            for li, f in self._lt_files.items():
                rows = pooled_rows(batch.acts_bltd[sel, li], lengths[sel], self.options.pooling)
                f.write_rows(0, first, encode_rows(rows, self.spec.dtype))
            pos += take

    def _write_rest(self, batch: Batch, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append every prompt's tokens but the last to sequence shards; (rest shard, first row) per prompt.

        A sequence shard is closed before a prompt that would push it past `shard_bytes`, unless
        the shard is still empty (a prompt larger than the budget gets a shard of its own).
        """
        b = batch.size
        n_rest = np.maximum(lengths - 1, 0)
        nbytes = n_rest * self.row_bytes
        rest_shard = np.empty(b, dtype=np.int64)
        rest_row = np.empty(b, dtype=np.int64)
        pos = 0
        while pos < b:
            if self._rest_shard < 0:
                self._open_rest_shard()
            over = self._rest_bytes + np.cumsum(nbytes[pos:]) > self.options.shard_bytes
            if self._rest_counts[-1] == 0:
                over[0] = False
            stop = pos + (int(over.argmax()) if over.any() else len(over))
            if stop == pos:
                self._open_rest_shard()
                continue
            sel = slice(pos, stop)
            rest_shard[sel] = self._rest_shard
            rest_row[sel] = self._rest_tokens[-1] + np.cumsum(n_rest[sel]) - n_rest[sel]
            real = np.arange(batch.acts_bltd.shape[2]) < n_rest[sel, None]
            if real.any():
                for li, f in self._rest_files.items():
                    f.append(encode_rows(batch.acts_bltd[sel, li][real], self.spec.dtype))
            self._rest_counts[-1] += stop - pos
            self._rest_tokens[-1] += int(n_rest[sel].sum())
            self._rest_bytes += int(nbytes[sel].sum())
            pos = stop
        return rest_shard, rest_row

    def _open_rest_shard(self) -> None:
        """Finish the current sequence shard (if any) and start the next one."""
        for f in self._rest_files.values():
            f.finish()
        self._rest_shard += 1
        self._rest_counts.append(0)
        self._rest_tokens.append(0)
        self._rest_bytes = 0
        self._rest_files = self._open_hidden(len(self.lt_counts) + self._rest_shard, None)

    def _write_logits(self, values: np.ndarray, indices: np.ndarray) -> None:
        """Top-k rows at their final offsets in the logits shards (spec keys, then upstream aliases)."""
        assert self._logits_k is not None
        starts = self._logits_starts
        pos = 0
        while pos < len(values):
            g = self._next + pos
            shard = int(np.searchsorted(starts, g, side="right") - 1)
            if shard != self._logits_shard:
                if self._logits_file is not None:
                    self._logits_file.finish()
                path = self.tmp_path / LOGITS_FILE_PATTERN.format(shard=shard)
                self._logits_file = SafetensorsShard(path, self._logits_slots(self._logits_k), self._logits_counts[shard])
                self._logits_shard = shard
            first = g - int(starts[shard])
            take = min(len(values) - pos, self._logits_counts[shard] - first)
            v, ix = values[pos : pos + take], indices[pos : pos + take]
            f = self._logits_file
            f.write_rows(0, first, v)
            f.write_rows(1, first, ix)
            if self.options.upstream_aliases:
                f.write_rows(2, first, v)
                f.write_rows(3, first, ix.astype(np.int32))
            pos += take

    # ---- publishing ----
    def close(self) -> Path:
        """Finish every shard, write the parquet index, publish atomically (read-only) and return the path."""
        if self._closed:
            if self.final_path.exists():
                return self.final_path
            raise FormatError("writer was aborted", self.tmp_path)
        spec = self.spec
        if self._next != spec.n_samples:
            raise ConfigError(f"wrote {self._next} samples but n_samples={spec.n_samples}", self.tmp_path)
        for f in list(self._lt_files.values()) + list(self._rest_files.values()):
            f.finish()
        if self._logits_file is not None:
            self._logits_file.finish()
        if self.full_sequence and sum(self._rest_tokens) == 0:  # no token beyond the last: no sequence shards (as upstream)
            for r in range(len(self._rest_counts)):
                for layer in spec.layers:
                    self._hidden_path(layer, len(self.lt_counts) + r).unlink(missing_ok=True)
            self._rest_counts, self._rest_tokens = [], []
        table = self.index.table(self._logits_counts if self._logits_k is not None else None)
        table = table.replace_schema_metadata(schema_metadata(spec, self._descriptors()))
        path = self.tmp_path / INDEX_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        import pyarrow.parquet as pq

        pq.write_table(table, path)
        self._closed = True
        try:
            return self.publish(self.tmp_path, self.final_path)
        finally:
            self._release(remove=True)

    def _descriptors(self) -> dict[str, Any]:
        """The `lmprobe:tensors` value: the hidden_layers descriptor and, when stored, logits_topk."""
        spec, opts = self.spec, self.options
        hidden: dict[str, Any] = {
            "type": "hidden",
            "layers": list(spec.layers),
            "dim": spec.d_model,
            "dtype": spec.dtype,
            "layout": "per_layer",
            "file_pattern": opts.file_pattern,
            "key_pattern": opts.key_pattern,
            "storage": opts.storage,
            "pooling": opts.pooling,
            "row_bytes": self.row_bytes,
        }
        if self.full_sequence:
            hidden["last_token_shards"] = len(self.lt_counts)
            hidden["shards"] = [{"num_prompts": c, "num_tokens": c} for c in self.lt_counts] + [
                {"num_prompts": c, "num_tokens": t} for c, t in zip(self._rest_counts, self._rest_tokens)
            ]
        else:
            hidden["shards"] = [{"num_prompts": c} for c in self.lt_counts]
        out: dict[str, Any] = {"hidden_layers": hidden}
        if self._logits_k is not None and self._logits_counts:
            out["logits_topk"] = {
                "type": "logits_topk",
                "k": self._logits_k,
                "dtype": "float32",
                "indices_dtype": "int64",
                "pooling": "last_token",
                "file_pattern": LOGITS_FILE_PATTERN,
                "row_bytes": logits_row_bytes(self._logits_k),
                "shards": [{"file": LOGITS_FILE_PATTERN.format(shard=s), "num_prompts": c}
                           for s, c in enumerate(self._logits_counts)],
            }
        return out

    def abort(self) -> None:
        """Stop without publishing (the temporary directory is removed by the next writer)."""
        self._closed = True
        self._release(remove=False)

    def _release(self, *, remove: bool) -> None:
        if self._lock is not None:
            self._lock.release(remove=remove)


def create_writer(out_root: Path, spec: StoreSpec) -> LmprobeWriter:
    """Format-registry entry point."""
    return LmprobeWriter(out_root, spec)
