"""merge (spec option B): stores and sharded runs physically copied into one consolidated store, published atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...atomic import publish_dir, remove_orphaned_tmp, remove_tree
from ...checksums import write_checksums
from ...errors import ConfigError, MetadataError
from .base import ZarrReaderBase
from .discover import open_reader
from .layout import (
    ACT_ARRAYS,
    PROMPT,
    RESPONSE,
    SAMPLE_KEY_BYTES,
    STORE_NAME,
    ZarrLayout,
    default_sample_key,
    is_int,
    now,
    zarr_module,
)
from .manifest import ZarrManifestReader
from .reader import ZarrReader
from .store import Columns, create_act_array, finish_store, seal_chunks

#: bytes of activations copied per block
COPY_BLOCK_BYTES = 64 << 20


def merge(inputs: list[Path], out: Path) -> Path:
    """Physically merge stores / sharded runs into one consolidated store `<out>/activations.zarr`.

    Samples keep the order of `inputs` (a sharded run in its manifest order); duplicate sample
    ids are refused; layers, H, P_max and R_max must agree; the first input's prompt chunking is
    kept. Built under a temporary name and published atomically; returns the store path.
    """
    if not inputs:
        raise ConfigError("merge needs at least one input")
    paths = [Path(p) for p in inputs]
    sources = [open_reader(p) for p in paths]
    try:
        return _merge(paths, sources, Path(out))
    finally:
        for r in sources:
            r.close()


def _merge(paths: list[Path], sources: list[ZarrReaderBase], out: Path) -> Path:
    first = sources[0]
    for path, r in zip(paths, sources):
        if (r.layers, r.d_model, r.max_tokens, r.r_max) != (first.layers, first.d_model, first.max_tokens, first.r_max):
            raise MetadataError(f"layout (layers {list(r.layers)}, H {r.d_model}, P_max {r.max_tokens}, R_max "
                                f"{r.r_max}) differs from {paths[0]}", path)
    ids = np.concatenate([r.sample_ids for r in sources])
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise MetadataError(f"sample id {int(uniq[counts > 1][0])} appears in more than one input", paths[0])
    truncated = [_truncation_counts(path, r) for path, r in zip(paths, sources)]
    cols = _merged_columns(paths, sources)
    out.mkdir(parents=True, exist_ok=True)
    final = out / STORE_NAME
    if final.exists():
        raise ConfigError("output store already exists", final)
    remove_orphaned_tmp(out)  # what a killed merge left (its process is gone); a live merge's is left alone
    tmp = out / f".tmp-{STORE_NAME}-{os.getpid()}"
    remove_tree(tmp)
    n = len(ids)
    t_chunk = _stores(first)[0].meta.arrays[PROMPT].chunks[2]  # the array's own chunking, not an attr
    layout = ZarrLayout(n_samples=n, layers=first.layers, hidden_size=first.d_model, p_max=first.max_tokens,
                        r_max=first.r_max, t_chunk_prompt=min(t_chunk, first.max_tokens))
    try:
        root = zarr_module().open_group(str(tmp), mode="w", zarr_format=2)
        arrays_group = root.create_group("arrays")
        arrays = {name: create_act_array(arrays_group, name, layout.shape(name), layout.chunks(name))
                  for name in ACT_ARRAYS}
        lis = list(range(len(first.layers)))
        sample_bytes = len(lis) * (first.max_tokens + first.r_max) * first.d_model * 2
        step = max(1, COPY_BLOCK_BYTES // max(1, sample_bytes))
        offset = 0
        for r in sources:
            for s in range(0, r.n_samples, step):
                idx = np.arange(s, min(s + step, r.n_samples))
                for name, lens in ((PROMPT, r.lengths), (RESPONSE, r.response_lengths)):
                    arrays[name][offset + s : offset + s + len(idx)] = r._block(name, idx, lis)
                    t_chunk = layout.chunks(name)[2]
                    seal_chunks(tmp / "arrays" / name, offset + s, lens[idx], len(lis), 0, t_chunk,
                                t_chunk * layout.hidden_size * 2, fsync=False)
            offset += r.n_samples
        pc, rc = (sum(c[k] for c in truncated) for k in (0, 1))
        attrs = dict(_stores(first)[0].meta.attrs)
        attrs.update(
            n_samples=n, created_at=now(), merged_from=[str(p) for p in paths], machine_id=0, num_machines=1,
            spec_hash=None, prompt_truncated_count=pc, response_truncated_count=rc,
            prompt_truncated_fraction=pc / n if n else 0.0, response_truncated_fraction=rc / n if n else 0.0,
            t_chunk_prompt=layout.t_chunk_prompt, t_chunk_response=layout.t_chunk_response,
            chunks={name: list(layout.chunks(name)) for name in ACT_ARRAYS},
            has_response=any(bool(s.meta.attrs.get("has_response", True)) for r in sources for s in _stores(r)),
        )
        finish_store(tmp, cols, attrs)
        write_checksums(tmp)
    except BaseException:
        remove_tree(tmp)
        raise
    return publish_dir(tmp, final)


def _stores(reader: ZarrReaderBase) -> list[ZarrReader]:
    """The single-store readers behind a reader (the shards of a sharded run)."""
    return list(reader.shards) if isinstance(reader, ZarrManifestReader) else [reader]  # type: ignore[list-item]


def _truncation_counts(path: Path, reader: ZarrReaderBase) -> tuple[int, int]:
    """(prompt, response) truncated-sample counts summed over a reader's stores (absent attrs count 0)."""
    totals = [0, 0]
    for store in _stores(reader):
        for k, key in enumerate(("prompt_truncated_count", "response_truncated_count")):
            value = store.meta.attrs.get(key, 0)
            if not is_int(value) or not 0 <= value <= store.n_samples:
                raise MetadataError(f"attr {key}={value!r} is not a count in [0, {store.n_samples}]",
                                    store.path / ".zattrs")
            totals[k] += value
    return totals[0], totals[1]


def _sample_keys(path: Path, r: ZarrReaderBase) -> list[str]:
    """A reader's sample keys (computed as the writer does where absent), checked to fit |S64."""
    keys = r.sample_keys
    if keys is None:
        prompts, responses = r.texts, r.response_texts
        return [default_sample_key(i, None if prompts is None else prompts[j],
                                   None if responses is None else responses[j])
                for j, i in enumerate(r.sample_ids.tolist())]
    for k in keys:
        if len(k) > SAMPLE_KEY_BYTES or not k.isascii():
            raise MetadataError(f"sample_key {k!r} does not fit the |S{SAMPLE_KEY_BYTES} ASCII the output stores",
                                path)
    return keys


def _merged_columns(paths: list[Path], sources: list[ZarrReaderBase]) -> Columns:
    """The per-sample columns of every source, concatenated; a column some source lacks is filled."""
    def cat(get: Callable[[ZarrReaderBase], Any], dtype: Any, fill: int) -> np.ndarray | None:
        parts = [get(r) for r in sources]
        if all(p is None for p in parts):
            return None
        return np.concatenate([np.full(r.n_samples, fill, dtype=dtype) if p is None else np.asarray(p, dtype=dtype)
                               for p, r in zip(parts, sources)])

    def listed(get: Callable[[ZarrReaderBase], Any], fill: Any) -> list[Any]:
        out: list[Any] = []
        for r in sources:
            values = get(r)
            out.extend([fill] * r.n_samples if values is None else values)
        return out

    extras = listed(lambda r: r.extra_rows, {})
    return Columns(
        prompt_len=np.concatenate([r.lengths for r in sources]).astype(np.int32),
        response_len=np.concatenate([r.response_lengths for r in sources]).astype(np.int32),
        sample_id=np.concatenate([r.sample_ids for r in sources]).astype(np.int64),
        sample_key=[k for p, r in zip(paths, sources) for k in _sample_keys(p, r)],
        prompts=listed(lambda r: r.texts, None), responses=listed(lambda r: r.response_texts, None),
        label=cat(lambda r: r.labels, np.int64, -1), hallu_label=cat(lambda r: r.hallu_label, np.int8, -1),
        split=cat(lambda r: r.split, np.int8, -1), extra=extras if any(extras) else None,
    )
