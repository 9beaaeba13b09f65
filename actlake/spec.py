"""StoreSpec: what every writer needs to know before the first batch (shape, provenance, options)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

MAX_DIM = 1 << 20
MAX_TOKENS = 1 << 24
MAX_LAYERS = 4096


@dataclass(frozen=True)
class StoreSpec:
    """The shape and identity of a store, fixed before writing starts.

    layers: stored layer indices, in stored order (the layer axis of every Batch).
    d_model: activation width. max_tokens: fixed token count T per sample (padding length).
    n_samples: number of samples this writer will receive.
    model_name: model identifier (`ckpt`); family: model family (see docs/formats.md).
    cls_token: whether token 0 is a CLS token (vision models).
    dataset: dataset root or spec string; data: plain-dict dataset description (hashed).
    provenance: free-form plain dict (versions, timestamps; not hashed where a format hashes).
    dtype: storage dtype name; options: per-format knobs (e.g. `patches_per_shard`).
    """

    layers: tuple[int, ...]
    d_model: int
    max_tokens: int
    n_samples: int
    model_name: str = "unknown"
    family: str = "unknown"
    cls_token: bool = False
    dataset: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    machine_id: int = 0
    num_machines: int = 1
    has_token_labels: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if not self.layers:
            raise ConfigError("at least one layer is required")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"layers must be unique, got {list(self.layers)}")
        if len(self.layers) > MAX_LAYERS:
            raise ConfigError(f"at most {MAX_LAYERS} layers")
        if not 0 < self.d_model <= MAX_DIM:
            raise ConfigError(f"d_model must be in 1..{MAX_DIM}, got {self.d_model}")
        if not 0 < self.max_tokens <= MAX_TOKENS:
            raise ConfigError(f"max_tokens must be in 1..{MAX_TOKENS}, got {self.max_tokens}")
        if self.n_samples < 0:
            raise ConfigError(f"n_samples must be >= 0, got {self.n_samples}")
        if not 0 <= self.machine_id < self.num_machines:
            raise ConfigError(f"machine_id {self.machine_id} not in [0, {self.num_machines})")

    def run_hash(self) -> str:
        """The identity every machine of one run shares: `content_hash` with machine_id and n_samples left out.

        Names the run directory that holds every machine's slice (`<format>-<first 16 hex>`).
        """
        import dataclasses

        return dataclasses.replace(self, machine_id=0, n_samples=0).content_hash()

    def content_hash(self) -> str:
        """sha256 of the canonical JSON of every field but `provenance` (build facts are not identity).

        Formats that are not content-addressed by their own spec name their published
        directory `<format>-<first 16 hex>` from this, so a rerun with the same arguments finds
        (and resumes or reuses) the same output.
        """
        import dataclasses
        import hashlib
        import json

        fields = dataclasses.asdict(self)
        fields.pop("provenance")
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()
