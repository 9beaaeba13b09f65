"""saev metadata.json: the validated 2.1 field set, the spec's sizing maths (section 3) and HASH."""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, MetadataError, ProtocolVersionError
from ...safe_pickle import safe_loads
from ...spec import MAX_DIM, MAX_LAYERS, MAX_TOKENS, StoreSpec

FORMAT = "saev"
PROTOCOL = "2.1"
DEFAULT_PATCHES_PER_SHARD = 2_400_000
MAX_EXAMPLES = 1 << 40
#: labels.bin value of a patch with no label; a text extraction's labels.bin holds only this value
IGNORE_LABEL = 255

#: newer upstream field names accepted on read -> protocol 2.1 names
FIELD_ALIASES = {"content_tokens_per_example": "patches_per_ex", "max_tokens_per_shard": "patches_per_shard"}
#: families written by actlake (vision per spec, text extensions documented in docs/formats/saev.md)
KNOWN_FAMILIES = ("clip", "siglip", "dinov2", "vit", "bert", "gpt2", "llama", "qwen2", "text", "synthetic")
#: the only `family` values upstream saev's loader accepts (a Literal in its Metadata)
UPSTREAM_FAMILIES = ("clip", "siglip", "dinov2", "dinov3", "fake-clip")
#: every family a directory may name: ours and upstream's
ACCEPTED_FAMILIES = KNOWN_FAMILIES + tuple(f for f in UPSTREAM_FAMILIES if f not in KNOWN_FAMILIES)
#: metadata.json flavours: "spec" = protocol 2.1 exactly; "upstream" = the field set upstream saev's current
#: loader takes (renamed fields, `pixel_agg`), a documented deviation from 2.1 (docs/formats/saev.md)
FLAVORS = ("spec", "upstream")
#: upstream saev's metadata.json fields, in its dataclass order (its loader calls `Metadata(**json)`)
UPSTREAM_FIELDS = ("family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
                   "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol")

_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "family": str,
    "ckpt": str,
    "layers": list,
    "patches_per_ex": int,
    "cls_token": bool,
    "d_model": int,
    "n_examples": int,
    "patches_per_shard": int,
    "data": (str, dict),
    "dataset": str,
    "dtype": str,
    "protocol": str,
}


def shard_name(index: int) -> str:
    """File name of shard `index` (zero-padded to 6 digits)."""
    return f"acts{index:06d}.bin"


def _canonical(obj: Any) -> Any:
    """Plain-data copy with dict keys sorted, so equal dicts pickle to equal bytes."""
    if isinstance(obj, dict):
        return {str(k): _canonical(obj[k]) for k in sorted(obj, key=str)}
    if isinstance(obj, (list, tuple)):
        return [_canonical(x) for x in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise ConfigError(f"data description must be plain data (dict/list/str/int/float/bool), got {type(obj).__name__}")


def encode_data(data: dict[str, Any]) -> str:
    """The spec's `data` field: base64 of a pickle (protocol 4) of a plain, key-sorted dict."""
    return base64.b64encode(pickle.dumps(_canonical(data), protocol=4)).decode("utf8")


def metadata_hash(metadata: dict[str, Any]) -> str:
    """The spec's HASH: full sha256 of the canonical JSON of metadata.json."""
    blob = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def upstream_short_hashes(metadata: dict[str, Any]) -> set[str]:
    """The 8-hex directory names upstream saev gives this metadata: the first 8 hex digits of sha256 of its
    field-ordered JSON (keys in file order, not sorted; default or compact separators)."""
    blobs = (json.dumps(metadata), json.dumps(metadata, separators=(",", ":")))
    return {hashlib.sha256(b.encode("utf-8")).hexdigest()[:8] for b in blobs}


@dataclass(frozen=True)
class SaevMetadata:
    """The validated content of `metadata.json` (protocol 2.1 field names)."""

    family: str
    ckpt: str
    layers: tuple[int, ...]
    patches_per_ex: int
    cls_token: bool
    d_model: int
    n_examples: int
    patches_per_shard: int = DEFAULT_PATCHES_PER_SHARD
    data: str = field(default_factory=lambda: encode_data({}))
    dataset: str = ""
    dtype: str = "float32"
    protocol: str = PROTOCOL
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys kept on read (e.g. pixel_agg)
    #: which field names metadata.json uses: "spec" (2.1) or "upstream" (read: upstream names present)
    flavor: str = "spec"
    #: the metadata.json object exactly as read (upstream field names included): what HASH is of
    on_disk: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if not self.layers or len(set(self.layers)) != len(self.layers) or len(self.layers) > MAX_LAYERS:
            raise ConfigError(f"layers must be 1..{MAX_LAYERS} unique integers, got {list(self.layers)}")
        if not 0 <= self.patches_per_ex < MAX_TOKENS or self.tokens_per_ex == 0:
            raise ConfigError(f"patches_per_ex out of range: {self.patches_per_ex}")
        if not 0 < self.d_model <= MAX_DIM:
            raise ConfigError(f"d_model must be in 1..{MAX_DIM}, got {self.d_model}")
        if not 0 <= self.n_examples <= MAX_EXAMPLES:
            raise ConfigError(f"n_examples must be in 0..{MAX_EXAMPLES}, got {self.n_examples}")
        if self.flavor not in FLAVORS:
            raise ConfigError(f"saev flavor must be one of {FLAVORS}, got {self.flavor!r}")
        if self.dtype != "float32":
            raise ConfigError(f"saev protocol 2.1 stores float32 only, got dtype {self.dtype!r}")
        if self.examples_per_shard < 1:
            raise ConfigError(
                f"patches_per_shard={self.patches_per_shard} is smaller than one example "
                f"({self.tokens_per_ex} tokens x {len(self.layers)} layers)"
            )

    # ---- spec section 3 ----
    @property
    def tokens_per_ex(self) -> int:
        return self.patches_per_ex + (1 if self.cls_token else 0)

    @property
    def examples_per_shard(self) -> int:
        return self.patches_per_shard // (self.tokens_per_ex * len(self.layers))

    @property
    def n_shards(self) -> int:
        return -(-self.n_examples // self.examples_per_shard)

    def shard_counts(self) -> list[int]:
        """Examples in each shard: `examples_per_shard` each, the last one the remainder."""
        s, n = self.examples_per_shard, self.n_examples
        return [min(s, n - i * s) for i in range(self.n_shards)]

    @property
    def example_bytes(self) -> int:
        return len(self.layers) * self.tokens_per_ex * self.d_model * 4

    @property
    def shard_bytes(self) -> int:
        """Size of every written shard file, the last one included: `examples_per_shard` examples."""
        return self.examples_per_shard * self.example_bytes

    def to_json(self) -> dict[str, Any]:
        """The `metadata.json` object: the spec's twelve fields (flavor "spec") or upstream's thirteen in its
        order (flavor "upstream": renamed fields, `pixel_agg` from `extra`, else null), plus any extras read."""
        core: dict[str, Any] = dict(
            family=self.family, ckpt=self.ckpt, layers=list(self.layers), patches_per_ex=self.patches_per_ex,
            cls_token=self.cls_token, d_model=self.d_model, n_examples=self.n_examples,
            patches_per_shard=self.patches_per_shard, data=self.data, dataset=self.dataset,
            dtype=self.dtype, protocol=self.protocol,
        )
        if self.flavor == "upstream":
            upstream_name = {name: alias for alias, name in FIELD_ALIASES.items()}
            renamed = {upstream_name.get(k, k): v for k, v in core.items()}
            core = {k: renamed[k] if k in renamed else self.extra.get(k) for k in UPSTREAM_FIELDS}
        return {**core, **{k: v for k, v in self.extra.items() if k not in core}}

    @property
    def hash(self) -> str:
        """The spec's HASH of metadata.json as written (as read, for a directory opened from disk)."""
        return metadata_hash(self.on_disk if self.on_disk is not None else self.to_json())

    def decode_data(self, *, source: Path | None = None) -> Any:
        """The dataset description: restricted-unpickled from base64 (never a plain pickle.load)."""
        if isinstance(self.data, dict):
            return self.data
        try:
            raw = base64.b64decode(self.data.encode("utf8"), validate=True)
        except ValueError as exc:
            raise MetadataError(f"field 'data' is not base64: {exc}", source) from exc
        return safe_loads(raw, source=source)

    @classmethod
    def from_json(cls, obj: Any, *, source: Path | None = None) -> "SaevMetadata":
        """Validate a parsed metadata.json (aliases of newer upstream names accepted)."""
        if not isinstance(obj, dict):
            raise MetadataError("metadata.json must hold a JSON object", source)
        raw, obj = obj, dict(obj)
        for alias, name in FIELD_ALIASES.items():
            if alias in obj and name not in obj:
                obj[name] = obj.pop(alias)
        for name, typ in _FIELD_TYPES.items():
            if name not in obj:
                raise MetadataError(f"missing field {name!r}", source)
            value = obj[name]
            ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
            if not ok:
                raise MetadataError(f"field {name!r} has type {type(value).__name__}, expected {typ}", source)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in obj["layers"]):
            raise MetadataError("field 'layers' must be a list of integers", source)
        check_protocol(obj["protocol"], source)
        extra = {k: v for k, v in obj.items() if k not in _FIELD_TYPES}
        flavor = "upstream" if any(alias in raw for alias in FIELD_ALIASES) else "spec"
        try:
            return cls(**{k: obj[k] for k in _FIELD_TYPES}, extra=extra, flavor=flavor, on_disk=raw)
        except ConfigError as exc:
            raise MetadataError(exc.problem, source) from exc


def check_protocol(protocol: str, source: Path | None) -> None:
    """Raise on another major protocol version; warn on a newer minor one."""
    m = re.fullmatch(r"(\d+)\.(\d+)", protocol)
    if not m:
        raise MetadataError(f"protocol {protocol!r} is not MAJOR.MINOR", source)
    major, minor = int(m.group(1)), int(m.group(2))
    if major != 2:
        raise ProtocolVersionError(f"protocol {protocol} is not readable (this reader speaks 2.x, written {PROTOCOL})", source)
    if minor > 1:
        warnings.warn(f"{source}: protocol {protocol} is newer than {PROTOCOL}; reading the 2.1 fields", stacklevel=3)


def metadata_from_spec(spec: StoreSpec) -> SaevMetadata:
    """saev metadata for a StoreSpec (the token axis is `max_tokens`, CLS included).

    Options: `patches_per_shard`; `flavor` ("spec", default, or "upstream": field names upstream saev's
    loader takes); `family` (replaces the spec's family, e.g. to name one of upstream's for flavor=upstream).
    """
    if spec.dtype != "float32":
        raise ConfigError(f"saev stores float32 (spec section 2.1), not {spec.dtype}")
    flavor = str(spec.options.get("flavor", "spec"))
    family = str(spec.options.get("family", spec.family))
    if flavor == "upstream" and family not in UPSTREAM_FAMILIES:
        raise ConfigError(
            f"flavor=upstream: family {family!r} is not one upstream saev accepts {UPSTREAM_FAMILIES}; "
            "name one with the option family=NAME")
    if "family" in spec.options and family not in ACCEPTED_FAMILIES:
        raise ConfigError(f"option family={family!r} is not one of {ACCEPTED_FAMILIES}")
    patches = spec.max_tokens - (1 if spec.cls_token else 0)
    return SaevMetadata(
        family=family,
        ckpt=spec.model_name,
        layers=spec.layers,
        patches_per_ex=patches,
        cls_token=spec.cls_token,
        d_model=spec.d_model,
        n_examples=spec.n_samples,
        patches_per_shard=int(spec.options.get("patches_per_shard", DEFAULT_PATCHES_PER_SHARD)),
        data=encode_data(spec.data),
        dataset=spec.dataset,
        flavor=flavor,
    )
