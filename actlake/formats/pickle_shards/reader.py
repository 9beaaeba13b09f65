"""Reader of the gzip-pickle shard format: index from metadata.json, shards loaded lazily, one cached."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...batch import Batch
from ...errors import FormatError, MetadataError, MissingFileError, TruncatedFileError
from ...jsonio import peek_json
from ...reader import Reader
from .layout import (
    EXTENSION_KEY,
    FORMAT,
    MAX_D_MODEL,
    MAX_DECLARED_TOKENS,
    SHARD_FILE_RE,
    is_int,
    layer_key,
)
from .metadata import ShardInfo, declared_rows, read_metadata, shard_path
from .shard_io import ShardContent, check_shard, load_shard_file
from .shard_io import inflate_cap as shard_inflate_cap


class PickleReader(Reader):
    """Reads a pickle-shard store: shards loaded lazily, the current one cached.

    Sample positions run through the shards in metadata order, then through each shard's
    items. With actlake's `actlake` metadata key the index comes from metadata.json; for stores
    written by other tools every shard is loaded once at open to build it.
    """

    format = FORMAT

    def __init__(self, path: str | Path, *, verify_checksums: bool = True) -> None:
        """`verify_checksums`: each shard's sha256 (metadata.json) is checked over its bytes on disk before it
        is decompressed or unpickled (False skips that, for a caller that has checked the files already)."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError("not a directory", self.path)
        self._open_store(read_metadata(self.path), verify_checksums)

    def _open_store(self, md: Any, verify_checksums: bool) -> None:
        """Build the index from validated metadata.json (`_shard_file` finds and size-checks each shard)."""
        self.metadata = md
        self.verify_checksums = verify_checksums
        self.layers = md.layers
        self.dtype = np.dtype(np.float32)
        self.files = []
        for info in md.shards:
            f = self._shard_file(info)
            if set(info.layers) != set(md.layers):
                raise MetadataError(f"shard {info.filename} holds layers {list(info.layers)}; this reader needs every "
                                    f"shard to hold every extracted layer {list(md.layers)}", self.path / "metadata.json")
            self.files.append(f)
        counts = np.array([s.num_samples for s in md.shards], dtype=np.int64)
        self.n_samples = int(counts.sum())
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._cache_index: int | None = None
        self._cache: dict[str, Any] | None = None
        self._cache_content: ShardContent | None = None
        self._texts: list[str] | None = None
        self._lengths: np.ndarray | None = None  # set by the index; shard() checks items against it
        self.d_model: int | None = None  # type: ignore[assignment]
        ext = md.extension
        if ext is not None and "sample_ids" in ext:
            self._index_from_extension(ext)
        else:
            self._index_from_shards()

    def _index_from_extension(self, ext: dict[str, Any]) -> None:
        """The per-sample index from actlake's `actlake` key (no shard is loaded); sizes checked before use."""
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
        longest = int(self._lengths.max()) if n else 0
        if self.max_tokens > max(longest, MAX_DECLARED_TOKENS):
            raise MetadataError(f"{EXTENSION_KEY}.max_tokens {self.max_tokens} exceeds both the longest sample "
                                f"({longest}) and {MAX_DECLARED_TOKENS}", source)
        if not 0 < self.d_model <= MAX_D_MODEL:
            raise MetadataError(f"{EXTENSION_KEY}.d_model must lie in [1, {MAX_D_MODEL}], got {self.d_model}", source)
        self.has_texts = bool(ext.get("has_texts", True))

    def _index_from_shards(self) -> None:
        """The per-sample index of a store written by another tool: every shard loaded once."""
        md = self.metadata
        self.d_model = md.hidden_size
        if self.d_model is not None and not 0 < self.d_model <= MAX_D_MODEL:
            raise MetadataError(f"model_params.hidden_size must lie in [1, {MAX_D_MODEL}], got {self.d_model}",
                                self.path / "metadata.json")
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
        self.has_texts = True
        if self.d_model is None:
            raise MetadataError("no hidden size: neither model_params.hidden_size nor any activation gives it",
                                self.path / "metadata.json")
        max_rows = int(max((r.max() for r in rows if len(r)), default=0))
        max_seq = self.metadata.extraction_config.get("max_seq_length")
        max_seq = int(max_seq) if is_int(max_seq) else 0
        if max_seq > max(max_rows, MAX_DECLARED_TOKENS):
            raise MetadataError(f"extraction_config.max_seq_length {max_seq} exceeds both the longest activation "
                                f"({max_rows} rows) and {MAX_DECLARED_TOKENS}", self.path / "metadata.json")
        self.max_tokens = max(max_rows, max_seq, 1)

    # ---- shards ----
    def _shard_file(self, info: ShardInfo) -> Path:
        """The file of one shard entry, which must exist with the size metadata.json records."""
        f = shard_path(self.path, info)
        if not f.is_file():
            raise MissingFileError("shard listed in metadata.json is missing", f)
        if f.stat().st_size != info.size_bytes:
            raise TruncatedFileError(f"size {f.stat().st_size} bytes, metadata.json says {info.size_bytes}", f)
        return f

    def _load_shard(self, k: int, info: ShardInfo) -> Any:
        """The unpickled content of shard `k` (its sha256 checked first, decompression capped)."""
        return load_shard_file(self.files[k], compressed=info.compressed, checksum=info.checksum,
                               verify_checksum=self.verify_checksums and info.checksum is not None,
                               max_inflated=self.inflate_cap(info))

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
            data = self._load_shard(k, info)
            content = check_shard(data, info, self.layers, self.d_model, self.files[k])
            if self.d_model is None:
                self.d_model = content.d_model
            if self._lengths is not None:
                self._check_against_index(k, content)
            for items in (data[layer_key(x)] for x in self.layers):
                for item in items:
                    item["activation"].flags.writeable = False
            self._cache, self._cache_content, self._cache_index = data, content, k
        return self._cache  # type: ignore[return-value]

    def inflate_cap(self, info: ShardInfo) -> int:
        """The most bytes shard `info`'s decompressed pickle may hold (`shard_io.inflate_cap`), from the rows and
        width metadata.json declares (actlake's index, else extraction_config / model_params)."""
        return shard_inflate_cap(info.num_samples, len(info.layers), declared_rows(self.metadata),
                                 self.metadata.hidden_size)

    def _check_against_index(self, k: int, content: ShardContent) -> None:
        """The items of shard `k` must be the samples the index says, with at least `lengths` rows."""
        start, end = int(self.shard_starts[k]), int(self.shard_starts[k + 1])
        if not np.array_equal(content.sample_ids, self._sample_ids[start:end]):
            raise FormatError("the items' sample_idx differ from the sample ids metadata.json lists", self.files[k])
        short = np.flatnonzero(content.rows < self._lengths[start:end])
        if len(short):
            j = int(short[0])
            raise FormatError(f"sample {int(content.sample_ids[j])} has {int(content.rows[j])} activation rows, "
                              f"token_count says {int(self._lengths[start + j])}", self.files[k])

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
        if not self.has_texts:
            return None
        if self._texts is None:
            texts: list[str] = []
            for k in range(len(self.metadata.shards)):
                texts.extend(self._content(k).texts)
            self._texts = texts
        return self._texts

    @property
    def cls_token(self) -> bool:
        """The `cls_token` actlake records in its metadata.json extension (absent: False, as for other tools)."""
        value = (self.metadata.extension or {}).get("cls_token", False)
        if not isinstance(value, bool):
            raise MetadataError(f"actlake cls_token must be true or false, got {value!r}", self.path / "metadata.json")
        return value

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
        """Real-token rows of one sample at one layer: a read-only view of the cached shard (float32 items)."""
        s = self.check_sample(sample)
        act = self._item(s, layer)["activation"]  # shard() checked its rows against lengths
        return np.asarray(act[: int(self._lengths[s])], dtype=np.float32)

    def batch(self, samples: Sequence[int] | np.ndarray, layers: Sequence[int] | None = None) -> Batch:
        """A padded Batch, visiting the requested samples shard by shard (each shard loaded once per call)."""
        idx = self.check_samples(samples)
        layer_list = list(self.layers if layers is None else layers)
        keys = [layer_key(self.layers[self.layer_index(x)]) for x in layer_list]
        text_key = keys[0] if keys else layer_key(self.layers[0])
        shard_of = np.searchsorted(self.shard_starts, idx, side="right") - 1
        order = np.argsort(shard_of, kind="stable")
        if len(order):
            self.shard(int(shard_of[order[0]]))  # checks the declared width against real items before allocating
        acts = np.zeros((len(idx), len(layer_list), self.max_tokens, self.d_model), dtype=np.float32)
        texts: list[str] = [""] * len(idx)
        for b in order:
            s, k = int(idx[b]), int(shard_of[b])
            data = self.shard(k)
            j = s - int(self.shard_starts[k])
            n = int(self._lengths[s])
            for li, key in enumerate(keys):
                acts[b, li, :n] = data[key][j]["activation"][:n]
            item = data[text_key][j]
            meta = item.get("metadata") if isinstance(item.get("metadata"), dict) else {}
            text = meta.get("text")
            texts[b] = text if isinstance(text, str) else str(item.get("text_preview", ""))
        return Batch(
            acts_bltd=acts, lengths=self._lengths[idx], sample_ids=self._sample_ids[idx],
            texts=texts if self.has_texts else None,
            labels=None if self._labels is None else self._labels[idx],
        )

    def last_token(self, layer: int) -> np.ndarray:
        """(N, D) last real token per sample for one layer, in one pass over the shards."""
        key = layer_key(self.layers[self.layer_index(layer)])
        out: np.ndarray | None = None
        for k, info in enumerate(self.metadata.shards):
            if not info.num_samples:
                continue
            items = self.shard(k)[key]
            if out is None:  # allocated once a shard has confirmed the width
                out = np.zeros((self.n_samples, self.d_model), dtype=np.float32)
            start = int(self.shard_starts[k])
            lengths = self._lengths[start : start + len(items)]
            real = np.flatnonzero(lengths)
            if len(real):
                out[start + real] = np.stack([items[j]["activation"][lengths[j] - 1] for j in real])
        return out if out is not None else np.zeros((self.n_samples, self.d_model), dtype=np.float32)

    def summary(self) -> dict[str, Any]:
        """The base summary without decompressing every shard to learn whether texts exist."""
        loaded = self._texts
        if loaded is None:
            self._texts = []  # the base summary only asks whether texts exist; has_texts already says
        try:
            return super().summary()
        finally:
            self._texts = loaded

    def close(self) -> None:
        """Drop the cached shard."""
        self._cache = self._cache_content = None
        self._cache_index = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled to a DataLoader worker without the cached shard."""
        state = self.__dict__.copy()
        state["_cache"], state["_cache_content"], state["_cache_index"] = None, None, None  # each worker loads its own shards
        return state


def detect(path: Path) -> bool:
    """A directory with a metadata.json carrying `version` and `shards` (or shard files beside a broken one)."""
    if not (path.is_dir() and (path / "metadata.json").is_file()):
        return False
    obj = peek_json(path / "metadata.json")
    if isinstance(obj, dict) and "version" in obj and "shards" in obj:
        return True
    return any(SHARD_FILE_RE.match(p.name) for p in path.iterdir())  # broken metadata: let the reader name it


def open_reader(path: Path, *, verify_checksums: bool = True) -> PickleReader:
    """Format-registry entry point; `verify_checksums` (default) checks each shard's sha256 before it is
    decompressed and unpickled."""
    return PickleReader(path, verify_checksums=verify_checksums)
