"""gzip-pickle activation shards v1.0 (shared/specs/pickle-shards-v1.md): writer, reader, verify, merge.

Choices where the spec is silent are recorded in docs/formats/pickle.md:
- each machine publishes a self-contained store `<out_root>/pickle-<job16>/machine_XXXX/`
  (`job16`: the first 16 hex of a hash of the StoreSpec without `machine_id`, `n_samples` and
  `provenance`, so every machine of one job shares the parent); `merge` joins such stores;
- shard ids start at 1 (as in the spec's example); shards hold every extracted layer of their
  samples and close once their raw float32 activation bytes reach `shard_bytes`;
- `activation` is [max_seq_length, hidden] with `token_count` real rows and zero padding, the
  spec's shape, so its DataLoader example stacks items (option `padded=false`: real tokens
  only, [token_count, hidden]); `shape` is its shape;
- actlake keeps its extras under keys the spec's loader never reads: `label` and the full
  `text` (when longer than the preview) in each item's `metadata`, and a top-level `actlake`
  object in metadata.json (sample ids, lengths, labels, provenance, the spec hash);
- shards are pickled with protocol 5 and compressed with gzip level 1 (activations are high
  entropy); both are options.

Modules: layout (constants, names, options), metadata (metadata.json), shard_io (shard files),
writer, reader, verify, merge.
"""

from __future__ import annotations

from .layout import (
    CHECKSUM_RE,
    DEFAULT_SHARD_BYTES,
    EXTENSION_KEY,
    FORMAT,
    ITEM_KEYS,
    MAX_D_MODEL,
    MAX_DECLARED_TOKENS,
    PREVIEW_CHARS,
    REQUIRED_FIELDS,
    SHARD_KEYS,
    VERSION,
    PickleOptions,
    job_hash,
    layer_key,
    shard_filename,
    store_path,
)
from .merge import merge
from .metadata import PickleMetadata, ShardInfo, read_metadata, shard_path
from .reader import PickleReader, detect, open_reader
from .shard_io import (
    ShardContent,
    check_shard,
    file_sha256,
    load_shard_file,
    write_shard,
)
from .verify import verify
from .writer import PickleWriter, create_writer

__all__ = [
    "CHECKSUM_RE", "DEFAULT_SHARD_BYTES", "EXTENSION_KEY", "FORMAT", "ITEM_KEYS", "MAX_DECLARED_TOKENS", "MAX_D_MODEL",
    "PREVIEW_CHARS", "REQUIRED_FIELDS", "SHARD_KEYS", "VERSION", "PickleMetadata", "PickleOptions", "PickleReader",
    "PickleWriter", "ShardContent", "ShardInfo", "check_shard", "create_writer", "detect", "file_sha256", "job_hash",
    "layer_key", "load_shard_file", "merge", "open_reader", "read_metadata", "shard_filename", "shard_path",
    "store_path", "verify", "write_shard",
]
