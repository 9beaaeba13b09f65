"""lmprobe dataset 2.0: parquet index with `lmprobe:` schema metadata + per-layer safetensors shards.

The contract is shared/specs/lmprobe-format-2.0.md. Choices where the spec is silent, and where
the upstream `lmprobe` package departs from it, are recorded in docs/formats/lmprobe.md:
- tensors are written with the spec's `file_pattern`/`key_pattern` defaults, which are also the
  names upstream hard-codes, so upstream's hub loader finds them;
- logits shards hold the spec keys `topk_values` (float32) / `topk_indices` (int64) AND
  upstream's `logits_topk.values` (float32) / `logits_topk.indices` (int32) aliases;
- `row_bytes` and shard sizes use the real element size (fp16 = 2 bytes), not upstream's 4;
- prompts are addressed by row (never by a hash of their text), so duplicate texts stay apart;
- shard files are streamed: each safetensors file is written with a reserved, space-padded
  header (allowed by the safetensors format) that is filled in when the shard is complete.

This package is `actlake.formats.lmprobe`; the upstream PyPI package is the top-level `lmprobe`.
Modules here use absolute imports only and never import the upstream package.
"""

from __future__ import annotations

from actlake.formats.lmprobe.codec import (
    encode_rows,
    from_bfloat16_bits,
    to_bfloat16_bits,
)
from actlake.formats.lmprobe.descriptors import HiddenDescriptor, LogitsDescriptor
from actlake.formats.lmprobe.index import check_columns, check_info, read_index_metadata
from actlake.formats.lmprobe.interop import local_hub
from actlake.formats.lmprobe.layout import (
    ACTLAKE_META_KEY,
    DEFAULT_FILE_PATTERN,
    DEFAULT_KEY_PATTERN,
    DEFAULT_SHARD_BYTES,
    FORMAT,
    FORMAT_VERSION,
    INDEX_PATH,
    LOGITS_FILE_PATTERN,
    LOGITS_INDICES_KEY,
    LOGITS_VALUES_KEY,
    UPSTREAM_INDICES_KEY,
    UPSTREAM_VALUES_KEY,
    LmprobeOptions,
    fixed_shard_counts,
    logits_row_bytes,
)
from actlake.formats.lmprobe.metadata import build_provenance, model_revision
from actlake.formats.lmprobe.reader import LmprobeReader, detect, open_reader
from actlake.formats.lmprobe.safetensors_io import (
    SafetensorsShard,
    TensorInfo,
    map_tensor,
    read_safetensors_header,
)
from actlake.formats.lmprobe.verify import verify
from actlake.formats.lmprobe.writer import LmprobeWriter, create_writer

__all__ = [
    "ACTLAKE_META_KEY",
    "DEFAULT_FILE_PATTERN",
    "DEFAULT_KEY_PATTERN",
    "DEFAULT_SHARD_BYTES",
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_PATH",
    "LOGITS_FILE_PATTERN",
    "LOGITS_INDICES_KEY",
    "LOGITS_VALUES_KEY",
    "UPSTREAM_INDICES_KEY",
    "UPSTREAM_VALUES_KEY",
    "HiddenDescriptor",
    "LmprobeOptions",
    "LmprobeReader",
    "LmprobeWriter",
    "LogitsDescriptor",
    "SafetensorsShard",
    "TensorInfo",
    "build_provenance",
    "check_columns",
    "check_info",
    "create_writer",
    "detect",
    "encode_rows",
    "fixed_shard_counts",
    "from_bfloat16_bits",
    "local_hub",
    "logits_row_bytes",
    "map_tensor",
    "model_revision",
    "open_reader",
    "read_index_metadata",
    "read_safetensors_header",
    "to_bfloat16_bits",
    "verify",
]
