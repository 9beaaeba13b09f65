"""lmprobe dataset 2.0: parquet index with `lmprobe:` schema metadata + per-layer safetensors shards.

The contract is shared/specs/lmprobe-format-2.0.md. Choices where the spec is silent, and where
the upstream `lmprobe` package departs from it, are recorded in docs/formats/lmprobe.md:
- tensors are written with the spec's `file_pattern`/`key_pattern` defaults, which are also the
  names upstream hard-codes, so upstream's hub loader finds them;
- logits shards hold the spec keys `topk_values` (float32) / `topk_indices` (int64) AND
  upstream's `logits_topk.values` (float32) / `logits_topk.indices` (int32) aliases;
- `row_bytes` and shard sizes use the real element size (fp16 = 2 bytes), not upstream's 4;
- prompts are addressed by row (never by a hash of their text), so duplicate texts stay apart;
- shard files are streamed: each safetensors file is written with a reserved, space-padded
  header (allowed by the safetensors format) that is filled in when the shard is complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import re
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..atomic import publish_dir, remove_tree, resolve_inside
from ..batch import Batch
from ..errors import (
    ConfigError,
    FormatError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
    SampleIndexError,
    TruncatedFileError,
    UnsafePathError,
)
from ..reader import Reader, TokenSegment
from ..spec import StoreSpec
from ..writer import Writer

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
#: StoreSpec.provenance / StoreSpec.data keys searched (in order) for the model revision
REVISION_KEYS = ("model_revision", "revision", "commit", "weights_sha256", "checkpoint_sha256")


# --------------------------------------------------------------------------------------------
# Options and layout maths
# --------------------------------------------------------------------------------------------


def _check_pattern(pattern: Any, fields: tuple[str, ...], name: str, source: Path | None = None) -> str:
    """A format pattern that formats with exactly the named integer fields (else a typed error)."""
    error = ConfigError if source is None else MetadataError
    if not isinstance(pattern, str) or not pattern:
        raise error(f"{name} must be a non-empty string, got {pattern!r}", source)
    try:
        out = pattern.format(**{f: 0 for f in fields})
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise error(f"{name} {pattern!r} does not format with {fields}: {exc!r}", source) from None
    if not out:
        raise error(f"{name} {pattern!r} formats to an empty string", source)
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
        if not isinstance(self.shard_bytes, int) or isinstance(self.shard_bytes, bool) or self.shard_bytes < 1:
            raise ConfigError(f"lmprobe shard_bytes must be a positive integer, got {self.shard_bytes!r}")
        if self.logits_topk is not None and (not isinstance(self.logits_topk, int) or self.logits_topk < 0):
            raise ConfigError(f"lmprobe logits_topk must be a non-negative integer, got {self.logits_topk!r}")
        _check_pattern(self.file_pattern, ("layer", "shard"), "file_pattern")
        _check_pattern(self.key_pattern, ("layer",), "key_pattern")
        a = self.file_pattern.format(layer=0, shard=0)
        if a in (self.file_pattern.format(layer=1, shard=0), self.file_pattern.format(layer=0, shard=1)):
            raise ConfigError(f"file_pattern {self.file_pattern!r} must name every (layer, shard) differently")
        if Path(a).is_absolute() or ".." in Path(a).parts:
            raise ConfigError(f"file_pattern {self.file_pattern!r} must stay inside the dataset directory")

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> "LmprobeOptions":
        o = spec.options
        k = o.get("logits_topk")
        return cls(
            storage=str(o.get("storage", "pooled")),
            pooling=str(o.get("pooling", "last_token")),
            shard_bytes=int(o.get("shard_bytes", DEFAULT_SHARD_BYTES)),
            logits_topk=None if k is None else int(k),
            upstream_aliases=bool(o.get("upstream_aliases", True)),
            file_pattern=str(o.get("file_pattern", DEFAULT_FILE_PATTERN)),
            key_pattern=str(o.get("key_pattern", DEFAULT_KEY_PATTERN)),
        )


def fixed_shard_counts(n_rows: int, row_bytes: int, shard_bytes: int) -> list[int]:
    """Rows per shard for fixed-size rows: `shard_bytes // row_bytes` each (>= 1), last the remainder."""
    per = max(1, shard_bytes // max(1, row_bytes))
    return [min(per, n_rows - i) for i in range(0, n_rows, per)]


def logits_row_bytes(k: int) -> int:
    """Bytes of one logits row in the spec's tensors: float32 values + int64 indices."""
    return k * (4 + 8)


def model_revision(spec: StoreSpec) -> str | None:
    """The model revision recorded for `spec`: first of REVISION_KEYS in provenance, then data."""
    for source in (spec.provenance, spec.data):
        for key in REVISION_KEYS:
            value = source.get(key)
            if isinstance(value, str) and value:
                return value
    return None


def _package_version(name: str) -> str | None:
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def build_provenance(spec: StoreSpec) -> dict[str, Any]:
    """The spec's provenance block (all its keys), overlaid with `spec.provenance`."""
    from .. import __version__

    out: dict[str, Any] = {
        "lmprobe_version": None,  # lmprobe did not write this dataset; actlake_version says who did
        "extraction_backend": "actlake",
        "nnsight_version": _package_version("nnsight"),
        "torch_version": _package_version("torch"),
        "transformers_version": _package_version("transformers"),
        "python_version": platform.python_version(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "actlake_version": __version__,
    }
    for key, value in spec.provenance.items():
        out[str(key)] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    """JSON-able copy of a value (numpy scalars and arrays become Python numbers and lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """Activations in the storage dtype's bit layout (C-contiguous)."""
    if dtype == "bfloat16":
        return to_bfloat16_bits(np.asarray(x, dtype=np.float32))
    return np.ascontiguousarray(x, dtype=np.dtype(dtype))


# --------------------------------------------------------------------------------------------
# safetensors files: streamed writer, header parser
# --------------------------------------------------------------------------------------------


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a safetensors file being written: key, dtype code, element size, row shape."""

    key: str
    code: str
    itemsize: int
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return self.itemsize * int(np.prod(self.row_shape, dtype=np.int64))


def _header_json(slots: Sequence[TensorSlot], n_rows: int, tensor_bytes: Sequence[int]) -> str:
    obj: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for slot, nbytes in zip(slots, tensor_bytes):
        obj[slot.key] = {"dtype": slot.code, "shape": [n_rows, *slot.row_shape], "data_offsets": [start, start + nbytes]}
        start += nbytes
    return json.dumps(obj, separators=(",", ":"))


class SafetensorsShard:
    """A safetensors file streamed row by row.

    With `n_rows` known, every tensor's region is fixed and rows are written at their offsets
    (several tensors per file). With `n_rows=None` (one tensor only) rows are appended. The
    header region is reserved up front and written on `finish()`, padded with spaces.
    """

    def __init__(self, path: Path, slots: Sequence[TensorSlot], n_rows: int | None) -> None:
        if n_rows is None and len(slots) != 1:
            raise ConfigError("a safetensors shard of unknown row count holds exactly one tensor")
        self.path = path
        self.slots = tuple(slots)
        self.n_rows = n_rows
        worst = 10**15 if n_rows is None else n_rows
        worst_bytes = [10**19 if n_rows is None else worst * s.row_bytes for s in self.slots]
        self.header_size = _round8(len(_header_json(self.slots, worst, worst_bytes)))
        self.data_start = 8 + self.header_size
        self.appended = 0
        self.written = [0] * len(self.slots)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * self.data_start)
            if n_rows is not None:
                f.truncate(self.data_start + sum(n_rows * s.row_bytes for s in self.slots))

    def _base(self, slot_index: int) -> int:
        assert self.n_rows is not None
        return self.data_start + sum(self.n_rows * s.row_bytes for s in self.slots[:slot_index])

    def write_rows(self, slot_index: int, first_row: int, rows: np.ndarray) -> None:
        """Write `rows` (C-contiguous, row shape of the slot) at row `first_row` of tensor `slot_index`."""
        slot = self.slots[slot_index]
        data = np.ascontiguousarray(rows)
        if self.n_rows is None:
            offset = self.data_start + self.appended * slot.row_bytes
            self.appended += len(data)
        else:
            if first_row + len(data) > self.n_rows:
                raise ConfigError(f"{len(data)} rows at {first_row} overflow {self.n_rows} rows", self.path)
            offset = self._base(slot_index) + first_row * slot.row_bytes
        self.written[slot_index] += len(data)
        if data.size:
            with open(self.path, "r+b") as f:
                f.seek(offset)
                f.write(memoryview(data).cast("B"))

    def append(self, rows: np.ndarray) -> None:
        """Append rows to the single tensor of an unknown-length shard."""
        self.write_rows(0, self.appended, rows)

    @property
    def rows(self) -> int:
        return self.appended if self.n_rows is None else self.n_rows

    def finish(self) -> None:
        """Write the real header (checking every row was written)."""
        n = self.rows
        for slot, count in zip(self.slots, self.written):
            if count != n:
                raise FormatError(f"tensor {slot.key!r} got {count} rows, expected {n}", self.path)
        text = _header_json(self.slots, n, [n * s.row_bytes for s in self.slots])
        if len(text) > self.header_size:
            raise FormatError("safetensors header outgrew its reserved space", self.path)
        with open(self.path, "r+b") as f:
            f.write(struct.pack("<Q", self.header_size) + text.ljust(self.header_size).encode("utf-8"))
            f.truncate(self.data_start + sum(n * s.row_bytes for s in self.slots))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a parsed safetensors header: dtype code, shape, absolute byte range."""

    key: str
    code: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return ST_NUMPY[self.code]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors file's header (8-byte length + JSON) and check the file's size against it."""
    if not path.is_file():
        raise MissingFileError("safetensors shard is missing", path)
    size = path.stat().st_size
    if size < 8:
        raise TruncatedFileError(f"{size} bytes: too short for a safetensors header", path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise TruncatedFileError(f"header length {header_len} does not fit in the file ({size} bytes)", path)
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"safetensors header is not UTF-8 JSON: {exc}", path) from None
    if not isinstance(header, dict):
        raise FormatError("safetensors header is not a JSON object", path)
    data_start = 8 + header_len
    out: dict[str, TensorInfo] = {}
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            code = entry["dtype"]
            shape = tuple(int(x) for x in entry["shape"])
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"tensor {key!r} has a malformed header entry: {exc!r}", path) from None
        if code not in ST_NUMPY:
            raise FormatError(f"tensor {key!r} has unsupported dtype {code!r}", path)
        if any(d < 0 for d in shape) or begin < 0 or stop < begin:
            raise FormatError(f"tensor {key!r} has a negative shape or byte range", path)
        want = math.prod(shape) * ST_NUMPY[code].itemsize  # Python ints: an absurd shape cannot wrap around
        if stop - begin != want:
            raise FormatError(f"tensor {key!r} spans {stop - begin} bytes, its shape {list(shape)} needs {want}", path)
        out[key] = TensorInfo(key, code, shape, data_start + begin, want)
        end = max(end, stop)
    if data_start + end != size:
        raise TruncatedFileError(f"file is {size} bytes, its header describes {data_start + end}", path)
    return out


def map_tensor(path: Path, info: TensorInfo) -> np.ndarray:
    """A read-only memmap of one tensor (np.empty for zero-size tensors)."""
    if info.nbytes == 0:
        return np.empty(info.shape, dtype=info.np_dtype)
    return np.memmap(path, dtype=info.np_dtype, mode="r", offset=info.start, shape=info.shape)


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


@dataclass
class _PromptRecord:
    """The addressing of one prompt, kept until the index is written at close."""

    lt_shard: int
    lt_row: int
    rest_shard: int  # -1 when the prompt has no rest tokens or storage is pooled
    rest_row: int
    n_tokens: int


class LmprobeWriter(Writer):
    """Streams Batches into `<out_root>/lmprobe-<hash16>` (built under `.tmp-lmprobe-<hash16>`).

    Per-layer shard files are open only while their shard fills (rows written at their final
    offsets, nothing buffered beyond one batch); the parquet index (per-prompt metadata, no
    activations) is written at close. An interrupted run restarts from the first sample.
    """

    def __init__(self, out_root: str | Path, spec: StoreSpec) -> None:
        self.spec = spec
        self.options = opts = LmprobeOptions.from_spec(spec)
        if spec.dtype not in HIDDEN_DTYPES:
            raise ConfigError(f"lmprobe stores {sorted(HIDDEN_DTYPES)}, not dtype {spec.dtype!r}")
        self.code, self.itemsize = HIDDEN_DTYPES[spec.dtype]
        self.row_bytes = spec.d_model * self.itemsize
        self.root = Path(out_root)
        digest = spec.content_hash()[:16]
        self.final_path = self.root / f"lmprobe-{digest}"
        self.tmp_path = self.root / f".tmp-lmprobe-{digest}"
        self._closed = False
        self.root.mkdir(parents=True, exist_ok=True)
        if self.final_path.exists():
            self.resume_from = spec.n_samples
            self._closed = True
            return
        remove_tree(self.tmp_path)
        self.tmp_path.mkdir(parents=True)
        self.resume_from = 0
        self.lt_counts = fixed_shard_counts(spec.n_samples, self.row_bytes, opts.shard_bytes)
        self.lt_starts = np.cumsum([0] + self.lt_counts)
        self._next = 0
        self._lt_files: dict[int, SafetensorsShard] = {}  # layer position -> file of current lt shard
        self._lt_shard = -1
        self._rest_files: dict[int, SafetensorsShard] = {}
        self._rest_shard = -1  # index among rest shards
        self._rest_counts: list[int] = []  # prompts per rest shard
        self._rest_tokens: list[int] = []  # tokens per rest shard
        self._rest_bytes = 0
        self._records: list[_PromptRecord] = []
        self._texts: list[str] = []
        self._labels: list[Any] = []
        self._sample_ids: list[int] = []
        self._token_ids: list[list[int] | None] = []
        self._any_token_ids = False
        self._token_ppl: list[list[float] | None] = []
        self._token_strings: list[list[str] | None] = []
        self._extra: dict[str, list[Any]] = {}
        self._logits_k: int | None = None if opts.logits_topk in (None, 0) else opts.logits_topk
        self._logits_wanted = opts.logits_topk != 0
        self._logits_counts: list[int] = []
        self._logits_file: SafetensorsShard | None = None
        self._logits_shard = -1
        self._logits_rows = 0

    # ---- helpers ----
    def _hidden_path(self, layer: int, shard: int) -> Path:
        return self.tmp_path / self.options.file_pattern.format(layer=layer, shard=shard)

    def _hidden_slot(self, layer: int) -> TensorSlot:
        return TensorSlot(self.options.key_pattern.format(layer=layer), self.code, self.itemsize, (self.spec.d_model,))

    def _open_lt_shard(self, shard: int) -> None:
        for f in self._lt_files.values():
            f.finish()
        self._lt_shard = shard
        self._lt_files = {
            li: SafetensorsShard(self._hidden_path(layer, shard), [self._hidden_slot(layer)], self.lt_counts[shard])
            for li, layer in enumerate(self.spec.layers)
        }

    def _open_rest_shard(self) -> None:
        for f in self._rest_files.values():
            f.finish()
        self._rest_shard += 1
        self._rest_counts.append(0)
        self._rest_tokens.append(0)
        self._rest_bytes = 0
        shard = len(self.lt_counts) + self._rest_shard
        self._rest_files = {
            li: SafetensorsShard(self._hidden_path(layer, shard), [self._hidden_slot(layer)], None)
            for li, layer in enumerate(self.spec.layers)
        }

    def _logits_slots(self, k: int) -> list[TensorSlot]:
        slots = [TensorSlot(LOGITS_VALUES_KEY, "F32", 4, (k,)), TensorSlot(LOGITS_INDICES_KEY, "I64", 8, (k,))]
        if self.options.upstream_aliases:
            slots += [TensorSlot(UPSTREAM_VALUES_KEY, "F32", 4, (k,)), TensorSlot(UPSTREAM_INDICES_KEY, "I32", 4, (k,))]
        return slots

    # ---- writing ----
    def write_batch(self, batch: Batch) -> None:
        if self._closed:
            if self.final_path.exists():
                return
            raise FormatError("writer is closed", self.tmp_path)
        spec = self.spec
        b, n_layers, t, d = batch.acts_bltd.shape
        if n_layers != len(spec.layers) or d != spec.d_model or t > spec.max_tokens:
            raise ConfigError(
                f"batch shape {batch.acts_bltd.shape} does not fit [B, {len(spec.layers)}, <={spec.max_tokens}, {spec.d_model}]"
            )
        if self._next + b > spec.n_samples:
            raise ConfigError(f"more samples than n_samples={spec.n_samples}", self.tmp_path)
        if b == 0:
            return
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        self._check_extra(batch)
        logits = self._batch_logits(batch)
        self._write_last_token(batch, lengths)
        rest = self._write_rest(batch, lengths) if self.options.storage == "full_sequence" else [(-1, 0)] * b
        if logits is not None:
            self._write_logits(*logits)
        self._record(batch, lengths, rest)
        self._next += b

    def _check_extra(self, batch: Batch) -> None:
        for key in batch.extra:
            if key in RESERVED_COLUMNS and key not in (EXTRA_TOKEN_PERPLEXITY, EXTRA_TOKEN_STRINGS, "label", "text"):
                raise ConfigError(f"extra column {key!r} collides with an lmprobe index column")

    def _batch_logits(self, batch: Batch) -> tuple[np.ndarray, np.ndarray] | None:
        """(values [B, k] float32, indices [B, k] int64), top-k sorted descending, or None."""
        has = batch.logits_topk_values is not None and batch.logits_topk_indices is not None
        if not self._logits_wanted:
            return None
        if self._next == 0 and self._logits_file is None and not self._logits_counts:
            if not has:
                if self.options.logits_topk:
                    raise ConfigError("options['logits_topk'] is set but the batch carries no logits_topk_values/indices")
                self._logits_wanted = False
                return None
            k_batch = int(batch.logits_topk_values.shape[1])
            k = self._logits_k or k_batch
            if k < 1:
                raise ConfigError("logits_topk must be >= 1 when logits are stored")
            self._logits_k = k
            self._logits_counts = fixed_shard_counts(self.spec.n_samples, logits_row_bytes(k), self.options.shard_bytes)
        if not has:
            raise ConfigError("the first batch carried logits; every batch must carry logits_topk_values/indices")
        values = np.asarray(batch.logits_topk_values, dtype=np.float32)
        indices = np.asarray(batch.logits_topk_indices, dtype=np.int64)
        k = self._logits_k
        assert k is not None
        if values.shape != indices.shape or values.ndim != 2 or values.shape[0] != batch.size:
            raise ConfigError(f"logits_topk_values {values.shape} and indices {indices.shape} must both be [B, k]")
        if values.shape[1] < k:
            raise ConfigError(f"batch carries top-{values.shape[1]} logits, the store keeps top-{k}")
        order = np.argsort(-values, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(values, order, 1), np.take_along_axis(indices, order, 1)

    def _pooled_rows(self, acts: np.ndarray, li: int, lengths: np.ndarray) -> np.ndarray:
        """[B, D] float32 pooled (last_token or mean) vectors of layer position `li`."""
        b = acts.shape[0]
        if self.options.pooling == "mean":
            out = np.zeros((b, acts.shape[3]), dtype=np.float32)
            for i in range(b):
                if lengths[i] > 0:
                    out[i] = acts[i, li, : lengths[i]].mean(axis=0, dtype=np.float64)
            return out
        last = np.maximum(lengths - 1, 0)
        out = np.asarray(acts[np.arange(b), li, last], dtype=np.float32)
        out[lengths == 0] = 0
        return out

    def _write_last_token(self, batch: Batch, lengths: np.ndarray) -> None:
        acts = batch.acts_bltd
        pos = 0
        while pos < batch.size:
            g = self._next + pos
            shard = int(np.searchsorted(self.lt_starts, g, side="right") - 1)
            if shard != self._lt_shard:
                self._open_lt_shard(shard)
            first = g - int(self.lt_starts[shard])
            take = min(batch.size - pos, self.lt_counts[shard] - first)
            sel = slice(pos, pos + take)
            for li in range(len(self.spec.layers)):
                rows = self._pooled_rows(acts[sel], li, lengths[sel])
                self._lt_files[li].write_rows(0, first, _encode(rows, self.spec.dtype))
            pos += take

    def _write_rest(self, batch: Batch, lengths: np.ndarray) -> list[tuple[int, int]]:
        """Append every prompt's tokens but the last to sequence shards; return (rest shard, row) per prompt."""
        groups: list[tuple[int, list[int]]] = []  # (rest shard, prompts in this batch)
        out: list[tuple[int, int]] = []
        for i in range(batch.size):
            n_rest = max(int(lengths[i]) - 1, 0)
            nbytes = n_rest * self.row_bytes
            if self._rest_shard < 0 or (self._rest_counts[-1] > 0 and self._rest_bytes + nbytes > self.options.shard_bytes):
                self._flush_rest_groups(batch, lengths, groups)
                groups = []
                self._open_rest_shard()
            if not groups or groups[-1][0] != self._rest_shard:
                groups.append((self._rest_shard, []))
            groups[-1][1].append(i)
            out.append((self._rest_shard, self._rest_tokens[-1]))
            self._rest_counts[-1] += 1
            self._rest_tokens[-1] += n_rest
            self._rest_bytes += nbytes
        self._flush_rest_groups(batch, lengths, groups)
        return out

    def _flush_rest_groups(self, batch: Batch, lengths: np.ndarray, groups: list[tuple[int, list[int]]]) -> None:
        for _, prompts in groups:
            parts = [(i, int(lengths[i]) - 1) for i in prompts if lengths[i] > 1]
            if not parts:
                continue
            for li in range(len(self.spec.layers)):
                rows = np.concatenate([batch.acts_bltd[i, li, :n] for i, n in parts], axis=0)
                self._rest_files[li].append(_encode(rows, self.spec.dtype))

    def _write_logits(self, values: np.ndarray, indices: np.ndarray) -> None:
        assert self._logits_k is not None
        starts = np.cumsum([0] + self._logits_counts)
        pos = 0
        while pos < len(values):
            g = self._next + pos
            shard = int(np.searchsorted(starts, g, side="right") - 1)
            if shard != self._logits_shard:
                if self._logits_file is not None:
                    self._logits_file.finish()
                path = self.tmp_path / LOGITS_FILE_PATTERN.format(shard=shard)
                self._logits_file = SafetensorsShard(path, self._logits_slots(self._logits_k), self._logits_counts[shard])
                self._logits_shard = shard
            first = g - int(starts[shard])
            take = min(len(values) - pos, self._logits_counts[shard] - first)
            v, ix = values[pos : pos + take], indices[pos : pos + take]
            f = self._logits_file
            f.write_rows(0, first, v)
            f.write_rows(1, first, ix)
            if self.options.upstream_aliases:
                f.write_rows(2, first, v)
                f.write_rows(3, first, ix.astype(np.int32))
            pos += take

    def _record(self, batch: Batch, lengths: np.ndarray, rest: list[tuple[int, int]]) -> None:
        b = batch.size
        texts = batch.texts if batch.texts is not None else batch.extra.get("text")
        for i in range(b):
            g = self._next + i
            shard = int(np.searchsorted(self.lt_starts, g, side="right") - 1)
            self._records.append(_PromptRecord(shard, g - int(self.lt_starts[shard]), rest[i][0], rest[i][1], int(lengths[i])))
            self._texts.append("" if texts is None else str(texts[i]))
            self._sample_ids.append(int(batch.sample_ids[i]))
        if batch.labels is not None:
            self._labels += [None if int(x) < 0 else int(x) for x in np.asarray(batch.labels)]
        elif "label" in batch.extra:
            self._labels += [_plain(x) for x in batch.extra["label"]]
        else:
            self._labels += [None] * b
        if batch.token_ids is not None:
            self._any_token_ids = True
            ids = np.asarray(batch.token_ids, dtype=np.int64)
            self._token_ids += [ids[i, : lengths[i]].tolist() for i in range(b)]
        else:
            self._token_ids += [None] * b
        for key, store in ((EXTRA_TOKEN_PERPLEXITY, self._token_ppl), (EXTRA_TOKEN_STRINGS, self._token_strings)):
            column = batch.extra.get(key)
            store += [None if column is None or column[i] is None else _plain(list(column[i])) for i in range(b)]
        for key, column in batch.extra.items():
            if key in (EXTRA_TOKEN_PERPLEXITY, EXTRA_TOKEN_STRINGS, "label", "text"):
                continue
            values = self._extra.setdefault(key, [None] * (self._next))
            values += [_plain(column[i]) for i in range(b)]
        for key, values in self._extra.items():
            if len(values) < self._next + b:
                values += [None] * (self._next + b - len(values))

    # ---- publishing ----
    def close(self) -> Path:
        if self._closed:
            if self.final_path.exists():
                return self.final_path
            raise FormatError("writer was aborted", self.tmp_path)
        spec = self.spec
        if self._next != spec.n_samples:
            raise ConfigError(f"wrote {self._next} samples but n_samples={spec.n_samples}", self.tmp_path)
        for f in list(self._lt_files.values()) + list(self._rest_files.values()):
            f.finish()
        if self._logits_file is not None:
            self._logits_file.finish()
        full = self.options.storage == "full_sequence"
        if full and sum(self._rest_tokens) == 0:  # no token beyond the last: no sequence shards (as upstream)
            for r in range(len(self._rest_counts)):
                for layer in spec.layers:
                    self._hidden_path(layer, len(self.lt_counts) + r).unlink(missing_ok=True)
            self._rest_counts, self._rest_tokens = [], []
            self._records = [_PromptRecord(r.lt_shard, r.lt_row, -1, 0, r.n_tokens) for r in self._records]
        table = self._index_table()
        path = self.tmp_path / INDEX_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        import pyarrow.parquet as pq

        pq.write_table(table, path)
        self._closed = True
        return publish_dir(self.tmp_path, self.final_path)

    def _descriptors(self) -> dict[str, Any]:
        spec, opts = self.spec, self.options
        hidden: dict[str, Any] = {
            "type": "hidden",
            "layers": list(spec.layers),
            "dim": spec.d_model,
            "dtype": spec.dtype,
            "layout": "per_layer",
            "file_pattern": opts.file_pattern,
            "key_pattern": opts.key_pattern,
            "storage": opts.storage,
            "pooling": opts.pooling,
            "row_bytes": self.row_bytes,
        }
        if opts.storage == "full_sequence":
            hidden["last_token_shards"] = len(self.lt_counts)
            hidden["shards"] = [{"num_prompts": c, "num_tokens": c} for c in self.lt_counts] + [
                {"num_prompts": c, "num_tokens": t} for c, t in zip(self._rest_counts, self._rest_tokens)
            ]
        else:
            hidden["shards"] = [{"num_prompts": c} for c in self.lt_counts]
        out = {"hidden_layers": hidden}
        if self._logits_k is not None and self._logits_counts:
            out["logits_topk"] = {
                "type": "logits_topk",
                "k": self._logits_k,
                "dtype": "float32",
                "indices_dtype": "int64",
                "pooling": "last_token",
                "file_pattern": LOGITS_FILE_PATTERN,
                "row_bytes": logits_row_bytes(self._logits_k),
                "shards": [
                    {"file": LOGITS_FILE_PATTERN.format(shard=s), "num_prompts": c}
                    for s, c in enumerate(self._logits_counts)
                ],
            }
        return out

    def _index_table(self) -> Any:
        import pyarrow as pa

        spec, n = self.spec, self.spec.n_samples
        recs = self._records
        cols: dict[str, Any] = {"text": pa.array(self._texts, type=pa.string())}
        labels = self._labels
        if all(x is None or (isinstance(x, int) and not isinstance(x, bool)) for x in labels):
            cols["label"] = pa.array(labels, type=pa.int32())
        else:
            cols["label"] = pa.array([None if x is None else str(x) for x in labels], type=pa.string())
        cols["num_tokens"] = pa.array([r.n_tokens for r in recs], type=pa.int32())
        cols["shard_index"] = pa.array([r.lt_shard for r in recs], type=pa.int32())
        cols["row_offset"] = pa.array([r.lt_row for r in recs], type=pa.int32())
        if self.options.storage == "full_sequence":
            cols["token_offset"] = pa.array([r.lt_row for r in recs], type=pa.int64())
            ids, offs = [], []
            for r in recs:
                n_rest = max(r.n_tokens - 1, 0) if r.rest_shard >= 0 else 0
                shard = len(self.lt_counts) + r.rest_shard
                head_ids = [shard] * n_rest
                head_offs = list(range(r.rest_row, r.rest_row + n_rest))
                tail = r.n_tokens > 0
                ids.append(head_ids + ([r.lt_shard] if tail else []))
                offs.append(head_offs + ([r.lt_row] if tail else []))
            cols["token_shard_ids"] = pa.array(ids, type=pa.list_(pa.int64()))
            cols["token_shard_offsets"] = pa.array(offs, type=pa.list_(pa.int64()))
        if self._logits_k is not None and self._logits_counts:
            starts = np.cumsum([0] + self._logits_counts)
            g = np.arange(n, dtype=np.int64)
            shard = np.searchsorted(starts, g, side="right") - 1
            cols["shard_index_logits"] = pa.array(shard.astype(np.int32), type=pa.int32())
            cols["row_offset_logits"] = pa.array((g - starts[shard]).astype(np.int32), type=pa.int32())
        if any(x is not None for x in self._token_ppl):
            stats = [_ppl_stats(x) for x in self._token_ppl]
            for j, name in enumerate(("perplexity_mean", "perplexity_min", "perplexity_max")):
                cols[name] = pa.array([None if s is None else s[j] for s in stats], type=pa.float64())
        if self._any_token_ids:
            cols["token_ids"] = pa.array(self._token_ids, type=pa.list_(pa.int64()))
        if any(x is not None for x in self._token_ppl):
            cols["token_perplexity"] = pa.array(
                [None if x is None else [float(v) for v in x] for x in self._token_ppl], type=pa.list_(pa.float64()))
        if any(x is not None for x in self._token_strings):
            cols["token_strings"] = pa.array(
                [None if x is None else [str(v) for v in x] for x in self._token_strings], type=pa.list_(pa.string()))
        cols["sample_id"] = pa.array(self._sample_ids, type=pa.int64())
        for key, values in self._extra.items():
            try:
                cols[key] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                cols[key] = pa.array([None if v is None else json.dumps(v) for v in values], type=pa.string())
        table = pa.table(cols)
        info = {
            "format_version": FORMAT_VERSION,
            "model": {"name": spec.model_name, "revision": model_revision(spec)},
            "num_prompts": n,
            "prompt_ordering": PROMPT_ORDERING,
            "tensors": self._descriptors(),
            "provenance": build_provenance(spec),
        }
        meta = {f"lmprobe:{k}".encode(): json.dumps(v).encode() for k, v in info.items()}
        meta[ACTLAKE_META_KEY] = json.dumps({
            "content_hash": spec.content_hash(), "family": spec.family, "dataset": spec.dataset,
            "data": _plain(spec.data), "max_tokens": spec.max_tokens, "cls_token": spec.cls_token,
            "machine_id": spec.machine_id, "num_machines": spec.num_machines,
        }).encode()
        return table.replace_schema_metadata(meta)

    def abort(self) -> None:
        self._closed = True


def _ppl_stats(values: list[float] | None) -> tuple[float, float, float] | None:
    if values is None or len(values) == 0:
        return None
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.min()), float(arr.max())


def create_writer(out_root: Path, spec: StoreSpec) -> LmprobeWriter:
    """Format-registry entry point."""
    return LmprobeWriter(out_root, spec)


# --------------------------------------------------------------------------------------------
# Index reading and validation
# --------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_index_metadata(index_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the `lmprobe:` info dict, actlake's own dict) from the parquet footer, JSON-decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not index_path.is_file():
        raise MissingFileError("parquet index is missing", index_path)
    try:
        schema = pq.read_schema(index_path)
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"not a readable parquet file: {exc}", index_path) from None
    info: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    for k, v in (schema.metadata or {}).items():
        key = k.decode("utf-8", "replace")
        if key.startswith("lmprobe:") or k == ACTLAKE_META_KEY:
            try:
                value = json.loads(v.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise MetadataError(f"schema metadata {key!r} is not valid JSON: {exc}", index_path) from None
            if k == ACTLAKE_META_KEY:
                ours = value if isinstance(value, dict) else {}
            else:
                info[key.removeprefix("lmprobe:")] = value
    if not info:
        raise MetadataError("parquet schema carries no 'lmprobe:' metadata (a 1.x dataset?)", index_path)
    return info, ours


REQUIRED_INFO: dict[str, type | tuple[type, ...]] = {
    "format_version": str, "model": dict, "num_prompts": int, "prompt_ordering": str, "tensors": dict,
    "provenance": dict,
}


def check_info(info: dict[str, Any], source: Path) -> None:
    """Raise on a missing/mistyped top-level key or an unreadable major version."""
    for key, typ in REQUIRED_INFO.items():
        if key not in info:
            raise MetadataError(f"schema metadata lacks 'lmprobe:{key}'", source)
        if not isinstance(info[key], typ) or (typ is int and isinstance(info[key], bool)):
            raise MetadataError(f"'lmprobe:{key}' must be {typ.__name__}, got {type(info[key]).__name__}", source)
    m = re.fullmatch(r"(\d+)\.(\d+)", info["format_version"])
    if not m:
        raise MetadataError(f"format_version {info['format_version']!r} is not MAJOR.MINOR", source)
    if int(m.group(1)) != 2:
        raise ProtocolVersionError(f"format_version {info['format_version']} is not readable (this reader speaks 2.x)", source)
    model = info["model"]
    if not isinstance(model.get("name"), str) or not (model.get("revision") is None or isinstance(model.get("revision"), str)):
        raise MetadataError("'lmprobe:model' must be {name: str, revision: str|null}", source)


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
    def parse(cls, desc: Any, source: Path) -> "HiddenDescriptor":
        if not isinstance(desc, dict):
            raise MetadataError("tensors.hidden_layers must be an object", source)

        def need(key: str, ok: Any, what: str) -> Any:
            if key not in desc or not ok(desc[key]):
                raise MetadataError(f"tensors.hidden_layers.{key} must be {what}, got {desc.get(key)!r}", source)
            return desc[key]

        layers = need("layers", lambda v: isinstance(v, list) and v and all(_is_int(x) for x in v) and len(set(v)) == len(v),
                      "a non-empty list of unique integers")
        dim = need("dim", lambda v: _is_int(v) and v > 0, "a positive integer")
        dtype = need("dtype", lambda v: v in HIDDEN_DTYPES, f"one of {sorted(HIDDEN_DTYPES)}")
        need("layout", lambda v: v == "per_layer", "'per_layer'")
        storage = need("storage", lambda v: v in STORAGES, f"one of {STORAGES}")
        file_pattern = _check_pattern(desc.get("file_pattern"), ("layer", "shard"), "tensors.hidden_layers.file_pattern", source)
        key_pattern = _check_pattern(desc.get("key_pattern"), ("layer",), "tensors.hidden_layers.key_pattern", source)
        pooling = desc.get("pooling", "last_token")
        if not isinstance(pooling, str):
            raise MetadataError(f"tensors.hidden_layers.pooling must be a string, got {pooling!r}", source)
        shards = need("shards", lambda v: isinstance(v, list), "a list")
        prompts, tokens = [], []
        for i, s in enumerate(shards):
            if not isinstance(s, dict) or not _is_int(s.get("num_prompts")) or s["num_prompts"] < 0:
                raise MetadataError(f"tensors.hidden_layers.shards[{i}] needs an integer num_prompts >= 0", source)
            prompts.append(s["num_prompts"])
            if storage == "full_sequence":
                if not _is_int(s.get("num_tokens")) or s["num_tokens"] < 0:
                    raise MetadataError(f"tensors.hidden_layers.shards[{i}] needs an integer num_tokens >= 0", source)
                tokens.append(s["num_tokens"])
            else:
                tokens.append(s["num_prompts"])
        lts = len(shards)
        if storage == "full_sequence":
            lts = need("last_token_shards", lambda v: _is_int(v) and 0 <= v <= len(shards),
                       f"an integer in [0, {len(shards)}]")
            for i in range(lts):
                if tokens[i] != prompts[i]:
                    raise MetadataError(f"last-token shard {i} has num_tokens {tokens[i]} != num_prompts {prompts[i]}", source)
        row_bytes = desc.get("row_bytes")
        if row_bytes is not None and not _is_int(row_bytes):
            raise MetadataError(f"tensors.hidden_layers.row_bytes must be an integer, got {row_bytes!r}", source)
        return cls(tuple(layers), dim, dtype, file_pattern, key_pattern, storage, pooling, tuple(prompts),
                   tuple(tokens), lts, row_bytes)

    def file(self, layer: int, shard: int) -> str:
        return self.file_pattern.format(layer=layer, shard=shard)

    def key(self, layer: int) -> str:
        return self.key_pattern.format(layer=layer)


@dataclass(frozen=True)
class LogitsDescriptor:
    """The validated `tensors.logits_topk` descriptor."""

    k: int
    file_pattern: str
    shard_prompts: tuple[int, ...]
    row_bytes: int | None

    @classmethod
    def parse(cls, desc: Any, source: Path) -> "LogitsDescriptor":
        if not isinstance(desc, dict) or not _is_int(desc.get("k")) or desc["k"] < 1:
            raise MetadataError("tensors.logits_topk must be an object with an integer k >= 1", source)
        pattern = _check_pattern(desc.get("file_pattern"), ("shard",), "tensors.logits_topk.file_pattern", source)
        shards = desc.get("shards")
        if not isinstance(shards, list) or not all(isinstance(s, dict) and _is_int(s.get("num_prompts")) for s in shards):
            raise MetadataError("tensors.logits_topk.shards must list {num_prompts: int}", source)
        rb = desc.get("row_bytes")
        return cls(desc["k"], pattern, tuple(s["num_prompts"] for s in shards), rb if _is_int(rb) else None)

    def file(self, shard: int) -> str:
        return self.file_pattern.format(shard=shard)


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


def _column_numpy(table: Any, name: str, dtype: Any) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        col = col.fill_null(-1)
    return np.asarray(col.to_numpy(), dtype=dtype)


def _list_column(table: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat int64 values, [N+1] int64 list offsets) of a list<int> column."""
    import pyarrow as pa

    col = table.column(name).combine_chunks()
    if col.null_count:
        col = pa.array([x if x is not None else [] for x in col.to_pylist()], type=col.type)
    offsets = np.asarray(col.offsets.to_numpy(), dtype=np.int64)
    values = np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=np.int64)
    base = offsets[0]
    return values[base : offsets[-1]], offsets - base


class LmprobeReader(Reader):
    """Reader of an lmprobe 2.0 dataset; prompts are addressed by row, tensors memory-mapped."""

    format = FORMAT

    def __init__(self, path: str | Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError("not a directory", self.path)
        self.index_path = self.path / INDEX_PATH
        self.info, self.actlake_meta = read_index_metadata(self.index_path)
        check_info(self.info, self.index_path)
        tensors = self.info["tensors"]
        if "hidden_layers" not in tensors:
            raise MetadataError("tensors has no hidden_layers descriptor", self.index_path)
        self.hidden = h = HiddenDescriptor.parse(tensors["hidden_layers"], self.index_path)
        self.logits_desc = LogitsDescriptor.parse(tensors["logits_topk"], self.index_path) if "logits_topk" in tensors else None
        try:
            self.table = pq.read_table(self.index_path)
        except (pa.ArrowException, OSError) as exc:
            raise FormatError(f"not a readable parquet file: {exc}", self.index_path) from None
        problems = check_columns(self.table, h, self.logits_desc)
        if problems:
            raise MetadataError(problems[0], self.index_path)
        self.n_samples = self.table.num_rows
        if self.info["num_prompts"] != self.n_samples:
            raise MetadataError(f"num_prompts {self.info['num_prompts']} != {self.n_samples} index rows", self.index_path)
        self.layers = h.layers
        self.d_model = h.dim
        self.stored_dtype = h.dtype
        self.dtype = np.dtype(np.float32) if h.dtype == "bfloat16" else np.dtype(h.dtype)
        self.full_sequence = h.storage == "full_sequence"
        self.shard_index = _column_numpy(self.table, "shard_index", np.int64)
        self.row_offset = _column_numpy(self.table, "row_offset", np.int64)
        self.num_tokens = _column_numpy(self.table, "num_tokens", np.int64)
        if self.full_sequence:
            self.tok_ids, self.tok_bounds = _list_column(self.table, "token_shard_ids")
            self.tok_offs, _ = _list_column(self.table, "token_shard_offsets")
        self._check_addressing()
        # every shard path is resolved (and refused if it escapes the root) before anything is read
        self._files: dict[tuple[int, int], Path] = {}
        for layer in h.layers:
            for shard in range(len(h.shard_prompts)):
                self._files[(layer, shard)] = resolve_inside(self.path, h.file(layer, shard), source=self.index_path)
        self._logits_files: list[Path] = []
        if self.logits_desc is not None:
            self._logits_files = [resolve_inside(self.path, self.logits_desc.file(s), source=self.index_path)
                                  for s in range(len(self.logits_desc.shard_prompts))]
        for f in list(self._files.values()) + self._logits_files:
            if not f.is_file():
                raise MissingFileError("shard described by the index is missing", f)
        self._check_sizes()
        self._maps: dict[tuple[int, int], tuple[np.ndarray, TensorInfo]] = {}
        self._logits_cache: tuple[np.ndarray, np.ndarray] | None = None
        self._meta_cache: dict[str, Any] = {}
        self.max_tokens = self._max_tokens()

    def _check_addressing(self) -> None:
        h, src = self.hidden, self.index_path
        n_lt = h.last_token_shards
        if self.n_samples and (self.shard_index.min() < 0 or self.shard_index.max() >= n_lt):
            raise MetadataError(f"shard_index outside the {n_lt} last-token shards", src)
        counts = np.asarray(h.shard_prompts[:n_lt], dtype=np.int64)
        if self.n_samples and (self.row_offset.min() < 0 or (self.row_offset >= counts[self.shard_index]).any()):
            raise MetadataError("row_offset beyond its shard's num_prompts", src)
        if self.full_sequence:
            if (np.diff(self.tok_bounds) != self.num_tokens).any():
                raise MetadataError("token_shard_ids lengths differ from num_tokens", src)
            rows = np.asarray(h.shard_tokens, dtype=np.int64)
            if len(self.tok_ids) and (self.tok_ids.min() < 0 or self.tok_ids.max() >= len(rows)
                                      or self.tok_offs.min() < 0 or (self.tok_offs >= rows[self.tok_ids]).any()):
                raise MetadataError("token_shard_ids/token_shard_offsets point outside the shards", src)

    def _check_sizes(self) -> None:
        """Refuse a dim / row count the shard files cannot hold, before anything is allocated from it."""
        h = self.hidden
        row = h.dim * HIDDEN_DTYPES[h.dtype][1]
        for (layer, shard), f in self._files.items():
            need = h.shard_tokens[shard] * row
            size = f.stat().st_size
            if size < need:
                raise TruncatedFileError(f"{size} bytes cannot hold the {h.shard_tokens[shard]} x {h.dim} "
                                         f"{h.dtype} rows the index describes ({need} bytes)", f)

    def _max_tokens(self) -> int:
        if not self.full_sequence:
            return 1
        longest = int(self.num_tokens.max()) if self.n_samples else 1
        declared = self.actlake_meta.get("max_tokens")
        if _is_int(declared) and declared > max(longest, MAX_DECLARED_TOKENS):
            raise MetadataError(f"actlake max_tokens {declared} is absurd (longest prompt {longest} tokens)",
                                self.index_path)
        return max(longest, 1, declared if _is_int(declared) else 0)

    # ---- tensors ----
    def tensor(self, layer: int, shard: int) -> np.ndarray:
        """The raw (rows, D) memmap of one shard of one layer (bfloat16 as uint16 bits)."""
        self.layer_index(layer)
        hit = self._maps.get((layer, shard))
        if hit is None:
            hit = self._map_hidden(layer, shard)
            self._maps[(layer, shard)] = hit
        return hit[0]

    def _map_hidden(self, layer: int, shard: int) -> tuple[np.ndarray, TensorInfo]:
        h = self.hidden
        path = self._files[(layer, shard)]
        header = read_safetensors_header(path)
        key = h.key(layer)
        info = header.get(key)
        if info is None:
            raise FormatError(f"tensor {key!r} (key_pattern {h.key_pattern!r}) is not in the file", path)
        code = HIDDEN_DTYPES[h.dtype][0]
        want = (h.shard_tokens[shard], h.dim)
        if info.code != code or info.shape != want:
            raise FormatError(f"tensor {key!r} is {info.code} {list(info.shape)}, the index says {code} {list(want)}", path)
        return map_tensor(path, info), info

    def _decode(self, raw: np.ndarray) -> np.ndarray:
        if self.stored_dtype == "bfloat16":
            return from_bfloat16_bits(raw)
        return np.array(raw, dtype=self.dtype, copy=True)

    # ---- metadata ----
    @property
    def lengths(self) -> np.ndarray:
        """Stored token rows per prompt: num_tokens for full_sequence, 1 for pooled."""
        if self.full_sequence:
            return self.num_tokens
        return np.ones(self.n_samples, dtype=np.int64)

    def _cached(self, name: str, make: Any) -> Any:
        if name not in self._meta_cache:
            self._meta_cache[name] = make()
        return self._meta_cache[name]

    @property
    def sample_ids(self) -> np.ndarray:
        """The `sample_id` column actlake writes; row positions for datasets without it."""
        if "sample_id" in self.table.column_names:
            return self._cached("sample_id", lambda: _column_numpy(self.table, "sample_id", np.int64))
        return np.arange(self.n_samples, dtype=np.int64)

    @property
    def texts(self) -> list[str]:
        return self._cached("text", lambda: [x if x is not None else "" for x in self.table.column("text").to_pylist()])

    @property
    def labels(self) -> np.ndarray | None:
        """int64 labels (-1 for null); None for string labels (see `row(i)['label']`)."""
        import pyarrow as pa

        col = self.table.column("label")
        if not pa.types.is_integer(col.type):
            return None
        return self._cached("label", lambda: _column_numpy(self.table, "label", np.int64))

    @property
    def provenance(self) -> dict[str, Any]:
        return {"model": self.info["model"], "format_version": self.info["format_version"],
                **self.info["provenance"], **({"actlake": self.actlake_meta} if self.actlake_meta else {})}

    def row(self, i: int) -> dict[str, Any]:
        """Every index column of row `i` as plain Python values."""
        s = self.check_sample(i)
        return self.table.slice(s, 1).to_pylist()[0]

    def extra_columns(self) -> list[str]:
        """Index columns that are not part of the spec's addressing (user columns and sample_id)."""
        return [c for c in self.table.column_names if c not in RESERVED_COLUMNS]

    # ---- reads ----
    def get(self, sample: int, layer: int) -> np.ndarray:
        """(num_tokens, D) for full_sequence datasets, (1, D) for pooled ones."""
        s = self.check_sample(sample)
        if not self.full_sequence:
            mm = self.tensor(layer, int(self.shard_index[s]))
            return self._decode(mm[int(self.row_offset[s]) : int(self.row_offset[s]) + 1])
        ids = self.tok_ids[self.tok_bounds[s] : self.tok_bounds[s + 1]]
        offs = self.tok_offs[self.tok_bounds[s] : self.tok_bounds[s + 1]]
        out = np.empty((len(ids), self.d_model), dtype=self.dtype)
        start = 0
        while start < len(ids):  # runs of consecutive rows in one shard: one slice each
            stop = start + 1
            while stop < len(ids) and ids[stop] == ids[start] and offs[stop] == offs[stop - 1] + 1:
                stop += 1
            mm = self.tensor(layer, int(ids[start]))
            out[start:stop] = self._decode(mm[int(offs[start]) : int(offs[start]) + stop - start])
            start = stop
        return out

    def vector(self, sample: int, layer: int, token: int) -> np.ndarray:
        """One (D,) vector: token `token` of a full-sequence prompt (-1: last token)."""
        s = self.check_sample(sample)
        if not self.full_sequence:
            if token not in (0, -1):
                raise SampleIndexError(f"pooled dataset stores one vector per prompt, asked token {token}", self.path)
            return self.get(s, layer)[0]
        n = int(self.num_tokens[s])
        t = token + n if token < 0 else token
        if not 0 <= t < n:
            raise SampleIndexError(f"token {token} out of range for a {n}-token prompt", self.path)
        j = self.tok_bounds[s] + t
        return self._decode(self.tensor(layer, int(self.tok_ids[j]))[int(self.tok_offs[j]) : int(self.tok_offs[j]) + 1])[0]

    def last_token(self, layer: int) -> np.ndarray:
        """(N, D) last-token (or pooled) vectors of one layer: one read per shard."""
        self.layer_index(layer)
        h = self.hidden
        out = np.empty((self.n_samples, self.d_model), dtype=self.dtype)
        order = np.argsort(self.shard_index, kind="stable")
        bounds = np.searchsorted(self.shard_index[order], np.arange(h.last_token_shards + 1))
        for shard in range(h.last_token_shards):
            sel = order[bounds[shard] : bounds[shard + 1]]
            if len(sel) == 0:
                continue
            offs = self.row_offset[sel]
            contiguous = sel[-1] - sel[0] == len(sel) - 1 and offs[-1] - offs[0] == len(sel) - 1 \
                and (np.diff(sel) == 1).all() and (np.diff(offs) == 1).all()
            if contiguous and self.stored_dtype != "bfloat16":
                self._read_rows_into(layer, shard, int(offs[0]), out[sel[0] : sel[-1] + 1])
            else:
                out[sel] = self._decode(self.tensor(layer, shard)[offs])
        return out

    def _read_rows_into(self, layer: int, shard: int, first_row: int, dest: np.ndarray) -> None:
        """One `readinto` of consecutive rows straight into `dest` (no intermediate copy)."""
        hit = self._maps.get((layer, shard))
        if hit is None:
            self.tensor(layer, shard)
            hit = self._maps[(layer, shard)]
        info = hit[1]
        row_bytes = self.d_model * info.np_dtype.itemsize
        view = memoryview(dest).cast("B")
        path = self._files[(layer, shard)]
        with open(path, "rb", buffering=0) as f:
            f.seek(info.start + first_row * row_bytes)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise TruncatedFileError(f"file ended after {got} of {len(view)} bytes", path)
                got += n

    def token_segments(self, layer: int) -> list[TokenSegment]:
        """Pooled float32/float16 datasets: memmap segments per shard; otherwise materialised."""
        self.layer_index(layer)
        if self.full_sequence or self.stored_dtype == "bfloat16":
            return super().token_segments(layer)
        segments = []
        pos = 0
        while pos < self.n_samples:
            shard = int(self.shard_index[pos])
            stop = pos + 1
            while stop < self.n_samples and self.shard_index[stop] == shard:
                stop += 1
            segments.append(TokenSegment(self.tensor(layer, shard), self.row_offset[pos:stop].copy(),
                                         np.ones(stop - pos, dtype=np.int64), pos))
            pos = stop
        return segments

    def logits(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(values [N, k] float32, indices [N, k] int64) of every prompt, or None when not stored."""
        if self.logits_desc is None:
            return None
        k = self.logits_desc.k
        si = _column_numpy(self.table, "shard_index_logits", np.int64)
        ro = _column_numpy(self.table, "row_offset_logits", np.int64)
        # map (and so size-check) every shard before allocating from the descriptor's k
        tensors = [self._logits_tensors(shard, path) for shard, path in enumerate(self._logits_files)]
        counts = np.asarray(self.logits_desc.shard_prompts, dtype=np.int64)
        if self.n_samples and (si.min() < 0 or si.max() >= len(counts) or ro.min() < 0 or (ro >= counts[si]).any()):
            raise MetadataError("shard_index_logits/row_offset_logits point outside the logits shards", self.index_path)
        values = np.empty((self.n_samples, k), dtype=np.float32)
        indices = np.empty((self.n_samples, k), dtype=np.int64)
        for shard, (v, ix) in enumerate(tensors):
            sel = np.nonzero(si == shard)[0]
            values[sel] = v[ro[sel]]
            indices[sel] = ix[ro[sel]]
        return values, indices

    def _logits_tensors(self, shard: int, path: Path) -> tuple[np.ndarray, np.ndarray]:
        assert self.logits_desc is not None
        header = read_safetensors_header(path)
        n, k = self.logits_desc.shard_prompts[shard], self.logits_desc.k
        out = []
        for key, alias in ((LOGITS_VALUES_KEY, UPSTREAM_VALUES_KEY), (LOGITS_INDICES_KEY, UPSTREAM_INDICES_KEY)):
            info = header.get(key) or header.get(alias)
            if info is None:
                raise FormatError(f"logits tensor {key!r} (or {alias!r}) is missing", path)
            if info.shape != (n, k):
                raise FormatError(f"logits tensor {info.key!r} has shape {list(info.shape)}, expected {[n, k]}", path)
            out.append(map_tensor(path, info))
        return out[0], out[1]

    def _batch_meta(self, idx: np.ndarray, acts: np.ndarray, lengths: np.ndarray) -> Batch:
        """Metadata of positions `idx`, with token ids, logits and user columns for conversion."""
        base = super()._batch_meta(idx, acts, lengths)
        token_ids = None
        if "token_ids" in self.table.column_names:
            token_ids = np.zeros((len(idx), acts.shape[2]), dtype=np.int64)
            col = self.table.column("token_ids")
            for b, s in enumerate(idx):
                ids = col[int(s)].as_py() or []
                n = min(len(ids), acts.shape[2])
                token_ids[b, :n] = ids[:n]
        values = indices = None
        if self.logits_desc is not None and self._logits_cache is None:
            self._logits_cache = self.logits()
        lg = self._logits_cache
        if lg is not None:
            values, indices = lg[0][idx], lg[1][idx]
        extra: dict[str, list[Any]] = {}
        for name in self.extra_columns() + [c for c in (EXTRA_TOKEN_PERPLEXITY, EXTRA_TOKEN_STRINGS)
                                            if c in self.table.column_names]:
            if name == "sample_id":
                continue
            col = self.table.column(name)
            extra[name] = [col[int(s)].as_py() for s in idx]
        if self.labels is None:
            col = self.table.column("label")
            extra["label"] = [col[int(s)].as_py() for s in idx]
        return Batch(acts_bltd=base.acts_bltd, lengths=base.lengths, sample_ids=base.sample_ids, texts=base.texts,
                     labels=base.labels, token_ids=token_ids, logits_topk_values=values,
                     logits_topk_indices=indices, extra=extra)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(storage=self.hidden.storage, pooling=self.hidden.pooling, stored_dtype=self.stored_dtype,
                   shards=len(self.hidden.shard_prompts), last_token_shards=self.hidden.last_token_shards,
                   logits_topk=None if self.logits_desc is None else self.logits_desc.k)
        return out

    def close(self) -> None:
        self._maps.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state


# --------------------------------------------------------------------------------------------
# Column checks (shared by the reader and verify)
# --------------------------------------------------------------------------------------------


def check_columns(table: Any, hidden: HiddenDescriptor | None, logits: LogitsDescriptor | None) -> list[str]:
    """Problems with the index columns' presence and exact types (messages without the file name)."""
    import pyarrow as pa

    want: dict[str, Any] = {"text": pa.string(), "num_tokens": pa.int32(), "shard_index": pa.int32(),
                            "row_offset": pa.int32()}
    optional: dict[str, Any] = {
        "perplexity_mean": pa.float64(), "perplexity_min": pa.float64(), "perplexity_max": pa.float64(),
        "token_ids": pa.list_(pa.int64()), "token_perplexity": pa.list_(pa.float64()),
        "token_strings": pa.list_(pa.string()),
    }
    full = {"token_offset": pa.int64(), "token_shard_ids": pa.list_(pa.int64()),
            "token_shard_offsets": pa.list_(pa.int64())}
    logit_cols = {"shard_index_logits": pa.int32(), "row_offset_logits": pa.int32()}
    if hidden is not None and hidden.storage == "full_sequence":
        want.update(full)
    else:
        optional.update(full)
    if logits is not None:
        want.update(logit_cols)
    else:
        optional.update(logit_cols)
    schema = table.schema
    problems = []
    for name, typ in want.items():
        if name not in schema.names:
            problems.append(f"index column {name!r} is missing")
        elif not schema.field(name).type.equals(typ):
            problems.append(f"index column {name!r} has type {schema.field(name).type}, expected {typ}")
    if "label" not in schema.names:
        problems.append("index column 'label' is missing")
    elif schema.field("label").type not in (pa.int32(), pa.string()):
        problems.append(f"index column 'label' has type {schema.field('label').type}, expected int32 or string")
    for name, typ in optional.items():
        if name in schema.names and not schema.field(name).type.equals(typ):
            problems.append(f"index column {name!r} has type {schema.field(name).type}, expected {typ}")
    for name in CORE_COLUMNS[2:] + tuple(k for k in ("token_offset", "shard_index_logits", "row_offset_logits") if k in want):
        if name in schema.names and table.column(name).null_count:
            problems.append(f"index column {name!r} has nulls")
    return problems


# --------------------------------------------------------------------------------------------
# Registry entry points
# --------------------------------------------------------------------------------------------


def detect(path: Path) -> bool:
    """A directory holding `index/train-00000-of-00001.parquet`."""
    return path.is_dir() and (path / INDEX_PATH).is_file()


def open_reader(path: Path) -> LmprobeReader:
    return LmprobeReader(path)


def verify(path: Path) -> list[str]:
    """Check every invariant of the spec; one message per problem, each naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    index = path / INDEX_PATH
    try:
        info, _ = read_index_metadata(index)
        check_info(info, index)
    except FormatError as exc:
        return [str(exc)]
    problems: list[str] = []

    def bad(file: Path, msg: str) -> None:
        problems.append(f"{file}: {msg}")

    try:
        table = pq.read_table(index)
    except (pa.ArrowException, OSError) as exc:
        return [f"{index}: not a readable parquet file: {exc}"]
    tensors = info["tensors"]
    hidden = logits = None
    try:
        hidden = HiddenDescriptor.parse(tensors.get("hidden_layers"), index)
    except FormatError as exc:
        problems.append(str(exc))
    if "logits_topk" in tensors:
        try:
            logits = LogitsDescriptor.parse(tensors["logits_topk"], index)
        except FormatError as exc:
            problems.append(str(exc))
    for msg in check_columns(table, hidden, logits):
        bad(index, msg)
    if info["num_prompts"] != table.num_rows:
        bad(index, f"num_prompts {info['num_prompts']} != {table.num_rows} index rows")
    if problems or hidden is None:
        return problems
    n = table.num_rows
    # ---- hidden descriptor maths ----
    itemsize = HIDDEN_DTYPES[hidden.dtype][1]
    if hidden.row_bytes is None:
        if hidden.storage == "pooled":
            bad(index, "tensors.hidden_layers.row_bytes is missing")
    elif hidden.row_bytes != hidden.dim * itemsize:
        bad(index, f"tensors.hidden_layers.row_bytes {hidden.row_bytes} != dim {hidden.dim} x {itemsize} bytes ({hidden.dtype})")
    if hidden.storage == "pooled" and hidden.pooling not in POOLINGS:
        bad(index, f"tensors.hidden_layers.pooling {hidden.pooling!r} is not one of {POOLINGS}")
    lts = hidden.last_token_shards
    if sum(hidden.shard_prompts[:lts]) != n:
        bad(index, f"last-token shards hold {sum(hidden.shard_prompts[:lts])} prompts, the index has {n} rows")
    # ---- addressing ----
    si = np.asarray(table.column("shard_index").to_numpy(), dtype=np.int64)
    ro = np.asarray(table.column("row_offset").to_numpy(), dtype=np.int64)
    nt = np.asarray(table.column("num_tokens").to_numpy(), dtype=np.int64)
    counts = np.asarray(hidden.shard_prompts[:lts], dtype=np.int64)
    if n and (si.min() < 0 or si.max() >= lts):
        bad(index, f"shard_index outside [0, {lts})")
    elif n:
        if ro.min() < 0 or (ro >= counts[si]).any():
            bad(index, "row_offset beyond its shard's num_prompts")
        elif len(np.unique(si * (int(counts.max()) + 1) + ro)) != n:
            bad(index, "two prompts share one (shard_index, row_offset) last-token row")
    if (nt < 0).any():
        bad(index, "num_tokens has negative values")
    if hidden.storage == "full_sequence":
        ids, bounds = _list_column(table, "token_shard_ids")
        offs, obounds = _list_column(table, "token_shard_offsets")
        rows = np.asarray(hidden.shard_tokens, dtype=np.int64)
        if (np.diff(bounds) != nt).any() or (obounds != bounds).any():
            bad(index, "token_shard_ids / token_shard_offsets lengths differ from num_tokens")
        elif len(ids) and (ids.min() < 0 or ids.max() >= len(rows) or offs.min() < 0 or (offs >= rows[ids]).any()):
            bad(index, "token_shard_ids / token_shard_offsets point outside the shards")
        else:
            has = nt > 0
            last = bounds[1:][has] - 1
            if (ids[last] != si[has]).any() or (offs[last] != ro[has]).any():
                bad(index, "the last token's (shard, offset) differs from (shard_index, row_offset)")
            rest = np.ones(len(ids), dtype=bool)
            rest[last] = False
            if (ids[rest] < lts).any():
                bad(index, "a non-last token points into a last-token shard")
            seq_used = np.bincount(ids[rest], minlength=len(rows))[lts:]
            if (seq_used != rows[lts:]).any():
                bad(index, f"sequence shards hold {rows[lts:].tolist()} tokens, the index addresses {seq_used.tolist()}")
        to = np.asarray(table.column("token_offset").to_numpy(), dtype=np.int64)
        if (to != ro).any():
            bad(index, "token_offset differs from row_offset")
    # ---- hidden shard files ----
    code = HIDDEN_DTYPES[hidden.dtype][0]
    expected_files: set[Path] = set()
    for layer in hidden.layers:
        for shard, rows_n in enumerate(hidden.shard_tokens):
            try:
                f = resolve_inside(path, hidden.file(layer, shard), source=index)
            except UnsafePathError as exc:
                problems.append(str(exc))
                return problems
            expected_files.add(f)
            try:
                header = read_safetensors_header(f)
            except FormatError as exc:
                problems.append(str(exc))
                continue
            key = hidden.key(layer)
            t = header.get(key)
            if t is None:
                bad(f, f"tensor {key!r} is missing (key_pattern {hidden.key_pattern!r})")
            elif t.code != code or t.shape != (rows_n, hidden.dim):
                bad(f, f"tensor {key!r} is {t.code} {list(t.shape)}, expected {code} {[rows_n, hidden.dim]}")
    # ---- logits ----
    if logits is not None:
        if logits.row_bytes != logits_row_bytes(logits.k):
            bad(index, f"tensors.logits_topk.row_bytes {logits.row_bytes} != k x (4 + 8) = {logits_row_bytes(logits.k)}")
        if sum(logits.shard_prompts) != n:
            bad(index, f"logits shards hold {sum(logits.shard_prompts)} prompts, the index has {n} rows")
        lsi = np.asarray(table.column("shard_index_logits").to_numpy(), dtype=np.int64)
        lro = np.asarray(table.column("row_offset_logits").to_numpy(), dtype=np.int64)
        lc = np.asarray(logits.shard_prompts, dtype=np.int64)
        if n and (lsi.min() < 0 or lsi.max() >= len(lc) or lro.min() < 0 or (lro >= lc[np.clip(lsi, 0, len(lc) - 1)]).any()):
            bad(index, "shard_index_logits / row_offset_logits point outside the logits shards")
        for shard, (rows_n, entry) in enumerate(zip(logits.shard_prompts, tensors["logits_topk"]["shards"])):
            try:
                f = resolve_inside(path, logits.file(shard), source=index)
            except UnsafePathError as exc:
                problems.append(str(exc))
                return problems
            expected_files.add(f)
            if "file" in entry and entry["file"] != logits.file(shard):
                bad(index, f"logits shard {shard} lists file {entry['file']!r}, file_pattern gives {logits.file(shard)!r}")
            try:
                header = read_safetensors_header(f)
            except FormatError as exc:
                problems.append(str(exc))
                continue
            for key, want_code in ((LOGITS_VALUES_KEY, "F32"), (LOGITS_INDICES_KEY, "I64"),
                                   (UPSTREAM_VALUES_KEY, "F32"), (UPSTREAM_INDICES_KEY, "I32")):
                t = header.get(key)
                if t is None:
                    if key in (LOGITS_VALUES_KEY, LOGITS_INDICES_KEY):
                        bad(f, f"tensor {key!r} is missing")
                elif t.code != want_code or t.shape != (rows_n, logits.k):
                    bad(f, f"tensor {key!r} is {t.code} {list(t.shape)}, expected {want_code} {[rows_n, logits.k]}")
    for f in sorted(path.rglob("*.safetensors")):
        if f.resolve() not in expected_files:
            bad(f, "safetensors file not described by the index")
    return problems


# --------------------------------------------------------------------------------------------
# Upstream interop: serve a local dataset directory to lmprobe's hub-only loader
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def local_hub(root: str | Path, repo_id: str) -> Iterator[None]:
    """Within the block, `huggingface_hub.hf_hub_download(repo_id, name, ...)` returns `root/name`.

    Upstream lmprobe's `load_activations` / `pull_dataset` only fetch through the hub client
    (imported at call time), so this lets it read an actlake-written directory with no
    network. Other repositories go to the real function. Paths stay inside `root`.
    """
    import huggingface_hub

    original = huggingface_hub.hf_hub_download
    root = Path(root)

    def fake(repo: str, filename: str, *args: Any, **kwargs: Any) -> str:
        if repo != repo_id:
            return original(repo, filename, *args, **kwargs)
        target = resolve_inside(root, filename)
        if not target.is_file():
            raise MissingFileError("requested by lmprobe but not in the dataset", target)
        return str(target)

    huggingface_hub.hf_hub_download = fake
    try:
        yield
    finally:
        huggingface_hub.hf_hub_download = original
