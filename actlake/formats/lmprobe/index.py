"""Reading and checking the parquet index: `lmprobe:` schema metadata, column presence and exact types."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from actlake.errors import (
    FormatError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
)
from actlake.formats.lmprobe.descriptors import HiddenDescriptor, LogitsDescriptor
from actlake.formats.lmprobe.layout import ACTLAKE_META_KEY, CORE_COLUMNS
from actlake.jsonio import parse_json

REQUIRED_INFO: dict[str, type] = {
    "format_version": str, "model": dict, "num_prompts": int, "prompt_ordering": str, "tensors": dict,
    "provenance": dict,
}


def read_index_metadata(index_path: Path, filesystem: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the `lmprobe:` info dict, actlake's own dict) from the parquet footer, JSON-decoded. `filesystem`: an
    fsspec filesystem `index_path` lies on (a remote store; the caller has checked that the file exists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if filesystem is None and not index_path.is_file():
        raise MissingFileError("parquet index is missing", index_path)
    try:
        schema = pq.read_schema(str(index_path) if filesystem else index_path, filesystem=filesystem)
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"not a readable parquet file: {exc}", index_path) from None
    info: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    for k, v in (schema.metadata or {}).items():
        key = k.decode("utf-8", "replace")
        if key.startswith("lmprobe:") or k == ACTLAKE_META_KEY:
            value = parse_json(v, index_path, f"schema metadata {key!r}")
            if k == ACTLAKE_META_KEY:
                ours = value if isinstance(value, dict) else {}
            else:
                info[key.removeprefix("lmprobe:")] = value
    if not info:
        raise MetadataError("parquet schema carries no 'lmprobe:' metadata (a 1.x dataset?)", index_path)
    return info, ours


def read_index_table(index_path: Path, filesystem: Any = None) -> Any:
    """The whole parquet index as a pyarrow Table (a typed error naming the file if unreadable); `filesystem` as
    for read_index_metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(index_path) if filesystem else index_path, filesystem=filesystem)
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"not a readable parquet file: {exc}", index_path) from None


def check_info(info: dict[str, Any], source: Path) -> None:
    """Raise on a missing/mistyped top-level key or an unreadable major version."""
    for key, typ in REQUIRED_INFO.items():
        if key not in info:
            raise MetadataError(f"schema metadata lacks 'lmprobe:{key}'", source)
        if not isinstance(info[key], typ) or (typ is int and isinstance(info[key], bool)):
            raise MetadataError(f"'lmprobe:{key}' must be {typ.__name__}, got {type(info[key]).__name__}", source)
    m = re.fullmatch(r"(\d+)\.(\d+)", info["format_version"])
    if not m:
        raise MetadataError(f"format_version {info['format_version']!r} is not MAJOR.MINOR", source)
    if int(m.group(1)) != 2:
        raise ProtocolVersionError(f"format_version {info['format_version']} is not readable (this reader speaks 2.x)", source)
    model = info["model"]
    if not isinstance(model.get("name"), str) or not (model.get("revision") is None or isinstance(model.get("revision"), str)):
        raise MetadataError("'lmprobe:model' must be {name: str, revision: str|null}", source)


def check_columns(table: Any, hidden: HiddenDescriptor | None, logits: LogitsDescriptor | None) -> list[str]:
    """Problems with the index columns' presence and exact types (messages without the file name)."""
    import pyarrow as pa

    want: dict[str, Any] = {"text": pa.string(), "num_tokens": pa.int32(), "shard_index": pa.int32(),
                            "row_offset": pa.int32()}
    optional: dict[str, Any] = {
        "perplexity_mean": pa.float64(), "perplexity_min": pa.float64(), "perplexity_max": pa.float64(),
        "token_ids": pa.list_(pa.int64()), "token_perplexity": pa.list_(pa.float64()),
        "token_strings": pa.list_(pa.string()),
    }
    full = {"token_offset": pa.int64(), "token_shard_ids": pa.list_(pa.int64()),
            "token_shard_offsets": pa.list_(pa.int64())}
    logit_cols = {"shard_index_logits": pa.int32(), "row_offset_logits": pa.int32()}
    (want if hidden is not None and hidden.storage == "full_sequence" else optional).update(full)
    (want if logits is not None else optional).update(logit_cols)
    schema = table.schema
    problems = []
    for name, typ in want.items():
        if name not in schema.names:
            problems.append(f"index column {name!r} is missing")
        elif not schema.field(name).type.equals(typ):
            problems.append(f"index column {name!r} has type {schema.field(name).type}, expected {typ}")
    if "label" not in schema.names:
        problems.append("index column 'label' is missing")
    elif schema.field("label").type not in (pa.int32(), pa.string()):
        problems.append(f"index column 'label' has type {schema.field('label').type}, expected int32 or string")
    for name, typ in optional.items():
        if name in schema.names and not schema.field(name).type.equals(typ):
            problems.append(f"index column {name!r} has type {schema.field(name).type}, expected {typ}")
    for name in CORE_COLUMNS[2:] + tuple(k for k in ("token_offset", "shard_index_logits", "row_offset_logits") if k in want):
        if name in schema.names and table.column(name).null_count:
            problems.append(f"index column {name!r} has nulls")
    return problems


def column_numpy(table: Any, name: str, dtype: Any) -> np.ndarray:
    """One scalar column as a numpy array (nulls become -1)."""
    col = table.column(name)
    if col.null_count:
        col = col.fill_null(-1)
    return np.asarray(col.to_numpy(), dtype=dtype)


def list_column(table: Any, name: str, source: Path) -> tuple[np.ndarray, np.ndarray]:
    """(flat int64 values, [N+1] int64 list offsets) of a list<int> column (null lists are empty)."""
    import pyarrow.compute as pc

    col = table.column(name).combine_chunks()
    lengths = np.asarray(pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    flat = pc.list_flatten(col)
    if flat.null_count:
        raise MetadataError(f"index column {name!r} has nulls inside its lists", source)
    values = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.int64)
    return values, np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
