"""gzip-pickle activation shards v1.0 (shared/specs/pickle-shards-v1.md): writer, reader, verify, merge.

Choices where the spec is silent are recorded in docs/formats/pickle.md:
- each machine publishes a self-contained store `<out_root>/pickle-<job16>/machine_XXXX/`
  (`job16`: the first 16 hex of a hash of the StoreSpec without `machine_id`, `n_samples` and
  `provenance`, so every machine of one job shares the parent); `merge` joins such stores;
- shard ids start at 1 (as in the spec's example); shards hold every extracted layer of their
  samples and close once their raw float32 activation bytes reach `shard_bytes`;
- `activation` holds the real tokens only ([token_count, hidden]); `shape` is its shape;
- actlake keeps its extras under keys the spec's loader never reads: `label` and the full
  `text` (when longer than the preview) in each item's `metadata`, and a top-level `actlake`
  object in metadata.json (sample ids, lengths, labels, provenance, the spec hash);
- shards are pickled with protocol 5 and compressed with gzip level 1 (activations are high
  entropy); both are options.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import time
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

import numpy as np

from ..atomic import fsync_dir, fsync_file, publish_dir, resolve_inside, write_json_atomic
from ..batch import Batch
from ..errors import (
    ConfigError,
    DuplicateSampleError,
    FormatError,
    HashMismatchError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
    TruncatedFileError,
    UnsafePathError,
    UnsafePickleError,
)
from ..reader import Reader
from ..safe_pickle import safe_load
from ..spec import StoreSpec
from ..writer import Writer

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
ITEM_KEYS = ("sample_idx", "activation", "shape", "text_preview", "metadata")
_CHUNK = 1 << 20


def shard_filename(shard_id: int, compressed: bool = True) -> str:
    """`shard_{id:04d}.pkl.gz` (or `.pkl` uncompressed)."""
    return f"shard_{shard_id:04d}.pkl{'.gz' if compressed else ''}"


def layer_key(layer: int) -> str:
    """Top-level shard key of one layer: `layer_{idx}`."""
    return f"layer_{layer}"


def utc_now_iso() -> str:
    """ISO 8601 UTC timestamp with a `Z` suffix, as in the spec's example."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy; other tools pickle numpy ints), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _plain(obj: Any) -> Any:
    """A JSON-able copy of `obj` (numpy scalars to Python, tuples to lists, paths to strings)."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


# --------------------------------------------------------------------------------------------
# Options and metadata
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PickleOptions:
    """Writer knobs read from `StoreSpec.options` (unknown keys belong to other formats)."""

    shard_bytes: int = DEFAULT_SHARD_BYTES
    compressed: bool = True
    compresslevel: int = DEFAULT_COMPRESSLEVEL
    pickle_protocol: int = DEFAULT_PICKLE_PROTOCOL

    def __post_init__(self) -> None:
        if not _is_int(self.shard_bytes) or self.shard_bytes < 1:
            raise ConfigError(f"shard_bytes must be a positive integer, got {self.shard_bytes!r}")
        if not isinstance(self.compressed, bool):
            raise ConfigError(f"compressed must be true or false, got {self.compressed!r}")
        if not _is_int(self.compresslevel) or not 0 <= self.compresslevel <= 9:
            raise ConfigError(f"compresslevel must be 0..9, got {self.compresslevel!r}")
        if self.pickle_protocol not in (4, 5):
            raise ConfigError(f"pickle_protocol must be 4 or 5, got {self.pickle_protocol!r}")

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> "PickleOptions":
        o = spec.options
        return cls(
            shard_bytes=int(o.get("shard_bytes", DEFAULT_SHARD_BYTES)),
            compressed=_as_bool(o.get("compressed", True)),
            compresslevel=int(o.get("compresslevel", DEFAULT_COMPRESSLEVEL)),
            pickle_protocol=int(o.get("pickle_protocol", DEFAULT_PICKLE_PROTOCOL)),
        )


def _as_bool(value: Any) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    if isinstance(value, (bool, int)):
        return bool(value)
    raise ConfigError(f"expected a boolean, got {value!r}")


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
    def from_json(cls, i: int, obj: Any, source: Path) -> "ShardInfo":
        if not isinstance(obj, dict):
            raise MetadataError(f"shards[{i}] must be a JSON object", source)
        for name in ("shard_id", "size_bytes", "num_samples"):
            if not _is_int(obj.get(name)) or obj[name] < 0:
                raise MetadataError(f"shards[{i}].{name} must be a non-negative integer, got {obj.get(name)!r}", source)
        filename = obj.get("filename")
        if not isinstance(filename, str) or not filename:
            raise MetadataError(f"shards[{i}].filename must be a non-empty string", source)
        layers = obj.get("layers")
        if not isinstance(layers, list) or not all(_is_int(x) for x in layers):
            raise MetadataError(f"shards[{i}].layers must be a list of integers", source)
        compressed = obj.get("compressed", filename.endswith(".gz"))
        if not isinstance(compressed, bool):
            raise MetadataError(f"shards[{i}].compressed must be a boolean", source)
        rng = obj.get("sample_id_range")
        if rng is not None and not (isinstance(rng, list) and len(rng) == 2 and all(_is_int(x) for x in rng)):
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
        if _is_int(ext.get("d_model")):
            return ext["d_model"]
        params = self.extraction_config.get("model_params")
        if isinstance(params, dict) and _is_int(params.get("hidden_size")):
            return params["hidden_size"]
        return None

    @classmethod
    def from_json(cls, obj: Any, source: Path) -> "PickleMetadata":
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
        if not isinstance(layers, list) or not layers or not all(_is_int(x) for x in layers) \
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


def read_metadata(path: Path) -> PickleMetadata:
    """Validated metadata.json of a pickle-shard directory."""
    source = Path(path) / "metadata.json"
    if not source.is_file():
        raise MissingFileError("required file metadata.json is missing", source)
    try:
        obj = json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MetadataError(f"not valid UTF-8 JSON: {exc}", source) from exc
    return PickleMetadata.from_json(obj, source)


def shard_path(root: Path, info: ShardInfo) -> Path:
    """The file of one shard entry, refusing names that leave the store directory."""
    p = resolve_inside(root, info.filename, source=root / "metadata.json")
    if p.parent != Path(root).resolve():
        raise UnsafePathError(f"shard filename {info.filename!r} must name a file directly in the store", root / "metadata.json")
    return p


# --------------------------------------------------------------------------------------------
# Shard bytes: write with an inline sha256, load with the restricted unpickler
# --------------------------------------------------------------------------------------------


class _HashingWriter:
    """A write-only file wrapper that hashes and counts every byte as it is written."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._raw.flush()


class _HashingReader:
    """A read-only file wrapper that (optionally) hashes every byte read from it."""

    def __init__(self, raw: IO[bytes], hashing: bool) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256() if hashing else None

    def _seen(self, data: Any) -> None:
        if self.sha256 is not None:
            self.sha256.update(data)

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self._seen(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self._raw.readinto(buf)
        self._seen(memoryview(buf)[:n])
        return n

    def readline(self, limit: int = -1) -> bytes:
        data = self._raw.readline(limit)
        self._seen(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


def write_shard(path: Path, shard: dict[str, Any], options: PickleOptions) -> tuple[int, str]:
    """Pickle (and gzip) `shard` to `path`, fsynced; return (size in bytes, "sha256:<hex>").

    The checksum is computed over the bytes as they are written (no second pass).
    """
    with open(path, "wb") as raw:
        out = _HashingWriter(raw)
        if options.compressed:
            with gzip.GzipFile(filename="", mode="wb", compresslevel=options.compresslevel,
                               fileobj=out, mtime=0) as gz:  # type: ignore[arg-type]
                _dump(shard, gz, options.pickle_protocol)
        else:
            _dump(shard, out, options.pickle_protocol)
        raw.flush()
        os.fsync(raw.fileno())
    return out.size, f"sha256:{out.sha256.hexdigest()}"


def _dump(obj: Any, f: Any, protocol: int) -> None:
    import pickle

    pickle.Pickler(f, protocol=protocol).dump(obj)


def load_shard_file(path: Path, *, compressed: bool, checksum: str | None = None,
                    verify_checksum: bool = False) -> Any:
    """Load one shard with the restricted unpickler; typed errors for truncation and corruption."""
    want = None
    if verify_checksum:
        m = CHECKSUM_RE.match(checksum or "")
        if m is None:
            raise MetadataError(f"shard has no sha256 checksum to verify (got {checksum!r})", path)
        want = m.group(1)
    if not path.is_file():
        raise MissingFileError("shard listed in metadata.json is missing", path)
    with open(path, "rb") as raw:
        reader = _HashingReader(raw, True) if want is not None else None
        stream: Any = raw if reader is None else reader
        try:
            if compressed:
                with gzip.GzipFile(fileobj=stream, mode="rb") as gz:
                    obj = safe_load(gz, source=path)  # type: ignore[arg-type]
            else:
                obj = safe_load(stream, source=path)
        except UnsafePickleError as exc:
            cause = exc.__cause__
            if isinstance(cause, EOFError) or "truncated" in str(cause):
                raise TruncatedFileError(f"shard ends early ({cause})", path) from exc
            if isinstance(cause, (gzip.BadGzipFile, zlib.error, OSError)):
                raise FormatError(f"not a valid gzip stream ({cause})", path) from exc
            raise
        if reader is not None:
            reader.drain()
            got = reader.sha256.hexdigest()  # type: ignore[union-attr]
            if got != want:
                raise HashMismatchError(f"checksum sha256:{got} does not match metadata.json sha256:{want}", path)
    return obj


def file_sha256(path: Path) -> str:
    """`sha256:<hex>` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


@dataclass(frozen=True)
class ShardContent:
    """What one loaded shard says about its samples (first layer's item order)."""

    sample_ids: np.ndarray
    rows: np.ndarray  # activation rows per sample
    token_counts: np.ndarray
    labels: np.ndarray | None
    texts: list[str]


def check_shard(data: Any, info: ShardInfo, layers: Sequence[int], d_model: int | None, path: Path) -> ShardContent:
    """Validate the structure of a loaded shard against its metadata entry; raise FormatError."""
    if not isinstance(data, dict):
        raise FormatError(f"shard must hold a dict, got {type(data).__name__}", path)
    if set(info.layers) != set(layers):
        raise MetadataError(f"shard {info.filename} holds layers {list(info.layers)}, expected every extracted "
                            f"layer {list(layers)}", path)
    first: list[int] | None = None
    rows: list[int] = []
    counts: list[int] = []
    labels: list[int] = []
    texts: list[str] = []
    for layer in layers:
        key = layer_key(layer)
        items = data.get(key)
        if not isinstance(items, list):
            raise FormatError(f"key {key!r} is missing or not a list", path)
        if len(items) != info.num_samples:
            raise FormatError(f"{key} has {len(items)} items, metadata.json says num_samples={info.num_samples}", path)
        ids = []
        for j, item in enumerate(items):
            if not isinstance(item, dict) or "activation" not in item or not _is_int(item.get("sample_idx")):
                raise FormatError(f"{key}[{j}] must be a dict with an integer sample_idx and an activation", path)
            act = item["activation"]
            if not isinstance(act, np.ndarray) or act.ndim != 2 or act.dtype.kind != "f":
                raise FormatError(f"{key}[{j}].activation must be a 2-D float array", path)
            if d_model is None:
                d_model = int(act.shape[1])  # a store without hidden_size: the first activation sets it
            if act.shape[1] != d_model:
                raise FormatError(f"{key}[{j}].activation has width {act.shape[1]}, expected {d_model}", path)
            ids.append(int(item["sample_idx"]))
            if first is None:
                meta = item.get("metadata") if isinstance(item.get("metadata"), dict) else {}
                count = meta.get("token_count")
                rows.append(act.shape[0])
                counts.append(int(count) if _is_int(count) and 0 <= count <= act.shape[0] else act.shape[0])
                label = meta.get("label")
                labels.append(int(label) if _is_int(label) else -1)
                text = meta.get("text")
                preview = item.get("text_preview")
                texts.append(text if isinstance(text, str) else preview if isinstance(preview, str) else "")
        if first is None:
            first = ids
        elif ids != first:
            raise FormatError(f"{key} lists samples in another order than {layer_key(layers[0])}", path)
    has_labels = any(x != -1 for x in labels)
    return ShardContent(np.asarray(first or [], dtype=np.int64), np.asarray(rows, dtype=np.int64),
                        np.asarray(counts, dtype=np.int64),
                        np.asarray(labels, dtype=np.int64) if has_labels else None, texts)


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


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


def _first(*values: Any) -> Any:
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
    return _plain({
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
    return _plain({
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


@dataclass
class _Pending:
    """Samples buffered for the shard being filled."""

    items: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)  # [sample][layer]
    sample_ids: list[int] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    labels: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = 0


class PickleWriter(Writer):
    """Buffers samples up to `shard_bytes` of float32 activations, then writes one shard.

    Works under `<parent>/.tmp-machine_XXXX/`; each committed shard is renamed from `.partial`
    and followed by a `.shard_XXXX.json` sidecar (its metadata entry and sample index), so an
    interrupted writer reopened with the same spec resumes after its last committed shard.
    `close()` writes metadata.json and publishes the directory read-only.
    """

    def __init__(self, out_root: Path, spec: StoreSpec) -> None:
        self.spec = spec
        self.options = PickleOptions.from_spec(spec)
        if spec.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ConfigError(f"pickle shards hold float32 activations; cannot take dtype {spec.dtype!r}")
        self.final_path = store_path(out_root, spec)
        self.parent = self.final_path.parent
        self.tmp_path = self.parent / f".tmp-{self.final_path.name}"
        self.spec_hash = spec.content_hash()
        self._closed = False
        self._started = time.monotonic()
        self._batch_size: int | None = None
        self._pending = _Pending()
        self._shards: list[ShardInfo] = []
        self._index: list[dict[str, Any]] = []
        self._seen: set[int] = set()
        self._has_labels = False
        self._has_texts = False
        self.parent.mkdir(parents=True, exist_ok=True)
        if self.final_path.exists():
            self._check_published()
            self.resume_from = spec.n_samples
            self._closed = True
            return
        self._open_tmp()

    def _check_published(self) -> None:
        md = read_metadata(self.final_path)
        ext = md.extension or {}
        if ext.get("spec_hash") != self.spec_hash:
            raise ConfigError(f"a different pickle store is already published here (spec hash "
                              f"{ext.get('spec_hash')!r}, this spec {self.spec_hash}); remove it or use another "
                              f"out root", self.final_path)

    def _open_tmp(self) -> None:
        tmp = self.tmp_path
        progress = tmp / "progress.json"
        try:
            state = json.loads(progress.read_text(encoding="utf-8"))
            if state.get("spec_hash") != self.spec_hash:
                raise ValueError("another spec")
            self._restore(state)
        except (OSError, ValueError, KeyError, TypeError, FormatError):
            _remove_tmp(tmp)
            tmp.mkdir(parents=True)
            write_json_atomic(progress, {"spec_hash": self.spec_hash, "started_at": utc_now_iso(),
                                         "elapsed_seconds": 0.0})
            self._shards, self._index, self._seen = [], [], set()
        self.resume_from = sum(s.num_samples for s in self._shards)

    def _restore(self, state: dict[str, Any]) -> None:
        """Keep the shards committed by an interrupted run (those with a sidecar); drop the rest."""
        tmp = self.tmp_path
        self._started -= float(state.get("elapsed_seconds", 0.0))
        committed = set()
        k = 1
        while (tmp / f".shard_{k:04d}.json").is_file():
            side = json.loads((tmp / f".shard_{k:04d}.json").read_text(encoding="utf-8"))
            info = ShardInfo.from_json(k - 1, side["info"], tmp)
            if not (tmp / info.filename).is_file() or (tmp / info.filename).stat().st_size != info.size_bytes:
                break
            self._shards.append(info)
            self._index.append(side["index"])
            self._seen.update(side["index"]["sample_ids"])
            self._has_labels |= side["index"]["labels"] is not None
            self._has_texts |= bool(side["index"].get("has_texts"))
            self._batch_size = side.get("batch_size", self._batch_size)
            committed.update({info.filename, f".shard_{k:04d}.json"})
            k += 1
        for f in tmp.iterdir():
            if f.name not in committed and f.name != "progress.json":
                f.unlink()

    # ---- writing ----
    def write_batch(self, batch: Batch) -> None:
        if self._closed:
            if self.final_path.exists():
                return
            raise FormatError("writer is closed", self.tmp_path)
        spec = self.spec
        b, n_layers, t, d = batch.acts_bltd.shape
        if n_layers != len(spec.layers) or d != spec.d_model or t > spec.max_tokens:
            raise ConfigError(f"batch shape {batch.acts_bltd.shape} does not fit [B, {len(spec.layers)}, "
                              f"<={spec.max_tokens}, {spec.d_model}]", self.tmp_path)
        if self.written + b > spec.n_samples:
            raise ConfigError(f"more samples than n_samples={spec.n_samples}", self.tmp_path)
        self._batch_size = max(self._batch_size or 0, b)
        ids = np.asarray(batch.sample_ids, dtype=np.int64)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        dataset_idx = batch.extra.get("dataset_idx")
        self._has_texts |= batch.texts is not None
        self._has_labels |= batch.labels is not None
        for k in range(b):
            sid = int(ids[k])
            if sid in self._seen:
                raise ConfigError(f"sample id {sid} was already written; sample ids must be unique", self.tmp_path)
            self._seen.add(sid)
            n = int(lengths[k])
            row_bytes = n_layers * n * d * 4
            if self._pending.items and self._pending.nbytes + row_bytes > self.options.shard_bytes:
                self._flush()
            text = "" if batch.texts is None else str(batch.texts[k])
            label = None if batch.labels is None else int(batch.labels[k])
            meta: dict[str, Any] = {
                "token_count": n,
                "dataset_idx": sid if dataset_idx is None else int(dataset_idx[k]),
                "machine_id": spec.machine_id,
            }
            if label is not None:
                meta["label"] = label
            preview = text[:PREVIEW_CHARS]
            if len(text) > PREVIEW_CHARS:
                meta["text"] = text  # one string object: pickle stores it once per shard
            layer_items = []
            for j in range(n_layers):
                act = batch.acts_bltd[k, j, :n].astype(np.float32)  # a copy: the caller may reuse its buffer
                layer_items.append({"sample_idx": sid, "activation": act, "shape": tuple(act.shape),
                                    "text_preview": preview, "metadata": dict(meta)})
            p = self._pending
            p.items.append(layer_items)
            p.sample_ids.append(sid)
            p.lengths.append(n)
            p.labels.append(-1 if label is None else label)
            p.nbytes += row_bytes
            if p.nbytes >= self.options.shard_bytes:
                self._flush()

    @property
    def written(self) -> int:
        """Samples received so far (committed shards plus the buffer)."""
        return sum(s.num_samples for s in self._shards) + len(self._pending.sample_ids)

    def _flush(self) -> None:
        """Write the buffered samples as the next shard and commit it (rename, then sidecar)."""
        p = self._pending
        if not p.items:
            return
        shard_id = len(self._shards) + 1
        layers = self.spec.layers
        shard = {layer_key(layer): [row[j] for row in p.items] for j, layer in enumerate(layers)}
        name = shard_filename(shard_id, self.options.compressed)
        partial = self.tmp_path / f"{name}.partial"
        size, checksum = write_shard(partial, shard, self.options)
        os.replace(partial, self.tmp_path / name)
        info = ShardInfo(shard_id, name, size, len(p.sample_ids), tuple(layers),
                         (min(p.sample_ids), max(p.sample_ids)), self.options.compressed, checksum)
        index = {"sample_ids": p.sample_ids, "lengths": p.lengths,
                 "labels": p.labels if self._has_labels else None, "has_texts": self._has_texts}
        write_json_atomic(self.tmp_path / f".shard_{shard_id:04d}.json",
                          {"info": info.to_json(), "index": index, "batch_size": self._batch_size}, indent=None)
        write_json_atomic(self.tmp_path / "progress.json",
                          {"spec_hash": self.spec_hash, "elapsed_seconds": time.monotonic() - self._started})
        self._shards.append(info)
        self._index.append(index)
        self._pending = _Pending()

    def close(self) -> Path:
        if self._closed:
            if self.final_path.exists():
                return self.final_path
            raise FormatError("writer was aborted", self.tmp_path)
        self._flush()
        if self.written != self.spec.n_samples:
            raise ConfigError(f"wrote {self.written} samples but the spec says n_samples={self.spec.n_samples}",
                              self.tmp_path)
        duration = float(self.spec.provenance.get("extraction_duration_seconds", time.monotonic() - self._started))
        write_json_atomic(self.tmp_path / "metadata.json", self._metadata(duration))
        for f in self.tmp_path.glob(".shard_*.json"):
            f.unlink()
        (self.tmp_path / "progress.json").unlink()
        self._closed = True
        return publish_dir(self.tmp_path, self.final_path)

    def _metadata(self, duration: float) -> dict[str, Any]:
        spec = self.spec
        sample_ids = [i for idx in self._index for i in idx["sample_ids"]]
        lengths = [n for idx in self._index for n in idx["lengths"]]
        labels = None
        if self._has_labels:
            labels = [x for idx in self._index for x in (idx["labels"] or [-1] * len(idx["sample_ids"]))]
        return {
            "version": VERSION,
            "created_at": utc_now_iso(),
            "extraction_config": extraction_config(spec, self._batch_size),
            "distributed_config": distributed_config(spec),
            "shards": [s.to_json() for s in self._shards],
            "statistics": statistics(self._shards, spec.layers, duration),
            EXTENSION_KEY: _plain({
                "extension_version": EXTENSION_VERSION,
                "spec_hash": self.spec_hash,
                "model_name": spec.model_name, "family": spec.family, "cls_token": spec.cls_token,
                "dataset": spec.dataset, "data": spec.data, "d_model": spec.d_model,
                "max_tokens": spec.max_tokens, "dtype": "float32", "source_dtype": spec.dtype,
                "n_samples": spec.n_samples, "has_texts": self._has_texts,
                "sample_ids": sample_ids, "lengths": lengths, "labels": labels,
                "provenance": spec.provenance,
            }),
        }

    def abort(self) -> None:
        self._pending = _Pending()
        self._closed = True


def _remove_tmp(tmp: Path) -> None:
    """Delete a temporary directory without chmod-ing its files (they may be hard links to published shards)."""
    if not tmp.exists():
        return
    for dirpath, _, _ in os.walk(tmp):
        Path(dirpath).chmod(Path(dirpath).stat().st_mode | stat.S_IWUSR | stat.S_IXUSR)
    shutil.rmtree(tmp)


def create_writer(out_root: Path, spec: StoreSpec) -> PickleWriter:
    """Format-registry entry point."""
    return PickleWriter(Path(out_root), spec)


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


class PickleReader(Reader):
    """Reads a pickle-shard store: shards loaded lazily, the current one cached.

    Sample positions run through the shards in metadata order, then through each shard's
    items. With actlake's `actlake` metadata key the index comes from metadata.json; for stores
    written by other tools every shard is loaded once at open to build it.
    """

    format = FORMAT

    def __init__(self, path: str | Path, *, verify_checksums: bool = False) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError("not a directory", self.path)
        self.metadata = md = read_metadata(self.path)
        self.verify_checksums = verify_checksums
        self.layers = md.layers
        self.dtype = np.dtype(np.float32)
        self._files = []
        for info in md.shards:
            f = shard_path(self.path, info)
            if not f.is_file():
                raise MissingFileError("shard listed in metadata.json is missing", f)
            if f.stat().st_size != info.size_bytes:
                raise TruncatedFileError(f"size {f.stat().st_size} bytes, metadata.json says {info.size_bytes}", f)
            if set(info.layers) != set(md.layers):
                raise MetadataError(f"shard {info.filename} holds layers {list(info.layers)}; this reader needs every "
                                    f"shard to hold every extracted layer {list(md.layers)}", self.path / "metadata.json")
            self._files.append(f)
        counts = np.array([s.num_samples for s in md.shards], dtype=np.int64)
        self.n_samples = int(counts.sum())
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._cache_index: int | None = None
        self._cache: dict[str, Any] | None = None
        self._cache_content: ShardContent | None = None
        self._texts: list[str] | None = None
        self.d_model: int | None = None  # type: ignore[assignment]
        ext = md.extension
        if ext is not None and "sample_ids" in ext:
            self._index_from_extension(ext)
        else:
            self._index_from_shards()

    def _index_from_extension(self, ext: dict[str, Any]) -> None:
        source = self.path / "metadata.json"
        n = self.n_samples
        try:
            self._sample_ids = np.asarray(ext["sample_ids"], dtype=np.int64).reshape(-1)
            self._lengths = np.asarray(ext["lengths"], dtype=np.int64).reshape(-1)
            labels = ext.get("labels")
            self._labels = None if labels is None else np.asarray(labels, dtype=np.int64).reshape(-1)
            self.d_model = int(ext["d_model"])
            self.max_tokens = int(ext["max_tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MetadataError(f"{EXTENSION_KEY!r} index is malformed: {exc}", source) from exc
        for name, arr in (("sample_ids", self._sample_ids), ("lengths", self._lengths), ("labels", self._labels)):
            if arr is not None and arr.shape != (n,):
                raise MetadataError(f"{EXTENSION_KEY}.{name} has {arr.shape[0]} entries, the shards hold {n} samples", source)
        if n and (self._lengths.min() < 0 or self._lengths.max() > self.max_tokens):
            raise MetadataError(f"{EXTENSION_KEY}.lengths outside [0, {self.max_tokens}]", source)
        if not 0 < self.d_model:
            raise MetadataError(f"{EXTENSION_KEY}.d_model must be positive", source)
        self._has_texts = bool(ext.get("has_texts", True))

    def _index_from_shards(self) -> None:
        md = self.metadata
        self.d_model = md.hidden_size
        ids, lengths, labels, texts, rows = [], [], [], [], []
        any_labels = False
        for k in range(len(md.shards)):
            content = self._content(k)
            ids.append(content.sample_ids)
            lengths.append(content.token_counts)
            rows.append(content.rows)
            any_labels |= content.labels is not None
            labels.append(content.labels if content.labels is not None else np.full(len(content.sample_ids), -1))
            texts.extend(content.texts)
        self._sample_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        self._lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self._labels = np.concatenate(labels).astype(np.int64) if any_labels else None
        self._texts = texts
        self._has_texts = True
        if self.d_model is None:
            raise MetadataError("no hidden size: neither model_params.hidden_size nor any activation gives it",
                                self.path / "metadata.json")
        max_rows = int(max((r.max() for r in rows if len(r)), default=0))
        max_seq = self.metadata.extraction_config.get("max_seq_length")
        self.max_tokens = max(max_rows, max_seq if _is_int(max_seq) else 0, 1)

    # ---- shards ----
    def locate(self, sample: int) -> tuple[int, int]:
        """(shard position in metadata order, item within that shard) of a sample position."""
        s = self.check_sample(sample)
        k = int(np.searchsorted(self.shard_starts, s, side="right")) - 1
        return k, s - int(self.shard_starts[k])

    def shard(self, k: int) -> dict[str, Any]:
        """The loaded, validated content of shard `k` (cached until another shard is asked for)."""
        if self._cache_index != k:
            self._cache = self._cache_content = None  # drop the old shard before loading the next
            info = self.metadata.shards[k]
            data = load_shard_file(self._files[k], compressed=info.compressed, checksum=info.checksum,
                                   verify_checksum=self.verify_checksums)
            content = check_shard(data, info, self.layers, self.d_model, self._files[k])
            if self.d_model is None and info.num_samples:
                self.d_model = int(data[layer_key(self.layers[0])][0]["activation"].shape[1])
            for items in (data[layer_key(x)] for x in self.layers):
                for item in items:
                    item["activation"].flags.writeable = False
            self._cache, self._cache_content, self._cache_index = data, content, k
        return self._cache  # type: ignore[return-value]

    def _content(self, k: int) -> ShardContent:
        """What shard `k` says about its samples (ids, token counts, labels, texts)."""
        self.shard(k)
        return self._cache_content  # type: ignore[return-value]

    def _item(self, sample: int, layer: int) -> dict[str, Any]:
        key = layer_key(self.layers[self.layer_index(layer)])
        k, j = self.locate(sample)
        return self.shard(k)[key][j]

    # ---- metadata ----
    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def sample_ids(self) -> np.ndarray:
        return self._sample_ids

    @property
    def labels(self) -> np.ndarray | None:
        return self._labels

    @property
    def texts(self) -> list[str] | None:
        """Full texts where stored, else the 200-character previews (one pass over the shards, cached)."""
        if not self._has_texts:
            return None
        if self._texts is None:
            texts: list[str] = []
            for k in range(len(self.metadata.shards)):
                texts.extend(self._content(k).texts)
            self._texts = texts
        return self._texts

    @property
    def provenance(self) -> dict[str, Any]:
        md = self.metadata
        ext = md.extension or {}
        config = md.extraction_config
        out = dict(ext.get("provenance") or {})
        out.update(
            model_name=ext.get("model_name", config.get("model_name")),
            family=ext.get("family", config.get("model_architecture")),
            model_architecture=config.get("model_architecture"),
            cls_token=bool(ext.get("cls_token", False)),
            dataset=ext.get("dataset", config.get("dataset_name")),
            created_at=md.raw.get("created_at"),
            version=md.raw.get("version"),
            machine_id=md.distributed_config.get("machine_id"),
        )
        return out

    # ---- reads ----
    def get(self, sample: int, layer: int) -> np.ndarray:
        s = self.check_sample(sample)
        act = self._item(s, layer)["activation"]
        n = int(self._lengths[s])
        if act.shape[0] < n:
            raise FormatError(f"sample {int(self._sample_ids[s])} has {act.shape[0]} activation rows, "
                              f"token_count says {n}", self._files[self.locate(s)[0]])
        return np.asarray(act[:n], dtype=np.float32)

    def batch(self, samples: Sequence[int] | np.ndarray, layers: Sequence[int] | None = None) -> Batch:
        idx = self.check_samples(samples)
        layer_list = list(self.layers if layers is None else layers)
        keys = [layer_key(self.layers[self.layer_index(x)]) for x in layer_list]
        acts = np.zeros((len(idx), len(layer_list), self.max_tokens, self.d_model), dtype=np.float32)
        texts: list[str] = [""] * len(idx)
        shard_of = np.searchsorted(self.shard_starts, idx, side="right") - 1
        for b in np.argsort(shard_of, kind="stable"):  # each shard loaded once per call
            s, k = int(idx[b]), int(shard_of[b])
            data = self.shard(k)
            j = s - int(self.shard_starts[k])
            n = int(self._lengths[s])
            for li, key in enumerate(keys):
                act = data[key][j]["activation"]
                if act.shape[0] < n:
                    raise FormatError(f"sample {int(self._sample_ids[s])} has {act.shape[0]} activation rows, "
                                      f"token_count says {n}", self._files[k])
                acts[b, li, :n] = act[:n]
            item = data[keys[0]][j] if keys else data[layer_key(self.layers[0])][j]
            meta = item.get("metadata") if isinstance(item.get("metadata"), dict) else {}
            text = meta.get("text")
            texts[b] = text if isinstance(text, str) else str(item.get("text_preview", ""))
        return Batch(
            acts_bltd=acts, lengths=self._lengths[idx], sample_ids=self._sample_ids[idx],
            texts=texts if self._has_texts else None,
            labels=None if self._labels is None else self._labels[idx],
        )

    def last_token(self, layer: int) -> np.ndarray:
        """(N, D) last real token per sample for one layer, in one pass over the shards."""
        key = layer_key(self.layers[self.layer_index(layer)])
        out = np.zeros((self.n_samples, self.d_model), dtype=np.float32)
        for k in range(len(self.metadata.shards)):
            items = self.shard(k)[key]
            start = int(self.shard_starts[k])
            for j, item in enumerate(items):
                n = int(self._lengths[start + j])
                if n:
                    out[start + j] = item["activation"][n - 1]
        return out

    def summary(self) -> dict[str, Any]:
        """The base summary without decompressing every shard to learn whether texts exist."""
        loaded = self._texts
        if loaded is None:
            self._texts = []  # `has_texts` only asks whether texts exist; _has_texts already says
        try:
            return super().summary()
        finally:
            self._texts = loaded

    def close(self) -> None:
        self._cache = self._cache_content = None
        self._cache_index = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"], state["_cache_content"], state["_cache_index"] = None, None, None  # each worker loads its own shards
        return state


def detect(path: Path) -> bool:
    """A directory with a metadata.json carrying `version` and `shards` (or shard files beside a broken one)."""
    f = path / "metadata.json"
    if not (path.is_dir() and f.is_file()):
        return False
    try:
        obj = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        obj = None
    if isinstance(obj, dict) and "version" in obj and "shards" in obj:
        return True
    return any(SHARD_FILE_RE.match(p.name) for p in path.iterdir())  # broken metadata: let the reader name it


def open_reader(path: Path, *, verify_checksums: bool = False) -> PickleReader:
    """Format-registry entry point; `verify_checksums` hashes every shard as it is loaded."""
    return PickleReader(path, verify_checksums=verify_checksums)


# --------------------------------------------------------------------------------------------
# Verify
# --------------------------------------------------------------------------------------------


def verify(path: Path, *, check_values: bool = True) -> list[str]:
    """Check every invariant of the spec (and of actlake's additions); one message per problem."""
    path = Path(path)
    source = path / "metadata.json"
    try:
        md = read_metadata(path)
    except FormatError as exc:
        return [str(exc)]
    problems: list[str] = []
    raw = md.raw
    try:
        datetime.fromisoformat(raw["created_at"])
    except ValueError:
        problems.append(f"{source}: created_at {raw['created_at']!r} is not ISO 8601")
    for key in ("model_name", "model_architecture", "model_params", "dataset_name", "dataset_config",
                "dataset_split", "layers_extracted", "max_seq_length", "batch_size"):
        if key not in md.extraction_config:
            problems.append(f"{source}: extraction_config lacks {key!r}")
    if "distributed_config" in raw:
        for key in ("machine_id", "total_machines", "multihost", "num_hosts", "mesh_type"):
            if key not in md.distributed_config:
                problems.append(f"{source}: distributed_config lacks {key!r}")
    stats = raw["statistics"]
    want_stats = {"total_shards": len(md.shards), "total_samples": md.n_samples,
                  "total_size_bytes": sum(s.size_bytes for s in md.shards), "layers_extracted": list(md.layers)}
    for key, want in want_stats.items():
        if stats.get(key) != want:
            problems.append(f"{source}: statistics.{key} is {stats.get(key)!r}, expected {want!r}")
    if not isinstance(stats.get("extraction_duration_seconds"), (int, float)):
        problems.append(f"{source}: statistics.extraction_duration_seconds is missing or not a number")
    d_model = md.hidden_size
    listed: set[str] = set()
    contents: list[ShardContent | None] = []
    for info in md.shards:
        try:
            f = shard_path(path, info)
        except FormatError as exc:
            problems.append(str(exc))
            contents.append(None)
            continue
        listed.add(f.name)
        if info.filename != shard_filename(info.shard_id, info.compressed):
            problems.append(f"{f}: filename does not follow shard_{{id:04d}}.pkl{'.gz' if info.compressed else ''} "
                            f"for shard_id {info.shard_id}")
        contents.append(_verify_shard(f, info, md, d_model, check_values, problems))
    for f in sorted(path.iterdir()):
        if SHARD_FILE_RE.match(f.name) and f.name not in listed:
            problems.append(f"{f}: shard file not listed in metadata.json")
    if problems:
        return problems
    all_ids = np.concatenate([c.sample_ids for c in contents if c is not None] or [np.zeros(0, np.int64)])
    uniq, counts = np.unique(all_ids, return_counts=True)
    if (counts > 1).any():
        problems.append(str(DuplicateSampleError(f"sample_idx {int(uniq[counts > 1][0])} occurs "
                                                 f"{int(counts[counts > 1][0])} times", path)))
    ext = md.extension
    if ext is not None and "sample_ids" in ext:
        problems.extend(_verify_extension(ext, contents, source))
    return problems


def _verify_shard(f: Path, info: ShardInfo, md: PickleMetadata, d_model: int | None, check_values: bool,
                  problems: list[str]) -> ShardContent | None:
    """Problems of one shard file (existence, size, checksum, structure, values)."""
    if not f.is_file():
        problems.append(str(MissingFileError("shard listed in metadata.json is missing", f)))
        return None
    size = f.stat().st_size
    if size != info.size_bytes:
        problems.append(str(TruncatedFileError(f"size {size} bytes, metadata.json says {info.size_bytes}", f)))
        return None
    if info.checksum is None:
        problems.append(f"{f}: metadata.json gives no checksum for this shard")
    elif CHECKSUM_RE.match(info.checksum) is None:
        problems.append(f"{f}: checksum {info.checksum!r} is not 'sha256:<64 hex>'")
    try:
        data = load_shard_file(f, compressed=info.compressed, checksum=info.checksum,
                               verify_checksum=info.checksum is not None and CHECKSUM_RE.match(info.checksum) is not None)
        content = check_shard(data, info, md.layers, d_model, f)
    except FormatError as exc:
        problems.append(str(exc))
        return None
    if len(content.sample_ids) and info.sample_id_range is not None \
            and list(info.sample_id_range) != [int(content.sample_ids.min()), int(content.sample_ids.max())]:
        problems.append(f"{f}: sample_id_range {list(info.sample_id_range)} does not match the items "
                        f"[{int(content.sample_ids.min())}, {int(content.sample_ids.max())}]")
    for layer in md.layers:
        for j, item in enumerate(data[layer_key(layer)]):
            where = f"{f}: {layer_key(layer)}[{j}]"
            missing = [k for k in ITEM_KEYS if k not in item]
            if missing:
                problems.append(f"{where} lacks {missing}")
                return content
            act = item["activation"]
            if act.dtype != np.float32:
                problems.append(f"{where}.activation is {act.dtype}, the spec says float32")
            if not isinstance(item["shape"], tuple) or item["shape"] != act.shape:
                problems.append(f"{where}.shape {item['shape']!r} is not the activation's shape tuple {act.shape}")
            if not isinstance(item["text_preview"], str) or len(item["text_preview"]) > PREVIEW_CHARS:
                problems.append(f"{where}.text_preview must be a string of at most {PREVIEW_CHARS} characters")
            meta = item["metadata"]
            if not isinstance(meta, dict):
                problems.append(f"{where}.metadata must be a dict")
            elif _is_int(meta.get("token_count")) and meta["token_count"] > act.shape[0] \
                    and meta["token_count"] > md.extraction_config.get("max_seq_length", 0):
                problems.append(f"{where}: token_count {meta['token_count']} exceeds the activation rows {act.shape[0]}")
            if check_values and not np.isfinite(act).all():
                problems.append(f"{where}.activation has non-finite values")
    return content


def _verify_extension(ext: dict[str, Any], contents: list[ShardContent | None], source: Path) -> list[str]:
    """actlake's index in metadata.json must agree with the shard items."""
    problems = []
    ids = np.concatenate([c.sample_ids for c in contents if c is not None] or [np.zeros(0, np.int64)])
    counts = np.concatenate([c.token_counts for c in contents if c is not None] or [np.zeros(0, np.int64)])
    if list(ext.get("sample_ids", [])) != ids.tolist():
        problems.append(f"{source}: {EXTENSION_KEY}.sample_ids do not match the shards' sample_idx")
    if list(ext.get("lengths", [])) != counts.tolist():
        problems.append(f"{source}: {EXTENSION_KEY}.lengths do not match the items' token_count")
    if ext.get("labels") is not None:
        labels = np.concatenate([c.labels if c.labels is not None else np.full(len(c.sample_ids), -1)
                                 for c in contents if c is not None] or [np.zeros(0, np.int64)])
        if list(ext["labels"]) != labels.tolist():
            problems.append(f"{source}: {EXTENSION_KEY}.labels do not match the items' metadata labels")
    return problems


# --------------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------------


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (same file system), else copy it and fsync."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        fsync_file(dst)


def _merge_sources(inputs: Sequence[Path]) -> list[dict[str, Any]]:
    out = []
    for p in inputs:
        blob = (p / "metadata.json").read_bytes()
        out.append({"path": str(p.resolve()), "metadata_sha256": hashlib.sha256(blob).hexdigest()})
    return out


def merge(inputs: Iterable[str | Path], out: str | Path, *, verify_checksums: bool = False) -> Path:
    """Join per-machine stores into one store at `out` (shards hard-linked or copied, renumbered from 1).

    Refuses duplicate sample ids across the inputs (DuplicateSampleError) and stores whose
    layers, width or model differ (MetadataError). Published atomically; rerunning with the
    same inputs returns the existing `out`.
    """
    paths = [Path(p) for p in inputs]
    out = Path(out)
    if not paths:
        raise ConfigError("merge needs at least one input store")
    if len({p.resolve() for p in paths}) != len(paths):
        raise ConfigError("the same input store is given twice")
    readers = [PickleReader(p, verify_checksums=verify_checksums) for p in paths]
    sources = [dict(src, machine_id=r.metadata.distributed_config.get("machine_id"))
               for src, r in zip(_merge_sources(paths), readers)]
    if out.exists():
        try:
            existing = read_metadata(out).extension or {}
        except FormatError:
            existing = {}
        if existing.get("merged_from") == sources:
            return out
        raise ConfigError("output directory exists and is not the merge of these inputs", out)
    first = readers[0]
    for r in readers[1:]:
        for what, a, b in (("layers_extracted", first.layers, r.layers), ("hidden size", first.d_model, r.d_model),
                           ("model_name", first.metadata.extraction_config.get("model_name"),
                            r.metadata.extraction_config.get("model_name"))):
            if a != b:
                raise MetadataError(f"cannot merge: {what} {b!r} differs from {a!r} in {first.path}", r.path / "metadata.json")
    seen: dict[int, Path] = {}
    for r in readers:
        for sid in r.sample_ids.tolist():
            if sid in seen:
                raise DuplicateSampleError(f"sample id {sid} also occurs in {seen[sid]}; sample ids must be unique "
                                           f"across merged stores", r.path / "metadata.json")
            seen[sid] = r.path
    tmp = out.parent / f".tmp-{out.name}"
    _remove_tmp(tmp)
    tmp.mkdir(parents=True)
    shards: list[ShardInfo] = []
    for r in readers:
        for info, f in zip(r.metadata.shards, r._files):
            if verify_checksums:
                got = file_sha256(f)
                if got != info.checksum:
                    raise HashMismatchError(f"checksum {got} does not match metadata.json {info.checksum}", f)
            new_id = len(shards) + 1
            name = shard_filename(new_id, info.compressed)
            _link_or_copy(f, tmp / name)
            shards.append(dataclasses.replace(info, shard_id=new_id, filename=name))
    write_json_atomic(tmp / "metadata.json", _merged_metadata(readers, shards, sources))
    fsync_dir(tmp)
    return publish_dir(tmp, out)


def _merged_metadata(readers: Sequence[PickleReader], shards: list[ShardInfo],
                     sources: list[dict[str, Any]]) -> dict[str, Any]:
    first = readers[0]
    mds = [r.metadata for r in readers]
    dist = dict(first.metadata.distributed_config)
    machine_ids = [m.distributed_config.get("machine_id") for m in mds]
    dist.update(machine_id=None, merged_machine_ids=machine_ids,
                total_machines=max([m.distributed_config.get("total_machines") or 1 for m in mds] + [len(mds)]))
    durations = [m.raw["statistics"].get("extraction_duration_seconds") for m in mds]
    duration = max((float(d) for d in durations if isinstance(d, (int, float))), default=0.0)
    has_labels = any(r.labels is not None for r in readers)
    ext0 = first.metadata.extension or {}
    ext = {k: v for k, v in ext0.items() if k not in ("sample_ids", "lengths", "labels", "merged_from")}
    ext.update(
        extension_version=EXTENSION_VERSION,
        d_model=first.d_model, max_tokens=max(r.max_tokens for r in readers),
        n_samples=sum(r.n_samples for r in readers),
        has_texts=any(r._has_texts for r in readers),
        spec_hash=None,
        sample_ids=np.concatenate([r.sample_ids for r in readers]).tolist(),
        lengths=np.concatenate([r.lengths for r in readers]).tolist(),
        labels=np.concatenate([r.labels if r.labels is not None else np.full(r.n_samples, -1)
                               for r in readers]).tolist() if has_labels else None,
        merged_from=sources,
    )
    config = dict(first.metadata.extraction_config)
    config["max_seq_length"] = ext["max_tokens"]
    return _plain({
        "version": VERSION,
        "created_at": utc_now_iso(),
        "extraction_config": config,
        "distributed_config": dist,
        "shards": [s.to_json() for s in shards],
        "statistics": statistics(shards, first.layers, duration),
        EXTENSION_KEY: ext,
    })
