"""LmprobeReader: an lmprobe 2.0 dataset through actlake's Reader protocol (rows by position, shards memory-mapped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from actlake.atomic import resolve_inside
from actlake.batch import Batch
from actlake.errors import (
    FormatError,
    MetadataError,
    MissingFileError,
    SampleIndexError,
    TruncatedFileError,
)
from actlake.formats.lmprobe.codec import from_bfloat16_bits
from actlake.formats.lmprobe.descriptors import HiddenDescriptor, LogitsDescriptor
from actlake.formats.lmprobe.index import (
    check_columns,
    check_info,
    column_numpy,
    list_column,
    read_index_metadata,
    read_index_table,
)
from actlake.formats.lmprobe.layout import (
    EXTRA_TOKEN_PERPLEXITY,
    EXTRA_TOKEN_STRINGS,
    FORMAT,
    HIDDEN_DTYPES,
    INDEX_PATH,
    LOGITS_INDEX_CODES,
    LOGITS_INDICES_KEY,
    LOGITS_VALUE_CODES,
    LOGITS_VALUES_KEY,
    MAX_DECLARED_TOKENS,
    RESERVED_COLUMNS,
    UPSTREAM_INDICES_KEY,
    UPSTREAM_VALUES_KEY,
    is_int,
)
from actlake.formats.lmprobe.safetensors_io import (
    TensorInfo,
    map_tensor,
    read_safetensors_header,
)
from actlake.reader import Reader, TokenSegment


def runs(ids: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, stops) of maximal runs with one shard id and consecutive row offsets."""
    breaks = np.flatnonzero((ids[1:] != ids[:-1]) | (offs[1:] != offs[:-1] + 1)) + 1
    return np.concatenate([[0], breaks]), np.concatenate([breaks, [len(ids)]])


class LmprobeReader(Reader):
    """Reader of an lmprobe 2.0 dataset; prompts are addressed by row, tensors memory-mapped."""

    _process_local = ("_maps",)

    format = FORMAT

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError("not a directory", self.path)
        self.index_path = self.path / INDEX_PATH
        self._open_index(read_index_metadata, read_index_table)

    def _open_index(self, read_metadata: Any, read_table: Any) -> None:
        """Parse and check the index (`read_metadata(path)`, `read_table(path)` read it), then find every shard
        it describes (`_shard_file`, `_file_size`) before anything is read from them."""
        self.info, self.actlake_meta = read_metadata(self.index_path)
        check_info(self.info, self.index_path)
        tensors = self.info["tensors"]
        if "hidden_layers" not in tensors:
            raise MetadataError("tensors has no hidden_layers descriptor", self.index_path)
        self.hidden = h = HiddenDescriptor.parse(tensors["hidden_layers"], self.index_path)
        self.logits_desc = LogitsDescriptor.parse(tensors["logits_topk"], self.index_path) if "logits_topk" in tensors else None
        self.table = read_table(self.index_path)
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
        self.shard_index = column_numpy(self.table, "shard_index", np.int64)
        self.row_offset = column_numpy(self.table, "row_offset", np.int64)
        self.num_tokens = column_numpy(self.table, "num_tokens", np.int64)
        if self.full_sequence:
            self.tok_ids, self.tok_bounds = list_column(self.table, "token_shard_ids", self.index_path)
            self.tok_offs, offs_bounds = list_column(self.table, "token_shard_offsets", self.index_path)
            if not np.array_equal(offs_bounds, self.tok_bounds):
                raise MetadataError("token_shard_offsets lengths differ from token_shard_ids", self.index_path)
        self._check_addressing()
        # every shard path is resolved (and refused if it escapes the root) before anything is read
        self._files: dict[tuple[int, int], Path] = {}
        for layer in h.layers:
            for shard in range(len(h.shard_prompts)):
                self._files[(layer, shard)] = self._shard_file(h.file(layer, shard))
        self._logits_files: list[Path] = []
        if self.logits_desc is not None:
            self._logits_files = [self._shard_file(self.logits_desc.file(s))
                                  for s in range(len(self.logits_desc.shard_prompts))]
        for f in list(self._files.values()) + self._logits_files:
            if self._file_size(f) is None:
                raise MissingFileError("shard described by the index is missing", f)
        self._check_sizes()
        self._maps: dict[tuple[int, int], tuple[np.ndarray, TensorInfo]] = {}
        self._logits_cache: tuple[np.ndarray, np.ndarray] | None = None
        self._meta_cache: dict[str, Any] = {}
        self.max_tokens = self._max_tokens()

    def _check_addressing(self) -> None:
        """Refuse shard_index/row_offset (and full-sequence token addresses) outside the described shards."""
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
            size = self._file_size(f)
            if size < need:
                raise TruncatedFileError(f"{size} bytes cannot hold the {h.shard_tokens[shard]} x {h.dim} "
                                         f"{h.dtype} rows the index describes ({need} bytes)", f)

    def _shard_file(self, relative: str) -> Path:
        """A shard file the index names, refused if it escapes the dataset directory."""
        return resolve_inside(self.path, relative, source=self.index_path)

    def _file_size(self, f: Path) -> int | None:
        """Size of a shard file in bytes (None: absent)."""
        return f.stat().st_size if f.is_file() else None

    def _header(self, f: Path) -> dict[str, TensorInfo]:
        """The checked safetensors header of a shard file."""
        return read_safetensors_header(f)

    def _map(self, f: Path, info: TensorInfo) -> Any:
        """The rows of one tensor (a read-only memmap; a remote reader reads byte ranges)."""
        return map_tensor(f, info)

    def _max_tokens(self) -> int:
        """Longest stored prompt (1 for pooled), or actlake's declared max_tokens when larger and sane."""
        if not self.full_sequence:
            return 1
        longest = int(self.num_tokens.max()) if self.n_samples else 1
        declared = self.actlake_meta.get("max_tokens")
        if is_int(declared) and declared > max(longest, MAX_DECLARED_TOKENS):
            raise MetadataError(f"actlake max_tokens {declared} is absurd (longest prompt {longest} tokens)",
                                self.index_path)
        return max(longest, 1, declared if is_int(declared) else 0)

    # ---- tensors ----
    def tensor(self, layer: int, shard: int) -> np.ndarray:
        """The raw (rows, D) memmap of one shard of one layer (bfloat16 as uint16 bits)."""
        return self._mapped(layer, shard)[0]

    def _mapped(self, layer: int, shard: int) -> tuple[np.ndarray, TensorInfo]:
        """(memmap, header entry) of one shard of one layer, mapped and checked on first use."""
        self.layer_index(layer)
        hit = self._maps.get((layer, shard))
        if hit is None:
            hit = self._maps[(layer, shard)] = self._map_hidden(layer, shard)
        return hit

    def _map_hidden(self, layer: int, shard: int) -> tuple[np.ndarray, TensorInfo]:
        h = self.hidden
        path = self._files[(layer, shard)]
        header = self._header(path)
        key = h.key(layer)
        info = header.get(key)
        if info is None:
            raise FormatError(f"tensor {key!r} (key_pattern {h.key_pattern!r}) is not in the file", path)
        code = HIDDEN_DTYPES[h.dtype][0]
        want = (h.shard_tokens[shard], h.dim)
        if info.code != code or info.shape != want:
            raise FormatError(f"tensor {key!r} is {info.code} {list(info.shape)}, the index says {code} {list(want)}", path)
        return self._map(path, info), info

    def _decode(self, raw: np.ndarray) -> np.ndarray:
        """Stored rows as `self.dtype` (a copy; bfloat16 widened to float32)."""
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
        """The integer `sample_id` column actlake writes; row positions for datasets without one."""
        import pyarrow as pa

        names = self.table.column_names
        if "sample_id" in names and pa.types.is_integer(self.table.schema.field("sample_id").type):
            return self._cached("sample_id", lambda: column_numpy(self.table, "sample_id", np.int64))
        return np.arange(self.n_samples, dtype=np.int64)

    @property
    def texts(self) -> list[str]:
        return self._cached("text", lambda: [x if x is not None else "" for x in self.table.column("text").to_pylist()])

    @property
    def labels(self) -> np.ndarray | None:
        """int64 labels (-1 for null); None for string labels (see `row(i)['label']`)."""
        import pyarrow as pa

        if not pa.types.is_integer(self.table.schema.field("label").type):
            return None
        return self._cached("label", lambda: column_numpy(self.table, "label", np.int64))

    @property
    def cls_token(self) -> bool:
        """The `cls_token` actlake records in the index footer, for full_sequence data only: a pooled row is the
        last token, never a CLS token (absent: False, as for other tools)."""
        value = self.actlake_meta.get("cls_token", False)
        if not isinstance(value, bool):
            raise MetadataError(f"actlake cls_token must be true or false, got {value!r}", self.index_path)
        return value and self.full_sequence

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
            row = int(self.row_offset[s])
            return self._decode(self.tensor(layer, int(self.shard_index[s]))[row : row + 1])
        self.layer_index(layer)
        ids = self.tok_ids[self.tok_bounds[s] : self.tok_bounds[s + 1]]
        offs = self.tok_offs[self.tok_bounds[s] : self.tok_bounds[s + 1]]
        out = np.empty((len(ids), self.d_model), dtype=self.dtype)
        if len(ids):
            for start, stop in zip(*runs(ids, offs)):  # one slice per run of consecutive rows in one shard
                first = int(offs[start])
                out[start:stop] = self._decode(self.tensor(layer, int(ids[start]))[first : first + stop - start])
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
        info = self._mapped(layer, shard)[1]
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
        if not self.n_samples:
            return []
        breaks = np.flatnonzero(np.diff(self.shard_index)) + 1
        starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [self.n_samples]])
        return [TokenSegment(self.tensor(layer, int(self.shard_index[a])), self.row_offset[a:z].copy(),
                             np.ones(z - a, dtype=np.int64), int(a)) for a, z in zip(starts, stops)]

    def logits(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(values [N, k] float32, indices [N, k] int64) of every prompt, or None when not stored."""
        if self.logits_desc is None:
            return None
        k = self.logits_desc.k
        si = column_numpy(self.table, "shard_index_logits", np.int64)
        ro = column_numpy(self.table, "row_offset_logits", np.int64)
        # map (and so size-check) every shard before allocating from the descriptor's k
        tensors = [self._logits_tensors(shard, path) for shard, path in enumerate(self._logits_files)]
        counts = np.asarray(self.logits_desc.shard_prompts, dtype=np.int64)
        if self.n_samples and (si.min() < 0 or si.max() >= len(counts) or ro.min() < 0 or (ro >= counts[si]).any()):
            raise MetadataError("shard_index_logits/row_offset_logits point outside the logits shards", self.index_path)
        values = np.empty((self.n_samples, k), dtype=np.float32)
        indices = np.empty((self.n_samples, k), dtype=np.int64)
        for shard, (v, ix) in enumerate(tensors):
            sel = np.flatnonzero(si == shard)
            values[sel] = v[ro[sel]]
            indices[sel] = ix[ro[sel]]
        return values, indices

    def _logits_tensors(self, shard: int, path: Path) -> tuple[np.ndarray, np.ndarray]:
        """(values, indices) memmaps of one logits shard: the spec keys, else upstream's aliases."""
        assert self.logits_desc is not None
        header = self._header(path)
        n, k = self.logits_desc.shard_prompts[shard], self.logits_desc.k
        out = []
        for key, alias, codes in ((LOGITS_VALUES_KEY, UPSTREAM_VALUES_KEY, LOGITS_VALUE_CODES),
                                  (LOGITS_INDICES_KEY, UPSTREAM_INDICES_KEY, LOGITS_INDEX_CODES)):
            info = header.get(key) or header.get(alias)
            if info is None:
                raise FormatError(f"logits tensor {key!r} (or {alias!r}) is missing", path)
            if info.shape != (n, k):
                raise FormatError(f"logits tensor {info.key!r} has shape {list(info.shape)}, expected {[n, k]}", path)
            if info.code not in codes:
                raise FormatError(f"logits tensor {info.key!r} has dtype {info.code}, expected one of {codes}", path)
            out.append(np.asarray(self._map(path, info)))
        return out[0], out[1]

    def _batch_meta(self, idx: np.ndarray, acts: np.ndarray, lengths: np.ndarray) -> Batch:
        """Metadata of positions `idx`, with token ids, logits and user columns for conversion."""
        import pyarrow as pa

        base = super()._batch_meta(idx, acts, lengths)
        rows = pa.array(idx, type=pa.int64())
        token_ids = None
        if "token_ids" in self.table.column_names:
            flat, bounds = list_column(self.table.select(["token_ids"]).take(rows), "token_ids", self.index_path)
            t = acts.shape[2]
            token_ids = np.zeros((len(idx), t), dtype=np.int64)
            real = np.arange(t) < np.minimum(np.diff(bounds), t)[:, None]
            token_ids[real] = flat[(bounds[:-1, None] + np.arange(t))[real]]
        values = indices = None
        if self.logits_desc is not None and self._logits_cache is None:
            self._logits_cache = self.logits()
        if self._logits_cache is not None:
            values, indices = self._logits_cache[0][idx], self._logits_cache[1][idx]
        names = [c for c in self.extra_columns() if c != "sample_id"]
        names += [c for c in (EXTRA_TOKEN_PERPLEXITY, EXTRA_TOKEN_STRINGS) if c in self.table.column_names]
        if self.labels is None:
            names.append("label")
        picked = self.table.select(names).take(rows) if names else None
        extra = {name: picked.column(name).to_pylist() for name in names} if picked is not None else {}
        return Batch(acts_bltd=base.acts_bltd, lengths=base.lengths, sample_ids=base.sample_ids, texts=base.texts,
                     labels=base.labels, token_ids=token_ids, logits_topk_values=values,
                     logits_topk_indices=indices, extra=extra)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(storage=self.hidden.storage, pooling=self.hidden.pooling, stored_dtype=self.stored_dtype,
                   shards=len(self.hidden.shard_prompts), last_token_shards=self.hidden.last_token_shards,
                   logits_topk=None if self.logits_desc is None else self.logits_desc.k)
        return out



def detect(path: Path) -> bool:
    """A directory holding `index/train-00000-of-00001.parquet`."""
    return path.is_dir() and (path / INDEX_PATH).is_file()


def open_reader(path: Path) -> LmprobeReader:
    """Format-registry entry point."""
    return LmprobeReader(path)
