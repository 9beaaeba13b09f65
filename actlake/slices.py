"""Machine slices of one extraction run: find them, write the run's manifest, read them as one Reader, merge them.

`actlake extract --num-machines M` makes every machine write its slice under ONE run directory
per format (docs/formats/extraction.md, "Machine slices"):

    zarr     <out>/zarr-<run16>/shards/shard-kkkk.zarr      + manifest.json (the zarr spec's)
    pickle   <out>/pickle-<job16>/machine_kkkk/             + manifest.json (actlake-slices/1)
    saev     <out>/saev-<run16>/machine_kkkk/<HASH>/         + manifest.json (actlake-slices/1)
    lmprobe  <out>/lmprobe-<run16>/machine_kkkk/            + manifest.json (actlake-slices/1)

Each slice records in its provenance a `run` block (the whole run's StoreSpec: the one a
1-machine extraction of the same config has), so `merge_run` publishes exactly the store a
1-machine run would have published (same content hash, same data files), by streaming the
slices' Batches into that format's writer (the `actlake.convert` machinery).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .batch import Batch
from .errors import ConfigError, FormatError, MetadataError, MissingSliceError
from .jsonio import peek_json
from .reader import Reader, TokenSegment

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "actlake-slices/1"
MACHINE_RE = re.compile(r"^machine_(\d{4,})$")
ZARR_SHARD_RE = re.compile(r"^shard-(\d{4,})\.zarr$")


# ------------------------------------------------------------------------------------------
# finding the slices
# ------------------------------------------------------------------------------------------


def _machine_dirs(run_dir: Path) -> dict[int, Path]:
    if not run_dir.is_dir():
        return {}
    return {int(m.group(1)): p for p in run_dir.iterdir() if p.is_dir() and (m := MACHINE_RE.match(p.name))}


def _saev_store(machine_dir: Path) -> Path | None:
    """The one published saev directory inside a saev machine directory (None if not published yet)."""
    from .formats import format_module

    saev = format_module("saev")
    found = [p for p in machine_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and saev.detect(p)]
    if len(found) > 1:
        raise MetadataError(f"more than one saev directory: {sorted(p.name for p in found)}", machine_dir)
    return found[0] if found else None


def run_format(path: str | Path) -> str | None:
    """The store format of a run directory of machine slices, or None when `path` is not one."""
    from .formats import format_module

    p = Path(path)
    if not p.is_dir():
        return None
    manifest = peek_json(p / MANIFEST_NAME)
    if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT:
        return str(manifest.get("store_format"))
    shards = p / "shards"
    if shards.is_dir() and any(ZARR_SHARD_RE.match(c.name) for c in shards.iterdir()):
        return "zarr"
    for machine_dir in sorted(_machine_dirs(p).values()):
        for name in ("pickle", "lmprobe"):
            if format_module(name).detect(machine_dir):
                return name
        if _saev_store(machine_dir) is not None:
            return "saev"
    return None


def is_slice_run(path: str | Path) -> bool:
    """Whether `path` is a run directory of machine slices (any format)."""
    return run_format(path) is not None


def _found_slices(run_dir: Path, fmt: str) -> dict[int, Path]:
    """Published slices by machine id (unpublished and temporary ones are left out)."""
    if fmt == "zarr":
        shards = run_dir / "shards"
        return {int(m.group(1)): c for c in (shards.iterdir() if shards.is_dir() else [])
                if (m := ZARR_SHARD_RE.match(c.name)) and c.is_dir()}
    out: dict[int, Path] = {}
    for k, machine_dir in _machine_dirs(run_dir).items():
        store = _saev_store(machine_dir) if fmt == "saev" else machine_dir
        if store is not None:
            out[k] = store
    return out


def _run_facts(store: Path, fmt: str) -> dict[str, Any]:
    """The `run` block a slice's provenance carries (empty for stores not written by the extractor)."""
    from .formats import open_store

    with open_store(store, fmt) as reader:
        prov = reader.provenance
        run = prov.get("run")
        facts = dict(run) if isinstance(run, dict) else {}
        facts.setdefault("num_machines", prov.get("num_machines"))
        return facts


def _num_machines(run_dir: Path, fmt: str, found: dict[int, Path]) -> int:
    manifest = peek_json(run_dir / MANIFEST_NAME)
    if isinstance(manifest, dict):
        for key in ("num_machines", "num_shards"):
            if isinstance(manifest.get(key), int):
                return int(manifest[key])
    if found:
        m = _run_facts(found[min(found)], fmt).get("num_machines")
        if isinstance(m, int) and m >= 1:
            return m
    return max(found) + 1 if found else 0


def slice_stores(run_dir: str | Path) -> list[Path]:
    """The published slice stores of a run, in machine order; MissingSliceError names missing machines.

    A single published store (a 1-machine run) is its own only slice.
    """
    from .formats import detect_format

    run = Path(run_dir)
    fmt = run_format(run)
    if fmt is None:
        detect_format(run)  # raises UnknownFormatError for what is no store at all
        return [run]
    found = _found_slices(run, fmt)
    m = _num_machines(run, fmt, found)
    missing = [k for k in range(m) if k not in found]
    if missing or not found:
        raise MissingSliceError(f"machine slice(s) {missing or 'all'} of {m or '?'} are not published yet", run,
                                missing=tuple(missing))
    return [found[k] for k in range(m)]


def run_dir_of(store: str | Path, fmt: str, num_machines: int) -> Path:
    """The run directory holding a published slice (the store itself for a 1-machine run)."""
    store = Path(store)
    if num_machines == 1:
        return store
    return store.parent.parent if fmt in ("zarr", "saev") else store.parent


# ------------------------------------------------------------------------------------------
# the manifest
# ------------------------------------------------------------------------------------------


def _slice_entry(run_dir: Path, k: int, store: Path, fmt: str) -> dict[str, Any]:
    from .formats import open_store

    with open_store(store, fmt) as reader:
        ids = reader.sample_ids
        run = reader.provenance.get("run")
        content = store.name if fmt == "saev" else (run or {}).get("slice_hash")
        return {"path": store.relative_to(run_dir).as_posix(), "machine_id": k, "n_samples": int(reader.n_samples),
                "sample_id_range": [int(ids.min()), int(ids.max()) + 1] if len(ids) else None,
                "content_hash": content}


def write_run_manifest(run_dir: str | Path, *, missing_ok: bool = False) -> Path | None:
    """Write `manifest.json` of a run once every slice is published (atomically); the path, or None
    when a slice is missing and `missing_ok` (the last machine to finish writes it)."""
    from .atomic import write_json_atomic

    run = Path(run_dir)
    fmt = run_format(run)
    if fmt is None:
        raise FormatError("not a run directory of machine slices", run)
    try:
        stores = slice_stores(run)
    except MissingSliceError:
        if missing_ok:
            return None
        raise
    if fmt == "zarr":
        from .formats.zarr_logger import write_manifest

        return write_manifest(run, len(stores), missing_ok=missing_ok)
    entries = [_slice_entry(run, k, s, fmt) for k, s in enumerate(stores)]
    facts = _run_facts(stores[0], fmt)
    manifest = {"format": MANIFEST_FORMAT, "store_format": fmt, "run_hash": facts.get("run_hash"),
                "store_hash": facts.get("store_hash"), "num_machines": len(stores),
                "n_samples": sum(e["n_samples"] for e in entries), "slices": entries}
    target = run / MANIFEST_NAME
    write_json_atomic(target, manifest)
    return target


def finish_slice(store: str | Path, fmt: str, num_machines: int) -> tuple[Path, bool]:
    """After a slice is published: (run directory, whether the run is complete and its manifest written)."""
    run = run_dir_of(store, fmt, num_machines)
    if num_machines == 1:
        return run, True
    return run, write_run_manifest(run, missing_ok=True) is not None


# ------------------------------------------------------------------------------------------
# reading every slice as one Reader
# ------------------------------------------------------------------------------------------


def _cat(parts: list[Any]) -> Any:
    """Concatenate per-slice columns (arrays or lists); None when any slice lacks the column."""
    if any(p is None for p in parts):
        return None
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    return [x for p in parts for x in p]


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """One Batch of several with the same layers and token count (a column some lack is dropped)."""
    if len(batches) == 1:
        return batches[0]
    keys = set(batches[0].extra).intersection(*(b.extra for b in batches[1:]))
    fields = ("texts", "labels", "token_labels", "token_ids", "response_bltd", "response_lengths", "response_texts",
              "logits_topk_values", "logits_topk_indices")
    cols = {name: _cat([getattr(b, name) for b in batches]) for name in fields}
    if (cols["response_bltd"] is None) != (cols["response_lengths"] is None):
        cols["response_bltd"] = cols["response_lengths"] = None
    return Batch(acts_bltd=np.concatenate([b.acts_bltd for b in batches]),
                 lengths=np.concatenate([np.asarray(b.lengths) for b in batches]),
                 sample_ids=np.concatenate([np.asarray(b.sample_ids) for b in batches]),
                 extra={k: _cat([list(b.extra[k]) for b in batches]) for k in sorted(keys)}, **cols)


class SliceRunReader(Reader):
    """The slices of one run (any format) read as one store: samples in machine order (= sample-id order)."""

    def __init__(self, run_dir: str | Path, stores: Sequence[Path], fmt: str) -> None:
        from .formats import open_store

        self.path = Path(run_dir)
        self.format = fmt
        self.stores = list(stores)
        self.slices: list[Reader] = []
        try:
            for store in self.stores:
                self.slices.append(open_store(store, fmt))
        except BaseException:
            self.close()
            raise
        first = self.slices[0]
        for store, r in zip(self.stores, self.slices):
            if (r.layers, r.d_model, r.max_tokens, np.dtype(r.dtype), r.cls_token) != (
                    first.layers, first.d_model, first.max_tokens, np.dtype(first.dtype), first.cls_token):
                raise MetadataError(f"slice has another shape (layers {list(r.layers)}, d_model {r.d_model}, "
                                    f"max_tokens {r.max_tokens}, {np.dtype(r.dtype)}, cls_token {r.cls_token}) "
                                    f"than {self.stores[0]}", store)
        self.layers, self.d_model, self.max_tokens, self.dtype = first.layers, first.d_model, first.max_tokens, first.dtype
        counts = np.array([r.n_samples for r in self.slices], dtype=np.int64)
        self.n_samples = int(counts.sum())
        self._starts = np.cumsum(counts) - counts

    def _column(self, name: str) -> Any:
        cache = self.__dict__.setdefault("_columns", {})
        if name not in cache:
            cache[name] = _cat([getattr(r, name) for r in self.slices])
        return cache[name]

    @property
    def lengths(self) -> np.ndarray:
        return self._column("lengths")

    @property
    def sample_ids(self) -> np.ndarray:
        return self._column("sample_ids")

    @property
    def texts(self) -> list[str] | None:
        return self._column("texts")

    @property
    def labels(self) -> np.ndarray | None:
        return self._column("labels")

    @property
    def token_labels(self) -> np.ndarray | None:
        return self._column("token_labels")

    @property
    def cls_token(self) -> bool:
        """The slices' `cls_token` (checked equal across slices on open)."""
        return self.slices[0].cls_token

    @property
    def provenance(self) -> dict[str, Any]:
        return {**self.slices[0].provenance, "run_dir": str(self.path),
                "slices": [str(s) for s in self.stores]}

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slice number, position within the slice) of reader positions."""
        idx = self.check_samples(samples)
        k = np.searchsorted(self._starts, idx, side="right") - 1
        return k, idx - self._starts[k]

    def get(self, sample: int, layer: int) -> np.ndarray:
        k, local = self.locate(np.array([sample]))
        return self.slices[int(k[0])].get(int(local[0]), layer)

    def batch(self, samples: Sequence[int] | np.ndarray, layers: Sequence[int] | None = None) -> Batch:
        k, local = self.locate(np.asarray(samples))
        order = np.argsort(k, kind="stable")
        parts = [self.slices[s].batch(local[order][k[order] == s], layers) for s in np.unique(k).tolist()]
        if not parts:
            return self.slices[0].batch(np.zeros(0, dtype=np.int64), layers)
        merged = concat_batches(parts)
        if (order == np.arange(len(order))).all():
            return merged
        return merged.select(np.argsort(order, kind="stable"))

    def last_token(self, layer: int) -> np.ndarray:
        return np.concatenate([r.last_token(layer) for r in self.slices])

    def iter_batches(self, batch_size: int = 64, layers: Sequence[int] | None = None) -> Iterator[Batch]:
        for r in self.slices:
            yield from r.iter_batches(batch_size, layers)

    def token_segments(self, layer: int) -> list[TokenSegment]:
        """Every slice's segments, their sample positions shifted to this reader's (no copy)."""
        out = []
        for start, r in zip(self._starts.tolist(), self.slices):
            out.extend(TokenSegment(s.rows_2d, s.base_rows, s.lengths, s.first_sample + start)
                       for s in r.token_segments(layer))
        return out

    def close(self) -> None:
        for r in self.slices:
            r.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_columns", None)
        return state


def open_run(run_dir: str | Path) -> Reader:
    """Every slice of a run as one Reader (zarr: its manifest reader); MissingSliceError when one is missing."""
    from .formats import format_module

    run = Path(run_dir)
    fmt = run_format(run)
    if fmt is None:
        raise FormatError("not a run directory of machine slices", run)
    stores = slice_stores(run)
    if fmt == "zarr":
        if not (run / MANIFEST_NAME).is_file():
            write_run_manifest(run)
        return format_module("zarr").open_reader(run)
    return SliceRunReader(run, stores, fmt)


# ------------------------------------------------------------------------------------------
# merging
# ------------------------------------------------------------------------------------------


def run_spec(store: str | Path, fmt: str) -> Any:
    """The whole run's StoreSpec recorded in a slice (None for stores not written by the extractor)."""
    from .spec import StoreSpec

    facts = _run_facts(Path(store), fmt)
    fields = facts.get("store_spec")
    if not isinstance(fields, dict):
        return None
    try:
        return StoreSpec(**{**fields, "provenance": {}})
    except TypeError as exc:
        raise MetadataError(f"the slice's run spec is not a StoreSpec: {exc}", store) from exc


def merge_run(run_dir: str | Path, out_root: str | Path, *, progress: bool = False, verify: bool = True) -> Path:
    """Publish the one store of a run's slices under `out_root` (saev: `out_root/<HASH>`); return its path.

    The store is exactly the one a 1-machine extraction of the same config publishes (same name and
    content hash, same data files); idempotent. A 1-machine run already under `out_root` is returned
    unchanged.
    """
    from .convert import batch_size_for
    from .formats import create_writer, detect_format, open_store, verify_before_publish, verify_store

    run, out = Path(run_dir), Path(out_root)
    stores = slice_stores(run)
    fmt = run_format(run) or detect_format(run)
    if len(stores) == 1 and out.resolve() in stores[0].resolve().parents:
        return stores[0]
    whole = run_spec(stores[0], fmt)
    if whole is None:
        raise ConfigError("the slices carry no run spec (not written by `actlake extract`); "
                          "merge the stores with `actlake merge STORE... --out DIR`", stores[0])
    reader = open_store(run, fmt) if len(stores) > 1 else open_store(stores[0], fmt)
    try:
        if int(reader.n_samples) != whole.n_samples:
            raise MetadataError(f"the slices hold {reader.n_samples} samples, the run spec says {whole.n_samples}", run)
        prov = dict(reader.provenance)
        prov.pop("run_dir", None)
        prov.pop("slices", None)
        prov.update(machine_id=0, num_machines=1, samples_per_machine=whole.n_samples,
                    sample_range=[0, whole.n_samples],
                    merged_from={"run_dir": str(run.resolve()), "format": fmt,
                                 "slices": [s.relative_to(run).as_posix() if run in s.parents else str(s)
                                            for s in stores]})
        run_block = dict(prov.get("run") or {})
        run_block.update(num_machines=1, machine_id=0, slice_hash=whole.content_hash(), run_hash=whole.run_hash())
        prov["run"] = run_block
        spec = dataclasses.replace(whole, provenance=prov)
        writer = create_writer(fmt, out, spec)
        checked = verify_before_publish(writer, fmt, "merged store") if verify else None
        try:
            start = int(writer.resume_from)
            if start < spec.n_samples:
                _stream(reader, writer, start, batch_size_for(reader), progress, spec.max_tokens)
            published = Path(writer.close())
        except BaseException:
            writer.abort()
            raise
    finally:
        reader.close()
    problems = verify_store(published, fmt) if checked is not None and not checked() else []
    if problems:  # published by an earlier run (a store verified before its publication is not re-read)
        raise FormatError(f"merged store fails verification: {'; '.join(problems[:5])}", published)
    return published


def _pooled_batches(reader: Reader, max_tokens: int, batch_size: int) -> Iterator[Batch]:
    """A pooled lmprobe store's rows as Batches its writer pools back to the same bytes.

    Each pooled row is broadcast over the sample's `num_tokens` positions (a view, no copy): the
    last-token pooling picks it, and the float64 mean of n equal float32 values is that value
    exactly; token ids and token counts come from the index, as the writer stored them.
    """
    parts = reader.slices if isinstance(reader, SliceRunReader) else [reader]
    for r in parts:
        n_tokens = np.asarray(r.num_tokens, dtype=np.int64)  # type: ignore[attr-defined]
        for s in range(0, r.n_samples, batch_size):
            idx = np.arange(s, min(s + batch_size, r.n_samples))
            rows = r.batch(idx).acts_bltd[:, :, :1]
            acts = np.broadcast_to(rows, (len(idx), rows.shape[1], max_tokens, rows.shape[3]))
            yield r._batch_meta(idx, acts, n_tokens[idx])  # type: ignore[attr-defined]


def _stream(reader: Reader, writer: Any, start: int, batch_size: int, progress: bool, max_tokens: int) -> None:
    """Feed every sample from position `start` on to `writer`, in order."""
    import sys

    from tqdm import tqdm

    pooled = reader.format == "lmprobe" and not getattr(_first_slice(reader), "full_sequence", True)
    if pooled and start:
        raise ConfigError("a pooled lmprobe merge restarts from the first sample", reader.path)
    with tqdm(total=reader.n_samples - start, unit="sample", disable=not progress, file=sys.stderr,
              desc=f"merge {reader.path.name}") as bar:
        if pooled:
            batches: Iterator[Batch] = _pooled_batches(reader, max_tokens, batch_size)
        elif start == 0:
            batches = reader.iter_batches(batch_size)
        else:
            batches = (reader.batch(np.arange(s, min(s + batch_size, reader.n_samples)))
                       for s in range(start, reader.n_samples, batch_size))
        drop_response = reader.format == "zarr" and not _zarr_has_response(reader)
        for batch in batches:
            if drop_response:  # a reader always fills the response arrays; the writer records whether data had one
                batch = dataclasses.replace(batch, response_bltd=None, response_lengths=None, response_texts=None)
            writer.write_batch(batch)
            bar.update(batch.size)


def _zarr_has_response(reader: Reader) -> bool:
    stores = getattr(reader, "shards", None) or [reader]
    return any(bool(store.meta.attrs.get("has_response", True)) for store in stores)  # type: ignore[attr-defined]


def _first_slice(reader: Reader) -> Reader:
    return reader.slices[0] if isinstance(reader, SliceRunReader) else reader
