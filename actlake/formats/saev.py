"""saev protocol 2.1: content-hashed directory of float32 memmap shards (shared/specs/saev-protocol-2.1.md).

Choices where the spec is silent are recorded in docs/formats/saev.md:
- the last shard is written truncated to its real example count; full-size (zero-padded, as
  upstream writes) last shards are read as well;
- optional additions (protocol minor addition, files only, so `metadata.json` and the hash keep
  the 2.1 field set): `lengths.bin` int32 [n_examples] real token counts, `sample_ids.bin`
  int64 [n_examples] global sample ids, `samples.jsonl` one JSON object per example with
  `text` / `label`, and `provenance.json` (unhashed build facts);
- `labels.bin` is uint8 [n_examples, patches_per_ex] (the CLS token has no label).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import fsync_dir, publish_dir, remove_tree, write_bytes_atomic, write_json_atomic
from ..batch import Batch
from ..errors import (
    ConfigError,
    FormatError,
    HashMismatchError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
    TruncatedFileError,
)
from ..reader import Reader, TokenSegment
from ..safe_pickle import safe_loads
from ..spec import MAX_DIM, MAX_LAYERS, MAX_TOKENS, StoreSpec
from ..writer import Writer

FORMAT = "saev"
PROTOCOL = "2.1"
DEFAULT_PATCHES_PER_SHARD = 2_400_000
SHARD_NAME_RE = re.compile(r"^acts(\d{6})\.bin$")
MAX_EXAMPLES = 1 << 40

#: newer upstream field names accepted on read -> protocol 2.1 names
FIELD_ALIASES = {"content_tokens_per_example": "patches_per_ex", "max_tokens_per_shard": "patches_per_shard"}
#: families written by actlake (vision per spec, text extensions documented in docs/formats/saev.md)
KNOWN_FAMILIES = ("clip", "siglip", "dinov2", "vit", "bert", "gpt2", "llama", "qwen2", "text", "synthetic")

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

    def to_json(self) -> dict[str, Any]:
        """The `metadata.json` object (exactly the spec's fields, plus any extras read)."""
        out = dict(self.extra)
        out.update(
            family=self.family, ckpt=self.ckpt, layers=list(self.layers), patches_per_ex=self.patches_per_ex,
            cls_token=self.cls_token, d_model=self.d_model, n_examples=self.n_examples,
            patches_per_shard=self.patches_per_shard, data=self.data, dataset=self.dataset,
            dtype=self.dtype, protocol=self.protocol,
        )
        return out

    @property
    def hash(self) -> str:
        return metadata_hash(self.to_json())

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
        obj = dict(obj)
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
        try:
            return cls(**{k: obj[k] for k in _FIELD_TYPES}, extra=extra)
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
    """saev metadata for a StoreSpec (the token axis is `max_tokens`, CLS included)."""
    if spec.dtype != "float32":
        raise ConfigError(f"saev stores float32 (spec section 2.1), not {spec.dtype}")
    patches = spec.max_tokens - (1 if spec.cls_token else 0)
    return SaevMetadata(
        family=spec.family,
        ckpt=spec.model_name,
        layers=spec.layers,
        patches_per_ex=patches,
        cls_token=spec.cls_token,
        d_model=spec.d_model,
        n_examples=spec.n_samples,
        patches_per_shard=int(spec.options.get("patches_per_shard", DEFAULT_PATCHES_PER_SHARD)),
        data=encode_data(spec.data),
        dataset=spec.dataset,
    )


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


class SaevWriter(Writer):
    """Streams batches into `acts%06d.bin` shards under `<root>/.tmp-<HASH>` and publishes `<root>/<HASH>`.

    Complete shards are durable (fsynced, renamed from `.partial`) and recorded in
    `progress.json`, so an interrupted writer reopened with the same metadata resumes at the
    first incomplete shard (`resume_from`). Sidecar arrays are preallocated memmaps flushed
    before each shard is committed.
    """

    def __init__(self, root: str | Path, metadata: SaevMetadata, *, token_labels: bool = False,
                 texts: bool = True, provenance: dict[str, Any] | None = None) -> None:
        self.metadata = metadata
        self.root = Path(root)
        self.final_path = self.root / metadata.hash
        self.tmp_path = self.root / f".tmp-{metadata.hash}"
        self._token_labels = token_labels
        self._texts = texts
        self._provenance = provenance or {}
        self._closed = False
        self._counts = metadata.shard_counts()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = None
        if self.final_path.exists():
            self.resume_from = metadata.n_examples
            self._closed = True  # identical config already published: nothing to do
            return
        self._lock()
        self._open_tmp()

    def _lock(self) -> None:
        """Hold an exclusive lock beside the temporary directory: two writers of one store would corrupt it."""
        import fcntl

        path = self.root / f".tmp-{self.metadata.hash}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise FormatError("another process is writing this store right now", self.tmp_path) from None
        self._lock_fd = fd

    def _unlock(self, *, remove: bool) -> None:
        if self._lock_fd is None:
            return
        if remove:
            (self.root / f".tmp-{self.metadata.hash}.lock").unlink(missing_ok=True)
        os.close(self._lock_fd)  # closing releases the flock
        self._lock_fd = None

    @property
    def already_published(self) -> bool:
        return self.final_path.exists() and self._closed

    def _open_tmp(self) -> None:
        md = self.metadata
        tmp = self.tmp_path
        progress_file = tmp / "progress.json"
        complete = 0
        if tmp.exists() and progress_file.exists():
            try:
                state = json.loads(progress_file.read_text())
                on_disk = json.loads((tmp / "metadata.json").read_text())
                complete = int(state["complete_shards"])
                if on_disk != md.to_json() or bool(state.get("token_labels")) != self._token_labels:
                    raise ValueError("different configuration")
            except (ValueError, KeyError, OSError, TypeError):
                remove_tree(tmp)
                complete = 0
        elif tmp.exists():
            remove_tree(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / ".texts").mkdir(exist_ok=True)
        if complete == 0:
            write_json_atomic(tmp / "metadata.json", md.to_json())
            self._write_progress(0)
        for stale in tmp.glob("*.partial"):
            stale.unlink()
        for stale in [*tmp.glob(".*.tmp-*"), *(tmp / ".texts").glob(".*.tmp-*")]:
            stale.unlink()  # temp files of an atomic write interrupted by a kill
        n = md.n_examples
        self._lengths = self._sidecar("lengths.bin", np.int32, (n,), fresh=complete == 0)
        self._sample_ids = self._sidecar("sample_ids.bin", np.int64, (n,), fresh=complete == 0)
        self._labels = (
            self._sidecar("labels.bin", np.uint8, (n, md.patches_per_ex), fresh=complete == 0)
            if self._token_labels else None
        )
        self._shard_idx = complete
        self.resume_from = sum(self._counts[:complete])
        self._next = self.resume_from  # next global example position
        self._in_shard = 0
        self._file = None
        self._text_lines: list[str] = []

    def _sidecar(self, name: str, dtype: Any, shape: tuple[int, ...], *, fresh: bool) -> np.ndarray | None:
        path = self.tmp_path / name
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if fresh or not path.exists() or path.stat().st_size != nbytes:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        if nbytes == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r+", shape=shape)

    def _write_progress(self, complete: int) -> None:
        write_json_atomic(self.tmp_path / "progress.json",
                          {"complete_shards": complete, "token_labels": self._token_labels})

    def _open_shard(self) -> None:
        self._file = open(self.tmp_path / f"{shard_name(self._shard_idx)}.partial", "wb", buffering=0)
        self._in_shard = 0

    def _commit_shard(self) -> None:
        """Make the current shard durable: sidecars, texts, shard file, then progress."""
        assert self._file is not None
        for arr in (self._lengths, self._sample_ids, self._labels):
            if isinstance(arr, np.memmap):
                arr.flush()
        if self._texts:
            write_bytes_atomic(self.tmp_path / ".texts" / f"{self._shard_idx:06d}.jsonl",
                               "".join(self._text_lines).encode("utf-8"))
        self._text_lines = []
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        name = shard_name(self._shard_idx)
        os.replace(self.tmp_path / f"{name}.partial", self.tmp_path / name)
        self._shard_idx += 1
        self._write_progress(self._shard_idx)  # its directory fsync also makes the rename above durable

    def write_batch(self, batch: Batch) -> None:
        if self._closed:
            if self.final_path.exists():
                return
            raise FormatError("writer is closed", self.tmp_path)
        md = self.metadata
        b, n_layers, t, d = batch.acts_bltd.shape
        if n_layers != len(md.layers) or d != md.d_model or t > md.tokens_per_ex:
            raise ConfigError(
                f"batch shape {batch.acts_bltd.shape} does not fit [B, {len(md.layers)}, <={md.tokens_per_ex}, {md.d_model}]"
            )
        if self._next + b > md.n_examples:
            raise ConfigError(f"more examples than n_examples={md.n_examples}")
        if self._token_labels and batch.token_labels is None:
            raise ConfigError("this writer stores labels.bin but the batch has no token_labels")
        acts = batch.acts_bltd
        lengths = np.asarray(batch.lengths)
        padded = bool(b) and int(lengths.min()) < t
        if t < md.tokens_per_ex or padded or acts.dtype != np.float32 or not acts.flags.c_contiguous:
            full = np.zeros((b, n_layers, md.tokens_per_ex, d), dtype=np.float32)
            full[:, :, :t] = acts
            if padded:  # padding positions are stored as zeros, whatever the model put there
                full.transpose(0, 2, 1, 3)[np.arange(md.tokens_per_ex)[None, :] >= lengths[:, None]] = 0
            acts = full
        start = 0
        while start < b:
            if self._file is None:
                self._open_shard()
            room = self._counts[self._shard_idx] - self._in_shard
            take = min(room, b - start)
            self._file.write(memoryview(acts[start : start + take]).cast("B"))
            self._record(batch, start, take)
            self._in_shard += take
            self._next += take
            start += take
            if self._in_shard == self._counts[self._shard_idx]:
                self._commit_shard()

    def _record(self, batch: Batch, start: int, take: int) -> None:
        pos = slice(self._next, self._next + take)
        sel = slice(start, start + take)
        self._lengths[pos] = np.asarray(batch.lengths[sel])
        self._sample_ids[pos] = np.asarray(batch.sample_ids[sel])
        if self._labels is not None:
            labels = np.asarray(batch.token_labels[sel])
            offset = 1 if self.metadata.cls_token else 0
            width = self.metadata.patches_per_ex
            got = labels[:, offset : offset + width]
            self._labels[pos, : got.shape[1]] = got
        if self._texts:
            for k in range(take):
                row: dict[str, Any] = {"i": self._next + k, "sample_id": int(batch.sample_ids[start + k])}
                if batch.texts is not None:
                    row["text"] = batch.texts[start + k]
                if batch.labels is not None:
                    row["label"] = int(batch.labels[start + k])
                self._text_lines.append(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> Path:
        if self._closed:
            if self.final_path.exists():
                return self.final_path
            raise FormatError("writer was aborted", self.tmp_path)
        md = self.metadata
        if self._next != md.n_examples:
            raise ConfigError(f"wrote {self._next} examples but metadata says n_examples={md.n_examples}", self.tmp_path)
        tmp = self.tmp_path
        for arr in (self._lengths, self._sample_ids, self._labels):
            if isinstance(arr, np.memmap):
                arr.flush()
        self._lengths = self._sample_ids = self._labels = None  # drop the maps before renaming
        shards = [{"name": shard_name(i), "n_examples": c} for i, c in enumerate(self._counts)]
        write_json_atomic(tmp / "shards.json", shards)
        if self._texts:
            parts = sorted((tmp / ".texts").glob("*.jsonl"))
            with open(tmp / "samples.jsonl", "wb") as out:
                for part in parts:
                    out.write(part.read_bytes())
        remove_tree(tmp / ".texts")
        if not self._token_labels and (tmp / "labels.bin").exists():
            (tmp / "labels.bin").unlink()
        if self._provenance:
            write_json_atomic(tmp / "provenance.json", self._provenance)
        (tmp / "progress.json").unlink()
        self._closed = True
        try:
            return publish_dir(tmp, self.final_path)
        finally:
            self._unlock(remove=True)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True
        self._unlock(remove=False)


def create_writer(out_root: Path, spec: StoreSpec) -> SaevWriter:
    """Format-registry entry point."""
    return SaevWriter(out_root, metadata_from_spec(spec), token_labels=spec.has_token_labels,
                      provenance=spec.provenance)


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise MissingFileError(f"required file {path.name} is missing", path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MetadataError(f"not valid UTF-8 JSON: {exc}", path) from exc


def read_metadata(path: Path) -> SaevMetadata:
    """Validated metadata.json of a saev directory."""
    return SaevMetadata.from_json(_read_json(path / "metadata.json"), source=path / "metadata.json")


def read_shards_json(path: Path, md: SaevMetadata) -> list[int]:
    """Validated example counts per shard from shards.json (checked against the sizing maths)."""
    source = path / "shards.json"
    entries = _read_json(source)
    if not isinstance(entries, list):
        raise MetadataError("shards.json must hold a JSON array", source)
    counts: list[int] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("n_examples"), int) or isinstance(entry.get("n_examples"), bool):
            raise MetadataError(f"entry {i} must be {{'name': str, 'n_examples': int}}", source)
        if entry["name"] != shard_name(i):
            raise MetadataError(f"entry {i} names {entry['name']!r}, expected {shard_name(i)!r}", source)
        counts.append(entry["n_examples"])
    if counts != md.shard_counts():
        raise MetadataError(
            f"shard example counts {counts[:4]}{'...' if len(counts) > 4 else ''} (total {sum(counts)}) do not "
            f"match n_examples={md.n_examples} with {md.examples_per_shard} examples per shard", source,
        )
    return counts


class SaevReader(Reader):
    """Memmap reader of a saev 2.1 directory (spec section 4 coordinate transform)."""

    format = FORMAT

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError("not a directory", self.path)
        self.metadata = md = read_metadata(self.path)
        self.shard_counts = read_shards_json(self.path, md)
        self.layers = md.layers
        self.d_model = md.d_model
        self.n_samples = md.n_examples
        self.dtype = np.dtype(np.float32)
        self.max_tokens = md.tokens_per_ex
        self.examples_per_shard = md.examples_per_shard
        for i, count in enumerate(self.shard_counts):
            f = self.path / shard_name(i)
            if not f.is_file():
                raise MissingFileError(f"shard listed in shards.json is missing", f)
            size = f.stat().st_size
            allowed = {count * md.example_bytes, md.examples_per_shard * md.example_bytes}
            if size not in allowed:
                raise TruncatedFileError(
                    f"size {size} bytes, expected {count * md.example_bytes} "
                    f"({count} examples x {md.example_bytes} bytes)", f)
        self._lengths = self._load_sidecar("lengths.bin", np.int32, (md.n_examples,))
        self._sample_ids = self._load_sidecar("sample_ids.bin", np.int64, (md.n_examples,))
        self._token_labels_raw = self._load_sidecar("labels.bin", np.uint8, (md.n_examples, md.patches_per_ex))
        if self._lengths is not None:
            lengths = np.asarray(self._lengths, dtype=np.int64)
            if len(lengths) and (lengths.min() < 0 or lengths.max() > md.tokens_per_ex):
                raise FormatError(f"lengths outside [0, {md.tokens_per_ex}]", self.path / "lengths.bin")
            self._lengths = lengths
        self._maps: dict[int, np.memmap] = {}
        self._samples_meta: list[dict[str, Any]] | None = None

    def _load_sidecar(self, name: str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray | None:
        f = self.path / name
        if not f.exists():
            return None
        want = int(np.prod(shape)) * np.dtype(dtype).itemsize
        size = f.stat().st_size
        if size != want:
            raise TruncatedFileError(f"size {size} bytes, expected {want} ({' x '.join(map(str, shape))} {np.dtype(dtype)})", f)
        if want == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(f, dtype=dtype, mode="r", shape=shape)

    # ---- memmaps ----
    def shard(self, index: int) -> np.memmap:
        """The (S_i, L, T, D) memmap of shard `index` (opened lazily, once per process)."""
        mm = self._maps.get(index)
        if mm is None:
            md = self.metadata
            count = self.shard_counts[index]
            mm = np.memmap(self.path / shard_name(index), dtype=np.float32, mode="r",
                           shape=(count, len(md.layers), md.tokens_per_ex, md.d_model))
            self._maps[index] = mm
        return mm

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard index, example within shard) of a global example index (spec 4.2 step 1)."""
        s = self.check_sample(sample)
        return s // self.examples_per_shard, s % self.examples_per_shard

    # ---- metadata ----
    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            return np.full(self.n_samples, self.max_tokens, dtype=np.int64)
        return self._lengths

    @property
    def sample_ids(self) -> np.ndarray:
        if self._sample_ids is None:
            return np.arange(self.n_samples, dtype=np.int64)
        return np.asarray(self._sample_ids)

    def _samples(self) -> list[dict[str, Any]] | None:
        if self._samples_meta is None:
            f = self.path / "samples.jsonl"
            if not f.exists():
                return None
            rows = []
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise MetadataError(f"line {lineno} is not JSON: {exc}", f) from exc
            if len(rows) != self.n_samples:
                raise MetadataError(f"{len(rows)} lines, expected {self.n_samples}", f)
            self._samples_meta = rows
        return self._samples_meta

    @property
    def texts(self) -> list[str] | None:
        rows = self._samples()
        if rows is None or not rows or "text" not in rows[0]:
            return None
        return [r.get("text", "") for r in rows]

    @property
    def labels(self) -> np.ndarray | None:
        rows = self._samples()
        if rows is None or not rows or "label" not in rows[0]:
            return None
        return np.array([r.get("label", -1) for r in rows], dtype=np.int64)

    @property
    def token_labels(self) -> np.ndarray | None:
        """[N, T] uint8 labels; the CLS position (if any) is 0, patches from `labels.bin`."""
        raw = self._token_labels_raw
        if raw is None:
            return None
        if not self.metadata.cls_token:
            return np.asarray(raw)
        out = np.zeros((self.n_samples, self.max_tokens), dtype=np.uint8)
        out[:, 1:] = raw
        return out

    @property
    def provenance(self) -> dict[str, Any]:
        f = self.path / "provenance.json"
        base = {"ckpt": self.metadata.ckpt, "family": self.metadata.family, "dataset": self.metadata.dataset,
                "hash": self.metadata.hash}
        if f.exists():
            base.update(_read_json(f))
        return base

    def data_description(self) -> Any:
        """The `data` field decoded with the restricted unpickler (only when asked)."""
        return self.metadata.decode_data(source=self.path / "metadata.json")

    # ---- reads ----
    def get(self, sample: int, layer: int) -> np.ndarray:
        li = self.layer_index(layer)
        shard, ex = self.locate(sample)
        n = int(self.lengths[shard * self.examples_per_shard + ex])
        return self.shard(shard)[ex, li, :n]

    def vector(self, sample: int, layer: int, token: int) -> np.ndarray:
        """One (D,) activation vector at a logical (example, layer, token) coordinate."""
        li = self.layer_index(layer)
        shard, ex = self.locate(sample)
        if not 0 <= token < self.max_tokens:
            raise FormatError(f"token {token} out of range [0, {self.max_tokens})", self.path)
        return self.shard(shard)[ex, li, token]

    def batch(self, samples: Any, layers: Any = None) -> Batch:
        idx = self.check_samples(samples)
        layer_list = list(self.layers if layers is None else layers)
        lis = np.array([self.layer_index(x) for x in layer_list], dtype=np.int64)
        out = np.empty((len(idx), len(lis), self.max_tokens, self.d_model), dtype=np.float32)
        shard_of = idx // self.examples_per_shard
        for shard in np.unique(shard_of):
            where = np.nonzero(shard_of == shard)[0]
            ex = idx[where] % self.examples_per_shard
            out[where] = self.shard(int(shard))[ex[:, None], lis[None, :]]
        return self._batch_meta(idx, out, self.lengths[idx])

    def last_token(self, layer: int) -> np.ndarray:
        li = self.layer_index(layer)
        out = np.empty((self.n_samples, self.d_model), dtype=np.float32)
        lengths = self.lengths
        for shard, count in enumerate(self.shard_counts):
            start = shard * self.examples_per_shard
            last = np.maximum(lengths[start : start + count] - 1, 0)
            out[start : start + count] = self.shard(shard)[np.arange(count), li, last]
        return out

    def token_segments(self, layer: int) -> list[TokenSegment]:
        li = self.layer_index(layer)
        n_layers, t = len(self.layers), self.max_tokens
        segments = []
        lengths = self.lengths
        for shard, count in enumerate(self.shard_counts):
            mm = self.shard(shard)
            rows = mm.reshape(count * n_layers * t, self.d_model)
            start = shard * self.examples_per_shard
            base = (np.arange(count, dtype=np.int64) * n_layers + li) * t
            segments.append(TokenSegment(rows, base, lengths[start : start + count], start))
        return segments

    def close(self) -> None:
        self._maps.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}  # each process maps its own files
        return state


def detect(path: Path) -> bool:
    """A directory with metadata.json that carries saev fields."""
    f = path / "metadata.json"
    if not (path.is_dir() and f.is_file()):
        return False
    try:
        obj = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return (path / "shards.json").is_file()  # looks like saev; let the reader name the problem
    return isinstance(obj, dict) and ("d_model" in obj or "protocol" in obj) and "version" not in obj


def open_reader(path: Path) -> SaevReader:
    return SaevReader(path)


def verify(path: Path, *, check_values: bool = True) -> list[str]:
    """Check every invariant of the spec; return one message per problem."""
    problems: list[str] = []
    try:
        md = read_metadata(path)
    except FormatError as exc:
        return [str(exc)]
    if path.name != md.hash:
        problems.append(str(HashMismatchError(f"directory name is not the metadata hash {md.hash}", path)))
    if md.family not in KNOWN_FAMILIES:
        problems.append(f"{path / 'metadata.json'}: family {md.family!r} is not one of {KNOWN_FAMILIES}")
    if md.dataset and not os.path.isabs(md.dataset) and ":" not in md.dataset:
        problems.append(f"{path / 'metadata.json'}: dataset {md.dataset!r} is not an absolute path")
    try:
        md.decode_data(source=path / "metadata.json")
    except FormatError as exc:
        problems.append(str(exc))
    try:
        counts = read_shards_json(path, md)
    except FormatError as exc:
        problems.append(str(exc))
        return problems
    for i, count in enumerate(counts):
        f = path / shard_name(i)
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        size = f.stat().st_size
        if size not in {count * md.example_bytes, md.examples_per_shard * md.example_bytes}:
            problems.append(f"{f}: size {size} bytes, expected {count * md.example_bytes}")
    listed = {shard_name(i) for i in range(len(counts))}
    for f in sorted(path.glob("acts*.bin")):
        if f.name not in listed:
            problems.append(f"{f}: shard not listed in shards.json")
    if problems:
        return problems
    try:
        reader = SaevReader(path)
    except FormatError as exc:
        return [str(exc)]
    if reader._sample_ids is not None and len(np.unique(reader.sample_ids)) != reader.n_samples:
        problems.append(f"{path / 'sample_ids.bin'}: sample ids are not unique")
    try:
        reader.texts
    except FormatError as exc:
        problems.append(str(exc))
    if check_values:
        for i in range(len(counts)):
            mm = reader.shard(i)
            step = max(1, (64 << 20) // max(1, md.example_bytes))
            for start in range(0, mm.shape[0], step):
                if not np.isfinite(mm[start : start + step]).all():
                    problems.append(f"{path / shard_name(i)}: non-finite values near example {start}")
                    break
    reader.close()
    return problems
