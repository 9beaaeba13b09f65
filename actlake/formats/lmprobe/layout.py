"""lmprobe 2.0 constants, the writer's validated options, and shard-size maths."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actlake.errors import ConfigError, MetadataError
from actlake.spec import StoreSpec

FORMAT = "lmprobe"
FORMAT_VERSION = "2.0"
INDEX_PATH = "index/train-00000-of-00001.parquet"
DEFAULT_FILE_PATTERN = "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
DEFAULT_KEY_PATTERN = "hidden.layer_{layer}"
LOGITS_FILE_PATTERN = "tensors/logits_topk_{shard:03d}.safetensors"
DEFAULT_SHARD_BYTES = 1 << 30  # upstream's default (1 GB)
STORAGES = ("pooled", "full_sequence")
POOLINGS = ("last_token", "mean")
PROMPT_ORDERING = "sequential"  # rows in the order the writer received them (sample order)
ACTLAKE_META_KEY = b"actlake"  # non-`lmprobe:` schema key: actlake's own round-trip facts
MAX_HEADER_BYTES = 100 << 20
MAX_DECLARED_TOKENS = 1 << 20  # a larger actlake max_tokens claim is refused (batch() pads to it)

#: spec keys of the logits file (values float32, indices int64: row_bytes = k * (4 + 8))
LOGITS_VALUES_KEY = "topk_values"
LOGITS_INDICES_KEY = "topk_indices"
#: upstream lmprobe's names for the same tensors (indices int32), written alongside
UPSTREAM_VALUES_KEY = "logits_topk.values"
UPSTREAM_INDICES_KEY = "logits_topk.indices"

#: numpy dtype name -> (safetensors code, element size); bfloat16 is carried as raw uint16
HIDDEN_DTYPES: dict[str, tuple[str, int]] = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}
#: safetensors code -> numpy dtype used to map the bytes
ST_NUMPY: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
#: safetensors codes the reader accepts for logits values / indices (upstream-written files included)
LOGITS_VALUE_CODES = ("F32", "F16", "F64")
LOGITS_INDEX_CODES = ("I64", "I32")

#: columns the writer owns; user extra columns may not use these names
CORE_COLUMNS = ("text", "label", "num_tokens", "shard_index", "row_offset")
RESERVED_COLUMNS = CORE_COLUMNS + (
    "token_offset", "token_shard_ids", "token_shard_offsets", "shard_index_logits", "row_offset_logits",
    "perplexity_mean", "perplexity_min", "perplexity_max", "token_ids", "token_perplexity", "token_strings",
    "sample_id",
)
#: Batch.extra keys with a meaning in the spec (others become user columns)
EXTRA_TOKEN_PERPLEXITY = "token_perplexity"
EXTRA_TOKEN_STRINGS = "token_strings"
#: Batch.extra keys the writer maps to spec columns rather than user columns
EXTRA_MAPPED = (EXTRA_TOKEN_PERPLEXITY, EXTRA_TOKEN_STRINGS, "label", "text")
#: StoreSpec.provenance / StoreSpec.data keys searched (in order) for the model revision
REVISION_KEYS = ("model_revision", "revision", "commit", "weights_sha256", "checkpoint_sha256")


def is_int(x: Any) -> bool:
    """A JSON integer (bool excluded)."""
    return isinstance(x, int) and not isinstance(x, bool)


#: what a placeholder's format spec may say: an optional fill/align and zero flag, a width up to MAX_PATTERN_WIDTH, `d`
_SPEC_RE = re.compile(r"^(?:0?>|0)?(\d{1,3})?d?$")
MAX_PATTERN_WIDTH = 32
MAX_PATTERN_LEN = 1024
MAX_NAME_LEN = 255  # one path component on every filesystem actlake writes to


def check_pattern(pattern: Any, fields: tuple[str, ...], name: str, source: Path | None = None) -> str:
    """A format pattern with only the documented placeholders (`{layer}`, `{shard}`) and plain widths up to
    MAX_PATTERN_WIDTH, whose formatted path components stay under MAX_NAME_LEN (else a typed error).

    The pattern is parsed before it is ever formatted, so a hostile width (`{layer:0>1500000000}`)
    is refused at once instead of allocating gigabytes."""
    error = ConfigError if source is None else MetadataError
    if not isinstance(pattern, str) or not pattern:
        raise error(f"{name} must be a non-empty string, got {pattern!r}", source)
    if len(pattern) > MAX_PATTERN_LEN:
        raise error(f"{name} is {len(pattern)} characters long (at most {MAX_PATTERN_LEN})", source)
    try:
        parts = list(string.Formatter().parse(pattern))
    except ValueError as exc:
        raise error(f"{name} {pattern[:80]!r} is not a format pattern: {exc}", source) from None
    for _, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in fields or conversion is not None:
            raise error(f"{name} {pattern[:80]!r} may only use the placeholders {list(fields)} without conversions",
                        source)
        m = _SPEC_RE.match(spec or "")
        if m is None or int(m.group(1) or 0) > MAX_PATTERN_WIDTH:
            raise error(f"{name} {pattern[:80]!r}: placeholder {{{field}:{spec[:20]}}} may only give a width "
                        f"up to {MAX_PATTERN_WIDTH}", source)
    try:
        out = pattern.format(**{f: 0 for f in fields})
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise error(f"{name} {pattern!r} does not format with {fields}: {exc!r}", source) from None
    if not out:
        raise error(f"{name} {pattern!r} formats to an empty string", source)
    if any(len(part) > MAX_NAME_LEN for part in out.split("/")):
        raise error(f"{name} {pattern[:80]!r} gives a file name over {MAX_NAME_LEN} characters", source)
    return pattern


@dataclass(frozen=True)
class LmprobeOptions:
    """The lmprobe knobs of `StoreSpec.options` (validated on construction)."""

    storage: str = "pooled"
    pooling: str = "last_token"
    shard_bytes: int = DEFAULT_SHARD_BYTES
    logits_topk: int | None = None  # None: k of the first batch carrying logits; 0: never store logits
    upstream_aliases: bool = True  # write upstream's logits key names too
    file_pattern: str = DEFAULT_FILE_PATTERN
    key_pattern: str = DEFAULT_KEY_PATTERN

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ConfigError(f"lmprobe storage must be one of {STORAGES}, got {self.storage!r}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"lmprobe pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.storage == "full_sequence" and self.pooling != "last_token":
            raise ConfigError("full_sequence storage keeps last-token shards; pooling must be 'last_token'")
        if not is_int(self.shard_bytes) or self.shard_bytes < 1:
            raise ConfigError(f"lmprobe shard_bytes must be a positive integer, got {self.shard_bytes!r}")
        if self.logits_topk is not None and (not is_int(self.logits_topk) or self.logits_topk < 0):
            raise ConfigError(f"lmprobe logits_topk must be a non-negative integer, got {self.logits_topk!r}")
        check_pattern(self.file_pattern, ("layer", "shard"), "file_pattern")
        check_pattern(self.key_pattern, ("layer",), "key_pattern")
        a = self.file_pattern.format(layer=0, shard=0)
        if a in (self.file_pattern.format(layer=1, shard=0), self.file_pattern.format(layer=0, shard=1)):
            raise ConfigError(f"file_pattern {self.file_pattern!r} must name every (layer, shard) differently")
        if Path(a).is_absolute() or ".." in Path(a).parts:
            raise ConfigError(f"file_pattern {self.file_pattern!r} must stay inside the dataset directory")

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> LmprobeOptions:
        """Options from `spec.options` (absent keys take the defaults)."""
        o = spec.options
        k = o.get("logits_topk")
        try:
            return cls(
                storage=str(o.get("storage", "pooled")),
                pooling=str(o.get("pooling", "last_token")),
                shard_bytes=int(o.get("shard_bytes", DEFAULT_SHARD_BYTES)),
                logits_topk=None if k is None else int(k),
                upstream_aliases=bool(o.get("upstream_aliases", True)),
                file_pattern=str(o.get("file_pattern", DEFAULT_FILE_PATTERN)),
                key_pattern=str(o.get("key_pattern", DEFAULT_KEY_PATTERN)),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"lmprobe options {dict(o)!r} do not parse: {exc}") from None


def fixed_shard_counts(n_rows: int, row_bytes: int, shard_bytes: int) -> list[int]:
    """Rows per shard for fixed-size rows: `shard_bytes // row_bytes` each (>= 1), last the remainder."""
    per = max(1, shard_bytes // max(1, row_bytes))
    return [min(per, n_rows - i) for i in range(0, n_rows, per)]


def logits_row_bytes(k: int) -> int:
    """Bytes of one logits row in the spec's tensors: float32 values + int64 indices."""
    return k * (4 + 8)


def shard_of(starts: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard, row within shard) of global rows, for shards beginning at `starts` (cumulative, [S+1])."""
    shard = np.searchsorted(starts, rows, side="right") - 1
    return shard, rows - starts[shard]
