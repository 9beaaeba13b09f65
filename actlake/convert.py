"""Conversion between stored layouts: a reader produces Batches, a writer of another format consumes them.

Generic over the format registry (docs/formats/convert.md): the target's StoreSpec comes from
the source reader (layers, width, token count, sample count, provenance), batches are sized
from a byte budget so memory stays bounded, and the output is checked with `actlake.verify`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .batch import Batch
from .errors import ConfigError, FormatError
from .formats import (
    FORMAT_MODULES,
    create_writer,
    format_module,
    open_store,
    verify_before_publish,
    verify_store,
)
from .reader import Reader
from .spec import StoreSpec

#: storage dtype each target is written in unless `dtype=` is given (None: keep the source's)
TARGET_DTYPES: dict[str, str | None] = {"saev": "float32", "pickle": "float32", "zarr": "float16", "lmprobe": None}
#: targets whose spec fixes the stored dtype: `dtype=` may only name that one
FIXED_DTYPES: dict[str, str] = {"saev": "float32", "pickle": "float32", "zarr": "float16"}
#: dtypes a target may be asked for with `dtype=`
ALLOWED_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_BATCH_BYTES = 64 << 20


def _model_name(prov: Mapping[str, Any]) -> str:
    model = prov.get("model")
    for value in (prov.get("model_name"), prov.get("ckpt"),
                  model.get("name") if isinstance(model, dict) else model):
        if isinstance(value, str) and value:
            return value
    return "unknown"


def _source_fact(reader: Reader, key: str, default: Any) -> Any:
    """A fact about the source: from its provenance, else from a `metadata` object it exposes."""
    prov = reader.provenance
    if key in prov and prov[key] is not None:
        return prov[key]
    return getattr(getattr(reader, "metadata", None), key, default)


def _plain(obj: Any) -> Any:
    """A JSON-able copy of `obj` (numpy scalars to Python, anything else unknown to a string)."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


def source_fingerprint(reader: Reader) -> str:
    """sha256 of what identifies the source's content cheaply: shape, sample index, labels and provenance.

    Part of the target's hashed `data`, so a rerun finds its earlier output while a different
    store recreated at the same path gets a new one instead of the stale conversion.
    """
    h = hashlib.sha256()
    h.update(json.dumps([reader.format, list(reader.layers), int(reader.d_model), int(reader.max_tokens),
                         int(reader.n_samples), np.dtype(reader.dtype).name]).encode())
    h.update(np.ascontiguousarray(reader.sample_ids, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(reader.lengths, dtype="<i8").tobytes())
    labels = reader.labels
    h.update(b"-" if labels is None else np.ascontiguousarray(labels, dtype="<i8").tobytes())
    h.update(json.dumps(_plain(dict(reader.provenance)), sort_keys=True).encode())
    return h.hexdigest()


def spec_for(reader: Reader, to_format: str, options: Mapping[str, Any] | None = None) -> StoreSpec:
    """The StoreSpec of a `to_format` store holding everything `reader` holds."""
    opts = dict(options or {})
    if to_format not in FORMAT_MODULES:
        format_module(to_format)  # raises UnknownFormatError naming the known formats
    dtype = opts.pop("dtype", None)
    if dtype is not None and dtype not in ALLOWED_DTYPES:
        raise ConfigError(f"dtype must be one of {ALLOWED_DTYPES}, got {dtype!r}")
    fixed = FIXED_DTYPES.get(to_format)
    if dtype is not None and fixed is not None and dtype != fixed:
        raise ConfigError(f"{to_format} stores {fixed} only (its spec), not {dtype}")
    dtype = dtype or TARGET_DTYPES.get(to_format) or np.dtype(reader.dtype).name
    if dtype not in ALLOWED_DTYPES:
        dtype = "float32"  # e.g. a float64 source: widest dtype every format stores
    prov = _plain(dict(reader.provenance))
    family = str(_source_fact(reader, "family", "unknown") or "unknown")
    dataset = str(prov.get("dataset") or "")
    if to_format == "saev":
        from .formats.saev import ACCEPTED_FAMILIES

        if family not in ACCEPTED_FAMILIES:
            family = "text"  # saev's catch-all family for language models (docs/formats/saev.md)
        if dataset and not os.path.isabs(dataset) and ":" not in dataset:
            dataset = ""
    if to_format == "zarr" and getattr(reader, "max_response_tokens", 0):
        opts.setdefault("r_max", int(reader.max_response_tokens))  # keep the source's response cap
    source = {"format": reader.format, "path": str(Path(reader.path).resolve())}
    prov["converted_from"] = source
    hashed = dict(source, fingerprint=source_fingerprint(reader))
    return StoreSpec(
        layers=tuple(reader.layers),
        d_model=int(reader.d_model),
        max_tokens=int(reader.max_tokens),
        n_samples=int(reader.n_samples),
        model_name=_model_name(prov),
        family=family,
        cls_token=reader.cls_token,  # every reader records it (Reader.cls_token), so no format drops it
        dataset=dataset,
        data={"converted_from": hashed},
        provenance=prov,
        dtype=dtype,
        has_token_labels=reader.token_labels is not None,
        options=opts,
    )


def batch_size_for(reader: Reader, batch_bytes: int = DEFAULT_BATCH_BYTES) -> int:
    """Samples per batch so one padded float32 batch [B, L, T, D] stays within `batch_bytes`."""
    if batch_bytes < 1:
        raise ConfigError(f"batch_bytes must be positive, got {batch_bytes}")
    itemsize = max(4, np.dtype(reader.dtype).itemsize)  # writers may widen to float32
    per_sample = len(reader.layers) * reader.max_tokens * reader.d_model * itemsize
    return int(max(1, min(batch_bytes // max(1, per_sample), max(1, reader.n_samples))))


def _batches(reader: Reader, start: int, batch_size: int) -> Iterator[Batch]:
    """Every sample from position `start` on, in order, in batches of at most `batch_size`."""
    if start == 0:
        yield from reader.iter_batches(batch_size)
        return
    for s in range(start, reader.n_samples, batch_size):
        yield reader.batch(np.arange(s, min(s + batch_size, reader.n_samples)))


def convert(src_path: str | Path, to_format: str, out_root: str | Path, options: Mapping[str, Any] | None = None,
            *, batch_bytes: int = DEFAULT_BATCH_BYTES, verify: bool = True) -> Path:
    """Copy the store at `src_path` into a new `to_format` store under `out_root`; return its path.

    Streams `batch_size_for(reader, batch_bytes)` samples at a time; resumes where an
    interrupted conversion with the same arguments stopped (the writer's `resume_from`). With
    `verify`, the output is verified in its temporary directory before the rename that publishes
    it: a store with problems is never published (FormatError listing them).
    """
    with open_store(src_path) as reader:
        spec = spec_for(reader, to_format, options)
        writer = create_writer(to_format, out_root, spec)
        checked = verify_before_publish(writer, to_format, "converted store") if verify else None
        try:
            start = int(writer.resume_from)
            if start < spec.n_samples:
                for batch in _batches(reader, start, batch_size_for(reader, batch_bytes)):
                    writer.write_batch(batch)
            out = writer.close()
        except BaseException:
            writer.abort()
            raise
    if checked is not None and not checked():  # published by an earlier run: check what is there
        problems = verify_store(out, to_format)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise FormatError(f"converted store fails verification: {'; '.join(problems[:5])}{more}", out)
    return Path(out)
