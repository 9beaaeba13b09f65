"""`actlake merge` for the gzip-pickle shard format: join per-machine stores, refusing duplicate sample ids."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...atomic import fsync_dir, fsync_file, publish_dir, write_json_atomic
from ...checksums import write_checksums
from ...errors import (
    ConfigError,
    DuplicateSampleError,
    FormatError,
    HashMismatchError,
    MetadataError,
)
from .layout import (
    EXTENSION_KEY,
    EXTENSION_VERSION,
    VERSION,
    plain,
    shard_filename,
    utc_now_iso,
)
from .metadata import ShardInfo, read_metadata, statistics
from .reader import PickleReader
from .shard_io import file_sha256
from .writer import remove_tmp


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (same file system), else copy it and fsync."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        fsync_file(dst)


def _merge_sources(inputs: Sequence[Path]) -> list[dict[str, Any]]:
    """Each input's resolved path and metadata.json sha256 (how a rerun recognises its own output)."""
    out = []
    for p in inputs:
        blob = (p / "metadata.json").read_bytes()
        out.append({"path": str(p.resolve()), "metadata_sha256": hashlib.sha256(blob).hexdigest()})
    return out


def merge(inputs: Iterable[str | Path], out: str | Path, *, verify_checksums: bool = False) -> Path:
    """Join per-machine stores into one store at `out` (shards hard-linked or copied, renumbered from 1).

    Refuses duplicate sample ids across the inputs (DuplicateSampleError) and stores whose
    layers, width or model differ (MetadataError). Published atomically; rerunning with the
    same inputs returns the existing `out`.
    """
    paths = [Path(p) for p in inputs]
    out = Path(out)
    if not paths:
        raise ConfigError("merge needs at least one input store")
    if len({p.resolve() for p in paths}) != len(paths):
        raise ConfigError("the same input store is given twice")
    readers = [PickleReader(p) for p in paths]  # a shard they load is checked; linked shards: verify_checksums
    sources = [dict(src, machine_id=r.metadata.distributed_config.get("machine_id"))
               for src, r in zip(_merge_sources(paths), readers)]
    if out.exists():
        try:
            existing = read_metadata(out).extension or {}
        except FormatError:
            existing = {}
        if existing.get("merged_from") == sources:
            return out
        raise ConfigError("output directory exists and is not the merge of these inputs", out)
    first = readers[0]
    for r in readers[1:]:
        for what, a, b in (("layers_extracted", first.layers, r.layers), ("hidden size", first.d_model, r.d_model),
                           ("model_name", first.metadata.extraction_config.get("model_name"),
                            r.metadata.extraction_config.get("model_name"))):
            if a != b:
                raise MetadataError(f"cannot merge: {what} {b!r} differs from {a!r} in {first.path}", r.path / "metadata.json")
    _refuse_duplicates(readers)
    tmp = out.parent / f".tmp-{out.name}"
    remove_tmp(tmp)
    tmp.mkdir(parents=True)
    try:
        shards: list[ShardInfo] = []
        for r in readers:
            for info, f in zip(r.metadata.shards, r.files):
                if verify_checksums:
                    got = file_sha256(f)
                    if got != info.checksum:
                        raise HashMismatchError(f"checksum {got} does not match metadata.json {info.checksum}", f)
                new_id = len(shards) + 1
                name = shard_filename(new_id, info.compressed)
                _link_or_copy(f, tmp / name)
                shards.append(dataclasses.replace(info, shard_id=new_id, filename=name))
        write_json_atomic(tmp / "metadata.json", _merged_metadata(readers, shards, sources))
        write_checksums(tmp)
        fsync_dir(tmp)
    except BaseException:
        remove_tmp(tmp)
        raise
    return publish_dir(tmp, out)


def _refuse_duplicates(readers: Sequence[PickleReader]) -> None:
    """DuplicateSampleError naming the input where a sample id first repeats (in input order)."""
    ids = np.concatenate([r.sample_ids for r in readers] or [np.zeros(0, np.int64)])
    order = np.argsort(ids, kind="stable")
    repeats = order[1:][ids[order][1:] == ids[order][:-1]]  # positions of second and later occurrences
    if not len(repeats):
        return
    pos = int(repeats.min())
    sid = int(ids[pos])
    owner = np.searchsorted(np.cumsum([r.n_samples for r in readers]), [int(np.flatnonzero(ids == sid)[0]), pos],
                            side="right")
    raise DuplicateSampleError(f"sample id {sid} also occurs in {readers[int(owner[0])].path}; sample ids must be "
                               f"unique across merged stores", readers[int(owner[1])].path / "metadata.json")


def _merged_metadata(readers: Sequence[PickleReader], shards: list[ShardInfo],
                     sources: list[dict[str, Any]]) -> dict[str, Any]:
    """metadata.json of the merged store (first input's config, totals and actlake index over all inputs)."""
    first = readers[0]
    mds = [r.metadata for r in readers]
    dist = dict(first.metadata.distributed_config)
    machine_ids = [m.distributed_config.get("machine_id") for m in mds]
    dist.update(machine_id=None, merged_machine_ids=machine_ids,
                total_machines=max([m.distributed_config.get("total_machines") or 1 for m in mds] + [len(mds)]))
    durations = [m.raw["statistics"].get("extraction_duration_seconds") for m in mds]
    duration = max((float(d) for d in durations if isinstance(d, (int, float))), default=0.0)
    has_labels = any(r.labels is not None for r in readers)
    ext0 = first.metadata.extension or {}
    ext = {k: v for k, v in ext0.items() if k not in ("sample_ids", "lengths", "labels", "merged_from")}
    ext.update(
        extension_version=EXTENSION_VERSION,
        d_model=first.d_model, max_tokens=max(r.max_tokens for r in readers),
        n_samples=sum(r.n_samples for r in readers),
        has_texts=any(r.has_texts for r in readers),
        spec_hash=None,
        sample_ids=np.concatenate([r.sample_ids for r in readers]).tolist(),
        lengths=np.concatenate([r.lengths for r in readers]).tolist(),
        labels=np.concatenate([r.labels if r.labels is not None else np.full(r.n_samples, -1)
                               for r in readers]).tolist() if has_labels else None,
        merged_from=sources,
    )
    config = dict(first.metadata.extraction_config)
    config["max_seq_length"] = ext["max_tokens"]
    return plain({
        "version": VERSION,
        "created_at": utc_now_iso(),
        "extraction_config": config,
        "distributed_config": dist,
        "shards": [s.to_json() for s in shards],
        "statistics": statistics(shards, first.layers, duration),
        EXTENSION_KEY: ext,
    })
