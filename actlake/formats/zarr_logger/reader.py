"""ZarrReader: one store, opened read-only from consolidated metadata, read from its chunk files or zarr's API."""

from __future__ import annotations

import itertools
import os
import zlib
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ...errors import FormatError, MetadataError, TruncatedFileError
from .base import ReadTask, ZarrReaderBase, read_threads_for
from .chunks import ChunkFiles, FdCache, missing_chunk
from .layout import ACT_ARRAYS, META_ARRAYS, NATIVE_F16, REQUIRED_META, zarr_module
from .meta import ArrayMeta, StoreMeta
from ...jsonio import read_jsonl, refuse_oversized
from ...store_walk import link_error, refuse_links

#: coordinates one zarr-API gather builds at most (each is int64 per dimension)
API_COORDS = 1 << 20
#: bytes one zarr-API block read returns at most
API_BLOCK_BYTES = 64 << 20


def _texts_column(rows: list[dict[str, Any]] | None, key: str) -> list[str] | None:
    """One text field of JSONL rows; None when no row has it (a null text is read as "")."""
    if rows is None or not rows or all(r.get(key) is None for r in rows):
        return None
    return [r.get(key) or "" for r in rows]


#: what zarr-python and its codecs raise on a chunk it cannot decode (blosc, lz4 and zstd: RuntimeError; gzip:
#: zlib.error or EOFError), turned into a TruncatedFileError naming the array
CHUNK_ERRORS = (ValueError, KeyError, TypeError, OSError, RuntimeError, zlib.error, EOFError)


def refuse_store_links(store: Path, arrays: Iterable[str] = ()) -> None:
    """UnsafePathError naming the first link in the store's folders (`arrays`: the array folders, chunk files
    included; one listing each, about 40 ms per 100,000 chunks). Chunk files are also opened without
    following links (O_NOFOLLOW on the direct path, a check before each zarr API read): a link swapped in later."""
    for folder in (store, store / "arrays", store / "text", *(store / "arrays" / name for name in arrays)):
        refuse_links(folder)


class ZarrReader(ZarrReaderBase):
    """Reader of one store, opened read-only with consolidated metadata; handles are per process."""

    def __init__(self, path: str | Path, *, fast: bool = True, read_threads: int | None = None,
                 fd_cache: FdCache | None = None) -> None:
        self.path = Path(path)
        self.read_threads = read_threads_for(read_threads)
        refuse_store_links(self.path)
        self.meta = meta = StoreMeta.load(self.path)
        refuse_store_links(self.path, meta.arrays)
        self._fds = FdCache() if fd_cache is None else fd_cache
        self.layers = meta.layers
        self.d_model = meta.hidden_size
        self.n_samples = meta.n_samples
        self.max_tokens = meta.p_max
        self.r_max = meta.r_max
        self._pid = -1
        self._root: Any = None
        self._cache: dict[str, Any] = {}  # decoded per-sample columns, computed once
        self._direct = {name: self._chunk_files(meta.arrays[name]) if fast else None for name in ACT_ARRAYS}
        self._load_columns(self.path / "arrays")

    def _load_columns(self, arrays: Path | str) -> None:
        """The small per-sample arrays, loaded whole and checked (lengths within P_max / R_max; errors name
        `arrays`/<name>)."""
        meta = self.meta
        small = {name: self._load_small(name) for name in META_ARRAYS if name in meta.arrays}
        for name in REQUIRED_META:
            values = small[name].astype(np.int64)
            cap = meta.p_max if name == "prompt_len" else meta.r_max
            if len(values) and (values.min() < 0 or values.max() > cap):
                raise MetadataError(f"values outside [0, {cap}]", f"{arrays}/{name}")
        for name in ("sample_id", "label"):
            if name in small:
                small[name] = small[name].astype(np.int64)
        self._prompt_len = small["prompt_len"].astype(np.int64)
        self._response_len = small["response_len"].astype(np.int64)
        self._small = small

    def _chunk_files(self, meta: ArrayMeta) -> ChunkFiles | None:
        """Direct chunk-file reads where they return exactly zarr's values; None -> zarr API."""
        ok = (meta.uncompressed and meta.dtype == NATIVE_F16 and meta.order == "C" and meta.fill_value in (0, 0.0)
              and meta.chunks[:2] == (1, 1) and meta.chunks[3] == meta.shape[3])
        if not ok:
            return None
        return ChunkFiles(str(self.path / "arrays" / meta.name), meta.separator, meta.chunks[2], meta.shape[3], self._fds)

    @property
    def fast(self) -> bool:
        """Whether both activation arrays are read straight from their chunk files."""
        return all(v is not None for v in self._direct.values())

    @property
    def root(self) -> Any:
        """The zarr group, opened read-only from consolidated metadata, once per process."""
        if self._root is None or self._pid != os.getpid():
            refuse_oversized([folder / name for folder in (self.path, self.path / "arrays")
                              for name in (".zgroup", ".zattrs", ".zmetadata")])
            try:
                self._root = zarr_module().open_consolidated(str(self.path), mode="r", zarr_format=2)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                raise MetadataError(f"zarr could not open the store: {exc}", self.path / ".zmetadata") from exc
            except RecursionError:  # zarr-python parses .zattrs / .zarray itself, with no depth cap
                raise MetadataError("zarr metadata (.zattrs, .zgroup or .zarray) is JSON nested too deeply",
                                    self.path) from None
            self._pid = os.getpid()
        return self._root

    def _load_small(self, name: str) -> np.ndarray:
        """A whole per-sample array (validated to shape (N,) by StoreMeta)."""
        try:
            return np.asarray(self.root["arrays"][name][:])
        except CHUNK_ERRORS as exc:
            raise FormatError(f"unreadable array: {exc}", self.path / "arrays" / name) from exc

    def _array(self, part: str) -> Any:
        """The zarr array of an activation part (API path)."""
        return self.root["arrays"][part]

    def _require_chunks(self, part: str, reads: list[tuple[int, int, int, int]]) -> None:
        """Every chunk file the zarr API will read for the real tokens (sample, layer position, t0, t1) of
        `reads` must exist: zarr would read a missing one as the fill value, silently."""
        meta = self.meta.arrays[part]
        sep, ch = meta.separator, meta.chunks
        folder = self.path / "arrays" / part
        across_h = range(-(-meta.shape[3] // ch[3]))
        for sample, li, t0, t1 in reads:
            for c in range(t0 // ch[2], -(-t1 // ch[2])):
                for h in across_h:
                    path = folder / sep.join(map(str, (sample // ch[0], li // ch[1], c, h)))
                    if not os.path.lexists(path):
                        raise missing_chunk(path, sample, li, c, ch[2])
                    if os.path.islink(path):  # zarr-python would follow it
                        raise link_error(path)

    def _api_error(self, part: str, what: str, exc: Exception) -> TruncatedFileError:
        return TruncatedFileError(f"chunk of {what} is unreadable: {exc}", self.path / "arrays" / part)

    # ---- read primitives ----
    def _read(self, part: str, sample: int, li: int, t0: int, t1: int, out: np.ndarray) -> None:
        if t1 <= t0:
            return
        direct = self._direct[part]
        if direct is not None:
            direct.read(sample, li, t0, t1, out)
            return
        self._require_chunks(part, [(sample, li, t0, t1)])
        try:
            out[...] = self._array(part)[sample, li, t0:t1, :]
        except CHUNK_ERRORS as exc:
            raise self._api_error(part, f"sample {sample} layer position {li}", exc) from exc

    def _read_rows(self, part: str, samples: np.ndarray, li: int, tokens: np.ndarray, out: np.ndarray) -> None:
        """One token row per sample: direct pread per row on the thread pool, or zarr coordinate selections."""
        samples, tokens = np.asarray(samples, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
        n = len(samples)
        direct = self._direct[part]
        if direct is None:
            step = max(1, API_COORDS // self.d_model)
            cols = np.arange(self.d_model, dtype=np.int64)[None, :]
            self._require_chunks(part, [(s, li, t, t + 1) for s, t in zip(samples.tolist(), tokens.tolist())])
            for a in range(0, n, step):
                s, t = samples[a : a + step, None], tokens[a : a + step, None]
                try:
                    out[a : a + step] = self._array(part).vindex[s, np.full_like(s, li), t, cols]
                except CHUNK_ERRORS as exc:
                    raise self._api_error(part, f"layer position {li}", exc) from exc
            return
        threads = self.read_threads
        if threads <= 1 or n < 2 * threads:
            direct.read_rows(samples, li, tokens, out)
            return
        bounds = np.linspace(0, n, threads + 1).astype(np.int64).tolist()
        self._in_threads(lambda ab: direct.read_rows(samples[ab[0] : ab[1]], li, tokens[ab[0] : ab[1]],
                                                     out[ab[0] : ab[1]]), list(itertools.pairwise(bounds)))

    def _read_many(self, part: str, tasks: list[ReadTask]) -> None:
        """Direct reads as the base class does; through zarr's API, one orthogonal selection per layer and block.

        zarr-python fetches the chunks of one selection concurrently, so a block costs about one
        call instead of one call per (sample, layer).
        """
        if self._direct[part] is not None or len(tasks) < 2:
            super()._read_many(part, tasks)
            return
        by_layer: dict[int, list[ReadTask]] = {}
        for task in tasks:
            n, view = task[2], task[3]
            if n < len(view):
                view[n:] = 0  # destinations are uninitialised
            if n:
                by_layer.setdefault(task[1], []).append(task)
        cap = self._array(part).shape[2]
        step = max(1, API_BLOCK_BYTES // max(1, cap * self.d_model * 2))
        for li, group in by_layer.items():
            for a in range(0, len(group), step):
                block = group[a : a + step]
                self._require_chunks(part, [(s, li, 0, n) for s, _, n, _ in block])
                t_max = max(n for _, _, n, _ in block)
                samples = np.array([s for s, _, _, _ in block], dtype=np.int64)
                try:
                    got = self._array(part).get_orthogonal_selection((samples, li, slice(0, t_max), slice(None)))
                except CHUNK_ERRORS as exc:
                    raise self._api_error(part, f"layer position {li}", exc) from exc
                for k, (_, _, n, view) in enumerate(block):
                    view[:n] = got[k, :n]

    def _parallel_ok(self) -> bool:
        return self.fast

    # ---- metadata ----
    @property
    def attrs(self) -> dict[str, Any]:
        """The root attrs (global metadata)."""
        return dict(self.meta.attrs)

    @property
    def sample_ids(self) -> np.ndarray:
        ids = self._small.get("sample_id")
        return np.arange(self.n_samples, dtype=np.int64) if ids is None else ids

    @property
    def labels(self) -> np.ndarray | None:
        return self._small.get("label")

    @property
    def hallu_label(self) -> np.ndarray | None:
        return self._small.get("hallu_label")

    @property
    def split(self) -> np.ndarray | None:
        return self._small.get("split")

    def _cached(self, key: str, compute: Any) -> Any:
        """A decoded per-sample column, computed on first use."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    @property
    def sample_keys(self) -> list[str] | None:
        def decode() -> list[str] | None:
            keys = self._small.get("sample_key")
            return None if keys is None else [k.decode("ascii", "replace") for k in keys.tolist()]

        return self._cached("sample_key", decode)

    def jsonl_rows(self, name: str) -> list[dict[str, Any]] | None:
        """One JSONL file of text/ (None if absent), checked: one object per sample, `i` in order."""
        return self._cached(f"rows:{name}", lambda: self._load_jsonl(self.path / "text" / name))

    def _load_jsonl(self, f: Path) -> list[dict[str, Any]] | None:
        if not f.exists():
            return None
        rows = read_jsonl(f)
        for lineno, row in enumerate(rows):
            if not isinstance(row, dict) or row.get("i") != lineno:
                raise MetadataError(f"line {lineno + 1} is not an object with \"i\": {lineno}", f)
        if len(rows) != self.n_samples:
            raise MetadataError(f"{len(rows)} lines, expected {self.n_samples}", f)
        return rows

    @property
    def texts(self) -> list[str] | None:
        return self._cached("texts", lambda: _texts_column(self.jsonl_rows("prompts.jsonl"), "prompt"))

    @property
    def response_texts(self) -> list[str] | None:
        return self._cached("response_texts", lambda: _texts_column(self.jsonl_rows("responses.jsonl"), "response"))

    @property
    def extra_rows(self) -> list[dict[str, Any]] | None:
        def strip() -> list[dict[str, Any]] | None:
            rows = self.jsonl_rows("extra_metadata.jsonl")
            return None if rows is None else [{k: v for k, v in r.items() if k not in ("i", "sample_key")} for r in rows]

        return self._cached("extra_rows", strip)

    @property
    def provenance(self) -> dict[str, Any]:
        a = self.meta.attrs
        out = {k: a[k] for k in ("model_id", "family", "dataset_name", "created_at", "git_commit", "schema_version",
                                 "spec_hash", "machine_id", "num_machines") if k in a}
        if isinstance(a.get("provenance"), dict):
            out.update(a["provenance"])
        return out

    def close(self) -> None:
        """Drop the zarr handle and close the cached chunk-file descriptors (reads reopen lazily)."""
        self._root = None
        self._fds.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_root"] = None  # each process opens its own handle
        state["_pid"] = -1
        return state
