"""`actlake verify` for the gzip-pickle shard format: every invariant of the spec and of actlake's additions."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import (
    DuplicateSampleError,
    FormatError,
    MissingFileError,
    TruncatedFileError,
)
from ...checksums import store_findings
from .layout import (
    CHECKSUM_RE,
    EXTENSION_KEY,
    ITEM_KEYS,
    PREVIEW_CHARS,
    SHARD_FILE_RE,
    SHARD_KEYS,
    is_int,
    layer_key,
    shard_filename,
)
from .metadata import PickleMetadata, ShardInfo, declared_rows, read_metadata, shard_path
from .shard_io import ShardContent, check_shard, inflate_cap, load_shard_file


def verify(path: Path, *, check_values: bool = True, published_as: Path | None = None) -> list[str]:
    """Check every invariant of the spec (and of actlake's additions); one message per problem; then every
    file against checksums.json in one streaming pass. (`published_as`, the final path of a temporary
    directory verified before its rename, changes nothing here: no name is checked.)"""
    path = Path(path)
    return list(dict.fromkeys(_verify_structure(path, check_values) + store_findings(path)))


def _verify_structure(path: Path, check_values: bool) -> list[str]:
    """metadata.json, every shard (checksum, structure, values) and actlake's index against the spec."""
    source = path / "metadata.json"
    try:
        md = read_metadata(path)
    except FormatError as exc:
        return [str(exc)]
    problems: list[str] = []
    raw = md.raw
    try:
        datetime.fromisoformat(raw["created_at"])
    except ValueError:
        problems.append(f"{source}: created_at {raw['created_at']!r} is not ISO 8601")
    for key in ("model_name", "model_architecture", "model_params", "dataset_name", "dataset_config",
                "dataset_split", "layers_extracted", "max_seq_length", "batch_size"):
        if key not in md.extraction_config:
            problems.append(f"{source}: extraction_config lacks {key!r}")
    if "distributed_config" in raw:
        for key in ("machine_id", "total_machines", "multihost", "num_hosts", "mesh_type"):
            if key not in md.distributed_config:
                problems.append(f"{source}: distributed_config lacks {key!r}")
    stats = raw["statistics"]
    want_stats = {"total_shards": len(md.shards), "total_samples": md.n_samples,
                  "total_size_bytes": sum(s.size_bytes for s in md.shards), "layers_extracted": list(md.layers)}
    for key, want in want_stats.items():
        if stats.get(key) != want:
            problems.append(f"{source}: statistics.{key} is {stats.get(key)!r}, expected {want!r}")
    if not isinstance(stats.get("extraction_duration_seconds"), (int, float)):
        problems.append(f"{source}: statistics.extraction_duration_seconds is missing or not a number")
    for i, entry in enumerate(raw["shards"]):
        missing = [k for k in SHARD_KEYS if k not in entry]
        if missing:
            problems.append(f"{source}: shards[{i}] lacks {missing}")
    params = md.extraction_config.get("model_params")
    ext_width = (md.extension or {}).get("d_model")
    if isinstance(params, dict) and ext_width is not None and params.get("hidden_size") != ext_width:
        problems.append(f"{source}: model_params.hidden_size {params.get('hidden_size')!r} differs from "
                        f"{EXTENSION_KEY}.d_model {ext_width!r}")
    d_model = md.hidden_size
    listed: set[str] = set()
    contents: list[ShardContent | None] = []
    for info in md.shards:
        try:
            f = shard_path(path, info)
        except FormatError as exc:
            problems.append(str(exc))
            contents.append(None)
            continue
        listed.add(f.name)
        if info.filename != shard_filename(info.shard_id, info.compressed):
            problems.append(f"{f}: filename does not follow shard_{{id:04d}}.pkl{'.gz' if info.compressed else ''} "
                            f"for shard_id {info.shard_id}")
        content = _verify_shard(f, info, md, d_model, check_values, problems)
        contents.append(content)
        if d_model is None and content is not None:
            d_model = content.d_model  # no declared width: the first shard's items set it for the rest
    for f in sorted(path.iterdir()):
        if SHARD_FILE_RE.match(f.name) and f.name not in listed:
            problems.append(f"{f}: shard file not listed in metadata.json")
    if problems:
        return problems
    all_ids = np.concatenate([c.sample_ids for c in contents if c is not None] or [np.zeros(0, np.int64)])
    uniq, counts = np.unique(all_ids, return_counts=True)
    if (counts > 1).any():
        problems.append(str(DuplicateSampleError(f"sample_idx {int(uniq[counts > 1][0])} occurs "
                                                 f"{int(counts[counts > 1][0])} times", path)))
    ext = md.extension
    if ext is not None and "sample_ids" in ext:
        problems.extend(_verify_extension(ext, contents, source))
    return problems


def _verify_shard(f: Path, info: ShardInfo, md: PickleMetadata, d_model: int | None, check_values: bool,
                  problems: list[str]) -> ShardContent | None:
    """Problems of one shard file (existence, size, checksum, structure, values)."""
    if not f.is_file():
        problems.append(str(MissingFileError("shard listed in metadata.json is missing", f)))
        return None
    size = f.stat().st_size
    if size != info.size_bytes:
        problems.append(str(TruncatedFileError(f"size {size} bytes, metadata.json says {info.size_bytes}", f)))
        return None
    if info.checksum is None:
        problems.append(f"{f}: metadata.json gives no checksum for this shard")
    elif CHECKSUM_RE.match(info.checksum) is None:
        problems.append(f"{f}: checksum {info.checksum!r} is not 'sha256:<64 hex>'")
    try:
        data = load_shard_file(f, compressed=info.compressed, checksum=info.checksum,
                               verify_checksum=info.checksum is not None and CHECKSUM_RE.match(info.checksum) is not None,
                               max_inflated=inflate_cap(info.num_samples, len(info.layers), declared_rows(md),
                                                        md.hidden_size))
        content = check_shard(data, info, md.layers, d_model, f)
    except FormatError as exc:
        problems.append(str(exc))
        return None
    if len(content.sample_ids) and info.sample_id_range is not None \
            and list(info.sample_id_range) != [int(content.sample_ids.min()), int(content.sample_ids.max())]:
        problems.append(f"{f}: sample_id_range {list(info.sample_id_range)} does not match the items "
                        f"[{int(content.sample_ids.min())}, {int(content.sample_ids.max())}]")
    max_seq = md.extraction_config.get("max_seq_length")
    for layer in md.layers:
        for j, item in enumerate(data[layer_key(layer)]):
            where = f"{f}: {layer_key(layer)}[{j}]"
            missing = [k for k in ITEM_KEYS if k not in item]
            if missing:
                problems.append(f"{where} lacks {missing}")
                return content
            act = item["activation"]
            if act.dtype != np.float32:
                problems.append(f"{where}.activation is {act.dtype}, the spec says float32")
            if not isinstance(item["shape"], tuple) or item["shape"] != act.shape:
                problems.append(f"{where}.shape {item['shape']!r} is not the activation's shape tuple {act.shape}")
            if not isinstance(item["text_preview"], str) or len(item["text_preview"]) > PREVIEW_CHARS:
                problems.append(f"{where}.text_preview must be a string of at most {PREVIEW_CHARS} characters")
            meta = item["metadata"]
            if isinstance(meta, dict) and isinstance(meta.get("text"), str) \
                    and item["text_preview"] != meta["text"][:PREVIEW_CHARS]:
                problems.append(f"{where}.text_preview is not the first {PREVIEW_CHARS} characters of metadata.text")
            if not isinstance(meta, dict):
                problems.append(f"{where}.metadata must be a dict")
            elif "token_count" in meta and not (is_int(meta["token_count"]) and meta["token_count"] >= 0):
                problems.append(f"{where}.metadata.token_count {meta['token_count']!r} is not a non-negative integer")
            elif "token_count" in meta and meta["token_count"] > act.shape[0] and act.shape[0] != max_seq:
                problems.append(f"{where}: token_count {meta['token_count']} exceeds the activation rows "
                                f"{act.shape[0]}, which are not a truncation at max_seq_length {max_seq}")
            if check_values and not np.isfinite(act).all():
                problems.append(f"{where}.activation has non-finite values")
    return content


def _verify_extension(ext: dict[str, Any], contents: list[ShardContent | None], source: Path) -> list[str]:
    """actlake's index in metadata.json must agree with the shard items."""
    problems = []
    widths = {c.d_model for c in contents if c is not None and c.d_model is not None}
    if widths and widths != {ext.get("d_model")}:
        problems.append(f"{source}: {EXTENSION_KEY}.d_model {ext.get('d_model')!r} is not the items' width {sorted(widths)}")
    ids = np.concatenate([c.sample_ids for c in contents if c is not None] or [np.zeros(0, np.int64)])
    counts = np.concatenate([c.token_counts for c in contents if c is not None] or [np.zeros(0, np.int64)])
    if list(ext.get("sample_ids", [])) != ids.tolist():
        problems.append(f"{source}: {EXTENSION_KEY}.sample_ids do not match the shards' sample_idx")
    if list(ext.get("lengths", [])) != counts.tolist():
        problems.append(f"{source}: {EXTENSION_KEY}.lengths do not match the items' token_count")
    max_tokens = ext.get("max_tokens")
    if not is_int(max_tokens) or max_tokens < int(counts.max(initial=0)):
        problems.append(f"{source}: {EXTENSION_KEY}.max_tokens {max_tokens!r} is below the longest sample "
                        f"({int(counts.max(initial=0))} tokens)")
    if ext.get("labels") is not None:
        labels = np.concatenate([c.labels if c.labels is not None else np.full(len(c.sample_ids), -1)
                                 for c in contents if c is not None] or [np.zeros(0, np.int64)])
        if list(ext["labels"]) != labels.tolist():
            problems.append(f"{source}: {EXTENSION_KEY}.labels do not match the items' metadata labels")
    return problems
