"""Writer of the gzip-pickle shard format: buffer samples to a byte budget, commit shards, resume, publish."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...atomic import WriterLock, write_json_atomic
from ...batch import Batch
from ...errors import ConfigError, FormatError
from ...spec import StoreSpec
from ...writer import Writer
from .layout import (
    EXTENSION_KEY,
    EXTENSION_VERSION,
    PREVIEW_CHARS,
    VERSION,
    PickleOptions,
    layer_key,
    plain,
    shard_filename,
    store_path,
    utc_now_iso,
)
from .metadata import (
    ShardInfo,
    distributed_config,
    extraction_config,
    read_metadata,
    statistics,
)
from .shard_io import write_shard


@dataclass
class _Pending:
    """Samples buffered for the shard being filled."""

    items: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)  # [sample][layer]
    sample_ids: list[int] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    labels: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = 0


class PickleWriter(Writer):
    """Buffers samples up to `shard_bytes` of float32 activations, then writes one shard.

    Works under `<parent>/.tmp-machine_XXXX/`; each committed shard is renamed from `.partial`
    and followed by a `.shard_XXXX.json` sidecar (its metadata entry and sample index), so an
    interrupted writer reopened with the same spec resumes after its last committed shard.
    `close()` writes metadata.json and publishes the directory read-only.
    """

    def __init__(self, out_root: Path, spec: StoreSpec) -> None:
        self.spec = spec
        self.options = PickleOptions.from_spec(spec)
        if spec.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ConfigError(f"pickle shards hold float32 activations; cannot take dtype {spec.dtype!r}")
        self.final_path = store_path(out_root, spec)
        self.parent = self.final_path.parent
        self.tmp_path = self.parent / f".tmp-{self.final_path.name}"
        self.spec_hash = spec.content_hash()
        self._closed = False
        self._started = time.monotonic()
        self._batch_size: int | None = None
        self._pending = _Pending()
        self._shards: list[ShardInfo] = []
        self._index: list[dict[str, Any]] = []
        self._seen: set[int] = set()
        self._has_labels = False
        self._has_texts = False
        self._lock: WriterLock | None = None
        self.parent.mkdir(parents=True, exist_ok=True)
        if self.final_path.exists():
            self._check_published()
            self.resume_from = spec.n_samples
            self._closed = True
            return
        self._lock = WriterLock(self.tmp_path)
        self._open_tmp()

    def _release(self, *, remove: bool) -> None:
        if self._lock is not None:
            self._lock.release(remove=remove)

    def _check_published(self) -> None:
        """Refuse a published store at our path that another spec wrote (same job hash, other content)."""
        md = read_metadata(self.final_path)
        ext = md.extension or {}
        if ext.get("spec_hash") != self.spec_hash:
            raise ConfigError(f"a different pickle store is already published here (spec hash "
                              f"{ext.get('spec_hash')!r}, this spec {self.spec_hash}); remove it or use another "
                              f"out root", self.final_path)

    def _open_tmp(self) -> None:
        """Resume from the temporary directory of an interrupted run with this spec, or start it afresh."""
        tmp = self.tmp_path
        progress = tmp / "progress.json"
        try:
            state = json.loads(progress.read_text(encoding="utf-8"))
            if state.get("spec_hash") != self.spec_hash:
                raise ValueError("another spec")
            self._restore(state)
        except (OSError, ValueError, KeyError, TypeError, FormatError):
            remove_tmp(tmp)
            tmp.mkdir(parents=True)
            write_json_atomic(progress, {"spec_hash": self.spec_hash, "started_at": utc_now_iso(),
                                         "elapsed_seconds": 0.0})
            self._shards, self._index, self._seen = [], [], set()
            self._has_labels = self._has_texts = False  # _restore may have set these before failing
            self._batch_size = None
            self._started = time.monotonic()
        self.resume_from = sum(s.num_samples for s in self._shards)

    def _restore(self, state: dict[str, Any]) -> None:
        """Keep the shards committed by an interrupted run (those with a sidecar); drop the rest."""
        tmp = self.tmp_path
        self._started -= float(state.get("elapsed_seconds", 0.0))
        committed = set()
        k = 1
        while (tmp / f".shard_{k:04d}.json").is_file():
            side = json.loads((tmp / f".shard_{k:04d}.json").read_text(encoding="utf-8"))
            info = ShardInfo.from_json(k - 1, side["info"], tmp)
            if not (tmp / info.filename).is_file() or (tmp / info.filename).stat().st_size != info.size_bytes:
                break
            self._shards.append(info)
            self._index.append(side["index"])
            self._seen.update(side["index"]["sample_ids"])
            self._has_labels |= side["index"]["labels"] is not None
            self._has_texts |= bool(side["index"].get("has_texts"))
            self._batch_size = side.get("batch_size", self._batch_size)
            committed.update({info.filename, f".shard_{k:04d}.json"})
            k += 1
        for f in tmp.iterdir():
            if f.name not in committed and f.name != "progress.json":
                f.unlink()

    # ---- writing ----
    def write_batch(self, batch: Batch) -> None:
        spec = self.spec
        if not self.accepts(batch, n_layers=len(spec.layers), d_model=spec.d_model, max_tokens=spec.max_tokens,
                            written=self.written, n_samples=spec.n_samples):
            return
        b, n_layers, _, d = batch.acts_bltd.shape
        padded = self.options.padded
        self._batch_size = max(self._batch_size or 0, b)
        ids = np.asarray(batch.sample_ids, dtype=np.int64)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        dataset_idx = batch.extra.get("dataset_idx")
        self._has_texts |= batch.texts is not None
        self._has_labels |= batch.labels is not None
        for k in range(b):
            sid = int(ids[k])
            if sid in self._seen:
                raise ConfigError(f"sample id {sid} was already written; sample ids must be unique", self.tmp_path)
            self._seen.add(sid)
            n = int(lengths[k])
            rows = spec.max_tokens if padded else n  # stored rows per layer
            row_bytes = n_layers * rows * d * 4
            if self._pending.items and self._pending.nbytes + row_bytes > self.options.shard_bytes:
                self._flush()
            text = "" if batch.texts is None else str(batch.texts[k])
            label = None if batch.labels is None else int(batch.labels[k])
            meta: dict[str, Any] = {
                "token_count": n,
                "dataset_idx": sid if dataset_idx is None else int(dataset_idx[k]),
                "machine_id": spec.machine_id,
            }
            if label is not None:
                meta["label"] = label
            preview = text[:PREVIEW_CHARS]
            if len(text) > PREVIEW_CHARS:
                meta["text"] = text  # one string object: pickle stores it once per shard
            layer_items = []
            for j in range(n_layers):
                act = np.zeros((rows, d), dtype=np.float32)  # a copy: the caller may reuse its buffer
                act[:n] = batch.acts_bltd[k, j, :n]  # padding rows stay zero whatever the batch held there
                layer_items.append({"sample_idx": sid, "activation": act, "shape": tuple(act.shape),
                                    "text_preview": preview, "metadata": dict(meta)})
            p = self._pending
            p.items.append(layer_items)
            p.sample_ids.append(sid)
            p.lengths.append(n)
            p.labels.append(-1 if label is None else label)
            p.nbytes += row_bytes
            if p.nbytes >= self.options.shard_bytes:
                self._flush()

    @property
    def written(self) -> int:
        """Samples received so far (committed shards plus the buffer)."""
        return sum(s.num_samples for s in self._shards) + len(self._pending.sample_ids)

    def _flush(self) -> None:
        """Write the buffered samples as the next shard and commit it (rename, then sidecar)."""
        p = self._pending
        if not p.items:
            return
        shard_id = len(self._shards) + 1
        layers = self.spec.layers
        shard = {layer_key(layer): [row[j] for row in p.items] for j, layer in enumerate(layers)}
        name = shard_filename(shard_id, self.options.compressed)
        partial = self.tmp_path / f"{name}.partial"
        size, checksum = write_shard(partial, shard, self.options)
        os.replace(partial, self.tmp_path / name)
        info = ShardInfo(shard_id, name, size, len(p.sample_ids), tuple(layers),
                         (min(p.sample_ids), max(p.sample_ids)), self.options.compressed, checksum)
        index = {"sample_ids": p.sample_ids, "lengths": p.lengths,
                 "labels": p.labels if self._has_labels else None, "has_texts": self._has_texts}
        write_json_atomic(self.tmp_path / f".shard_{shard_id:04d}.json",
                          {"info": info.to_json(), "index": index, "batch_size": self._batch_size}, indent=None)
        write_json_atomic(self.tmp_path / "progress.json",
                          {"spec_hash": self.spec_hash, "elapsed_seconds": time.monotonic() - self._started})
        self._shards.append(info)
        self._index.append(index)
        self._pending = _Pending()

    def close(self) -> Path:
        if self._closed:
            if self.final_path.exists():
                return self.final_path
            raise FormatError("writer was aborted", self.tmp_path)
        self._flush()
        if self.written != self.spec.n_samples:
            raise ConfigError(f"wrote {self.written} samples but the spec says n_samples={self.spec.n_samples}",
                              self.tmp_path)
        duration = float(self.spec.provenance.get("extraction_duration_seconds", time.monotonic() - self._started))
        write_json_atomic(self.tmp_path / "metadata.json", self._metadata(duration))
        for f in self.tmp_path.glob(".shard_*.json"):
            f.unlink()
        (self.tmp_path / "progress.json").unlink()
        self._closed = True
        try:
            return self.publish(self.tmp_path, self.final_path)
        finally:
            self._release(remove=True)

    def _metadata(self, duration: float) -> dict[str, Any]:
        """The full metadata.json: the spec's fields plus actlake's per-sample index under `actlake`."""
        spec = self.spec
        sample_ids = [i for idx in self._index for i in idx["sample_ids"]]
        lengths = [n for idx in self._index for n in idx["lengths"]]
        labels = None
        if self._has_labels:
            labels = [x for idx in self._index for x in (idx["labels"] or [-1] * len(idx["sample_ids"]))]
        return {
            "version": VERSION,
            "created_at": utc_now_iso(),
            "extraction_config": extraction_config(spec, self._batch_size),
            "distributed_config": distributed_config(spec),
            "shards": [s.to_json() for s in self._shards],
            "statistics": statistics(self._shards, spec.layers, duration),
            EXTENSION_KEY: plain({
                "extension_version": EXTENSION_VERSION,
                "spec_hash": self.spec_hash,
                "model_name": spec.model_name, "family": spec.family, "cls_token": spec.cls_token,
                "dataset": spec.dataset, "data": spec.data, "d_model": spec.d_model,
                "max_tokens": spec.max_tokens, "dtype": "float32", "source_dtype": spec.dtype,
                "n_samples": spec.n_samples, "has_texts": self._has_texts,
                "sample_ids": sample_ids, "lengths": lengths, "labels": labels,
                "provenance": spec.provenance,
            }),
        }

    def abort(self) -> None:
        self._pending = _Pending()
        self._closed = True
        self._release(remove=False)


def remove_tmp(tmp: Path) -> None:
    """Delete a temporary directory without chmod-ing its files (they may be hard links to published shards)."""
    if not tmp.exists():
        return
    for dirpath, _, _ in os.walk(tmp):
        Path(dirpath).chmod(Path(dirpath).stat().st_mode | stat.S_IWUSR | stat.S_IXUSR)
    shutil.rmtree(tmp)


def create_writer(out_root: Path, spec: StoreSpec) -> PickleWriter:
    """Format-registry entry point."""
    return PickleWriter(Path(out_root), spec)
