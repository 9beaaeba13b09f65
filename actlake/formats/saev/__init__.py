"""saev protocol 2.1: content-hashed directory of float32 memmap shards (shared/specs/saev-protocol-2.1.md).

Choices where the spec is silent are recorded in docs/formats/saev.md:
- every shard, the last one included, is written at the full size of section 3 (as upstream
  writes and memmaps it; the last one's tail is a zero-reading file hole); last shards truncated
  to their real example count (older actlake) are read as well;
- optional additions (protocol minor addition, files only, so `metadata.json` and the hash keep
  the 2.1 field set): `lengths.bin` int32 [n_examples] real token counts, `sample_ids.bin`
  int64 [n_examples] global sample ids, `samples.jsonl` one JSON object per example with
  `text` / `label`, and `provenance.json` (unhashed build facts);
- `labels.bin` is uint8 [n_examples, patches_per_ex] (the CLS token has no label);
- option `flavor=upstream` writes the metadata.json field set upstream saev's current loader takes
  (a documented deviation from 2.1; the directory is named by the hash of that metadata as written).
"""

from __future__ import annotations

from .metadata import (
    ACCEPTED_FAMILIES,
    DEFAULT_PATCHES_PER_SHARD,
    FIELD_ALIASES,
    FLAVORS,
    FORMAT,
    KNOWN_FAMILIES,
    PROTOCOL,
    UPSTREAM_FAMILIES,
    UPSTREAM_FIELDS,
    SaevMetadata,
    check_protocol,
    encode_data,
    metadata_from_spec,
    metadata_hash,
    shard_name,
)
from .reader import SaevReader, detect, open_reader, read_metadata, read_shards_json
from .verify import verify
from .writer import SaevWriter, create_writer

__all__ = [
    "ACCEPTED_FAMILIES", "DEFAULT_PATCHES_PER_SHARD", "FIELD_ALIASES", "FLAVORS", "FORMAT", "KNOWN_FAMILIES",
    "PROTOCOL", "UPSTREAM_FAMILIES", "UPSTREAM_FIELDS", "SaevMetadata",
    "SaevReader", "SaevWriter", "check_protocol", "create_writer", "detect", "encode_data", "metadata_from_spec",
    "metadata_hash", "open_reader", "read_metadata", "read_shards_json", "shard_name", "verify",
]
