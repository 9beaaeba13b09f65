"""`verify`: every invariant of the lmprobe 2.0 spec checked, one message per problem, each naming its file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from actlake.atomic import resolve_inside
from actlake.checksums import store_findings
from actlake.errors import FormatError, UnsafePathError
from actlake.finite import FiniteCheck, FloatRegion
from actlake.formats.lmprobe.descriptors import HiddenDescriptor, LogitsDescriptor
from actlake.formats.lmprobe.index import (
    check_columns,
    check_info,
    column_numpy,
    list_column,
    read_index_metadata,
    read_index_table,
)
from actlake.formats.lmprobe.layout import (
    HIDDEN_DTYPES,
    INDEX_PATH,
    LOGITS_INDICES_KEY,
    LOGITS_VALUES_KEY,
    POOLINGS,
    UPSTREAM_INDICES_KEY,
    UPSTREAM_VALUES_KEY,
    logits_row_bytes,
)
from actlake.formats.lmprobe.safetensors_io import read_safetensors_header


class _Problems(list):
    """Problem messages, each prefixed with the file it is about."""

    def bad(self, file: Path, msg: str) -> None:
        self.append(f"{file}: {msg}")


def verify(path: Path, *, published_as: Path | None = None) -> list[str]:
    """Check every invariant of the spec; one message per problem, each naming the file; then every file
    against checksums.json in one streaming pass. (`published_as`, the final path of a temporary directory
    verified before its rename, changes nothing here: no name is checked.)"""
    path = Path(path)
    checks: dict[str, FiniteCheck] = {}
    problems = _verify_structure(path, checks)
    return list(dict.fromkeys(problems + store_findings(path, inspector_for=checks.get)))


#: safetensors dtype code -> finite.KINDS element kind (hidden-state tensors)
_FLOAT_KINDS = {"F16": "f2", "BF16": "bf16", "F32": "f4", "F64": "f8"}


def _verify_structure(path: Path, checks: dict[str, FiniteCheck]) -> list[str]:
    """The index, descriptors, addressing and shard headers against the spec; `checks` gets, per hidden-state
    file (relative path), the NaN / Inf check of its tensor for the checksums pass."""
    index = path / INDEX_PATH
    try:
        info, _ = read_index_metadata(index)
        check_info(info, index)
        table = read_index_table(index)
    except FormatError as exc:
        return [str(exc)]
    problems = _Problems()
    tensors = info["tensors"]
    hidden = logits = None
    try:
        hidden = HiddenDescriptor.parse(tensors.get("hidden_layers"), index)
    except FormatError as exc:
        problems.append(str(exc))
    if "logits_topk" in tensors:
        try:
            logits = LogitsDescriptor.parse(tensors["logits_topk"], index)
        except FormatError as exc:
            problems.append(str(exc))
    for msg in check_columns(table, hidden, logits):
        problems.bad(index, msg)
    if info["num_prompts"] != table.num_rows:
        problems.bad(index, f"num_prompts {info['num_prompts']} != {table.num_rows} index rows")
    if problems or hidden is None:
        return list(problems)
    _check_hidden_descriptor(problems, index, tensors["hidden_layers"], hidden, table.num_rows)
    try:
        _check_addressing(problems, index, table, hidden)
    except FormatError as exc:
        problems.append(str(exc))
    expected: set[Path] = set()
    try:
        _check_hidden_files(problems, path, index, hidden, expected, checks)
        if logits is not None:
            _check_logits(problems, path, index, table, tensors["logits_topk"], logits, expected)
    except UnsafePathError as exc:
        problems.append(str(exc))
        return list(problems)
    for f in sorted(path.rglob("*.safetensors")):
        if f.resolve() not in expected:
            problems.bad(f, "safetensors file not described by the index")
    return list(problems)


def _check_hidden_descriptor(problems: _Problems, index: Path, raw: dict[str, Any], hidden: HiddenDescriptor,
                             n: int) -> None:
    """`type`, `row_bytes`, `pooling`, and the last-token shards' prompt total."""
    if raw.get("type") != "hidden":
        problems.bad(index, f"tensors.hidden_layers.type is {raw.get('type')!r}, expected 'hidden'")
    itemsize = HIDDEN_DTYPES[hidden.dtype][1]
    if hidden.row_bytes is None:
        if hidden.storage == "pooled":
            problems.bad(index, "tensors.hidden_layers.row_bytes is missing")
    elif hidden.row_bytes != hidden.dim * itemsize:
        problems.bad(index, f"tensors.hidden_layers.row_bytes {hidden.row_bytes} != dim {hidden.dim} x {itemsize} bytes "
                            f"({hidden.dtype})")
    if hidden.storage == "pooled" and hidden.pooling not in POOLINGS:
        problems.bad(index, f"tensors.hidden_layers.pooling {hidden.pooling!r} is not one of {POOLINGS}")
    lts = hidden.last_token_shards
    if sum(hidden.shard_prompts[:lts]) != n:
        problems.bad(index, f"last-token shards hold {sum(hidden.shard_prompts[:lts])} prompts, the index has {n} rows")


def _check_addressing(problems: _Problems, index: Path, table: Any, hidden: HiddenDescriptor) -> None:
    """shard_index/row_offset in range and distinct; full-sequence token lists consistent with the shards."""
    n = table.num_rows
    lts = hidden.last_token_shards
    si = column_numpy(table, "shard_index", np.int64)
    ro = column_numpy(table, "row_offset", np.int64)
    nt = column_numpy(table, "num_tokens", np.int64)
    counts = np.asarray(hidden.shard_prompts[:lts], dtype=np.int64)
    if n and (si.min() < 0 or si.max() >= lts):
        problems.bad(index, f"shard_index outside [0, {lts})")
    elif n:
        if ro.min() < 0 or (ro >= counts[si]).any():
            problems.bad(index, "row_offset beyond its shard's num_prompts")
        elif len(np.unique(si * (int(counts.max()) + 1) + ro)) != n:
            problems.bad(index, "two prompts share one (shard_index, row_offset) last-token row")
    if (nt < 0).any():
        problems.bad(index, "num_tokens has negative values")
    if hidden.storage != "full_sequence":
        return
    ids, bounds = list_column(table, "token_shard_ids", index)
    offs, obounds = list_column(table, "token_shard_offsets", index)
    rows = np.asarray(hidden.shard_tokens, dtype=np.int64)
    if (np.diff(bounds) != nt).any() or (obounds != bounds).any():
        problems.bad(index, "token_shard_ids / token_shard_offsets lengths differ from num_tokens")
    elif len(ids) and (ids.min() < 0 or ids.max() >= len(rows) or offs.min() < 0 or (offs >= rows[ids]).any()):
        problems.bad(index, "token_shard_ids / token_shard_offsets point outside the shards")
    else:
        has = nt > 0
        last = bounds[1:][has] - 1
        if (ids[last] != si[has]).any() or (offs[last] != ro[has]).any():
            problems.bad(index, "the last token's (shard, offset) differs from (shard_index, row_offset)")
        rest = np.ones(len(ids), dtype=bool)
        rest[last] = False
        if (ids[rest] < lts).any():
            problems.bad(index, "a non-last token points into a last-token shard")
        seq_used = np.bincount(ids[rest], minlength=len(rows))[lts:]
        if (seq_used != rows[lts:]).any():
            problems.bad(index, f"sequence shards hold {rows[lts:].tolist()} tokens, the index addresses {seq_used.tolist()}")
    if (column_numpy(table, "token_offset", np.int64) != ro).any():
        problems.bad(index, "token_offset differs from row_offset")


def _check_hidden_files(problems: _Problems, path: Path, index: Path, hidden: HiddenDescriptor,
                        expected: set[Path], checks: dict[str, FiniteCheck]) -> None:
    """Every (layer, shard) file inside the root, with the key_pattern tensor of the described dtype and shape;
    a well-formed tensor's values are checked for NaN / Inf in the checksums pass (`checks`)."""
    code = HIDDEN_DTYPES[hidden.dtype][0]
    for layer in hidden.layers:
        for shard, rows_n in enumerate(hidden.shard_tokens):
            f = resolve_inside(path, hidden.file(layer, shard), source=index)
            expected.add(f)
            try:
                header = read_safetensors_header(f)
            except FormatError as exc:
                problems.append(str(exc))
                continue
            key = hidden.key(layer)
            t = header.get(key)
            if t is None:
                problems.bad(f, f"tensor {key!r} is missing (key_pattern {hidden.key_pattern!r})")
            elif t.code != code or t.shape != (rows_n, hidden.dim):
                problems.bad(f, f"tensor {key!r} is {t.code} {list(t.shape)}, expected {code} {[rows_n, hidden.dim]}")
            elif t.code in _FLOAT_KINDS:
                rel = os.path.relpath(f, path.resolve()).replace(os.sep, "/")
                row = t.nbytes // max(1, rows_n)
                checks[rel] = FiniteCheck(f, [FloatRegion(t.start, t.start + t.nbytes, _FLOAT_KINDS[t.code],
                                                          f"tensor {key!r}", row)])


def _check_logits(problems: _Problems, path: Path, index: Path, table: Any, raw: dict[str, Any],
                  logits: LogitsDescriptor, expected: set[Path]) -> None:
    """The logits descriptor's maths, addressing columns, `file` entries and tensors (spec keys and aliases)."""
    n = table.num_rows
    if raw.get("type") != "logits_topk":
        problems.bad(index, f"tensors.logits_topk.type is {raw.get('type')!r}, expected 'logits_topk'")
    if logits.row_bytes != logits_row_bytes(logits.k):
        problems.bad(index, f"tensors.logits_topk.row_bytes {logits.row_bytes} != k x (4 + 8) = {logits_row_bytes(logits.k)}")
    if sum(logits.shard_prompts) != n:
        problems.bad(index, f"logits shards hold {sum(logits.shard_prompts)} prompts, the index has {n} rows")
    lsi = column_numpy(table, "shard_index_logits", np.int64)
    lro = column_numpy(table, "row_offset_logits", np.int64)
    lc = np.asarray(logits.shard_prompts, dtype=np.int64)
    if n and (not len(lc) or lsi.min() < 0 or lsi.max() >= len(lc) or lro.min() < 0 or (lro >= lc[lsi]).any()):
        problems.bad(index, "shard_index_logits / row_offset_logits point outside the logits shards")
    for shard, (rows_n, entry) in enumerate(zip(logits.shard_prompts, raw["shards"])):
        f = resolve_inside(path, logits.file(shard), source=index)
        expected.add(f)
        if "file" in entry and entry["file"] != logits.file(shard):
            problems.bad(index, f"logits shard {shard} lists file {entry['file']!r}, file_pattern gives {logits.file(shard)!r}")
        try:
            header = read_safetensors_header(f)
        except FormatError as exc:
            problems.append(str(exc))
            continue
        for key, want_code in ((LOGITS_VALUES_KEY, "F32"), (LOGITS_INDICES_KEY, "I64"),
                               (UPSTREAM_VALUES_KEY, "F32"), (UPSTREAM_INDICES_KEY, "I32")):
            t = header.get(key)
            if t is None:
                if key in (LOGITS_VALUES_KEY, LOGITS_INDICES_KEY):
                    problems.bad(f, f"tensor {key!r} is missing")
            elif t.code != want_code or t.shape != (rows_n, logits.k):
                problems.bad(f, f"tensor {key!r} is {t.code} {list(t.shape)}, expected {want_code} {[rows_n, logits.k]}")
