"""What the graph extracts and trains, fixed when the code location loads (environment variables).

Partitions need the machine count and the layer set before any run starts, so these come from
the environment (documented in docs/orchestration.md), not from run config: a run can never
change what an existing asset key means.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from actlake.errors import ConfigError

DEFAULT_MODEL = "minilm"
DEFAULT_DATA = "builtin:stdlib-docs"
DEFAULT_LAYERS = (1, 3, 5)
EXTRA_FORMATS = ("lmprobe", "zarr", "pickle")


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {raw!r}") from None


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"${name} must be a number, got {raw!r}") from None


def _list_env(name: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, "").split(",") if x.strip()]


@dataclass(frozen=True)
class GraphSettings:
    """The graph's shape and its extraction parameters.

    checkpoints_root: a directory whose subdirectories are checkpoints (one dynamic partition
    each); empty: the single model `model` ("minilm", "tiny-random:<arch>" or an HF directory).
    val_fraction: share of samples held out for validation, chosen by a hash of the sample id.
    formats: extra stored layouts, each its own asset converted from the saev directory.
    """

    model: str = DEFAULT_MODEL
    checkpoints_root: str = ""
    data: str = DEFAULT_DATA
    limit: int = 256
    max_seq_len: int = 64
    batch_size: int = 32
    num_machines: int = 2
    layers: tuple[int, ...] = DEFAULT_LAYERS
    val_fraction: float = 0.2
    device: str = "auto"
    gpus: int = 1
    formats: tuple[str, ...] = ()
    automation: bool = True
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "formats", tuple(self.formats))
        if self.num_machines < 1:
            raise ConfigError(f"ACTLAKE_NUM_MACHINES must be >= 1, got {self.num_machines}")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"ACTLAKE_LAYERS must list distinct layers, got {list(self.layers)}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"ACTLAKE_VAL_FRACTION must be in (0, 1), got {self.val_fraction}")
        if self.limit < 1 or self.max_seq_len < 2 or self.batch_size < 1 or self.gpus < 1:
            raise ConfigError("ACTLAKE_LIMIT, ACTLAKE_BATCH_SIZE, ACTLAKE_GPUS must be >= 1 and ACTLAKE_MAX_SEQ_LEN >= 2")
        unknown = sorted(set(self.formats) - set(EXTRA_FORMATS))
        if unknown:
            raise ConfigError(f"ACTLAKE_FORMATS: unknown formats {unknown}; known: {list(EXTRA_FORMATS)}")

    @classmethod
    def from_env(cls) -> "GraphSettings":
        """Settings from the ACTLAKE_* environment variables (defaults: the embedded demo)."""
        layers = _list_env("ACTLAKE_LAYERS")
        try:
            parsed_layers = tuple(int(x) for x in layers) if layers else DEFAULT_LAYERS
        except ValueError:
            raise ConfigError(f"ACTLAKE_LAYERS must be comma-separated integers, got {layers}") from None
        return cls(
            model=os.environ.get("ACTLAKE_MODEL", "").strip() or DEFAULT_MODEL,
            checkpoints_root=os.environ.get("ACTLAKE_CHECKPOINTS", "").strip(),
            data=os.environ.get("ACTLAKE_DATA", "").strip() or DEFAULT_DATA,
            limit=_int_env("ACTLAKE_LIMIT", 256),
            max_seq_len=_int_env("ACTLAKE_MAX_SEQ_LEN", 64),
            batch_size=_int_env("ACTLAKE_BATCH_SIZE", 32),
            num_machines=_int_env("ACTLAKE_NUM_MACHINES", 2),
            layers=parsed_layers,
            val_fraction=_float_env("ACTLAKE_VAL_FRACTION", 0.2),
            device=os.environ.get("ACTLAKE_DEVICE", "").strip() or "auto",
            gpus=_int_env("ACTLAKE_GPUS", 1),
            formats=tuple(_list_env("ACTLAKE_FORMATS")),
            automation=os.environ.get("ACTLAKE_AUTOMATION", "on").strip().lower() not in ("off", "0", "false", "no"),
        )
