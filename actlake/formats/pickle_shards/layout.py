"""Constants, names, hashing and writer options of the gzip-pickle shard format."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError
from ...spec import StoreSpec

FORMAT = "pickle"
VERSION = "1.0"
EXTENSION_KEY = "actlake"
EXTENSION_VERSION = 1
PREVIEW_CHARS = 200
DEFAULT_SHARD_BYTES = 100 * 2**20
DEFAULT_COMPRESSLEVEL = 1
DEFAULT_PICKLE_PROTOCOL = 5
SHARD_FILE_RE = re.compile(r"^shard_(\d{4,})\.pkl(\.gz)?$")
CHECKSUM_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
REQUIRED_FIELDS = ("version", "created_at", "extraction_config", "shards", "statistics")
SHARD_KEYS = ("shard_id", "filename", "size_bytes", "num_samples", "layers", "sample_id_range", "compressed",
              "checksum")
ITEM_KEYS = ("sample_idx", "activation", "shape", "text_preview", "metadata")
CHUNK_BYTES = 1 << 20
#: largest max_tokens / hidden size a store may declare beyond what its items show (batch() pads to them)
MAX_DECLARED_TOKENS = 1 << 20
MAX_D_MODEL = 1 << 20


def shard_filename(shard_id: int, compressed: bool = True) -> str:
    """`shard_{id:04d}.pkl.gz` (or `.pkl` uncompressed)."""
    return f"shard_{shard_id:04d}.pkl{'.gz' if compressed else ''}"


def layer_key(layer: int) -> str:
    """Top-level shard key of one layer: `layer_{idx}`."""
    return f"layer_{layer}"


def utc_now_iso() -> str:
    """ISO 8601 UTC timestamp with a `Z` suffix, as in the spec's example."""
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def is_int(value: Any) -> bool:
    """An integer (Python or numpy; other tools pickle numpy ints), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def plain(obj: Any) -> Any:
    """A JSON-able copy of `obj` (numpy scalars to Python, tuples to lists, paths to strings)."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


@dataclass(frozen=True)
class PickleOptions:
    """Writer knobs read from `StoreSpec.options` (unknown keys belong to other formats)."""

    shard_bytes: int = DEFAULT_SHARD_BYTES
    compressed: bool = True
    compresslevel: int = DEFAULT_COMPRESSLEVEL
    pickle_protocol: int = DEFAULT_PICKLE_PROTOCOL
    #: activations padded to `max_seq_length` rows (zeros past `token_count`), the spec's shape, so its
    #: DataLoader example stacks them; False keeps the real tokens only (smaller, ragged)
    padded: bool = True

    def __post_init__(self) -> None:
        if not is_int(self.shard_bytes) or self.shard_bytes < 1:
            raise ConfigError(f"shard_bytes must be a positive integer, got {self.shard_bytes!r}")
        if not isinstance(self.compressed, bool):
            raise ConfigError(f"compressed must be true or false, got {self.compressed!r}")
        if not is_int(self.compresslevel) or not 0 <= self.compresslevel <= 9:
            raise ConfigError(f"compresslevel must be 0..9, got {self.compresslevel!r}")
        if self.pickle_protocol not in (4, 5):
            raise ConfigError(f"pickle_protocol must be 4 or 5, got {self.pickle_protocol!r}")
        if not isinstance(self.padded, bool):
            raise ConfigError(f"padded must be true or false, got {self.padded!r}")

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> PickleOptions:
        """The options of `spec`, defaults for those not given; ConfigError for unusable values."""
        o = spec.options
        return cls(
            shard_bytes=_as_int("shard_bytes", o.get("shard_bytes", DEFAULT_SHARD_BYTES)),
            compressed=_as_bool(o.get("compressed", True)),
            compresslevel=_as_int("compresslevel", o.get("compresslevel", DEFAULT_COMPRESSLEVEL)),
            pickle_protocol=_as_int("pickle_protocol", o.get("pickle_protocol", DEFAULT_PICKLE_PROTOCOL)),
            padded=_as_bool(o.get("padded", True)),
        )


def _as_int(name: str, value: Any) -> int:
    """An integral option value (`5e7` from a JSON command line included); ConfigError otherwise."""
    if is_int(value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ConfigError(f"{name} must be an integer, got {value!r}")


def _as_bool(value: Any) -> bool:
    """A boolean option value (true/false, 1/0, yes/no); ConfigError otherwise."""
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    if isinstance(value, (bool, int)):
        return bool(value)
    raise ConfigError(f"expected a boolean, got {value!r}")


def job_hash(spec: StoreSpec) -> str:
    """Hash shared by every machine of one job: the spec without machine_id, n_samples, provenance."""
    fields = dataclasses.asdict(spec)
    for name in ("provenance", "machine_id", "n_samples"):
        fields.pop(name)
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def store_path(out_root: Path, spec: StoreSpec) -> Path:
    """Published directory of one machine's store: `<out_root>/pickle-<job16>/machine_XXXX`."""
    return Path(out_root) / f"pickle-{job_hash(spec)[:16]}" / f"machine_{spec.machine_id:04d}"
