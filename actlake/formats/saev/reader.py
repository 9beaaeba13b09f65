"""SaevReader: memmap reads by the spec's section 4 coordinate transform."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ...batch import Batch
from ...errors import FormatError, MetadataError, MissingFileError, TruncatedFileError
from ...jsonio import peek_json, read_json, read_jsonl
from ...reader import Reader, TokenSegment
from ...store_walk import open_regular, refuse_links
from .metadata import FORMAT, IGNORE_LABEL, SaevMetadata, shard_name


def read_metadata(path: Path) -> SaevMetadata:
    """Validated metadata.json of a saev directory."""
    return SaevMetadata.from_json(read_json(path / "metadata.json"), source=path / "metadata.json")


def read_shards_json(path: Path, md: SaevMetadata) -> list[int]:
    """Validated example counts per shard from shards.json (checked against the sizing maths)."""
    source = path / "shards.json"
    entries = read_json(source)
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


def expected_shard_size(count: int, md: SaevMetadata) -> str:
    """What a shard holding `count` examples may measure, for messages: full size, or (a short last
    shard) truncated to its real count."""
    full = f"expected {md.shard_bytes} ({md.examples_per_shard} examples x {md.example_bytes} bytes)"
    if count == md.examples_per_shard:
        return full
    return f"{full} or {count * md.example_bytes} (truncated to its {count} examples)"


def memmap_regular(path: Path, dtype: Any, shape: tuple[int, ...]) -> np.memmap:
    """A read-only memmap of `path`, opened without following a link (a link swapped in after the reader
    checked the directory is refused too: UnsafePathError naming it)."""
    with os.fdopen(open_regular(path), "rb") as fh:
        return np.memmap(fh, dtype=dtype, mode="r", shape=shape)


class SaevReader(Reader):
    """Memmap reader of a saev 2.1 directory (spec section 4 coordinate transform)."""

    format = FORMAT
    _process_local = ("_maps",)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError("not a directory", self.path)
        refuse_links(self.path)  # a saev directory is flat: a linked file would be read as the store's own
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
                raise MissingFileError("shard listed in shards.json is missing", f)
            size = f.stat().st_size
            allowed = {count * md.example_bytes, md.examples_per_shard * md.example_bytes}
            if size not in allowed:
                raise TruncatedFileError(
                    f"size {size} bytes, {expected_shard_size(count, md)}", f)
        self._lengths = self._load_sidecar("lengths.bin", np.int32, (md.n_examples,))
        self._sample_ids = self._load_sidecar("sample_ids.bin", np.int64, (md.n_examples,))
        self._token_labels_raw = self._load_sidecar("labels.bin", np.uint8, (md.n_examples, md.patches_per_ex))
        self._labels_all_ignore: bool | None = None
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
        return memmap_regular(f, dtype, shape)

    # ---- memmaps ----
    def shard(self, index: int) -> np.memmap:
        """The (S_i, L, T, D) memmap of shard `index` (opened lazily, once per process)."""
        mm = self._maps.get(index)
        if mm is None:
            md = self.metadata
            count = self.shard_counts[index]
            mm = memmap_regular(self.path / shard_name(index), np.float32,
                                (count, len(md.layers), md.tokens_per_ex, md.d_model))
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
            rows = read_jsonl(f)
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
        """[N, T] uint8 labels; the CLS position (if any) is 0, patches from `labels.bin`.
        None when there is no labels.bin, or when every patch is IGNORE_LABEL (a text extraction)."""
        raw = self._token_labels_raw
        if raw is None or self._all_ignore(raw):
            return None
        if not self.metadata.cls_token:
            return np.asarray(raw)
        out = np.zeros((self.n_samples, self.max_tokens), dtype=np.uint8)
        out[:, 1:] = raw
        return out

    def _all_ignore(self, raw: np.ndarray) -> bool:
        """Whether labels.bin holds only IGNORE_LABEL (checked once, in bounded row blocks)."""
        if self._labels_all_ignore is None:
            flat = np.asarray(raw).reshape(-1)
            step = 1 << 24
            self._labels_all_ignore = all(bool((flat[i : i + step] == IGNORE_LABEL).all())
                                          for i in range(0, len(flat), step))
        return self._labels_all_ignore

    @property
    def cls_token(self) -> bool:
        """metadata.json's `cls_token`: token 0 of every example is CLS."""
        return self.metadata.cls_token

    @property
    def provenance(self) -> dict[str, Any]:
        f = self.path / "provenance.json"
        out = read_json(f) if f.exists() else {}
        if not isinstance(out, dict):
            raise MetadataError("must hold a JSON object", f)
        out = dict(out)
        # identity facts come from the hashed metadata.json; the unhashed provenance.json cannot override them
        out.update(ckpt=self.metadata.ckpt, family=self.metadata.family, dataset=self.metadata.dataset,
                   hash=self.metadata.hash)
        return out

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


def detect(path: Path) -> bool:
    """A directory with metadata.json that carries saev fields."""
    if not (path.is_dir() and (path / "metadata.json").is_file()):
        return False
    obj = peek_json(path / "metadata.json")
    if obj is None:
        return (path / "shards.json").is_file()  # looks like saev; let the reader name the problem
    return isinstance(obj, dict) and ("d_model" in obj or "protocol" in obj) and "version" not in obj


def open_reader(path: Path) -> SaevReader:
    return SaevReader(path)
