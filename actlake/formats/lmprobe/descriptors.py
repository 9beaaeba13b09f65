"""The validated `lmprobe:tensors` descriptors (hidden layers, top-k logits), parsed from untrusted JSON."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actlake.errors import MetadataError
from actlake.formats.lmprobe.layout import (
    HIDDEN_DTYPES,
    STORAGES,
    check_pattern,
    is_int,
)


@dataclass(frozen=True)
class HiddenDescriptor:
    """The validated `tensors.hidden_layers` descriptor."""

    layers: tuple[int, ...]
    dim: int
    dtype: str
    file_pattern: str
    key_pattern: str
    storage: str
    pooling: str
    shard_prompts: tuple[int, ...]
    shard_tokens: tuple[int, ...]  # rows per shard file (= prompts for pooled and last-token shards)
    last_token_shards: int
    row_bytes: int | None

    @classmethod
    def parse(cls, desc: Any, source: Path) -> HiddenDescriptor:
        """Validate the raw descriptor; a MetadataError naming `source` on the first problem."""
        if not isinstance(desc, dict):
            raise MetadataError("tensors.hidden_layers must be an object", source)

        def need(key: str, ok: Any, what: str) -> Any:
            if key not in desc or not ok(desc[key]):
                raise MetadataError(f"tensors.hidden_layers.{key} must be {what}, got {desc.get(key)!r}", source)
            return desc[key]

        layers = need("layers", lambda v: isinstance(v, list) and v and all(is_int(x) for x in v) and len(set(v)) == len(v),
                      "a non-empty list of unique integers")
        dim = need("dim", lambda v: is_int(v) and v > 0, "a positive integer")
        dtype = need("dtype", lambda v: isinstance(v, str) and v in HIDDEN_DTYPES, f"one of {sorted(HIDDEN_DTYPES)}")
        need("layout", lambda v: v == "per_layer", "'per_layer'")
        storage = need("storage", lambda v: isinstance(v, str) and v in STORAGES, f"one of {STORAGES}")
        file_pattern = check_pattern(desc.get("file_pattern"), ("layer", "shard"), "tensors.hidden_layers.file_pattern", source)
        key_pattern = check_pattern(desc.get("key_pattern"), ("layer",), "tensors.hidden_layers.key_pattern", source)
        pooling = desc.get("pooling", "last_token")
        if not isinstance(pooling, str):
            raise MetadataError(f"tensors.hidden_layers.pooling must be a string, got {pooling!r}", source)
        shards = need("shards", lambda v: isinstance(v, list), "a list")
        prompts, tokens = [], []
        for i, s in enumerate(shards):
            if not isinstance(s, dict) or not is_int(s.get("num_prompts")) or s["num_prompts"] < 0:
                raise MetadataError(f"tensors.hidden_layers.shards[{i}] needs an integer num_prompts >= 0", source)
            prompts.append(s["num_prompts"])
            if storage == "full_sequence":
                if not is_int(s.get("num_tokens")) or s["num_tokens"] < 0:
                    raise MetadataError(f"tensors.hidden_layers.shards[{i}] needs an integer num_tokens >= 0", source)
                tokens.append(s["num_tokens"])
            else:
                tokens.append(s["num_prompts"])
        lts = len(shards)
        if storage == "full_sequence":
            lts = need("last_token_shards", lambda v: is_int(v) and 0 <= v <= len(shards),
                       f"an integer in [0, {len(shards)}]")
            for i in range(lts):
                if tokens[i] != prompts[i]:
                    raise MetadataError(f"last-token shard {i} has num_tokens {tokens[i]} != num_prompts {prompts[i]}", source)
        row_bytes = desc.get("row_bytes")
        if row_bytes is not None and not is_int(row_bytes):
            raise MetadataError(f"tensors.hidden_layers.row_bytes must be an integer, got {row_bytes!r}", source)
        return cls(tuple(layers), dim, dtype, file_pattern, key_pattern, storage, pooling, tuple(prompts),
                   tuple(tokens), lts, row_bytes)

    def file(self, layer: int, shard: int) -> str:
        """Relative path of one shard of one layer (from `file_pattern`)."""
        return self.file_pattern.format(layer=layer, shard=shard)

    def key(self, layer: int) -> str:
        """Tensor key of one layer inside its shards (from `key_pattern`)."""
        return self.key_pattern.format(layer=layer)


@dataclass(frozen=True)
class LogitsDescriptor:
    """The validated `tensors.logits_topk` descriptor."""

    k: int
    file_pattern: str
    shard_prompts: tuple[int, ...]
    row_bytes: int | None

    @classmethod
    def parse(cls, desc: Any, source: Path) -> LogitsDescriptor:
        """Validate the raw descriptor; a MetadataError naming `source` on the first problem."""
        if not isinstance(desc, dict) or not is_int(desc.get("k")) or desc["k"] < 1:
            raise MetadataError("tensors.logits_topk must be an object with an integer k >= 1", source)
        pattern = check_pattern(desc.get("file_pattern"), ("shard",), "tensors.logits_topk.file_pattern", source)
        shards = desc.get("shards")
        if not isinstance(shards, list) or not all(
                isinstance(s, dict) and is_int(s.get("num_prompts")) and s["num_prompts"] >= 0 for s in shards):
            raise MetadataError("tensors.logits_topk.shards must list {num_prompts: int >= 0}", source)
        rb = desc.get("row_bytes")
        return cls(desc["k"], pattern, tuple(s["num_prompts"] for s in shards), rb if is_int(rb) else None)

    def file(self, shard: int) -> str:
        """Relative path of one logits shard (from `file_pattern`)."""
        return self.file_pattern.format(shard=shard)
