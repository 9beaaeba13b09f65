"""Constants, the store layout (P_max, R_max, chunking) resolved from StoreSpec.options, and naming helpers."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ...errors import ConfigError
from ...spec import StoreSpec

FORMAT = "zarr"
SCHEMA = "actlake-zarr-activation-logger"
SCHEMA_VERSION = "1.0"
MANIFEST_FORMAT = "actlake-zarr-manifest"
STORE_NAME = "activations.zarr"
MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
PARTS_DIR = ".actlake-parts"
DEFAULT_R_MAX = 64
DEFAULT_CHUNK_BYTES = 1 << 20
SAMPLE_KEY_BYTES = 64
#: longest fixed-length bytes dtype accepted for `arrays/sample_key` when reading (|S64 is written)
MAX_SAMPLE_KEY_BYTES = 1024
META_CHUNK = 1 << 16
#: largest N, L, T (P_max / R_max) and H a store may claim; larger is refused before any allocation
MAX_DIMS = {"N": 1 << 31, "L": 1 << 16, "T": 1 << 24, "H": 1 << 20}
#: largest (sample, layer) slice T * H * 2 bytes a store may claim (one read allocates this much)
MAX_SLICE_BYTES = 1 << 32
FD_CACHE_MAX = 4096  # most chunk-file descriptors one reader keeps open (per process)
SPLIT_CODES = {"train": 0, "val": 1, "validation": 1, "dev": 1, "test": 2}
PROMPT, RESPONSE = "prompt_activations", "response_activations"
ACT_ARRAYS = (PROMPT, RESPONSE)
SHARD_RE = re.compile(r"^shard-(\d{4,})\.zarr$")
#: per-sample arrays: name -> numpy dtype string as written (`REQUIRED_META` ones must exist)
META_ARRAYS = {"prompt_len": "<i4", "response_len": "<i4", "sample_id": "<i8", "label": "<i8",
               "hallu_label": "|i1", "split": "|i1", "sample_key": f"|S{SAMPLE_KEY_BYTES}"}
REQUIRED_META = ("prompt_len", "response_len")
#: every global key the writer puts in the root attrs (verify checks they are present)
REQUIRED_ATTRS = ("schema", "schema_version", "model_id", "num_layers", "layers", "hidden_size", "T_max",
                  "P_max", "R_max", "dtype", "t_chunk_prompt", "t_chunk_response", "chunks", "created_at",
                  "git_commit", "dataset_name", "n_samples", "prompt_truncated_count",
                  "response_truncated_count", "prompt_truncated_fraction", "response_truncated_fraction")
NATIVE_F16 = "<f2" if sys.byteorder == "little" else ">f2"
KNOWN_OPTIONS = ("p_max", "r_max", "p_quantile", "r_quantile", "prompt_lengths", "response_lengths",
                 "t_chunk_prompt", "chunk_bytes")


def zarr_module() -> Any:
    """zarr-python, imported on first use (keeps `import actlake` light)."""
    import zarr

    return zarr


def plain(obj: Any) -> Any:
    """A JSON-able copy of `obj` (numpy scalars -> Python, unknown objects -> str)."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


def is_int(x: Any) -> bool:
    """A JSON integer (bool excluded)."""
    return isinstance(x, int) and not isinstance(x, bool)


def now() -> str:
    """The current UTC time, ISO 8601 to the second (the `created_at` attr)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_t_chunk(p_max: int, hidden: int, target_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Prompt chunk length: the largest power of two whose chunk is <= target_bytes, capped at P_max."""
    t = 1
    while t * 2 * hidden * 2 <= target_bytes:
        t *= 2
    return max(1, min(t, p_max))


def quantile_cap(lengths: Sequence[int], q: float, name: str) -> int:
    """A token cap at quantile `q` of a length distribution (an observed length, at least 1)."""
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise ConfigError(f"{name}: the length distribution is empty")
    if arr.min() < 0:
        raise ConfigError(f"{name}: lengths must be >= 0")
    return max(1, int(np.quantile(arr, q, method="higher")))


def default_sample_key(sample_id: int, prompt: str | None, response: str | None) -> str:
    """sha256 hex of the canonical JSON `[sample_id, prompt, response]` (64 ASCII characters)."""
    blob = json.dumps([int(sample_id), prompt, response], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def run_hash(spec: StoreSpec) -> str:
    """The identity every machine of one sharded run shares (machine_id and n_samples left out)."""
    return replace(spec, machine_id=0, n_samples=0).content_hash()


def int8_code(value: Any, name: str, names: dict[str, int]) -> int:
    """An int8 code from an int, bool or (for split) a name; None -> -1 (unknown)."""
    if value is None:
        return -1
    if isinstance(value, str):
        if value.lower() in names:
            return names[value.lower()]
        raise ConfigError(f"{name} value {value!r} is not one of {sorted(names)} or an integer")
    code = int(value)
    if not -128 <= code <= 127:
        raise ConfigError(f"{name} value {value!r} does not fit int8")
    return code


@dataclass(frozen=True)
class ZarrLayout:
    """Shapes and chunking of one store (validated on construction)."""

    n_samples: int
    layers: tuple[int, ...]
    hidden_size: int
    p_max: int
    r_max: int
    t_chunk_prompt: int
    p_quantile: float | None = None
    r_quantile: float | None = None

    def __post_init__(self) -> None:
        if self.n_samples < 0 or self.hidden_size < 1 or not self.layers:
            raise ConfigError(f"invalid layout: n_samples={self.n_samples} hidden_size={self.hidden_size} "
                              f"layers={list(self.layers)}")
        if self.p_max < 1 or self.r_max < 1:
            raise ConfigError(f"P_max and R_max must be >= 1, got {self.p_max} and {self.r_max}")
        if not 1 <= self.t_chunk_prompt <= self.p_max:
            raise ConfigError(f"t_chunk_prompt must be in 1..P_max={self.p_max}, got {self.t_chunk_prompt}")

    @property
    def t_chunk_response(self) -> int:
        """The spec's recommendation: one chunk per (sample, layer) response slice."""
        return self.r_max

    def shape(self, name: str) -> tuple[int, int, int, int]:
        """(N, L, P_max or R_max, H) of an activation array."""
        t = self.p_max if name == PROMPT else self.r_max
        return (self.n_samples, len(self.layers), t, self.hidden_size)

    def chunks(self, name: str) -> tuple[int, int, int, int]:
        """(1, 1, T_chunk, H) of an activation array."""
        t = self.t_chunk_prompt if name == PROMPT else self.t_chunk_response
        return (1, 1, t, self.hidden_size)


def _int_option(options: dict[str, Any], key: str, default: int | None) -> int | None:
    """An integer option; absent or None -> `default`."""
    value = options.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"option {key!r} must be an integer, got {value!r}")
    return int(value)


def _quantile_option(options: dict[str, Any], key: str) -> float | None:
    """A quantile option in (0, 1], or None."""
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) <= 1:
        raise ConfigError(f"option {key!r} must be a quantile in (0, 1], got {value!r}")
    return float(value)


def layout_from_spec(spec: StoreSpec) -> ZarrLayout:
    """Resolve P_max / R_max / T_chunk from `spec.options` (see docs/formats/zarr.md)."""
    opts = dict(spec.options)
    unknown = sorted(set(opts) - set(KNOWN_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown zarr option(s) {unknown}; known: {sorted(KNOWN_OPTIONS)}")
    caps: dict[str, tuple[int, float | None]] = {}
    for part, default in (("p", spec.max_tokens), ("r", DEFAULT_R_MAX)):
        q = _quantile_option(opts, f"{part}_quantile")
        if q is not None:
            if opts.get(f"{part}_max") is not None:
                raise ConfigError(f"give {part}_max or {part}_quantile, not both")
            key = "prompt_lengths" if part == "p" else "response_lengths"
            if opts.get(key) is None:
                raise ConfigError(f"{part}_quantile needs the length distribution up front in option {key!r}")
            caps[part] = (quantile_cap(opts[key], q, key), q)
        else:
            caps[part] = (int(_int_option(opts, f"{part}_max", default)), None)  # type: ignore[arg-type]
    chunk_bytes = int(_int_option(opts, "chunk_bytes", DEFAULT_CHUNK_BYTES))  # type: ignore[arg-type]
    if chunk_bytes < 2 * spec.d_model:
        raise ConfigError(f"chunk_bytes must hold at least one token row ({2 * spec.d_model} bytes)")
    p_max = caps["p"][0]
    t_chunk = _int_option(opts, "t_chunk_prompt", None)
    if t_chunk is None:
        t_chunk = default_t_chunk(p_max, spec.d_model, chunk_bytes)
    return ZarrLayout(n_samples=spec.n_samples, layers=spec.layers, hidden_size=spec.d_model, p_max=p_max,
                      r_max=caps["r"][0], t_chunk_prompt=t_chunk, p_quantile=caps["p"][1], r_quantile=caps["r"][1])
