"""Zarr fp16 activation logger (shared/specs/zarr-activation-logger.md): writer, readers, verify, merge.

A store is a Zarr v2 directory `activations.zarr/` written through zarr-python (`zarr_format=2`):
`arrays/prompt_activations` (N, L, P_max, H) and `arrays/response_activations` (N, L, R_max, H),
float16, C order, fill 0, no compressor, no filters, chunks (1, 1, T_chunk, H); per-sample arrays
in `arrays/`; texts in `text/*.jsonl`; global metadata in the root attrs; consolidated metadata.

Layouts `actlake.open()` accepts (choices recorded in docs/formats/zarr.md):
- a store directory (`.../activations.zarr`);
- a run directory holding `activations.zarr/` (what a single writer publishes: `zarr-<hash16>/`);
- a sharded run directory: `shards/shard-XXXX.zarr/` (one per machine) + `manifest.json`
  mapping global index -> (shard, local index) (spec option A). `merge()` builds one store
  (spec option B).
Reads of one (sample, layer) touch only that sample and layer's chunk files; a local store is
read straight from its uncompressed chunk files (exactly zarr's bytes), with zarr's API as the
fallback for anything else.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import sys
import threading
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..atomic import fsync_dir, publish_dir, remove_tree, resolve_inside, write_bytes_atomic, write_json_atomic
from ..batch import Batch
from ..errors import (
    ConfigError,
    FormatError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
    TruncatedFileError,
)
from ..reader import Reader
from ..spec import StoreSpec
from ..writer import Writer

FORMAT = "zarr"
SCHEMA = "actlake-zarr-activation-logger"
SCHEMA_VERSION = "1.0"
MANIFEST_FORMAT = "actlake-zarr-manifest"
STORE_NAME = "activations.zarr"
MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
PARTS_DIR = ".actlake-parts"
DEFAULT_R_MAX = 64
DEFAULT_CHUNK_BYTES = 1 << 20
SAMPLE_KEY_BYTES = 64
META_CHUNK = 1 << 16
#: largest N, L, T (P_max / R_max) and H a store may claim; larger is refused before any allocation
MAX_DIMS = {"N": 1 << 31, "L": 1 << 16, "T": 1 << 24, "H": 1 << 20}
FD_CACHE_MAX = 4096  # most chunk-file descriptors one reader keeps open (per process)
SPLIT_CODES = {"train": 0, "val": 1, "validation": 1, "dev": 1, "test": 2}
PROMPT, RESPONSE = "prompt_activations", "response_activations"
ACT_ARRAYS = (PROMPT, RESPONSE)
SHARD_RE = re.compile(r"^shard-(\d{4,})\.zarr$")
#: per-sample arrays: name -> numpy dtype string as written (`required` ones must exist)
META_ARRAYS = {"prompt_len": "<i4", "response_len": "<i4", "sample_id": "<i8", "label": "<i8",
               "hallu_label": "|i1", "split": "|i1", "sample_key": f"|S{SAMPLE_KEY_BYTES}"}
REQUIRED_META = ("prompt_len", "response_len")
#: every global key the writer puts in the root attrs (verify checks they are present)
REQUIRED_ATTRS = ("schema", "schema_version", "model_id", "num_layers", "layers", "hidden_size", "T_max",
                  "P_max", "R_max", "dtype", "t_chunk_prompt", "t_chunk_response", "chunks", "created_at",
                  "git_commit", "dataset_name", "n_samples", "prompt_truncated_count",
                  "response_truncated_count", "prompt_truncated_fraction", "response_truncated_fraction")
_PART_RE = re.compile(r"^part-(\d{12})-(\d{12})\.json$")
_NATIVE_F16 = "<f2" if sys.byteorder == "little" else ">f2"


def _zarr() -> Any:
    """zarr-python, imported on first use (keeps `import actlake` light)."""
    import zarr

    return zarr


def _plain(obj: Any) -> Any:
    """A JSON-able copy of `obj` (numpy scalars -> Python, unknown objects -> str)."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


def default_t_chunk(p_max: int, hidden: int, target_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Prompt chunk length: the largest power of two whose chunk is <= target_bytes, capped at P_max."""
    t = 1
    while t * 2 * hidden * 2 <= target_bytes:
        t *= 2
    return max(1, min(t, p_max))


def quantile_cap(lengths: Sequence[int], q: float, name: str) -> int:
    """A token cap at quantile `q` of a length distribution (an observed length, at least 1)."""
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise ConfigError(f"{name}: the length distribution is empty")
    if arr.min() < 0:
        raise ConfigError(f"{name}: lengths must be >= 0")
    return max(1, int(np.quantile(arr, q, method="higher")))


# --------------------------------------------------------------------------------------------
# Layout: the shapes fixed before the first batch
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZarrLayout:
    """Shapes and chunking of one store (validated on construction)."""

    n_samples: int
    layers: tuple[int, ...]
    hidden_size: int
    p_max: int
    r_max: int
    t_chunk_prompt: int
    p_quantile: float | None = None
    r_quantile: float | None = None

    def __post_init__(self) -> None:
        if self.n_samples < 0 or self.hidden_size < 1 or not self.layers:
            raise ConfigError(f"invalid layout: n_samples={self.n_samples} hidden_size={self.hidden_size} "
                              f"layers={list(self.layers)}")
        if self.p_max < 1 or self.r_max < 1:
            raise ConfigError(f"P_max and R_max must be >= 1, got {self.p_max} and {self.r_max}")
        if not 1 <= self.t_chunk_prompt <= self.p_max:
            raise ConfigError(f"t_chunk_prompt must be in 1..P_max={self.p_max}, got {self.t_chunk_prompt}")

    @property
    def t_chunk_response(self) -> int:
        """The spec's recommendation: one chunk per (sample, layer) response slice."""
        return self.r_max

    def shape(self, name: str) -> tuple[int, int, int, int]:
        t = self.p_max if name == PROMPT else self.r_max
        return (self.n_samples, len(self.layers), t, self.hidden_size)

    def chunks(self, name: str) -> tuple[int, int, int, int]:
        t = self.t_chunk_prompt if name == PROMPT else self.t_chunk_response
        return (1, 1, t, self.hidden_size)


def _int_option(options: dict[str, Any], key: str, default: int | None) -> int | None:
    value = options.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"option {key!r} must be an integer, got {value!r}")
    return int(value)


def _quantile_option(options: dict[str, Any], key: str) -> float | None:
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) <= 1:
        raise ConfigError(f"option {key!r} must be a quantile in (0, 1], got {value!r}")
    return float(value)


def layout_from_spec(spec: StoreSpec) -> ZarrLayout:
    """Resolve P_max / R_max / T_chunk from `spec.options` (see docs/formats/zarr.md)."""
    opts = dict(spec.options)
    known = {"p_max", "r_max", "p_quantile", "r_quantile", "prompt_lengths", "response_lengths",
             "t_chunk_prompt", "chunk_bytes"}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ConfigError(f"unknown zarr option(s) {unknown}; known: {sorted(known)}")
    caps = {}
    for part, default in (("p", spec.max_tokens), ("r", DEFAULT_R_MAX)):
        q = _quantile_option(opts, f"{part}_quantile")
        if q is not None:
            if opts.get(f"{part}_max") is not None:
                raise ConfigError(f"give {part}_max or {part}_quantile, not both")
            key = "prompt_lengths" if part == "p" else "response_lengths"
            if opts.get(key) is None:
                raise ConfigError(f"{part}_quantile needs the length distribution up front in option {key!r}")
            caps[part] = (quantile_cap(opts[key], q, key), q)
        else:
            caps[part] = (_int_option(opts, f"{part}_max", default), None)
    chunk_bytes = _int_option(opts, "chunk_bytes", DEFAULT_CHUNK_BYTES)
    if chunk_bytes is None or chunk_bytes < 2 * spec.d_model:
        raise ConfigError(f"chunk_bytes must hold at least one token row ({2 * spec.d_model} bytes)")
    p_max = caps["p"][0]
    t_chunk = _int_option(opts, "t_chunk_prompt", None) or default_t_chunk(p_max, spec.d_model, chunk_bytes)
    return ZarrLayout(n_samples=spec.n_samples, layers=spec.layers, hidden_size=spec.d_model, p_max=p_max,
                      r_max=caps["r"][0], t_chunk_prompt=t_chunk, p_quantile=caps["p"][1], r_quantile=caps["r"][1])


# --------------------------------------------------------------------------------------------
# Per-sample columns and finishing a store (shared by the writer and merge)
# --------------------------------------------------------------------------------------------


@dataclass
class _Columns:
    """Per-sample values of a whole store, in store order."""

    prompt_len: np.ndarray  # capped, int32
    response_len: np.ndarray  # capped, int32
    sample_id: np.ndarray  # int64
    sample_key: list[str]
    prompts: list[str | None]
    responses: list[str | None]
    label: np.ndarray | None = None
    hallu_label: np.ndarray | None = None
    split: np.ndarray | None = None
    extra: list[dict[str, Any]] | None = None


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def _create_act_array(arrays_group: Any, name: str, shape: tuple[int, ...], chunks: tuple[int, ...]) -> Any:
    """An activation array exactly as the spec says: float16, C order, fill 0, no compressor/filters."""
    return arrays_group.create_array(name, shape=shape, chunks=chunks, dtype="float16", fill_value=0,
                                     compressors=None, filters=None, order="C")


def _finish_store(store: Path, cols: _Columns, attrs: dict[str, Any]) -> None:
    """Write the per-sample arrays and root attrs, consolidate the metadata, then write the JSONL texts."""
    zarr = _zarr()
    n = len(cols.sample_id)
    root = zarr.open_group(str(store), mode="r+", zarr_format=2)
    arrays = root["arrays"]
    keys_s64 = np.array([k.encode("ascii") for k in cols.sample_key], dtype=f"|S{SAMPLE_KEY_BYTES}").reshape(n)
    values: dict[str, np.ndarray | None] = {
        "prompt_len": cols.prompt_len, "response_len": cols.response_len, "sample_id": cols.sample_id,
        "sample_key": keys_s64, "label": cols.label, "hallu_label": cols.hallu_label, "split": cols.split,
    }
    for name, arr in values.items():
        if arr is None:
            continue
        dtype = np.dtype(META_ARRAYS[name])
        fill = b"" if dtype.kind == "S" else 0
        z = arrays.create_array(name, shape=(n,), chunks=(max(1, min(n, META_CHUNK)),), dtype=dtype,
                                fill_value=fill, compressors=None, filters=None, order="C", overwrite=True)
        if n:
            z[:] = np.asarray(arr).astype(dtype, copy=False)
    root.attrs.update(_plain(attrs))
    zarr.consolidate_metadata(str(store), zarr_format=2)
    # texts after consolidation: text/ is a plain folder, not a node of the Zarr hierarchy
    text = store / "text"
    text.mkdir(exist_ok=True)
    write_bytes_atomic(text / "prompts.jsonl", _jsonl(
        [{"i": i, "sample_key": k, "prompt": p} for i, (k, p) in enumerate(zip(cols.sample_key, cols.prompts))]))
    write_bytes_atomic(text / "responses.jsonl", _jsonl(
        [{"i": i, "sample_key": k, "response": r} for i, (k, r) in enumerate(zip(cols.sample_key, cols.responses))]))
    if cols.extra is not None and any(cols.extra):
        write_bytes_atomic(text / "extra_metadata.jsonl", _jsonl(
            [{"i": i, "sample_key": k, **e} for i, (k, e) in enumerate(zip(cols.sample_key, cols.extra))]))


def _truncation_attrs(prompt_true: np.ndarray, response_true: np.ndarray, p_max: int, r_max: int) -> dict[str, Any]:
    """The spec's truncation record: counts and fractions of samples longer than the caps."""
    n = len(prompt_true)
    pc, rc = int((prompt_true > p_max).sum()), int((response_true > r_max).sum())
    return {"prompt_truncated_count": pc, "response_truncated_count": rc,
            "prompt_truncated_fraction": pc / n if n else 0.0, "response_truncated_fraction": rc / n if n else 0.0}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_sample_key(sample_id: int, prompt: str | None, response: str | None) -> str:
    """sha256 hex of the canonical JSON `[sample_id, prompt, response]` (64 ASCII characters)."""
    blob = json.dumps([int(sample_id), prompt, response], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


def run_hash(spec: StoreSpec) -> str:
    """The identity every machine of one sharded run shares (machine_id and n_samples left out)."""
    return replace(spec, machine_id=0, n_samples=0).content_hash()


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
        if self.final_path.exists():
            self._check_published()
            self.resume_from = spec.n_samples
            self._closed = True
            return
        self._open_tmp()

    # ---- setup ----
    def _check_published(self) -> None:
        store = self.final_path / STORE_NAME if self.spec.num_machines == 1 else self.final_path
        try:
            attrs = json.loads((store / ".zattrs").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise MetadataError(f"published store is unreadable: {exc}", store / ".zattrs") from exc
        if attrs.get("spec_hash") != self.spec_hash:
            raise ConfigError("a store with another configuration is already published here", store)

    def _state(self) -> dict[str, Any]:
        return {"spec_hash": self.spec_hash, "layout": _plain(self.layout.__dict__)}

    def _open_tmp(self) -> None:
        parts = self.store_tmp / PARTS_DIR
        if self.tmp_path.exists():
            try:
                saved = json.loads((parts / "state.json").read_text(encoding="utf-8"))
                if saved != self._state():
                    raise ValueError("different configuration")
            except (OSError, ValueError):
                remove_tree(self.tmp_path)
        zarr = _zarr()
        if not self.tmp_path.exists():
            self.store_tmp.mkdir(parents=True)
            root = zarr.open_group(str(self.store_tmp), mode="w", zarr_format=2)
            arrays = root.create_group("arrays")
            for name in ACT_ARRAYS:
                _create_act_array(arrays, name, self.layout.shape(name), self.layout.chunks(name))
            parts.mkdir()
            write_json_atomic(parts / "state.json", self._state())
            self.resume_from = 0
        else:
            self.resume_from = self._recover_parts(parts)
        root = zarr.open_group(str(self.store_tmp), mode="r+", zarr_format=2)
        self._arrays = {name: root["arrays"][name] for name in ACT_ARRAYS}
        self._next = self.resume_from

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
            folder = self.store_tmp / "arrays" / name
            for entry in os.scandir(folder):
                head = entry.name.split(".", 1)[0]
                if head.isdigit() and int(head) >= done:
                    os.unlink(entry.path)
        return done

    # ---- writing ----
    def _fixed(self, acts_bltd: np.ndarray, lengths: np.ndarray, cap: int) -> np.ndarray:
        """(B, L, cap, H) float16: the first min(len, cap) tokens, zeros after (one fp32->fp16 cast)."""
        b, n_layers, t, d = acts_bltd.shape
        out = np.zeros((b, n_layers, cap, d), dtype=np.float16)
        k = min(t, cap)
        out[:, :, :k] = acts_bltd[:, :, :k]
        kept = np.minimum(lengths, cap)
        for i in np.nonzero(kept < k)[0]:
            out[i, :, int(kept[i]) : k] = 0
        return out

    def write_batch(self, batch: Batch) -> None:
        if self._closed:
            if self.final_path.exists():
                return
            raise FormatError("writer is closed", self.tmp_path)
        lay = self.layout
        b, n_layers, _, d = batch.acts_bltd.shape
        if n_layers != len(lay.layers) or d != lay.hidden_size:
            raise ConfigError(f"batch shape {batch.acts_bltd.shape} does not fit [B, {len(lay.layers)}, T, {lay.hidden_size}]")
        if self._next + b > lay.n_samples:
            raise ConfigError(f"more samples than n_samples={lay.n_samples}", self.tmp_path)
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
            self._fsync_chunks(start, start + b)
        write_json_atomic(self.store_tmp / PARTS_DIR / f"part-{start:012d}-{start + b:012d}.json", part, indent=None)
        self._next += b

    def _part(self, batch: Batch, lengths: np.ndarray, r_lengths: np.ndarray) -> dict[str, Any]:
        """The per-sample values of one batch, as recorded in its part file."""
        b = batch.size
        ids = [int(x) for x in np.asarray(batch.sample_ids)]
        prompts = [None] * b if batch.texts is None else [str(t) for t in batch.texts]
        responses = [None] * b if batch.response_texts is None else [str(t) for t in batch.response_texts]
        extra = dict(batch.extra)
        keys = extra.pop("sample_key", None)
        if keys is None:
            keys = [default_sample_key(i, p, r) for i, p, r in zip(ids, prompts, responses)]
        keys = [k.decode("ascii") if isinstance(k, bytes) else str(k) for k in keys]
        for k in keys:
            if len(k) > SAMPLE_KEY_BYTES or not k.isascii():
                raise ConfigError(f"sample_key {k!r} is not ASCII of at most {SAMPLE_KEY_BYTES} characters")
        hallu = extra.pop("hallu_label", None)
        split = extra.pop("split", None)
        rows = [{key: _plain(col[i]) for key, col in extra.items()} for i in range(b)] if extra else None
        return {
            "prompt_len_true": lengths.tolist(), "response_len_true": r_lengths.tolist(), "sample_id": ids,
            "sample_key": keys, "prompt": prompts, "response": responses,
            "has_response": batch.response_bltd is not None,
            "label": None if batch.labels is None else [int(x) for x in np.asarray(batch.labels)],
            "hallu_label": None if hallu is None else [_code(x, "hallu_label", {}) for x in hallu],
            "split": None if split is None else [_code(x, "split", SPLIT_CODES) for x in split],
            "extra": rows,
        }

    def _fsync_chunks(self, start: int, stop: int) -> None:
        """Make the chunk files of samples [start, stop) durable before their part file is recorded."""
        lay = self.layout
        for name in ACT_ARRAYS:
            folder = self.store_tmp / "arrays" / name
            n_chunks = -(-lay.shape(name)[2] // lay.chunks(name)[2])
            for s in range(start, stop):
                for li in range(len(lay.layers)):
                    for c in range(n_chunks):
                        try:
                            fd = os.open(folder / f"{s}.{li}.{c}.0", os.O_RDONLY)
                        except FileNotFoundError:
                            continue  # an all-zero chunk is not stored (fill value)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
            fsync_dir(folder)

    def _columns(self) -> tuple[_Columns, dict[str, Any]]:
        """Every part file, in order, as columns plus the truncation record."""
        parts_dir = self.store_tmp / PARTS_DIR
        parts = sorted((int(m.group(1)), f) for f in parts_dir.iterdir() if (m := _PART_RE.match(f.name)))
        merged: dict[str, list[Any]] = {}
        optional: dict[str, bool] = {"label": False, "hallu_label": False, "split": False, "extra": False}
        for _, f in parts:
            part = json.loads(f.read_text(encoding="utf-8"))
            b = len(part["sample_id"])
            self._has_response |= bool(part["has_response"])
            for key in ("prompt_len_true", "response_len_true", "sample_id", "sample_key", "prompt", "response"):
                merged.setdefault(key, []).extend(part[key])
            for key, fill in (("label", -1), ("hallu_label", -1), ("split", -1), ("extra", {})):
                values = part[key]
                optional[key] |= values is not None
                merged.setdefault(key, []).extend([fill] * b if values is None else values)
        lay = self.layout
        p_true = np.asarray(merged.get("prompt_len_true", []), dtype=np.int64)
        r_true = np.asarray(merged.get("response_len_true", []), dtype=np.int64)
        cols = _Columns(
            prompt_len=np.minimum(p_true, lay.p_max).astype(np.int32),
            response_len=np.minimum(r_true, lay.r_max).astype(np.int32),
            sample_id=np.asarray(merged.get("sample_id", []), dtype=np.int64),
            sample_key=list(merged.get("sample_key", [])),
            prompts=list(merged.get("prompt", [])), responses=list(merged.get("response", [])),
            label=np.asarray(merged["label"], dtype=np.int64) if optional["label"] else None,
            hallu_label=np.asarray(merged["hallu_label"], dtype=np.int8) if optional["hallu_label"] else None,
            split=np.asarray(merged["split"], dtype=np.int8) if optional["split"] else None,
            extra=list(merged["extra"]) if optional["extra"] else None,
        )
        return cols, _truncation_attrs(p_true, r_true, lay.p_max, lay.r_max)

    def _attrs(self, truncation: dict[str, Any]) -> dict[str, Any]:
        spec, lay = self.spec, self.layout
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "model_id": spec.model_name, "family": spec.family,
            "num_layers": len(lay.layers), "layers": list(lay.layers), "hidden_size": lay.hidden_size,
            "T_max": spec.max_tokens, "P_max": lay.p_max, "R_max": lay.r_max,
            "p_max_policy": "constant" if lay.p_quantile is None else "quantile", "p_quantile": lay.p_quantile,
            "r_max_policy": "constant" if lay.r_quantile is None else "quantile", "r_quantile": lay.r_quantile,
            "dtype": "float16", "t_chunk_prompt": lay.t_chunk_prompt, "t_chunk_response": lay.t_chunk_response,
            "chunks": {name: list(lay.chunks(name)) for name in ACT_ARRAYS},
            "created_at": _now(), "git_commit": spec.provenance.get("git_commit"),
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
        cols, truncation = self._columns()
        self._arrays = {}
        remove_tree(self.store_tmp / PARTS_DIR)
        _finish_store(self.store_tmp, cols, self._attrs(truncation))
        self._closed = True
        published = publish_dir(self.tmp_path, self.final_path)
        if self.spec.num_machines > 1:
            write_manifest(self.run_dir, self.spec.num_machines, missing_ok=True)
        return published

    def abort(self) -> None:
        self._arrays = {}
        self._closed = True


def _code(value: Any, name: str, names: dict[str, int]) -> int:
    """An int8 code from an int, bool or (for split) a name; None -> -1 (unknown)."""
    if value is None:
        return -1
    if isinstance(value, str):
        if value.lower() in names:
            return names[value.lower()]
        raise ConfigError(f"{name} value {value!r} is not one of {sorted(names)} or an integer")
    code = int(value)
    if not -128 <= code <= 127:
        raise ConfigError(f"{name} value {value!r} does not fit int8")
    return code


def _actlake_version() -> str:
    from .. import __version__

    return __version__


def create_writer(out_root: Path, spec: StoreSpec) -> ZarrWriter:
    """Format-registry entry point."""
    return ZarrWriter(out_root, spec)


# --------------------------------------------------------------------------------------------
# Store metadata (parsed from .zmetadata, validated)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayMeta:
    """The fields of one `.zarray` that reading depends on."""

    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    compressor: Any
    filters: Any
    fill_value: Any
    order: str
    separator: str

    @classmethod
    def from_json(cls, name: str, obj: Any, source: Path) -> "ArrayMeta":
        if not isinstance(obj, dict):
            raise MetadataError("array metadata must be a JSON object", source)
        for key in ("shape", "chunks", "dtype", "order"):
            if key not in obj:
                raise MetadataError(f"missing field {key!r}", source)
        if obj.get("zarr_format") != 2:
            raise ProtocolVersionError(f"zarr_format {obj.get('zarr_format')!r}, expected 2", source)
        shape, chunks = obj["shape"], obj["chunks"]
        if not (isinstance(shape, list) and isinstance(chunks, list) and len(shape) == len(chunks)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape + chunks)
                and all(c >= 1 for c in chunks)):
            raise MetadataError(f"shape {shape!r} / chunks {chunks!r} are not matching lists of sizes", source)
        if not isinstance(obj["dtype"], str):
            raise MetadataError(f"dtype {obj['dtype']!r} is not a string", source)
        sep = obj.get("dimension_separator", ".")
        if sep not in (".", "/"):
            raise MetadataError(f"dimension_separator {sep!r} is not '.' or '/'", source)
        return cls(name, tuple(shape), tuple(chunks), obj["dtype"], obj.get("compressor"), obj.get("filters"),
                   obj.get("fill_value"), obj["order"], sep)

    @property
    def uncompressed(self) -> bool:
        return self.compressor is None and not self.filters


def _np_dtype(text: str, source: Path) -> np.dtype:
    """numpy dtype of a .zarray dtype string, or MetadataError naming the file."""
    try:
        return np.dtype(text)
    except (TypeError, ValueError) as exc:
        raise MetadataError(f"dtype {text!r} is not a numpy dtype", source) from exc


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise MissingFileError(f"required file {path.name} is missing", path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise MetadataError(f"not valid UTF-8 JSON: {exc}", path) from exc


@dataclass(frozen=True)
class StoreMeta:
    """A store's consolidated metadata: root attrs and every array's `.zarray`, validated."""

    path: Path
    attrs: dict[str, Any]
    arrays: dict[str, ArrayMeta]
    n_samples: int
    layers: tuple[int, ...]
    hidden_size: int
    p_max: int
    r_max: int

    @classmethod
    def load(cls, path: Path) -> "StoreMeta":
        """Parse `.zmetadata`; raise a typed error naming the file on the first problem."""
        if not path.is_dir():
            raise MissingFileError("not a directory", path)
        zmeta_path = path / ".zmetadata"
        zmeta = _read_json(zmeta_path)
        if not isinstance(zmeta, dict) or not isinstance(zmeta.get("metadata"), dict):
            raise MetadataError("consolidated metadata must hold an object with 'metadata'", zmeta_path)
        entries = zmeta["metadata"]
        group = entries.get(".zgroup")
        if not isinstance(group, dict) or group.get("zarr_format") != 2:
            raise ProtocolVersionError("root group is not a Zarr v2 group", zmeta_path)
        attrs = entries.get(".zattrs", {})
        if not isinstance(attrs, dict):
            raise MetadataError("root .zattrs is not an object", zmeta_path)
        schema_version = str(attrs.get("schema_version", SCHEMA_VERSION))
        if not re.fullmatch(r"\d+(\.\d+)*", schema_version) or schema_version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise ProtocolVersionError(f"schema_version {schema_version!r} is not readable (this reader speaks "
                                       f"{SCHEMA_VERSION})", path / ".zattrs")
        arrays: dict[str, ArrayMeta] = {}
        for name in ACT_ARRAYS + tuple(META_ARRAYS):
            key = f"arrays/{name}/.zarray"
            if key not in entries:
                if name in ACT_ARRAYS + REQUIRED_META:
                    raise MissingFileError(f"required array arrays/{name} is not in the consolidated metadata", zmeta_path)
                continue
            zarray = path / key
            if not zarray.is_file():
                raise MissingFileError(f"required file {zarray.name} is missing", zarray)
            arrays[name] = ArrayMeta.from_json(name, entries[key], zarray)
        prompt, response = arrays[PROMPT], arrays[RESPONSE]
        for meta in (prompt, response):
            source = path / "arrays" / meta.name / ".zarray"
            if len(meta.shape) != 4:
                raise MetadataError(f"shape {list(meta.shape)} is not (N, L, T, H)", source)
            if _np_dtype(meta.dtype, source) != np.float16:
                raise MetadataError(f"dtype {meta.dtype!r}, the spec stores float16", source)
        n, n_layers, p_max, hidden = prompt.shape
        for meta in (prompt, response):
            for dim, size in zip("NLTH", meta.shape):
                if size > MAX_DIMS[dim]:
                    raise MetadataError(f"shape {list(meta.shape)} claims {dim}={size}, more than the "
                                        f"{MAX_DIMS[dim]} this reader accepts", path / "arrays" / meta.name / ".zarray")
        if response.shape[:2] != (n, n_layers) or response.shape[3] != hidden:
            raise MetadataError(f"shape {list(response.shape)} does not match {PROMPT} {list(prompt.shape)}",
                                path / "arrays" / RESPONSE / ".zarray")
        for name in META_ARRAYS:
            meta = arrays.get(name)
            if meta is not None and meta.shape != (n,):
                raise MetadataError(f"shape {list(meta.shape)}, expected ({n},)", path / "arrays" / name / ".zarray")
            source = path / "arrays" / name / ".zarray"
            if meta is not None and _np_dtype(meta.dtype, source) != np.dtype(META_ARRAYS[name]) and not (
                    name == "sample_key" and np.dtype(meta.dtype).kind == "S"):
                raise MetadataError(f"dtype {meta.dtype!r}, expected {META_ARRAYS[name]}", source)
        layers = attrs.get("layers", list(range(n_layers)))
        if not (isinstance(layers, list) and len(layers) == n_layers
                and all(isinstance(x, int) and not isinstance(x, bool) for x in layers) and len(set(layers)) == n_layers):
            raise MetadataError(f"attr 'layers' {layers!r} does not list {n_layers} unique layer indices", path / ".zattrs")
        for key, want in (("hidden_size", hidden), ("num_layers", n_layers), ("P_max", p_max),
                          ("R_max", response.shape[2]), ("n_samples", n)):
            if key in attrs and attrs[key] != want:
                raise MetadataError(f"attr {key}={attrs[key]!r} does not match the arrays ({want})", path / ".zattrs")
        return cls(path, attrs, arrays, n, tuple(layers), hidden, p_max, response.shape[2])


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


def default_fd_capacity() -> int:
    """Descriptors a reader may keep open: FD_CACHE_MAX, or an eighth of RLIMIT_NOFILE if that is less."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 128
    if soft == resource.RLIM_INFINITY:
        return FD_CACHE_MAX
    return max(16, min(FD_CACHE_MAX, soft // 8))


class FdCache:
    """A bounded LRU of read-only chunk-file descriptors, shared by one reader's arrays, per process.

    Opening a chunk file costs more than reading it from the page cache, so descriptors stay open
    (at most `capacity`, plus any pinned by reads in flight on other threads). Entries are pinned
    while read, so eviction never closes a descriptor a thread is reading; a fork, pickling or
    `close()` drops them all. Missing files are cached too (they read as the fill value).
    """

    def __init__(self, capacity: int | None = None) -> None:
        capacity = default_fd_capacity() if capacity is None else capacity
        if capacity < 1:
            raise ConfigError(f"fd cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd (-1: missing), size, pins, evicted]
        self._pid = os.getpid()

    def acquire(self, path: str) -> list[int]:
        """The pinned entry [fd, size, pins, evicted] of `path`; release() it after reading."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's descriptors are not ours to share
                self._entries = OrderedDict()
                self._pid = os.getpid()
            entry = self._entries.get(path)
            if entry is not None:
                self._entries.move_to_end(path)
                entry[2] += 1
                return entry
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            fd, size = -1, 0
        else:
            size = os.fstat(fd).st_size
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None:  # another thread opened it meanwhile
                if fd >= 0:
                    os.close(fd)
                entry[2] += 1
                return entry
            entry = [fd, size, 1, 0]
            self._entries[path] = entry
            while len(self._entries) > self.capacity:
                _, old = self._entries.popitem(last=False)
                old[3] = 1
                if old[2] == 0 and old[0] >= 0:
                    os.close(old[0])
            return entry

    def release(self, entry: list[int]) -> None:
        with self._lock:
            entry[2] -= 1
            if entry[2] == 0 and entry[3] and entry[0] >= 0:
                os.close(entry[0])
                entry[0] = -1

    def close(self) -> None:
        """Close every descriptor not pinned by a read in flight (those close on release)."""
        with self._lock:
            entries, self._entries = self._entries, OrderedDict()
            mine = self._pid == os.getpid()
            for entry in entries.values():
                entry[3] = 1
                if mine and entry[2] == 0 and entry[0] >= 0:
                    os.close(entry[0])
                    entry[0] = -1

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity}  # descriptors never travel to another process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"])  # type: ignore[misc]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: os may be gone
            pass


@dataclass(frozen=True)
class ChunkFiles:
    """Direct reads of an uncompressed, C-order, fp16 v2 activation array's chunk files."""

    folder: str
    separator: str
    t_chunk: int
    hidden: int
    fds: FdCache

    def chunk_path(self, sample: int, li: int, chunk: int) -> str:
        sep = self.separator
        return f"{self.folder}/{sample}{sep}{li}{sep}{chunk}{sep}0"

    def read(self, sample: int, li: int, t0: int, t1: int, out: np.ndarray) -> None:
        """Fill `out` ((t1 - t0, H) C-contiguous float16) with tokens [t0, t1) of (sample, li).

        One `os.preadv` per chunk straight into `out`, through the reader's descriptor cache.
        """
        tc, row = self.t_chunk, self.hidden * 2
        chunk_bytes = tc * row
        buf = memoryview(out).cast("B")
        fds = self.fds
        pos = 0
        t = t0
        while t < t1:
            c, within = divmod(t, tc)
            rows = min(tc - within, t1 - t)
            n = rows * row
            path = self.chunk_path(sample, li, c)
            entry = fds.acquire(path)
            try:
                fd, size = entry[0], entry[1]
                if fd < 0:
                    out[t - t0 : t - t0 + rows] = 0  # a chunk never written holds the fill value 0
                elif size != chunk_bytes:
                    raise TruncatedFileError(f"chunk file has {size} bytes, expected {chunk_bytes}", path)
                else:
                    got = os.preadv(fd, [buf[pos : pos + n]], within * row)
                    while got < n:  # short reads are legal; finish them
                        more = os.preadv(fd, [buf[pos + got : pos + n]], within * row + got)
                        if more <= 0:
                            raise TruncatedFileError(f"chunk file ended after {within * row + got} bytes", path)
                        got += more
            finally:
                fds.release(entry)
            pos += n
            t += rows


class ZarrReaderBase(Reader):
    """The Reader protocol for a prompt/response fp16 store; `get` is the prompt part.

    Subclasses provide the per-sample arrays and `_read(part, sample, li, t0, t1, out)`.
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
    def max_response_tokens(self) -> int:
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
        out = np.zeros((len(idx), cap, self.d_model), dtype=np.float16)
        self._read_many(name, [(s, li, int(lens[s]), out[k]) for k, (s, li) in enumerate(zip(idx.tolist(), lis))])
        return out

    def _part(self, part: str) -> tuple[str, int, np.ndarray]:
        if part == "prompt":
            return PROMPT, self.max_tokens, self._prompt_len
        if part == "response":
            return RESPONSE, self.r_max, self._response_len
        raise ConfigError(f"part must be 'prompt' or 'response', got {part!r}")

    def _block(self, name: str, idx: np.ndarray, lis: list[int]) -> np.ndarray:
        cap, lens = (self.max_tokens, self._prompt_len) if name == PROMPT else (self.r_max, self._response_len)
        out = np.zeros((len(idx), len(lis), cap, self.d_model), dtype=np.float16)
        self._read_many(name, [(s, li, int(lens[s]), out[b, j]) for b, s in enumerate(idx.tolist())
                               for j, li in enumerate(lis)])
        return out

    # ---- parallel reads ----
    def _parallel_ok(self) -> bool:
        """Whether reads may run on several threads (direct chunk-file reads only)."""
        return False

    def _read_many(self, name: str, tasks: list[tuple[int, int, int, np.ndarray]]) -> None:
        """Run (sample, layer position, n tokens, (T, H) destination) reads, on `read_threads` threads.

        Chunk-file reads release the GIL in the kernel copy, so a gather of many (sample, layer)
        pairs overlaps them; zarr-API reads stay on the calling thread.
        """
        threads = self.read_threads
        if threads <= 1 or len(tasks) < 2 * threads or not self._parallel_ok():
            for s, li, n, view in tasks:
                self._read(name, s, li, 0, n, view[:n])
            return

        def run(group: list[tuple[int, int, int, np.ndarray]]) -> None:
            for s, li, n, view in group:
                self._read(name, s, li, 0, n, view[:n])

        list(self._pool().map(run, [tasks[k::threads] for k in range(threads)]))

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
        extra = self._extra(idx)
        responses = self.response_texts
        texts, labels = self.texts, self.labels
        return Batch(
            acts_bltd=self._block(PROMPT, idx, lis), lengths=self._prompt_len[idx].astype(np.int64),
            sample_ids=self.sample_ids[idx], texts=None if texts is None else [texts[int(i)] for i in idx],
            labels=None if labels is None else labels[idx],
            response_bltd=self._block(RESPONSE, idx, lis), response_lengths=self._response_len[idx].astype(np.int64),
            response_texts=None if responses is None else [responses[int(i)] for i in idx], extra=extra,
        )

    def _extra(self, idx: np.ndarray) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        keys = self.sample_keys
        if keys is not None:
            out["sample_key"] = [keys[int(i)] for i in idx]
        for name in ("hallu_label", "split"):
            values = getattr(self, name)
            if values is not None:
                out[name] = [int(values[int(i)]) for i in idx]
        rows = self.extra_rows
        if rows is not None:
            for key in sorted({k for r in rows for k in r}):
                out[key] = [rows[int(i)].get(key) for i in idx]
        return out

    def last_token(self, layer: int) -> np.ndarray:
        """(N, H) prompt activation at the last stored prompt token (one row read per sample)."""
        li = self.layer_index(layer)
        out = np.zeros((self.n_samples, self.d_model), dtype=np.float16)
        for s, n in enumerate(self._prompt_len.tolist()):
            if n:
                self._read(PROMPT, s, li, n - 1, n, out[s : s + 1])
        return out

    def token_segments(self, layer: int) -> list[Any]:
        """The prompt tokens of one layer read straight into one (n_tokens, H) array."""
        from ..reader import TokenSegment

        li = self.layer_index(layer)
        lengths = self._prompt_len.astype(np.int64)
        rows = np.empty((int(lengths.sum()), self.d_model), dtype=np.float16)
        base = np.cumsum(lengths) - lengths
        for s, (b0, n) in enumerate(zip(base.tolist(), lengths.tolist())):
            self._read(PROMPT, s, li, 0, n, rows[b0 : b0 + n])
        return [TokenSegment(rows, base, lengths, 0)]

    # ---- optional per-sample metadata (subclasses fill) ----
    @property
    def response_texts(self) -> list[str] | None:
        return None

    @property
    def sample_keys(self) -> list[str] | None:
        return None

    @property
    def hallu_label(self) -> np.ndarray | None:
        return None

    @property
    def split(self) -> np.ndarray | None:
        return None

    @property
    def extra_rows(self) -> list[dict[str, Any]] | None:
        return None

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(P_max=self.max_tokens, R_max=self.r_max,
                   n_response_tokens=int(self._response_len.sum()), has_response_texts=self.response_texts is not None)
        return out


def _threads(value: int | None) -> int:
    """Read threads for gathers: `value`, else min(4, CPU count)."""
    if value is None:
        return max(1, min(4, os.cpu_count() or 1))
    if value < 1:
        raise ConfigError(f"read_threads must be >= 1, got {value}")
    return int(value)


def _texts_column(rows: list[dict[str, Any]] | None, key: str) -> list[str] | None:
    if rows is None or not rows or all(r.get(key) is None for r in rows):
        return None
    return [r.get(key) or "" for r in rows]


class ZarrReader(ZarrReaderBase):
    """Reader of one store, opened read-only with consolidated metadata; handles are per process."""

    def __init__(self, path: str | Path, *, fast: bool = True, read_threads: int | None = None,
                 fd_cache: FdCache | None = None) -> None:
        self.path = Path(path)
        self.read_threads = _threads(read_threads)
        self.meta = meta = StoreMeta.load(self.path)
        self._fds = FdCache() if fd_cache is None else fd_cache
        self.layers = meta.layers
        self.d_model = meta.hidden_size
        self.n_samples = meta.n_samples
        self.max_tokens = meta.p_max
        self.r_max = meta.r_max
        self._pid = -1
        self._root: Any = None
        self._jsonl: dict[str, list[dict[str, Any]] | None] = {}
        self._direct = {name: self._chunk_files(meta.arrays[name]) if fast else None for name in ACT_ARRAYS}
        small = {name: self._load_small(name) for name in META_ARRAYS if name in meta.arrays}
        for name in REQUIRED_META:
            values = small[name].astype(np.int64)
            cap = meta.p_max if name == "prompt_len" else meta.r_max
            if len(values) and (values.min() < 0 or values.max() > cap):
                raise FormatError(f"values outside [0, {cap}]", self.path / "arrays" / name)
        for name in ("sample_id", "label"):
            if name in small:
                small[name] = small[name].astype(np.int64)
        self._prompt_len = small["prompt_len"].astype(np.int64)
        self._response_len = small["response_len"].astype(np.int64)
        self._small = small

    def _chunk_files(self, meta: ArrayMeta) -> ChunkFiles | None:
        """Direct chunk-file reads where they return exactly zarr's values; None -> zarr API."""
        ok = (meta.uncompressed and meta.dtype == _NATIVE_F16 and meta.order == "C" and meta.fill_value in (0, 0.0)
              and meta.chunks[:2] == (1, 1) and meta.chunks[3] == meta.shape[3])
        if not ok:
            return None
        return ChunkFiles(str(self.path / "arrays" / meta.name), meta.separator, meta.chunks[2], meta.shape[3], self._fds)

    @property
    def fast(self) -> bool:
        """Whether both activation arrays are read straight from their chunk files."""
        return all(v is not None for v in self._direct.values())

    @property
    def root(self) -> Any:
        """The zarr group, opened read-only from consolidated metadata, once per process."""
        if self._root is None or self._pid != os.getpid():
            try:
                self._root = _zarr().open_consolidated(str(self.path), mode="r", zarr_format=2)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                raise MetadataError(f"zarr could not open the store: {exc}", self.path / ".zmetadata") from exc
            self._pid = os.getpid()
        return self._root

    def _load_small(self, name: str) -> np.ndarray:
        try:
            return np.asarray(self.root["arrays"][name][:])
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise FormatError(f"unreadable array: {exc}", self.path / "arrays" / name) from exc

    def _read(self, part: str, sample: int, li: int, t0: int, t1: int, out: np.ndarray) -> None:
        if t1 <= t0:
            return
        direct = self._direct[part]
        if direct is not None:
            direct.read(sample, li, t0, t1, out)
            return
        try:
            out[...] = self.root["arrays"][part][sample, li, t0:t1, :]
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise TruncatedFileError(f"chunk of sample {sample} layer position {li} is unreadable: {exc}",
                                     self.path / "arrays" / part) from exc

    # ---- metadata ----
    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.meta.attrs)

    @property
    def sample_ids(self) -> np.ndarray:
        ids = self._small.get("sample_id")
        return np.arange(self.n_samples, dtype=np.int64) if ids is None else ids

    @property
    def labels(self) -> np.ndarray | None:
        return self._small.get("label")

    @property
    def hallu_label(self) -> np.ndarray | None:
        return self._small.get("hallu_label")

    @property
    def split(self) -> np.ndarray | None:
        return self._small.get("split")

    @property
    def sample_keys(self) -> list[str] | None:
        if "sample_key" not in self._jsonl:  # decoded once
            keys = self._small.get("sample_key")
            self._jsonl["sample_key"] = None if keys is None else [k.decode("ascii", "replace") for k in keys.tolist()]
        return self._jsonl["sample_key"]  # type: ignore[return-value]

    def _rows(self, name: str) -> list[dict[str, Any]] | None:
        """One JSONL file of text/, checked: one object per sample, `i` in order."""
        if name not in self._jsonl:
            f = self.path / "text" / name
            if not f.exists():
                self._jsonl[name] = None
                return None
            rows = []
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh):
                    try:
                        row = json.loads(line)
                    except ValueError as exc:
                        raise MetadataError(f"line {lineno + 1} is not JSON: {exc}", f) from exc
                    if not isinstance(row, dict) or row.get("i") != lineno:
                        raise MetadataError(f"line {lineno + 1} is not an object with \"i\": {lineno}", f)
                    rows.append(row)
            if len(rows) != self.n_samples:
                raise MetadataError(f"{len(rows)} lines, expected {self.n_samples}", f)
            self._jsonl[name] = rows
        return self._jsonl[name]

    @property
    def texts(self) -> list[str] | None:
        return _texts_column(self._rows("prompts.jsonl"), "prompt")

    @property
    def response_texts(self) -> list[str] | None:
        return _texts_column(self._rows("responses.jsonl"), "response")

    @property
    def extra_rows(self) -> list[dict[str, Any]] | None:
        rows = self._rows("extra_metadata.jsonl")
        return None if rows is None else [{k: v for k, v in r.items() if k not in ("i", "sample_key")} for r in rows]

    @property
    def provenance(self) -> dict[str, Any]:
        a = self.meta.attrs
        out = {k: a[k] for k in ("model_id", "family", "dataset_name", "created_at", "git_commit", "schema_version",
                                 "spec_hash") if k in a}
        if isinstance(a.get("provenance"), dict):
            out.update(a["provenance"])
        return out

    def close(self) -> None:
        """Drop the zarr handle and close the cached chunk-file descriptors (reads reopen lazily)."""
        self._root = None
        self._fds.close()

    def _parallel_ok(self) -> bool:
        return self.fast

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_root"] = None  # each process opens its own handle
        state["_pid"] = -1
        return state


class ZarrManifestReader(ZarrReaderBase):
    """Multi-shard reader (spec option A): global index -> (shard, local index) from manifest.json."""

    def __init__(self, run_dir: str | Path, *, fast: bool = True, read_threads: int | None = None) -> None:
        self.path = Path(run_dir)
        self.read_threads = _threads(read_threads)
        self.manifest_path = self.path / MANIFEST_NAME
        manifest = _read_json(self.manifest_path)
        entries, index = _check_manifest(manifest, self.manifest_path)
        fds = FdCache()  # one descriptor budget for the whole run, not one per shard
        self.shards = [ZarrReader(resolve_inside(self.path, e["path"], source=self.manifest_path), fast=fast,
                                  read_threads=read_threads, fd_cache=fds) for e in entries]
        first = self.shards[0]
        for e, shard in zip(entries, self.shards):
            if shard.n_samples != e["n_samples"]:
                raise MetadataError(f"shard {e['path']} holds {shard.n_samples} samples, manifest says "
                                    f"{e['n_samples']}", self.manifest_path)
            if (shard.layers, shard.d_model, shard.max_tokens, shard.r_max) != (
                    first.layers, first.d_model, first.max_tokens, first.r_max):
                raise MetadataError(f"shard {e['path']} has another layout (layers, H, P_max, R_max) than "
                                    f"{entries[0]['path']}", self.manifest_path)
        self._shard_of = index[:, 0].copy()
        self._local_of = index[:, 1].copy()
        self.layers, self.d_model = first.layers, first.d_model
        self.max_tokens, self.r_max = first.max_tokens, first.r_max
        self.n_samples = len(index)
        self._prompt_len = self._concat(lambda r: r._prompt_len)
        self._response_len = self._concat(lambda r: r._response_len)

    def _column(self, name: str) -> Any:
        """A per-sample attribute of the shards in global order, computed once."""
        cache = self.__dict__.setdefault("_columns", {})
        if name not in cache:
            cache[name] = self._concat(lambda r: getattr(r, name))
        return cache[name]

    def _concat(self, column: Any) -> Any:
        """A per-sample column in global order (None if any shard lacks it)."""
        parts = [column(r) for r in self.shards]
        if any(p is None for p in parts):
            return None
        if isinstance(parts[0], np.ndarray):
            out = np.empty(self.n_samples, dtype=parts[0].dtype)
            for k, p in enumerate(parts):
                where = self._shard_of == k
                out[where] = p[self._local_of[where]]
            return out
        return [parts[s][l] for s, l in zip(self._shard_of.tolist(), self._local_of.tolist())]

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard number, local index) of a global sample position."""
        s = self.check_sample(sample)
        return int(self._shard_of[s]), int(self._local_of[s])

    def _read(self, part: str, sample: int, li: int, t0: int, t1: int, out: np.ndarray) -> None:
        self.shards[self._shard_of[sample]]._read(part, int(self._local_of[sample]), li, t0, t1, out)

    @property
    def sample_ids(self) -> np.ndarray:
        return self._column("sample_ids")

    @property
    def labels(self) -> np.ndarray | None:
        return self._column("labels")

    @property
    def hallu_label(self) -> np.ndarray | None:
        return self._column("hallu_label")

    @property
    def split(self) -> np.ndarray | None:
        return self._column("split")

    @property
    def sample_keys(self) -> list[str] | None:
        return self._column("sample_keys")

    @property
    def texts(self) -> list[str] | None:
        return self._column("texts")

    @property
    def response_texts(self) -> list[str] | None:
        return self._column("response_texts")

    @property
    def extra_rows(self) -> list[dict[str, Any]] | None:
        return self._column("extra_rows")

    @property
    def provenance(self) -> dict[str, Any]:
        return {**self.shards[0].provenance, "manifest": str(self.manifest_path), "num_shards": len(self.shards)}

    def _parallel_ok(self) -> bool:
        return all(shard.fast for shard in self.shards)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_manifest(manifest: Any, source: Path) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Validated manifest entries and the (N, 2) index; every path stays inside the run directory."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise MetadataError(f"not an {MANIFEST_FORMAT} (field 'format')", source)
    entries = manifest.get("shards")
    if not isinstance(entries, list) or not entries:
        raise MetadataError("field 'shards' must be a non-empty list", source)
    for k, e in enumerate(entries):
        if not (isinstance(e, dict) and isinstance(e.get("path"), str) and _is_int(e.get("n_samples"))
                and e["n_samples"] >= 0):
            raise MetadataError(f"shard entry {k} must be {{'path': str, 'n_samples': int}}", source)
        resolve_inside(source.parent, e["path"], source=source)
    raw = manifest.get("index")
    if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_int(p[1])
                                            for p in raw):
        raise MetadataError("field 'index' must be a list of [shard, local_index] pairs", source)
    index = np.asarray(raw, dtype=np.int64).reshape(-1, 2)
    counts = np.array([e["n_samples"] for e in entries], dtype=np.int64)
    if len(index) != counts.sum() or manifest.get("n_samples", len(index)) != len(index):
        raise MetadataError(f"index has {len(index)} entries; shards hold {int(counts.sum())}", source)
    if len(index):
        shard, local = index[:, 0], index[:, 1]
        if shard.min() < 0 or shard.max() >= len(entries) or local.min() < 0 or (local >= counts[shard]).any():
            raise MetadataError("index points outside a shard", source)
        flat = np.cumsum(counts)[shard] - counts[shard] + local
        if len(np.unique(flat)) != len(flat):
            raise MetadataError("index maps two global positions to one (shard, local) sample", source)
    return entries, index


def write_manifest(run_dir: str | Path, num_shards: int | None = None, *, missing_ok: bool = False) -> Path | None:
    """Write `manifest.json` over the published `shards/shard-XXXX.zarr` stores of a run directory.

    Global order: by sample id (stable: shard then local index on ties are refused as duplicates).
    With `num_shards`, shards 0..num_shards-1 must all be published; if one is missing, returns
    None when `missing_ok` (another machine will write it when it finishes) or raises.
    """
    run = Path(run_dir)
    folder = run / SHARDS_DIR
    found = {int(m.group(1)): p for p in (folder.iterdir() if folder.is_dir() else []) if (m := SHARD_RE.match(p.name))}
    want = range(num_shards) if num_shards is not None else sorted(found)
    missing = [k for k in want if k not in found]
    if missing or not found:
        if missing_ok:
            return None
        raise MissingFileError(f"shards {missing or 'all'} are not published yet", folder)
    readers = [ZarrReader(found[k]) for k in want]
    ids = np.concatenate([r.sample_ids for r in readers])
    shard_of = np.concatenate([np.full(r.n_samples, k, dtype=np.int64) for k, r in enumerate(readers)])
    local_of = np.concatenate([np.arange(r.n_samples, dtype=np.int64) for r in readers])
    order = np.argsort(ids, kind="stable")
    if len(ids) and (np.diff(ids[order]) == 0).any():
        dup = int(ids[order][np.nonzero(np.diff(ids[order]) == 0)[0][0]])
        raise MetadataError(f"sample id {dup} appears in more than one place across the shards", folder)
    first = readers[0]
    manifest = {
        "format": MANIFEST_FORMAT, "schema_version": SCHEMA_VERSION, "num_shards": len(readers),
        "n_samples": int(len(ids)), "layers": list(first.layers), "hidden_size": first.d_model,
        "P_max": first.max_tokens, "R_max": first.r_max,
        "shards": [{"path": f"{SHARDS_DIR}/{found[k].name}", "machine_id": k, "n_samples": r.n_samples}
                   for k, r in zip(want, readers)],
        "index": np.stack([shard_of[order], local_of[order]], axis=1).tolist(),
    }
    target = run / MANIFEST_NAME
    write_json_atomic(target, manifest, indent=None)
    return target


# --------------------------------------------------------------------------------------------
# Registry entry points
# --------------------------------------------------------------------------------------------


def _store_dir(path: Path) -> Path | None:
    """The store directory at `path` (a store, or a run directory holding activations.zarr)."""
    if (path / ".zgroup").is_file() and ((path / "arrays").is_dir() or (path / ".zmetadata").is_file()):
        return path
    if (path / STORE_NAME / ".zgroup").is_file():
        return path / STORE_NAME
    return None


def detect(path: Path) -> bool:
    """A store, a run directory holding one, or a sharded run directory (manifest.json or shards/)."""
    if not path.is_dir():
        return False
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        try:
            obj = json.loads(manifest.read_text(encoding="utf-8"))
            return isinstance(obj, dict) and obj.get("format") == MANIFEST_FORMAT
        except (ValueError, UnicodeDecodeError, OSError):
            return (path / SHARDS_DIR).is_dir()
    if (path / SHARDS_DIR).is_dir() and any(SHARD_RE.match(p.name) for p in (path / SHARDS_DIR).iterdir()):
        return True
    return _store_dir(path) is not None


def open_reader(path: Path, *, fast: bool = True) -> ZarrReaderBase:
    """A ZarrManifestReader for a sharded run directory, else a ZarrReader of the store."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return ZarrManifestReader(path, fast=fast)
    if (path / SHARDS_DIR).is_dir():
        raise MissingFileError("sharded run directory without manifest.json (not all shards are published)",
                               path / MANIFEST_NAME)
    store = _store_dir(path)
    if store is None:
        raise MissingFileError("no Zarr store here (.zgroup with arrays/, or activations.zarr/)", path / ".zgroup")
    return ZarrReader(store, fast=fast)


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------


def verify(path: Path) -> list[str]:
    """Check every invariant of the spec; one message per problem, each naming the file."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file() or (path / SHARDS_DIR).is_dir():
        return _verify_run(path)
    store = _store_dir(path)
    if store is None:
        return [str(MissingFileError("no Zarr store here", path / ".zgroup"))]
    return _verify_store(store)


def _verify_run(run: Path) -> list[str]:
    source = run / MANIFEST_NAME
    try:
        entries, _ = _check_manifest(_read_json(source), source)
    except FormatError as exc:
        return [str(exc)]
    problems: list[str] = []
    for e in entries:
        problems += _verify_store(resolve_inside(run, e["path"], source=source))
    listed = {resolve_inside(run, e["path"], source=source) for e in entries}
    for p in sorted((run / SHARDS_DIR).glob("shard-*.zarr")):
        if p.resolve() not in listed:
            problems.append(f"{p}: shard not listed in {MANIFEST_NAME}")
    if problems:
        return problems
    try:
        reader = ZarrManifestReader(run)
    except FormatError as exc:
        return [str(exc)]
    ids = reader.sample_ids
    if len(np.unique(ids)) != len(ids):
        problems.append(f"{source}: sample ids are not unique across shards")
    return problems


def _verify_store(store: Path) -> list[str]:
    problems: list[str] = []
    zgroup = store / ".zgroup"
    try:
        if _read_json(zgroup).get("zarr_format") != 2:
            problems.append(f"{zgroup}: zarr_format is not 2")
    except (FormatError, AttributeError) as exc:
        problems.append(str(exc) if isinstance(exc, FormatError) else f"{zgroup}: not an object")
    try:
        meta = StoreMeta.load(store)
    except FormatError as exc:
        return problems + [str(exc)]
    problems += _verify_consolidated(store)
    problems += _verify_attrs(store, meta)
    for name in ACT_ARRAYS:
        problems += _verify_act_array(store, meta, name)
    for name, am in meta.arrays.items():
        f = store / "arrays" / name / ".zarray"
        if am.compressor is not None:
            problems.append(f"{f}: compressor {am.compressor!r}, the spec stores uncompressed (null)")
        if am.filters:
            problems.append(f"{f}: filters {am.filters!r}, the spec allows none (null)")
        if am.order != "C":
            problems.append(f"{f}: order {am.order!r}, expected 'C'")
    try:
        reader = ZarrReader(store)
    except FormatError as exc:
        return problems + [str(exc)]
    problems += _verify_values(store, reader)
    return problems


def _verify_consolidated(store: Path) -> list[str]:
    """Every entry of .zmetadata matches the file on disk, and every metadata file is consolidated."""
    problems = []
    zpath = store / ".zmetadata"
    zmeta = _read_json(zpath)
    if zmeta.get("zarr_consolidated_format") != 1:
        problems.append(f"{zpath}: zarr_consolidated_format is not 1")
    entries = zmeta["metadata"]
    for key, value in entries.items():
        f = store / key
        try:
            on_disk = _read_json(f)
        except FormatError as exc:
            problems.append(str(exc))
            continue
        if isinstance(value, dict) and key.endswith(".zgroup"):
            value = {k: v for k, v in value.items() if k != "consolidated_metadata"}  # zarr-python 3 adds it
        if on_disk != value:
            problems.append(f"{f}: differs from its copy in .zmetadata (re-run zarr.consolidate_metadata)")
    for dirpath, _, filenames in os.walk(store):
        for name in filenames:
            if name in (".zarray", ".zgroup", ".zattrs"):
                rel = os.path.relpath(os.path.join(dirpath, name), store).replace(os.sep, "/")
                if rel not in entries:
                    problems.append(f"{store / rel}: not in the consolidated metadata {zpath.name}")
    return problems


def _verify_attrs(store: Path, meta: StoreMeta) -> list[str]:
    problems = []
    f = store / ".zattrs"
    a = meta.attrs
    for key in REQUIRED_ATTRS:
        if key not in a:
            problems.append(f"{f}: missing global attr {key!r}")
    if problems:
        return problems
    if a["schema"] != SCHEMA:
        problems.append(f"{f}: schema {a['schema']!r}, expected {SCHEMA!r}")
    if a["dtype"] != "float16":
        problems.append(f"{f}: dtype {a['dtype']!r}, expected 'float16'")
    if a["num_layers"] != len(meta.layers):
        problems.append(f"{f}: num_layers {a['num_layers']} but {len(meta.layers)} layers stored")
    chunks = a["chunks"]
    for name, t in ((PROMPT, a["t_chunk_prompt"]), (RESPONSE, a["t_chunk_response"])):
        want = list(meta.arrays[name].chunks)
        if not isinstance(chunks, dict) or chunks.get(name) != want or want[2] != t:
            problems.append(f"{f}: chunk parameters for {name} do not match its .zarray chunks {want}")
    n = meta.n_samples
    for part in ("prompt", "response"):
        count, frac = a[f"{part}_truncated_count"], a[f"{part}_truncated_fraction"]
        if not _is_int(count) or not 0 <= count <= n:
            problems.append(f"{f}: {part}_truncated_count {count!r} is not in [0, {n}]")
        elif not isinstance(frac, (int, float)) or abs(frac - (count / n if n else 0.0)) > 1e-9:
            problems.append(f"{f}: {part}_truncated_fraction {frac!r} is not count / n_samples")
    return problems


def _verify_act_array(store: Path, meta: StoreMeta, name: str) -> list[str]:
    am = meta.arrays[name]
    f = store / "arrays" / name / ".zarray"
    problems = []
    t = am.shape[2]
    if am.dtype not in ("<f2", "|f2"):
        problems.append(f"{f}: dtype {am.dtype!r}, expected '<f2'")
    if am.fill_value not in (0, 0.0):
        problems.append(f"{f}: fill_value {am.fill_value!r}, expected 0")
    want_t = t if name == RESPONSE else am.chunks[2]
    if am.chunks[:2] != (1, 1) or am.chunks[3] != am.shape[3] or am.chunks[2] != want_t or am.chunks[2] > max(t, 1):
        problems.append(f"{f}: chunks {list(am.chunks)}, expected (1, 1, T_chunk, H) with T_chunk "
                        f"{'= R_max' if name == RESPONSE else '<= P_max'}")
    if problems:
        return problems
    # chunk files: names inside the grid, full size
    folder = store / "arrays" / name
    n_chunks = -(-t // am.chunks[2]) if t else 0
    grid = (am.shape[0], am.shape[1], n_chunks, 1)
    chunk_bytes = am.chunks[2] * am.shape[3] * 2
    for dirpath, _, filenames in os.walk(folder):
        for fname in filenames:
            if fname.startswith("."):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fname), folder).replace(os.sep, am.separator)
            key = rel.split(am.separator)
            if len(key) != 4 or not all(k.isdigit() for k in key) or any(int(k) >= g for k, g in zip(key, grid)):
                problems.append(f"{folder / rel}: not a chunk of the ({', '.join(map(str, grid))}) chunk grid")
                continue
            size = os.path.getsize(os.path.join(dirpath, fname))
            if size != chunk_bytes:
                problems.append(f"{os.path.join(dirpath, fname)}: chunk file has {size} bytes, expected {chunk_bytes}")
    return problems


def _verify_values(store: Path, reader: ZarrReader) -> list[str]:
    problems = []
    ids = reader.sample_ids
    if len(np.unique(ids)) != len(ids):
        problems.append(f"{store / 'arrays' / 'sample_id'}: sample ids are not unique")
    for name, allowed in (("hallu_label", (-1, 0, 1)), ("split", (-1, 0, 1, 2))):
        values = reader._small.get(name)
        if values is not None and not np.isin(values, allowed).all():
            problems.append(f"{store / 'arrays' / name}: values outside {allowed}")
    keys = reader.sample_keys
    for fname, field in (("prompts.jsonl", "prompt"), ("responses.jsonl", "response")):
        f = store / "text" / fname
        try:
            rows = reader._rows(fname)
        except FormatError as exc:
            problems.append(str(exc))
            continue
        if rows is None:
            problems.append(f"{f}: missing")
            continue
        for k, row in enumerate(rows):
            if field not in row or not (row[field] is None or isinstance(row[field], str)):
                problems.append(f"{f}: line {k + 1} lacks a string {field!r}")
                break
            if keys is not None and row.get("sample_key") != keys[k]:
                problems.append(f"{f}: line {k + 1} sample_key does not match arrays/sample_key")
                break
    try:
        reader.extra_rows
    except FormatError as exc:
        problems.append(str(exc))
    return problems


# --------------------------------------------------------------------------------------------
# merge (spec option B)
# --------------------------------------------------------------------------------------------


def _merge_sources(inputs: Sequence[Path]) -> list[ZarrReaderBase]:
    """A reader per input, in order (a sharded run is read in its manifest's global order)."""
    return [open_reader(Path(p)) for p in inputs]


def merge(inputs: list[Path], out: Path) -> Path:
    """Physically merge stores / sharded runs into one consolidated store `<out>/activations.zarr`.

    Samples keep the order of `inputs` (a sharded run in its manifest order); duplicate sample
    ids are refused; chunking, P_max and R_max must agree. Built under a temporary name and
    published atomically; returns the store path.
    """
    if not inputs:
        raise ConfigError("merge needs at least one input")
    sources = _merge_sources(inputs)
    first = sources[0]
    for path, r in zip(inputs, sources):
        if (r.layers, r.d_model, r.max_tokens, r.r_max) != (first.layers, first.d_model, first.max_tokens, first.r_max):
            raise MetadataError(f"layout (layers {list(r.layers)}, H {r.d_model}, P_max {r.max_tokens}, R_max "
                                f"{r.r_max}) differs from {inputs[0]}", Path(path))
    ids = np.concatenate([r.sample_ids for r in sources])
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise MetadataError(f"sample id {int(uniq[counts > 1][0])} appears in more than one input", Path(inputs[0]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    final = out / STORE_NAME
    if final.exists():
        raise ConfigError("output store already exists", final)
    tmp = out / f".tmp-{STORE_NAME}-{os.getpid()}"
    remove_tree(tmp)
    attrs0 = _store_attrs(first)
    n = int(len(ids))
    t_chunk = int(attrs0.get("t_chunk_prompt") or _first_store(first).meta.arrays[PROMPT].chunks[2])
    layout = ZarrLayout(n_samples=n, layers=first.layers, hidden_size=first.d_model, p_max=first.max_tokens,
                        r_max=first.r_max, t_chunk_prompt=min(t_chunk, first.max_tokens))
    try:
        zarr = _zarr()
        root = zarr.open_group(str(tmp), mode="w", zarr_format=2)
        arrays_group = root.create_group("arrays")
        arrays = {name: _create_act_array(arrays_group, name, layout.shape(name), layout.chunks(name))
                  for name in ACT_ARRAYS}
        lis = list(range(len(first.layers)))
        sample_bytes = len(lis) * (first.max_tokens + first.r_max) * first.d_model * 2
        step = max(1, (64 << 20) // max(1, sample_bytes))
        offset = 0
        for r in sources:
            for s in range(0, r.n_samples, step):
                idx = np.arange(s, min(s + step, r.n_samples))
                for name in ACT_ARRAYS:
                    arrays[name][offset + s : offset + s + len(idx)] = r._block(name, idx, lis)
            offset += r.n_samples
        cols = _merged_columns(sources)
        attrs = dict(attrs0)
        pc = sum(int(_store_attrs(r).get("prompt_truncated_count", 0)) for r in sources)
        rc = sum(int(_store_attrs(r).get("response_truncated_count", 0)) for r in sources)
        attrs.update(
            n_samples=n, created_at=_now(), merged_from=[str(Path(p)) for p in inputs], machine_id=0, num_machines=1,
            spec_hash=None, prompt_truncated_count=pc, response_truncated_count=rc,
            prompt_truncated_fraction=pc / n if n else 0.0, response_truncated_fraction=rc / n if n else 0.0,
            t_chunk_prompt=layout.t_chunk_prompt, t_chunk_response=layout.t_chunk_response,
            chunks={name: list(layout.chunks(name)) for name in ACT_ARRAYS},
            has_response=any(bool(_store_attrs(r).get("has_response", True)) for r in sources),
        )
        _finish_store(tmp, cols, attrs)
    except BaseException:
        remove_tree(tmp)
        raise
    return publish_dir(tmp, final)


def _first_store(reader: ZarrReaderBase) -> ZarrReader:
    return reader.shards[0] if isinstance(reader, ZarrManifestReader) else reader  # type: ignore[return-value]


def _store_attrs(reader: ZarrReaderBase) -> dict[str, Any]:
    """Root attrs of a store; for a sharded run, the first shard's with truncation counts summed."""
    if isinstance(reader, ZarrManifestReader):
        attrs = dict(reader.shards[0].meta.attrs)
        for key in ("prompt_truncated_count", "response_truncated_count"):
            attrs[key] = sum(int(s.meta.attrs.get(key, 0)) for s in reader.shards)
        attrs["has_response"] = any(bool(s.meta.attrs.get("has_response", True)) for s in reader.shards)
        return attrs
    return dict(reader.meta.attrs)  # type: ignore[attr-defined]


def _merged_columns(sources: list[ZarrReaderBase]) -> _Columns:
    def cat(get: Any, dtype: Any, fill: int) -> np.ndarray | None:
        parts = [get(r) for r in sources]
        if all(p is None for p in parts):
            return None
        return np.concatenate([np.full(r.n_samples, fill, dtype=dtype) if p is None else np.asarray(p, dtype=dtype)
                               for p, r in zip(parts, sources)])

    def texts(get: Any) -> list[str | None]:
        out: list[str | None] = []
        for r in sources:
            values = get(r)
            out.extend([None] * r.n_samples if values is None else values)
        return out

    keys: list[str] = []
    for r in sources:
        k = r.sample_keys
        if k is None:
            prompts, responses = r.texts, r.response_texts
            k = [default_sample_key(int(i), None if prompts is None else prompts[j],
                                    None if responses is None else responses[j]) for j, i in enumerate(r.sample_ids)]
        keys.extend(k)
    extras: list[dict[str, Any]] = []
    for r in sources:
        rows = r.extra_rows
        extras.extend([{}] * r.n_samples if rows is None else rows)
    return _Columns(
        prompt_len=np.concatenate([r._prompt_len for r in sources]).astype(np.int32),
        response_len=np.concatenate([r._response_len for r in sources]).astype(np.int32),
        sample_id=np.concatenate([r.sample_ids for r in sources]).astype(np.int64),
        sample_key=keys, prompts=texts(lambda r: r.texts), responses=texts(lambda r: r.response_texts),
        label=cat(lambda r: r.labels, np.int64, -1), hallu_label=cat(lambda r: r.hallu_label, np.int8, -1),
        split=cat(lambda r: r.split, np.int8, -1), extra=extras if any(extras) else None,
    )
