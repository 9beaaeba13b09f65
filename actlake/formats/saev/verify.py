"""verify(): every invariant of the saev spec, one message per problem (or warning: what was not checked)."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...checksums import store_findings
from ...errors import FormatError, HashMismatchError, UnsafePickleError
from ...finite import FiniteCheck, FloatRegion
from ...safe_pickle import pickle_globals, runs_code
from ...verification import is_warning, warning
from .metadata import ACCEPTED_FAMILIES, SaevMetadata, shard_name, upstream_short_hashes
from .reader import SaevReader, expected_shard_size, read_metadata, read_shards_json


#: how upstream saev's own writer names a directory: 8 hex digits of its hash
SHORT_HASH = re.compile(r"[0-9a-f]{8}")


def verify(path: Path, *, check_values: bool = True, published_as: Path | None = None) -> list[str]:
    """Check every invariant of the spec; return one message per finding: a problem, or a warning
    (`actlake.verification.warning`) naming what could not be checked in an upstream-written directory.

    Every file is then checked against checksums.json (and its values for NaN / Inf) in one streaming pass.
    `published_as`: the path a temporary directory will be published under (its name is checked, not the
    temporary one's)."""
    path = Path(path)
    findings = _verify_structure(path, Path(published_as or path).name)
    inspect = None
    if check_values and all(is_warning(f) for f in findings):
        md = read_metadata(path)
        inspect = _value_checks(path, md, md.shard_counts())
    return list(dict.fromkeys(findings + store_findings(path, inspector_for=inspect)))


def _value_checks(path: Path, md: SaevMetadata, counts: list[int]) -> Callable[[str], FiniteCheck | None]:
    """Inspectors of the checksums pass: the real examples of each shard must be finite float32 (the hole
    past them reads as zeros and is not read)."""
    checks = {shard_name(i): FiniteCheck(path / shard_name(i), [
        FloatRegion(0, count * md.example_bytes, "f4", "activations", md.example_bytes, "example")]) for i, count in enumerate(counts)}
    return checks.get


def _verify_structure(path: Path, name: str) -> list[str]:
    """Metadata, name, shards.json, shard and sidecar sizes, sample ids, samples.jsonl, provenance.json."""
    findings: list[str] = []
    try:
        md = read_metadata(path)
    except FormatError as exc:
        return [str(exc)]
    name_finding = _name_finding(path, md, name)
    if name_finding:
        findings.append(name_finding)
    if md.family not in ACCEPTED_FAMILIES:
        findings.append(f"{path / 'metadata.json'}: family {md.family!r} is not one of {ACCEPTED_FAMILIES}")
    if md.dataset and not os.path.isabs(md.dataset) and ":" not in md.dataset:
        findings.append(f"{path / 'metadata.json'}: dataset {md.dataset!r} is not an absolute path")
    data = _data_finding(path, md)
    if data:
        findings.append(data)
    try:
        counts = read_shards_json(path, md)
    except FormatError as exc:
        findings.append(str(exc))
        return findings
    for i, count in enumerate(counts):
        f = path / shard_name(i)
        if not f.is_file():
            findings.append(f"{f}: missing")
            continue
        size = f.stat().st_size
        if size not in {count * md.example_bytes, md.shard_bytes}:
            findings.append(f"{f}: size {size} bytes, {expected_shard_size(count, md)}")
    listed = {shard_name(i) for i in range(len(counts))}
    for f in sorted(path.glob("acts*.bin")):
        if f.name not in listed:
            findings.append(f"{f}: shard not listed in shards.json")
    if not all(is_warning(f) for f in findings):
        return findings  # the files are not what the spec says: opening a reader would only repeat it
    try:
        reader = SaevReader(path)
    except FormatError as exc:
        return [*findings, str(exc)]
    if reader._sample_ids is not None and len(np.unique(reader.sample_ids)) != reader.n_samples:
        findings.append(f"{path / 'sample_ids.bin'}: sample ids are not unique")
    for facts in ("texts", "provenance"):  # samples.jsonl and provenance.json parse (info reads both)
        try:
            getattr(reader, facts)
        except FormatError as exc:
            findings.append(str(exc))
    reader.close()
    return findings


def _name_finding(path: Path, md: SaevMetadata, name: str) -> str | None:
    """The directory name against the HASH of metadata.json as written. Upstream's own writer names a
    directory with 8 hex digits of its own hash: when the name is that, a warning says the 2.1 HASH was
    not checked; any other name is a problem."""
    if name == md.hash:
        return None
    if SHORT_HASH.fullmatch(name):
        on_disk = md.on_disk if md.on_disk is not None else md.to_json()
        if name in upstream_short_hashes(on_disk):
            return warning(f"{path}: directory name is upstream saev's 8-hex hash of metadata.json (it matches); "
                           f"the protocol-2.1 HASH {md.hash} was not checked against the name")
        return str(HashMismatchError(f"directory name is neither the metadata hash {md.hash} nor upstream's "
                                     f"8-hex hash of it ({' / '.join(sorted(upstream_short_hashes(on_disk)))})",
                                     path))
    return str(HashMismatchError(f"directory name is not the metadata hash {md.hash}", path))


def _data_finding(path: Path, md: SaevMetadata) -> str | None:
    """The `data` field, never executed: it must decode with the restricted unpickler, or be a complete pickle
    of classes that unpickler refuses (upstream pickles its dataset class): a warning naming them, since the
    dataset description was then not checked. A broken stream or a callable that runs code is a problem."""
    source = path / "metadata.json"
    try:
        md.decode_data(source=source)
        return None
    except UnsafePickleError:
        pass
    except FormatError as exc:
        return str(exc)
    raw = base64.b64decode(str(md.data).encode("utf8"), validate=True)
    try:
        names = pickle_globals(raw, source=source)
    except UnsafePickleError as exc:
        return f"{source}: field 'data': {exc.problem}"
    harmful = [n for n in names if runs_code(n)]
    if harmful:
        return f"{source}: field 'data' pickles {', '.join(harmful)}, which runs code when unpickled"
    return warning(f"{source}: field 'data' pickles {', '.join(names) or 'objects'} (upstream saev pickles its "
                   "dataset class there), which the restricted unpickler refuses; it was not unpickled, so the "
                   "dataset description was not checked")
