"""Zarr fp16 activation logger (shared/specs/zarr-activation-logger.md): writer, readers, verify, merge.

A store is a Zarr v2 directory `activations.zarr/` written through zarr-python (`zarr_format=2`):
`arrays/prompt_activations` (N, L, P_max, H) and `arrays/response_activations` (N, L, R_max, H),
float16, C order, fill 0, no compressor, no filters, chunks (1, 1, T_chunk, H); per-sample arrays
in `arrays/`; texts in `text/*.jsonl`; global metadata in the root attrs; consolidated metadata.

Layouts `actlake.open()` accepts (choices recorded in docs/formats/zarr.md):
- a store directory (`.../activations.zarr`);
- a run directory holding `activations.zarr/` (what a single writer publishes: `zarr-<hash16>/`);
- a sharded run directory: `shards/shard-XXXX.zarr/` (one per machine) + `manifest.json`
  mapping global index -> (shard, local index) (spec option A). `merge()` builds one store
  (spec option B).
Reads of one (sample, layer) touch only that sample and layer's chunk files; a local store is
read straight from its uncompressed chunk files (exactly zarr's bytes), with zarr's API as the
fallback for anything else.

Modules: layout (constants, options, ZarrLayout), store (finishing a store), writer, meta
(validated `.zmetadata`), chunks (direct chunk-file reads), base / reader / manifest (readers),
discover (detect, open_reader), verify, merge.
"""

from __future__ import annotations

from .base import ZarrReaderBase
from .chunks import ChunkFiles, FdCache, default_fd_capacity
from .discover import detect, open_reader, store_roots
from .layout import (
    ACT_ARRAYS,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_R_MAX,
    FD_CACHE_MAX,
    FORMAT,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MAX_DIMS,
    MAX_SAMPLE_KEY_BYTES,
    MAX_SLICE_BYTES,
    META_ARRAYS,
    PARTS_DIR,
    PROMPT,
    REQUIRED_ATTRS,
    REQUIRED_META,
    RESPONSE,
    SAMPLE_KEY_BYTES,
    SCHEMA,
    SCHEMA_VERSION,
    SHARDS_DIR,
    STORE_NAME,
    ZarrLayout,
    default_sample_key,
    default_t_chunk,
    layout_from_spec,
    quantile_cap,
    run_hash,
)
from .manifest import ZarrManifestReader, check_manifest, write_manifest
from .merge import merge
from .meta import ArrayMeta, StoreMeta
from .reader import ZarrReader
from .verify import verify
from .writer import ZarrWriter, create_writer

__all__ = [
    "ACT_ARRAYS", "DEFAULT_CHUNK_BYTES", "DEFAULT_R_MAX", "FD_CACHE_MAX", "FORMAT", "MANIFEST_FORMAT", "MANIFEST_NAME",
    "MAX_DIMS", "MAX_SAMPLE_KEY_BYTES", "MAX_SLICE_BYTES", "META_ARRAYS", "PARTS_DIR", "PROMPT", "REQUIRED_ATTRS",
    "REQUIRED_META", "RESPONSE", "SAMPLE_KEY_BYTES", "SCHEMA", "SCHEMA_VERSION", "SHARDS_DIR", "STORE_NAME",
    "ArrayMeta", "ChunkFiles", "FdCache", "StoreMeta", "ZarrLayout", "ZarrManifestReader", "ZarrReader",
    "ZarrReaderBase", "ZarrWriter", "check_manifest", "create_writer", "default_fd_capacity", "default_sample_key",
    "default_t_chunk", "detect", "layout_from_spec", "merge", "open_reader", "quantile_cap", "run_hash",
    "store_roots", "verify", "write_manifest",
]
