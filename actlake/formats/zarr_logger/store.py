"""Building a store's arrays and finishing it (per-sample arrays, attrs, consolidation, texts): shared by writer and merge."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...atomic import fsync_dir, write_bytes_atomic
from .layout import META_ARRAYS, META_CHUNK, SAMPLE_KEY_BYTES, plain, zarr_module


@dataclass
class Columns:
    """Per-sample values of a whole store, in store order."""

    prompt_len: np.ndarray  # capped, int32
    response_len: np.ndarray  # capped, int32
    sample_id: np.ndarray  # int64
    sample_key: list[str]
    prompts: list[str | None]
    responses: list[str | None]
    label: np.ndarray | None = None
    hallu_label: np.ndarray | None = None
    split: np.ndarray | None = None
    extra: list[dict[str, Any]] | None = None


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    """UTF-8 JSON Lines of `rows`."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def create_act_array(arrays_group: Any, name: str, shape: tuple[int, ...], chunks: tuple[int, ...]) -> Any:
    """An activation array exactly as the spec says: float16, C order, fill 0, no compressor/filters."""
    return arrays_group.create_array(name, shape=shape, chunks=chunks, dtype="float16", fill_value=0,
                                     compressors=None, filters=None, order="C")


def seal_chunks(folder: Path, start: int, lengths: np.ndarray, n_layers: int, n_chunks: int, t_chunk: int,
                chunk_bytes: int, *, fsync: bool) -> None:
    """Make every chunk holding real tokens of samples start.. start + len(lengths) exist (`lengths` capped at
    the token axis), and with `fsync` make every chunk file of those samples durable.

    Why: zarr-python does not write a chunk equal to the fill value (write_empty_chunks=False), so real tokens
    that happen to be all zeros would leave no file, and a reader could not tell that from a deleted chunk. A
    missing real chunk is created as `chunk_bytes` zeros (a file hole): exactly the bytes zarr would write for
    it uncompressed. Chunks entirely in padding stay absent (they read as the fill value 0)."""
    for k, n in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        need = -(-n // t_chunk)
        for li in range(n_layers):
            for c in range(n_chunks if fsync else need):
                path = folder / f"{start + k}.{li}.{c}.0"
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    if c >= need:
                        continue  # padding only: absent, as zarr leaves it
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    os.ftruncate(fd, chunk_bytes)
                try:
                    if fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
    if fsync:
        fsync_dir(folder)


def truncation_attrs(prompt_true: np.ndarray, response_true: np.ndarray, p_max: int, r_max: int) -> dict[str, Any]:
    """The spec's truncation record: counts and fractions of samples longer than the caps."""
    n = len(prompt_true)
    pc, rc = int((prompt_true > p_max).sum()), int((response_true > r_max).sum())
    return {"prompt_truncated_count": pc, "response_truncated_count": rc,
            "prompt_truncated_fraction": pc / n if n else 0.0, "response_truncated_fraction": rc / n if n else 0.0}


def finish_store(store: Path, cols: Columns, attrs: dict[str, Any]) -> None:
    """Write the per-sample arrays and root attrs, consolidate the metadata, then write the JSONL texts.

    Idempotent: a writer interrupted inside it runs it again on resume (arrays are overwritten).
    """
    zarr = zarr_module()
    n = len(cols.sample_id)
    root = zarr.open_group(str(store), mode="r+", zarr_format=2)
    arrays = root["arrays"]
    keys_s64 = np.array([k.encode("ascii") for k in cols.sample_key], dtype=f"|S{SAMPLE_KEY_BYTES}").reshape(n)
    values: dict[str, np.ndarray | None] = {
        "prompt_len": cols.prompt_len, "response_len": cols.response_len, "sample_id": cols.sample_id,
        "sample_key": keys_s64, "label": cols.label, "hallu_label": cols.hallu_label, "split": cols.split,
    }
    for name, arr in values.items():
        if arr is None:
            continue
        dtype = np.dtype(META_ARRAYS[name])
        fill = b"" if dtype.kind == "S" else 0
        z = arrays.create_array(name, shape=(n,), chunks=(max(1, min(n, META_CHUNK)),), dtype=dtype,
                                fill_value=fill, compressors=None, filters=None, order="C", overwrite=True)
        if n:
            z[:] = np.asarray(arr).astype(dtype, copy=False)
    root.attrs.update(plain(attrs))
    with warnings.catch_warnings():
        # plain folders (the writer's part files, text/ on a rerun) are not Zarr nodes; zarr says so
        warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
        zarr.consolidate_metadata(str(store), zarr_format=2)
    # texts after consolidation: text/ is a plain folder, not a node of the Zarr hierarchy
    text = store / "text"
    text.mkdir(exist_ok=True)
    write_bytes_atomic(text / "prompts.jsonl", jsonl(
        [{"i": i, "sample_key": k, "prompt": p} for i, (k, p) in enumerate(zip(cols.sample_key, cols.prompts))]))
    write_bytes_atomic(text / "responses.jsonl", jsonl(
        [{"i": i, "sample_key": k, "response": r} for i, (k, r) in enumerate(zip(cols.sample_key, cols.responses))]))
    if cols.extra is not None and any(cols.extra):
        write_bytes_atomic(text / "extra_metadata.jsonl", jsonl(
            [{"i": i, "sample_key": k, **e} for i, (k, e) in enumerate(zip(cols.sample_key, cols.extra))]))
