"""Sharded runs (spec option A): manifest.json checked and written, and the multi-shard reader over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...atomic import resolve_inside, write_json_atomic
from ...errors import MetadataError, MissingFileError
from .base import ZarrReaderBase, read_threads_for
from .chunks import FdCache
from .layout import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    SHARD_RE,
    SHARDS_DIR,
    is_int,
)
from .meta import read_json
from .reader import ZarrReader


def check_manifest(manifest: Any, source: Path) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Validated manifest entries and the (N, 2) index; every path stays inside the run directory."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise MetadataError(f"not an {MANIFEST_FORMAT} (field 'format')", source)
    entries = manifest.get("shards")
    if not isinstance(entries, list) or not entries:
        raise MetadataError("field 'shards' must be a non-empty list", source)
    for k, e in enumerate(entries):
        if not (isinstance(e, dict) and isinstance(e.get("path"), str) and is_int(e.get("n_samples"))
                and e["n_samples"] >= 0):
            raise MetadataError(f"shard entry {k} must be {{'path': str, 'n_samples': int}}", source)
        resolve_inside(source.parent, e["path"], source=source)
    raw = manifest.get("index")
    if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 and is_int(p[0]) and is_int(p[1])
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

    Global order: ascending sample id; a sample id found twice across the shards is refused.
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
    for r in readers:
        r.close()  # only the per-sample arrays are needed, and those are loaded
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
        "n_samples": len(ids), "layers": list(first.layers), "hidden_size": first.d_model,
        "P_max": first.max_tokens, "R_max": first.r_max,
        "shards": [{"path": f"{SHARDS_DIR}/{found[k].name}", "machine_id": k, "n_samples": r.n_samples,
                    "sample_id_range": _id_range(r.sample_ids), "content_hash": r.meta.attrs.get("spec_hash")}
                   for k, r in zip(want, readers)],
        "index": np.stack([shard_of[order], local_of[order]], axis=1).tolist(),
    }
    target = run / MANIFEST_NAME
    write_json_atomic(target, manifest, indent=None)
    return target


def _id_range(ids: np.ndarray) -> list[int] | None:
    """[first, last + 1) of a shard's sample ids (None when empty)."""
    return [int(ids.min()), int(ids.max()) + 1] if len(ids) else None


class ZarrManifestReader(ZarrReaderBase):
    """Multi-shard reader (spec option A): global index -> (shard, local index) from manifest.json."""

    def __init__(self, run_dir: str | Path, *, fast: bool = True, read_threads: int | None = None) -> None:
        self.path = Path(run_dir)
        self.read_threads = read_threads_for(read_threads)
        self.manifest_path = self.path / MANIFEST_NAME
        entries, index = check_manifest(read_json(self.manifest_path), self.manifest_path)
        fds = FdCache()  # one descriptor budget for the whole run, not one per shard
        self.shards = [ZarrReader(resolve_inside(self.path, e["path"], source=self.manifest_path), fast=fast,
                                  read_threads=read_threads, fd_cache=fds) for e in entries]
        first = self.shards[0]
        for e, shard in zip(entries, self.shards):
            if shard.n_samples != e["n_samples"]:
                raise MetadataError(f"shard {e['path']} holds {shard.n_samples} samples, manifest says "
                                    f"{e['n_samples']}", self.manifest_path)
            if (shard.layers, shard.d_model, shard.max_tokens, shard.r_max, shard.cls_token) != (
                    first.layers, first.d_model, first.max_tokens, first.r_max, first.cls_token):
                raise MetadataError(f"shard {e['path']} has another layout (layers, H, P_max, R_max, cls_token) than "
                                    f"{entries[0]['path']}", self.manifest_path)
        self._shard_of = index[:, 0].copy()
        self._local_of = index[:, 1].copy()
        counts = np.array([s.n_samples for s in self.shards], dtype=np.int64)
        self._flat = (np.cumsum(counts) - counts)[self._shard_of] + self._local_of  # position in the shards' concatenation
        self.layers, self.d_model = first.layers, first.d_model
        self.max_tokens, self.r_max = first.max_tokens, first.r_max
        self.n_samples = len(index)
        self._prompt_len = self._concat([r._prompt_len for r in self.shards])
        self._response_len = self._concat([r._response_len for r in self.shards])

    def _column(self, name: str) -> Any:
        """A per-sample attribute of the shards in global order, computed once."""
        cache = self.__dict__.setdefault("_columns", {})
        if name not in cache:
            cache[name] = self._concat([getattr(r, name) for r in self.shards])
        return cache[name]

    def _concat(self, parts: list[Any]) -> Any:
        """Per-shard columns in global order (one fancy-index of their concatenation); None if any shard lacks it."""
        if any(p is None for p in parts):
            return None
        if isinstance(parts[0], np.ndarray):
            return np.concatenate(parts)[self._flat]
        pool = [x for p in parts for x in p]
        return [pool[i] for i in self._flat.tolist()]

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard number, local index) of a global sample position."""
        s = self.check_sample(sample)
        return int(self._shard_of[s]), int(self._local_of[s])

    def _read(self, part: str, sample: int, li: int, t0: int, t1: int, out: np.ndarray) -> None:
        self.shards[int(self._shard_of[sample])]._read(part, int(self._local_of[sample]), li, t0, t1, out)

    def _read_rows(self, part: str, samples: np.ndarray, li: int, tokens: np.ndarray, out: np.ndarray) -> None:
        """One gather per shard holding any of `samples`."""
        shard_of = self._shard_of[samples]
        for k in np.unique(shard_of).tolist():
            where = np.flatnonzero(shard_of == k)
            rows = np.empty((len(where), self.d_model), dtype=np.float16)
            self.shards[k]._read_rows(part, self._local_of[samples[where]], li, tokens[where], rows)
            out[where] = rows

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
    def cls_token(self) -> bool:
        """The shards' `cls_token` (checked equal across shards on open)."""
        return self.shards[0].cls_token

    @property
    def provenance(self) -> dict[str, Any]:
        return {**self.shards[0].provenance, "manifest": str(self.manifest_path), "num_shards": len(self.shards)}

    def _parallel_ok(self) -> bool:
        return all(shard.fast for shard in self.shards)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
