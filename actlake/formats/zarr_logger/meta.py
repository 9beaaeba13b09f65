"""A store's consolidated metadata (`.zmetadata`), parsed and validated before anything is allocated from it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...errors import MetadataError, MissingFileError, ProtocolVersionError
from ...jsonio import read_json
from .layout import (
    ACT_ARRAYS,
    MAX_DIMS,
    MAX_SAMPLE_KEY_BYTES,
    MAX_SLICE_BYTES,
    META_ARRAYS,
    PROMPT,
    REQUIRED_META,
    RESPONSE,
    SCHEMA_VERSION,
    is_int,
)


def np_dtype(text: str, source: Path) -> np.dtype:
    """numpy dtype of a .zarray dtype string, or MetadataError naming the file."""
    try:
        return np.dtype(text)
    except (TypeError, ValueError) as exc:
        raise MetadataError(f"dtype {text!r} is not a numpy dtype", source) from exc


@dataclass(frozen=True)
class ArrayMeta:
    """The fields of one `.zarray` that reading depends on."""

    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    compressor: Any
    filters: Any
    fill_value: Any
    order: str
    separator: str

    @classmethod
    def from_json(cls, name: str, obj: Any, source: Path) -> "ArrayMeta":
        """Validate one `.zarray` object (from `.zmetadata`); errors name `source`."""
        if not isinstance(obj, dict):
            raise MetadataError("array metadata must be a JSON object", source)
        for key in ("shape", "chunks", "dtype", "order"):
            if key not in obj:
                raise MetadataError(f"missing field {key!r}", source)
        if obj.get("zarr_format") != 2:
            raise ProtocolVersionError(f"zarr_format {obj.get('zarr_format')!r}, expected 2", source)
        shape, chunks = obj["shape"], obj["chunks"]
        if not (isinstance(shape, list) and isinstance(chunks, list) and len(shape) == len(chunks)
                and all(is_int(x) and x >= 0 for x in shape + chunks) and all(c >= 1 for c in chunks)):
            raise MetadataError(f"shape {shape!r} / chunks {chunks!r} are not matching lists of sizes", source)
        if not isinstance(obj["dtype"], str):
            raise MetadataError(f"dtype {obj['dtype']!r} is not a string", source)
        sep = obj.get("dimension_separator", ".")
        if sep not in (".", "/"):
            raise MetadataError(f"dimension_separator {sep!r} is not '.' or '/'", source)
        return cls(name, tuple(shape), tuple(chunks), obj["dtype"], obj.get("compressor"), obj.get("filters"),
                   obj.get("fill_value"), obj["order"], sep)

    @property
    def uncompressed(self) -> bool:
        """No compressor and no filters: a chunk file is the raw chunk bytes."""
        return self.compressor is None and not self.filters


def _check_act_array(meta: ArrayMeta, source: Path) -> None:
    """An activation array: 4-D float16, each dimension and one (sample, layer) slice within the reader's limits."""
    if len(meta.shape) != 4:
        raise MetadataError(f"shape {list(meta.shape)} is not (N, L, T, H)", source)
    if np_dtype(meta.dtype, source) != np.float16:
        raise MetadataError(f"dtype {meta.dtype!r}, the spec stores float16", source)
    for dim, size in zip("NLTH", meta.shape):
        if size > MAX_DIMS[dim]:
            raise MetadataError(f"shape {list(meta.shape)} claims {dim}={size}, more than the "
                                f"{MAX_DIMS[dim]} this reader accepts", source)
    if meta.shape[2] * meta.shape[3] * 2 > MAX_SLICE_BYTES:
        raise MetadataError(f"shape {list(meta.shape)} claims {meta.shape[2] * meta.shape[3] * 2} bytes per "
                            f"(sample, layer), more than the {MAX_SLICE_BYTES} this reader accepts", source)


def _check_meta_array(meta: ArrayMeta, n: int, source: Path) -> None:
    """A per-sample array: shape (N,) and the dtype actlake writes (any short |S for sample_key)."""
    if meta.shape != (n,):
        raise MetadataError(f"shape {list(meta.shape)}, expected ({n},)", source)
    dtype = np_dtype(meta.dtype, source)
    if meta.name == "sample_key" and dtype.kind == "S":
        if dtype.itemsize > MAX_SAMPLE_KEY_BYTES:
            raise MetadataError(f"dtype {meta.dtype!r}: sample keys longer than {MAX_SAMPLE_KEY_BYTES} bytes "
                                "are refused", source)
    elif dtype != np.dtype(META_ARRAYS[meta.name]):
        raise MetadataError(f"dtype {meta.dtype!r}, expected {META_ARRAYS[meta.name]}", source)


@dataclass(frozen=True)
class StoreMeta:
    """A store's consolidated metadata: root attrs and every array's `.zarray`, validated."""

    path: Path
    attrs: dict[str, Any]
    arrays: dict[str, ArrayMeta]
    n_samples: int
    layers: tuple[int, ...]
    hidden_size: int
    p_max: int
    r_max: int

    @classmethod
    def load(cls, path: Path) -> "StoreMeta":
        """Parse `.zmetadata`; raise a typed error naming the file on the first problem."""
        if not path.is_dir():
            raise MissingFileError("not a directory", path)
        return cls.from_consolidated(path, read_json(path / ".zmetadata"), lambda key: (path / key).is_file())

    @classmethod
    def from_consolidated(cls, path: Path, zmeta: Any, has_file: Callable[[str], bool]) -> "StoreMeta":
        """Validate parsed `.zmetadata` of the store at `path`; `has_file(key)`: whether the store holds the file
        `key` (e.g. "arrays/prompt_activations/.zarray"), so a remote store is checked the same way."""
        zmeta_path = path / ".zmetadata"
        if not isinstance(zmeta, dict) or not isinstance(zmeta.get("metadata"), dict):
            raise MetadataError("consolidated metadata must hold an object with 'metadata'", zmeta_path)
        entries = zmeta["metadata"]
        group = entries.get(".zgroup")
        if not isinstance(group, dict) or group.get("zarr_format") != 2:
            raise ProtocolVersionError("root group is not a Zarr v2 group", zmeta_path)
        attrs = entries.get(".zattrs", {})
        if not isinstance(attrs, dict):
            raise MetadataError("root .zattrs is not an object", zmeta_path)
        schema_version = str(attrs.get("schema_version", SCHEMA_VERSION))
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)*", schema_version) or \
                schema_version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise ProtocolVersionError(f"schema_version {schema_version!r} is not readable (this reader speaks "
                                       f"{SCHEMA_VERSION})", path / ".zattrs")
        arrays: dict[str, ArrayMeta] = {}
        for name in ACT_ARRAYS + tuple(META_ARRAYS):
            key = f"arrays/{name}/.zarray"
            if key not in entries:
                if name in ACT_ARRAYS + REQUIRED_META:
                    raise MissingFileError(f"required array arrays/{name} is not in the consolidated metadata", zmeta_path)
                continue
            zarray = path / key
            if not has_file(key):
                raise MissingFileError(f"required file {zarray.name} is missing", zarray)
            arrays[name] = ArrayMeta.from_json(name, entries[key], zarray)
        prompt, response = arrays[PROMPT], arrays[RESPONSE]
        for meta in (prompt, response):
            _check_act_array(meta, path / "arrays" / meta.name / ".zarray")
        n, n_layers, p_max, hidden = prompt.shape
        if response.shape[:2] != (n, n_layers) or response.shape[3] != hidden:
            raise MetadataError(f"shape {list(response.shape)} does not match {PROMPT} {list(prompt.shape)}",
                                path / "arrays" / RESPONSE / ".zarray")
        for name, meta in arrays.items():
            if name in META_ARRAYS:
                _check_meta_array(meta, n, path / "arrays" / name / ".zarray")
        layers = attrs.get("layers", list(range(n_layers)))
        if not (isinstance(layers, list) and len(layers) == n_layers
                and all(is_int(x) for x in layers) and len(set(layers)) == n_layers):
            raise MetadataError(f"attr 'layers' {layers!r} does not list {n_layers} unique layer indices", path / ".zattrs")
        for key, want in (("hidden_size", hidden), ("num_layers", n_layers), ("P_max", p_max),
                          ("R_max", response.shape[2]), ("n_samples", n)):
            if key in attrs and attrs[key] != want:
                raise MetadataError(f"attr {key}={attrs[key]!r} does not match the arrays ({want})", path / ".zattrs")
        return cls(path, attrs, arrays, n, tuple(layers), hidden, p_max, response.shape[2])
