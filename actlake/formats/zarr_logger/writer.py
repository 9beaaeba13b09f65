"""ZarrWriter: streams Batches into a preallocated store under a temporary name, resumable, published atomically."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ...atomic import WriterLock, remove_tree, write_json_atomic
from ...batch import Batch
from ...errors import ConfigError, FormatError, MetadataError
from ...spec import StoreSpec
from ...writer import Writer
from .layout import (
    ACT_ARRAYS,
    PARTS_DIR,
    PROMPT,
    RESPONSE,
    SAMPLE_KEY_BYTES,
    SCHEMA,
    SCHEMA_VERSION,
    SHARDS_DIR,
    SPLIT_CODES,
    STORE_NAME,
    default_sample_key,
    int8_code,
    layout_from_spec,
    now,
    plain,
    run_hash,
    zarr_module,
)
from .manifest import write_manifest
from .store import Columns, create_act_array, finish_store, seal_chunks, truncation_attrs

_PART_RE = re.compile(r"^part-(\d{12})-(\d{12})\.json$")
_CHUNK_SAMPLE_RE = re.compile(r"^([0-9]+)\.")


class ZarrWriter(Writer):
    """Streams Batches into a preallocated store under a temporary name and publishes it atomically.

    Single machine (`num_machines == 1`): `<out_root>/zarr-<hash16>/activations.zarr`, built in
    `<out_root>/.tmp-zarr-<hash16>/`. Machine k of M: `<out_root>/zarr-<runhash16>/shards/shard-kkkk.zarr`,
    built in `.tmp-shard-kkkk-<hash16>.zarr` beside it; the last shard to publish writes
    `manifest.json`. After each batch its chunk files are fsynced and a part file records its
    per-sample values, so an interrupted writer resumes after the last recorded batch.
    """

    def __init__(self, out_root: str | Path, spec: StoreSpec) -> None:
        self.spec = spec
        self.layout = layout_from_spec(spec)
        self.spec_hash = spec.content_hash()
        root = Path(out_root)
        if spec.num_machines == 1:
            self.run_dir = root / f"zarr-{self.spec_hash[:16]}"
            self.final_path = self.run_dir
            self.tmp_path = root / f".tmp-zarr-{self.spec_hash[:16]}"
            self.store_tmp = self.tmp_path / STORE_NAME
        else:
            self.run_dir = root / f"zarr-{run_hash(spec)[:16]}"
            shards = self.run_dir / SHARDS_DIR
            self.final_path = shards / f"shard-{spec.machine_id:04d}.zarr"
            self.tmp_path = shards / f".tmp-shard-{spec.machine_id:04d}-{self.spec_hash[:16]}.zarr"
            self.store_tmp = self.tmp_path
        self.tmp_path.parent.mkdir(parents=True, exist_ok=True)
        self._closed = False
        self._has_response = False
        self._lock: WriterLock | None = None
        if self.final_path.exists():
            self._check_published()
            self.resume_from = self._next = spec.n_samples
            self._closed = True
            return
        self._lock = WriterLock(self.tmp_path)
        self._open_tmp()

    # ---- setup ----
    def _check_published(self) -> None:
        """A published store here must carry this spec's hash (else another configuration owns the name)."""
        store = self.final_path / STORE_NAME if self.spec.num_machines == 1 else self.final_path
        source = store / ".zattrs"
        try:
            attrs = json.loads(source.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise MetadataError(f"published store is unreadable: {exc}", source) from exc
        if not isinstance(attrs, dict):
            raise MetadataError("published store attrs are not a JSON object", source)
        if attrs.get("spec_hash") != self.spec_hash:
            raise ConfigError("a store with another configuration is already published here", store)

    def _state(self) -> dict[str, Any]:
        return {"spec_hash": self.spec_hash, "layout": plain(self.layout.__dict__)}

    def _open_tmp(self) -> None:
        """Create the preallocated temporary store, or reopen one left by an interrupted run of this spec."""
        parts = self.store_tmp / PARTS_DIR
        self._finished = self.tmp_path.exists() and self._finished_tmp()
        if self._finished:  # an earlier close() finished the store and stopped before publishing it
            self._arrays = {}
            self.resume_from = self._next = self.spec.n_samples
            return
        if self.tmp_path.exists():
            try:
                saved = json.loads((parts / "state.json").read_text(encoding="utf-8"))
                if saved != self._state():
                    raise ValueError("different configuration")
            except (OSError, ValueError):
                remove_tree(self.tmp_path)
        zarr = zarr_module()
        if not self.tmp_path.exists():
            self.store_tmp.mkdir(parents=True)
            root = zarr.open_group(str(self.store_tmp), mode="w", zarr_format=2)
            arrays = root.create_group("arrays")
            for name in ACT_ARRAYS:
                create_act_array(arrays, name, self.layout.shape(name), self.layout.chunks(name))
            parts.mkdir()
            write_json_atomic(parts / "state.json", self._state())
            self.resume_from = 0
        else:
            self.resume_from = self._recover_parts(parts)
        root = zarr.open_group(str(self.store_tmp), mode="r+", zarr_format=2)
        self._arrays = {name: root["arrays"][name] for name in ACT_ARRAYS}
        self._next = self.resume_from

    def _finished_tmp(self) -> bool:
        """The temporary store is complete: attrs of this spec written, metadata consolidated, part files gone."""
        try:
            attrs = json.loads((self.store_tmp / ".zattrs").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return (isinstance(attrs, dict) and attrs.get("spec_hash") == self.spec_hash
                and (self.store_tmp / ".zmetadata").is_file() and not (self.store_tmp / PARTS_DIR).exists())

    def _recover_parts(self, parts: Path) -> int:
        """Samples covered by contiguous part files from 0; later parts and their chunks are dropped."""
        spans = []
        for f in parts.iterdir():
            m = _PART_RE.match(f.name)
            if m:
                spans.append((int(m.group(1)), int(m.group(2)), f))
            elif f.name != "state.json":
                f.unlink()
        done = 0
        for start, stop, f in sorted(spans):
            if start == done and stop > start:
                done = stop
            else:
                f.unlink()
        for name in ACT_ARRAYS:  # chunks of samples past the recorded ones are stale
            for entry in os.scandir(self.store_tmp / "arrays" / name):
                m = _CHUNK_SAMPLE_RE.match(entry.name)
                if m and int(m.group(1)) >= done:
                    os.unlink(entry.path)
        return done

    # ---- writing ----
    @staticmethod
    def _fixed(acts_bltd: np.ndarray, lengths: np.ndarray, cap: int) -> np.ndarray:
        """(B, L, cap, H) float16: the first min(len, cap) tokens, zeros after (one masked fp32->fp16 cast)."""
        b, n_layers, t, d = acts_bltd.shape
        out = np.zeros((b, n_layers, cap, d), dtype=np.float16)
        k = min(t, cap)
        real_bt = np.arange(k)[None, :] < np.minimum(lengths, cap)[:, None]
        np.copyto(out[:, :, :k], acts_bltd[:, :, :k], casting="same_kind", where=real_bt[:, None, :, None])
        return out

    def write_batch(self, batch: Batch) -> None:
        lay = self.layout
        if not self.accepts(batch, n_layers=len(lay.layers), d_model=lay.hidden_size, max_tokens=None,
                            written=self._next, n_samples=lay.n_samples):
            return
        b = batch.size
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        if batch.response_bltd is not None:
            r_lengths = np.asarray(batch.response_lengths, dtype=np.int64)
            if r_lengths.shape != (b,) or (b and (r_lengths.min() < 0 or r_lengths.max() > batch.response_bltd.shape[2])):
                raise ConfigError(f"response_lengths must be {b} values in [0, {batch.response_bltd.shape[2]}]")
        else:
            r_lengths = np.zeros(b, dtype=np.int64)
        part = self._part(batch, lengths, r_lengths)
        start = self._next
        if b:
            self._arrays[PROMPT][start : start + b] = self._fixed(batch.acts_bltd, lengths, lay.p_max)
            if batch.response_bltd is not None:
                self._arrays[RESPONSE][start : start + b] = self._fixed(batch.response_bltd, r_lengths, lay.r_max)
            self._fsync_chunks(start, lengths, r_lengths)
        write_json_atomic(self.store_tmp / PARTS_DIR / f"part-{start:012d}-{start + b:012d}.json", part, indent=None)
        self._next += b

    @staticmethod
    def _part(batch: Batch, lengths: np.ndarray, r_lengths: np.ndarray) -> dict[str, Any]:
        """The per-sample values of one batch, as recorded in its part file."""
        b = batch.size
        ids = np.asarray(batch.sample_ids).astype(np.int64).tolist()
        prompts = [None] * b if batch.texts is None else [str(t) for t in batch.texts]
        responses = [None] * b if batch.response_texts is None else [str(t) for t in batch.response_texts]
        extra = dict(batch.extra)
        keys = extra.pop("sample_key", None)
        if keys is None:
            keys = [default_sample_key(i, p, r) for i, p, r in zip(ids, prompts, responses)]
        keys = [k.decode("ascii", "replace") if isinstance(k, bytes) else str(k) for k in keys]
        for k in keys:
            if len(k) > SAMPLE_KEY_BYTES or not k.isascii():
                raise ConfigError(f"sample_key {k!r} is not ASCII of at most {SAMPLE_KEY_BYTES} characters")
        hallu = extra.pop("hallu_label", None)
        split = extra.pop("split", None)
        columns = {key: plain(list(col)) for key, col in extra.items()}  # one JSON pass per column
        rows = [{key: col[i] for key, col in columns.items()} for i in range(b)] if columns else None
        return {
            "prompt_len_true": lengths.tolist(), "response_len_true": r_lengths.tolist(), "sample_id": ids,
            "sample_key": keys, "prompt": prompts, "response": responses,
            "has_response": batch.response_bltd is not None,
            "label": None if batch.labels is None else np.asarray(batch.labels).astype(np.int64).tolist(),
            "hallu_label": None if hallu is None else [int8_code(x, "hallu_label", {}) for x in hallu],
            "split": None if split is None else [int8_code(x, "split", SPLIT_CODES) for x in split],
            "extra": rows,
        }

    def _fsync_chunks(self, start: int, lengths: np.ndarray, r_lengths: np.ndarray) -> None:
        """Make the chunk files of samples [start, start + B) durable before their part file is recorded, every
        chunk holding real tokens included (`store.seal_chunks`: zarr skips all-zero ones)."""
        lay = self.layout
        for name, lens, cap in ((PROMPT, lengths, lay.p_max), (RESPONSE, r_lengths, lay.r_max)):
            t_chunk = lay.chunks(name)[2]
            seal_chunks(self.store_tmp / "arrays" / name, start, np.minimum(lens, cap), len(lay.layers),
                        -(-lay.shape(name)[2] // t_chunk), t_chunk, t_chunk * lay.hidden_size * 2, fsync=True)

    def _columns(self) -> tuple[Columns, dict[str, Any]]:
        """Every part file, in order, as columns plus the truncation record."""
        parts_dir = self.store_tmp / PARTS_DIR
        parts = sorted((int(m.group(1)), f) for f in parts_dir.iterdir() if (m := _PART_RE.match(f.name)))
        merged: dict[str, list[Any]] = {key: [] for key in ("prompt_len_true", "response_len_true", "sample_id",
                                                             "sample_key", "prompt", "response")}
        optional: dict[str, list[Any] | None] = {"label": None, "hallu_label": None, "split": None, "extra": None}
        fills: dict[str, Any] = {"label": -1, "hallu_label": -1, "split": -1, "extra": {}}
        n_before = 0
        for _, f in parts:
            part = json.loads(f.read_text(encoding="utf-8"))
            b = len(part["sample_id"])
            self._has_response |= bool(part["has_response"])
            for key, values in merged.items():
                values.extend(part[key])
            for key, values in optional.items():
                if part[key] is not None and values is None:  # first batch carrying it: earlier ones get the fill
                    optional[key] = values = [fills[key]] * n_before
                if values is not None:
                    values.extend([fills[key]] * b if part[key] is None else part[key])
            n_before += b
        lay = self.layout
        p_true = np.asarray(merged["prompt_len_true"], dtype=np.int64)
        r_true = np.asarray(merged["response_len_true"], dtype=np.int64)
        cols = Columns(
            prompt_len=np.minimum(p_true, lay.p_max).astype(np.int32),
            response_len=np.minimum(r_true, lay.r_max).astype(np.int32),
            sample_id=np.asarray(merged["sample_id"], dtype=np.int64),
            sample_key=merged["sample_key"], prompts=merged["prompt"], responses=merged["response"],
            label=None if optional["label"] is None else np.asarray(optional["label"], dtype=np.int64),
            hallu_label=None if optional["hallu_label"] is None else np.asarray(optional["hallu_label"], dtype=np.int8),
            split=None if optional["split"] is None else np.asarray(optional["split"], dtype=np.int8),
            extra=optional["extra"],
        )
        return cols, truncation_attrs(p_true, r_true, lay.p_max, lay.r_max)

    def _attrs(self, truncation: dict[str, Any]) -> dict[str, Any]:
        """The root attrs: every global key of the spec plus actlake's identity and provenance."""
        spec, lay = self.spec, self.layout
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "model_id": spec.model_name, "family": spec.family,
            "cls_token": spec.cls_token,
            "num_layers": len(lay.layers), "layers": list(lay.layers), "hidden_size": lay.hidden_size,
            "T_max": spec.max_tokens, "P_max": lay.p_max, "R_max": lay.r_max,
            "p_max_policy": "constant" if lay.p_quantile is None else "quantile", "p_quantile": lay.p_quantile,
            "r_max_policy": "constant" if lay.r_quantile is None else "quantile", "r_quantile": lay.r_quantile,
            "dtype": "float16", "t_chunk_prompt": lay.t_chunk_prompt, "t_chunk_response": lay.t_chunk_response,
            "chunks": {name: list(lay.chunks(name)) for name in ACT_ARRAYS},
            "created_at": now(), "git_commit": spec.provenance.get("git_commit"),
            "dataset_name": spec.dataset, "data": spec.data, "n_samples": lay.n_samples,
            "has_response": self._has_response, **truncation,
            "machine_id": spec.machine_id, "num_machines": spec.num_machines, "spec_hash": self.spec_hash,
            "provenance": spec.provenance, "actlake_version": _actlake_version(),
        }

    def close(self) -> Path:
        if self._closed:
            if self.final_path.exists():
                if self.spec.num_machines > 1:
                    write_manifest(self.run_dir, self.spec.num_machines, missing_ok=True)
                return self.final_path
            raise FormatError("writer was aborted", self.tmp_path)
        if self._next != self.layout.n_samples:
            raise ConfigError(f"wrote {self._next} samples but n_samples={self.layout.n_samples}", self.tmp_path)
        if not self._finished:
            cols, truncation = self._columns()
            self._arrays = {}
            finish_store(self.store_tmp, cols, self._attrs(truncation))
            # the part files go last: a crash before this resumes from them, a crash after finds a finished store
            remove_tree(self.store_tmp / PARTS_DIR)
            self._finished = True
        self._closed = True
        try:
            published = self.publish(self.tmp_path, self.final_path, self.store_tmp)
        finally:
            self._release(remove=True)
        if self.spec.num_machines > 1:
            write_manifest(self.run_dir, self.spec.num_machines, missing_ok=True)
        return published

    def abort(self) -> None:
        self._arrays = {}
        self._closed = True
        self._release(remove=False)

    def _release(self, *, remove: bool) -> None:
        if self._lock is not None:
            self._lock.release(remove=remove)


def _actlake_version() -> str:
    from ... import __version__

    return __version__


def create_writer(out_root: Path, spec: StoreSpec) -> ZarrWriter:
    """Format-registry entry point."""
    return ZarrWriter(out_root, spec)
