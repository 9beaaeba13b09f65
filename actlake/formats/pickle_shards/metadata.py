"""metadata.json of the gzip-pickle shard format: its validated model, and the blocks a writer fills in."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...atomic import resolve_inside
from ...errors import (
    MetadataError,
    ProtocolVersionError,
    UnsafePathError,
)
from ...jsonio import read_json
from ...spec import StoreSpec
from .layout import EXTENSION_KEY, REQUIRED_FIELDS, is_int, plain


@dataclass(frozen=True)
class ShardInfo:
    """One entry of metadata.json `shards`."""

    shard_id: int
    filename: str
    size_bytes: int
    num_samples: int
    layers: tuple[int, ...]
    sample_id_range: tuple[int, int] | None
    compressed: bool
    checksum: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id, "filename": self.filename, "size_bytes": self.size_bytes,
            "num_samples": self.num_samples, "layers": list(self.layers),
            "sample_id_range": None if self.sample_id_range is None else list(self.sample_id_range),
            "compressed": self.compressed, "checksum": self.checksum,
        }

    @classmethod
    def from_json(cls, i: int, obj: Any, source: Path) -> ShardInfo:
        if not isinstance(obj, dict):
            raise MetadataError(f"shards[{i}] must be a JSON object", source)
        for name in ("shard_id", "size_bytes", "num_samples"):
            if not is_int(obj.get(name)) or obj[name] < 0:
                raise MetadataError(f"shards[{i}].{name} must be a non-negative integer, got {obj.get(name)!r}", source)
        filename = obj.get("filename")
        if not isinstance(filename, str) or not filename:
            raise MetadataError(f"shards[{i}].filename must be a non-empty string", source)
        layers = obj.get("layers")
        if not isinstance(layers, list) or not all(is_int(x) for x in layers):
            raise MetadataError(f"shards[{i}].layers must be a list of integers", source)
        compressed = obj.get("compressed", filename.endswith(".gz"))
        if not isinstance(compressed, bool):
            raise MetadataError(f"shards[{i}].compressed must be a boolean", source)
        rng = obj.get("sample_id_range")
        if rng is not None and not (isinstance(rng, list) and len(rng) == 2 and all(is_int(x) for x in rng)):
            raise MetadataError(f"shards[{i}].sample_id_range must be [first, last] integers", source)
        checksum = obj.get("checksum")
        if checksum is not None and not isinstance(checksum, str):
            raise MetadataError(f"shards[{i}].checksum must be a string", source)
        return cls(obj["shard_id"], filename, obj["size_bytes"], obj["num_samples"], tuple(layers),
                   None if rng is None else (rng[0], rng[1]), compressed, checksum)


@dataclass(frozen=True)
class PickleMetadata:
    """The validated content of metadata.json (`raw` keeps every key, unknown ones included)."""

    raw: dict[str, Any]
    shards: tuple[ShardInfo, ...]
    layers: tuple[int, ...]

    @property
    def extraction_config(self) -> dict[str, Any]:
        return self.raw["extraction_config"]

    @property
    def distributed_config(self) -> dict[str, Any]:
        value = self.raw.get("distributed_config")
        return value if isinstance(value, dict) else {}

    @property
    def extension(self) -> dict[str, Any] | None:
        value = self.raw.get(EXTENSION_KEY)
        return value if isinstance(value, dict) else None

    @property
    def n_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def hidden_size(self) -> int | None:
        ext = self.extension or {}
        if is_int(ext.get("d_model")):
            return ext["d_model"]
        params = self.extraction_config.get("model_params")
        if isinstance(params, dict) and is_int(params.get("hidden_size")):
            return params["hidden_size"]
        return None

    @classmethod
    def from_json(cls, obj: Any, source: Path) -> PickleMetadata:
        if not isinstance(obj, dict):
            raise MetadataError("metadata.json must hold a JSON object", source)
        for name in REQUIRED_FIELDS:
            if name not in obj:
                raise MetadataError(f"missing required field {name!r}", source)
        version = obj["version"]
        m = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", version) if isinstance(version, str) else None
        if m is None:
            raise MetadataError(f"version {version!r} is not semantic MAJOR.MINOR[.PATCH]", source)
        if int(m.group(1)) != 1:
            raise ProtocolVersionError(f"version {version} is not readable (this reader speaks 1.x)", source)
        if not isinstance(obj["created_at"], str):
            raise MetadataError("created_at must be an ISO 8601 string", source)
        config = obj["extraction_config"]
        if not isinstance(config, dict):
            raise MetadataError("extraction_config must be a JSON object", source)
        layers = config.get("layers_extracted")
        if not isinstance(layers, list) or not layers or not all(is_int(x) for x in layers) \
                or len(set(layers)) != len(layers):
            raise MetadataError("extraction_config.layers_extracted must be a non-empty list of unique integers", source)
        if not isinstance(obj["statistics"], dict):
            raise MetadataError("statistics must be a JSON object", source)
        if not isinstance(obj["shards"], list):
            raise MetadataError("shards must be a JSON array", source)
        shards = tuple(ShardInfo.from_json(i, s, source) for i, s in enumerate(obj["shards"]))
        ids = [s.shard_id for s in shards]
        if len(set(ids)) != len(ids):
            raise MetadataError("shard_id values are not unique", source)
        names = [s.filename for s in shards]
        if len(set(names)) != len(names):
            raise MetadataError("shard filenames are not unique", source)
        ext = obj.get(EXTENSION_KEY)
        if ext is not None and not isinstance(ext, dict):
            raise MetadataError(f"{EXTENSION_KEY!r} must be a JSON object", source)
        return cls(obj, shards, tuple(layers))


def declared_rows(md: PickleMetadata) -> int | None:
    """The most activation rows an item may hold by metadata.json: actlake's `max_tokens`, else the spec's
    `extraction_config.max_seq_length` (None when neither is a positive integer)."""
    for value in ((md.extension or {}).get("max_tokens"), md.extraction_config.get("max_seq_length")):
        if is_int(value) and value > 0:
            return int(value)
    return None


def read_metadata(path: Path) -> PickleMetadata:
    """Validated metadata.json of a pickle-shard directory."""
    source = Path(path) / "metadata.json"
    return PickleMetadata.from_json(read_json(source), source)


def shard_path(root: Path, info: ShardInfo) -> Path:
    """The file of one shard entry, refusing names that leave the store directory."""
    p = resolve_inside(root, info.filename, source=root / "metadata.json")
    if p.parent != Path(root).resolve():
        raise UnsafePathError(f"shard filename {info.filename!r} must name a file directly in the store", root / "metadata.json")
    return p


def _first(*values: Any) -> Any:
    """The first value that is not None (None if all are)."""
    return next((v for v in values if v is not None), None)


def extraction_config(spec: StoreSpec, batch_size: int | None) -> dict[str, Any]:
    """The spec's extraction_config, filled from the StoreSpec and its provenance."""
    prov, data = spec.provenance, spec.data if isinstance(spec.data, dict) else {}
    params = dict(prov["model_params"]) if isinstance(prov.get("model_params"), dict) else {}
    config = prov.get("model_config") if isinstance(prov.get("model_config"), dict) else {}
    for key in ("num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = _first(params.get(key), prov.get(key), config.get(key))
        if value is not None:
            params[key] = value
    params = {"hidden_size": spec.d_model} | {k: v for k, v in params.items() if k != "hidden_size"}
    return plain({
        "model_name": spec.model_name,
        "model_architecture": _first(prov.get("model_architecture"), prov.get("model_type"),
                                     config.get("model_type"), spec.family),
        "model_params": params,
        "dataset_name": _first(prov.get("dataset_name"), data.get("dataset_name"), data.get("name"), spec.dataset or None),
        "dataset_config": _first(prov.get("dataset_config"), data.get("dataset_config"), data.get("config")),
        "dataset_split": _first(prov.get("dataset_split"), data.get("dataset_split"), data.get("split")),
        "layers_extracted": list(spec.layers),
        "max_seq_length": spec.max_tokens,
        "batch_size": _first(prov.get("batch_size"), batch_size),
    })


def distributed_config(spec: StoreSpec) -> dict[str, Any]:
    """The spec's distributed_config (host facts from provenance; defaults: one host, 1-D mesh)."""
    prov = spec.provenance
    return plain({
        "machine_id": spec.machine_id,
        "total_machines": spec.num_machines,
        "multihost": bool(prov.get("multihost", False)),
        "num_hosts": int(prov.get("num_hosts", 1)),
        "mesh_type": str(prov.get("mesh_type", "1d")),
    })


def statistics(shards: Sequence[ShardInfo], layers: Sequence[int], duration: float) -> dict[str, Any]:
    """The spec's statistics block."""
    return {
        "total_shards": len(shards),
        "total_samples": sum(s.num_samples for s in shards),
        "total_size_bytes": sum(s.size_bytes for s in shards),
        "layers_extracted": list(layers),
        "extraction_duration_seconds": round(float(duration), 3),
    }
