"""verify(): every invariant of the saev spec, one message per problem."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...errors import FormatError, HashMismatchError
from .metadata import ACCEPTED_FAMILIES, shard_name
from .reader import SaevReader, expected_shard_size, read_metadata, read_shards_json


def verify(path: Path, *, check_values: bool = True) -> list[str]:
    """Check every invariant of the spec; return one message per problem."""
    problems: list[str] = []
    try:
        md = read_metadata(path)
    except FormatError as exc:
        return [str(exc)]
    if path.name != md.hash:
        problems.append(str(HashMismatchError(f"directory name is not the metadata hash {md.hash}", path)))
    if md.family not in ACCEPTED_FAMILIES:
        problems.append(f"{path / 'metadata.json'}: family {md.family!r} is not one of {ACCEPTED_FAMILIES}")
    if md.dataset and not os.path.isabs(md.dataset) and ":" not in md.dataset:
        problems.append(f"{path / 'metadata.json'}: dataset {md.dataset!r} is not an absolute path")
    try:
        md.decode_data(source=path / "metadata.json")
    except FormatError as exc:
        problems.append(str(exc))
    try:
        counts = read_shards_json(path, md)
    except FormatError as exc:
        problems.append(str(exc))
        return problems
    for i, count in enumerate(counts):
        f = path / shard_name(i)
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        size = f.stat().st_size
        if size not in {count * md.example_bytes, md.shard_bytes}:
            problems.append(f"{f}: size {size} bytes, {expected_shard_size(count, md)}")
    listed = {shard_name(i) for i in range(len(counts))}
    for f in sorted(path.glob("acts*.bin")):
        if f.name not in listed:
            problems.append(f"{f}: shard not listed in shards.json")
    if problems:
        return problems
    try:
        reader = SaevReader(path)
    except FormatError as exc:
        return [str(exc)]
    if reader._sample_ids is not None and len(np.unique(reader.sample_ids)) != reader.n_samples:
        problems.append(f"{path / 'sample_ids.bin'}: sample ids are not unique")
    try:
        reader.texts
    except FormatError as exc:
        problems.append(str(exc))
    if check_values:
        for i in range(len(counts)):
            mm = reader.shard(i)
            step = max(1, (64 << 20) // max(1, md.example_bytes))
            for start in range(0, mm.shape[0], step):
                if not np.isfinite(mm[start : start + step]).all():
                    problems.append(f"{path / shard_name(i)}: non-finite values near example {start}")
                    break
    reader.close()
    return problems
