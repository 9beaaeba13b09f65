"""verify: every invariant of the spec on a store or a sharded run; one message per problem, each naming the file."""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...atomic import resolve_inside
from ...checksums import store_findings
from ...errors import FormatError, MissingFileError
from ...finite import FiniteCheck, FloatRegion
from .discover import is_sharded_run, store_dir
from .layout import (
    ACT_ARRAYS,
    MANIFEST_NAME,
    PROMPT,
    REQUIRED_ATTRS,
    RESPONSE,
    SCHEMA,
    SHARDS_DIR,
    is_int,
)
from .chunks import missing_chunk
from .manifest import ZarrManifestReader, check_manifest
from .meta import ArrayMeta, StoreMeta, np_dtype, read_json
from .reader import ZarrReader

_DIGITS = re.compile(r"[0-9]+")


def verify(path: Path, *, published_as: Path | None = None) -> list[str]:
    """Check every invariant of the spec; one message per problem, each naming the file. Every store's files
    are checked against its checksums.json in one streaming pass. (`published_as`, the final path of a
    temporary directory verified before its rename, changes nothing here: no name is checked.)"""
    path = Path(path)
    if is_sharded_run(path):
        return _verify_run(path)
    store = store_dir(path)
    if store is None:
        return [str(MissingFileError("no Zarr store here", path / ".zgroup"))]
    return _verify_store(store)


def _verify_run(run: Path) -> list[str]:
    source = run / MANIFEST_NAME
    try:
        entries, _ = check_manifest(read_json(source), source)
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
    """The spec's invariants of one store, then its files against checksums.json, the activation chunks
    checked for NaN / Inf in the same streaming pass."""
    problems = _verify_structure(store)
    try:
        inspect = _value_checks(store, StoreMeta.load(store))
    except FormatError:
        inspect = None  # already reported
    return list(dict.fromkeys(problems + store_findings(store, inspector_for=inspect)))


def _value_checks(store: Path, meta: StoreMeta) -> Callable[[str], FiniteCheck | None]:
    """Inspectors of the checksums pass: every chunk file of an uncompressed little-endian fp16 activation
    array must hold finite values (padding rows included: they are zeros)."""
    arrays = {name: meta.arrays[name] for name in ACT_ARRAYS
              if meta.arrays[name].uncompressed and np_dtype(meta.arrays[name].dtype, store) == np.dtype("<f2")}

    def inspector(rel: str) -> FiniteCheck | None:
        parts = rel.split("/")
        am = arrays.get(parts[1]) if len(parts) > 2 and parts[0] == "arrays" else None
        if am is None or parts[-1].startswith("."):
            return None
        row = am.shape[3] * 2
        return FiniteCheck(store / rel, [FloatRegion(0, am.chunks[2] * row, "f2", "activations", row, "token row")])

    return inspector


def _verify_structure(store: Path) -> list[str]:
    problems: list[str] = []
    zgroup = store / ".zgroup"
    try:
        if read_json(zgroup).get("zarr_format") != 2:
            problems.append(f"{zgroup}: zarr_format is not 2")
    except (FormatError, AttributeError) as exc:
        problems.append(str(exc) if isinstance(exc, FormatError) else f"{zgroup}: not an object")
    try:
        meta = StoreMeta.load(store)
    except FormatError as exc:
        return problems + [str(exc)]
    problems += _verify_consolidated(store)
    problems += _verify_attrs(store, meta)
    try:
        reader: ZarrReader | None = ZarrReader(store)
        unreadable = None
    except FormatError as exc:
        reader, unreadable = None, str(exc)
    for name in ACT_ARRAYS:
        lengths = None if reader is None else reader.lengths if name == PROMPT else reader.response_lengths
        problems += _verify_act_array(store, meta, name, lengths)
    for name, am in meta.arrays.items():
        f = store / "arrays" / name / ".zarray"
        if am.compressor is not None:
            problems.append(f"{f}: compressor {am.compressor!r}, the spec stores uncompressed (null)")
        if am.filters:
            problems.append(f"{f}: filters {am.filters!r}, the spec allows none (null)")
        if am.order != "C":
            problems.append(f"{f}: order {am.order!r}, expected 'C'")
    if reader is None:
        return problems + [str(unreadable)]
    problems += _verify_values(store, reader)
    reader.close()
    return problems


def _verify_consolidated(store: Path) -> list[str]:
    """Every entry of .zmetadata matches the file on disk, and every metadata file is consolidated."""
    problems = []
    zpath = store / ".zmetadata"
    zmeta = read_json(zpath)
    if zmeta.get("zarr_consolidated_format") != 1:
        problems.append(f"{zpath}: zarr_consolidated_format is not 1")
    entries = zmeta["metadata"]
    for key, value in entries.items():
        f = store / key
        try:
            on_disk = read_json(f)
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
        if not is_int(count) or not 0 <= count <= n:
            problems.append(f"{f}: {part}_truncated_count {count!r} is not in [0, {n}]")
        elif not isinstance(frac, (int, float)) or abs(frac - (count / n if n else 0.0)) > 1e-9:
            problems.append(f"{f}: {part}_truncated_fraction {frac!r} is not count / n_samples")
    return problems


def _verify_act_array(store: Path, meta: StoreMeta, name: str, lengths: np.ndarray | None) -> list[str]:
    """dtype, fill, chunking; every chunk file inside the grid and full size; and (given the sample lengths)
    every chunk holding real tokens present."""
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
    present = array("q")  # flat ids of the chunk files found: O(files), 8 bytes each
    for dirpath, _, filenames in os.walk(folder):
        for fname in filenames:
            if fname.startswith("."):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fname), folder).replace(os.sep, am.separator)
            key = rel.split(am.separator)
            if len(key) != 4 or not all(_DIGITS.fullmatch(k) for k in key) or any(int(k) >= g for k, g in zip(key, grid)):
                problems.append(f"{folder / rel}: not a chunk of the ({', '.join(map(str, grid))}) chunk grid")
                continue
            present.append((int(key[0]) * grid[1] + int(key[1])) * n_chunks + int(key[2]))
            size = os.path.getsize(os.path.join(dirpath, fname))
            if size != chunk_bytes:
                problems.append(f"{os.path.join(dirpath, fname)}: chunk file has {size} bytes, expected {chunk_bytes}")
    if lengths is not None and n_chunks:
        problems += _missing_real_chunks(folder, am, np.asarray(lengths, dtype=np.int64), n_chunks,
                                         np.sort(np.frombuffer(present, dtype=np.int64)))
    return problems


def _missing_real_chunks(folder: Path, am: ArrayMeta, lengths: np.ndarray, n_chunks: int, present: np.ndarray,
                         named: int = 10) -> list[str]:
    """Chunks holding real tokens (chunk c of a sample with c * T_chunk < its length, every layer) that have no
    file: the first `named` as MissingFileError messages, then a count. Computed a block of samples at a time
    against the sorted ids of the files found (bounded memory)."""
    n_layers, t_chunk = am.shape[1], am.chunks[2]
    need = -(-lengths // t_chunk)
    out: list[str] = []
    total = 0
    block = max(1, (1 << 20) // max(1, n_layers * n_chunks))
    for start in range(0, len(need), block):
        seg = need[start : start + block]
        counts = seg * n_layers
        size = int(counts.sum())
        if not size:
            continue
        sample = np.repeat(np.arange(start, start + len(seg), dtype=np.int64), counts)
        per = np.repeat(seg, counts)
        j = np.arange(size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        layer, chunk = j // per, j % per
        flat = (sample * n_layers + layer) * n_chunks + chunk
        pos = np.minimum(np.searchsorted(present, flat), max(len(present) - 1, 0))
        lost = np.flatnonzero(present[pos] != flat) if len(present) else np.arange(size)
        total += len(lost)
        for k in lost[: max(0, named - len(out))].tolist():
            key = am.separator.join(map(str, (int(sample[k]), int(layer[k]), int(chunk[k]), 0)))
            out.append(str(missing_chunk(folder / key, int(sample[k]), int(layer[k]), int(chunk[k]), t_chunk)))
    if total > len(out):
        out.append(f"{folder}: {total - len(out)} more chunk files holding real tokens are missing")
    return out


def _verify_values(store: Path, reader: ZarrReader) -> list[str]:
    problems = []
    ids = reader.sample_ids
    if len(np.unique(ids)) != len(ids):
        problems.append(f"{store / 'arrays' / 'sample_id'}: sample ids are not unique")
    for name, allowed in (("hallu_label", (-1, 0, 1)), ("split", (-1, 0, 1, 2))):
        values = getattr(reader, name)
        if values is not None and not np.isin(values, allowed).all():
            problems.append(f"{store / 'arrays' / name}: values outside {allowed}")
    keys = reader.sample_keys
    for fname, field in (("prompts.jsonl", "prompt"), ("responses.jsonl", "response")):
        f = store / "text" / fname
        try:
            rows = reader.jsonl_rows(fname)
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
            if not isinstance(row.get("sample_key"), str):
                problems.append(f"{f}: line {k + 1} lacks a string 'sample_key' (the spec's i, sample_key, {field})")
                break
            if keys is not None and row["sample_key"] != keys[k]:
                problems.append(f"{f}: line {k + 1} sample_key does not match arrays/sample_key")
                break
    try:
        _ = reader.extra_rows  # parses and checks text/extra_metadata.jsonl
    except FormatError as exc:
        problems.append(str(exc))
    return problems
