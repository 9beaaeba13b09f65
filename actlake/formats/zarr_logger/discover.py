"""Registry entry points that find what is at a path: `detect` and `open_reader` (store, run dir or sharded run)."""

from __future__ import annotations

from pathlib import Path

from ...atomic import resolve_inside
from ...errors import MissingFileError
from .base import ZarrReaderBase
from .layout import MANIFEST_FORMAT, MANIFEST_NAME, SHARD_RE, SHARDS_DIR, STORE_NAME
from .manifest import ZarrManifestReader, check_manifest
from .meta import read_json
from .reader import ZarrReader
from ...jsonio import peek_json


def store_dir(path: Path) -> Path | None:
    """The store directory at `path` (a store, or a run directory holding activations.zarr)."""
    if (path / ".zgroup").is_file() and ((path / "arrays").is_dir() or (path / ".zmetadata").is_file()):
        return path
    if (path / STORE_NAME / ".zgroup").is_file():
        return path / STORE_NAME
    return None


def store_roots(path: Path) -> list[Path]:
    """The store directories at `path`, each carrying its own checksums.json: the store, or every shard store
    a sharded run's manifest lists."""
    path = Path(path)
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        entries, _ = check_manifest(read_json(manifest), manifest)
        return [resolve_inside(path, e["path"], source=manifest) for e in entries]
    store = store_dir(path)
    if store is None:
        raise MissingFileError("no Zarr store here (.zgroup with arrays/, or activations.zarr/)", path / ".zgroup")
    return [store]


def is_sharded_run(path: Path) -> bool:
    """A run directory of a sharded write (manifest.json, or a shards/ folder)."""
    return (path / MANIFEST_NAME).is_file() or (path / SHARDS_DIR).is_dir()


def detect(path: Path) -> bool:
    """A store, a run directory holding one, or a sharded run directory (manifest.json or shards/)."""
    if not path.is_dir():
        return False
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        obj = peek_json(manifest)
        if obj is None:
            return (path / SHARDS_DIR).is_dir()
        return isinstance(obj, dict) and obj.get("format") == MANIFEST_FORMAT
    if (path / SHARDS_DIR).is_dir() and any(SHARD_RE.match(p.name) for p in (path / SHARDS_DIR).iterdir()):
        return True
    return store_dir(path) is not None


def open_reader(path: Path, *, fast: bool = True) -> ZarrReaderBase:
    """A ZarrManifestReader for a sharded run directory, else a ZarrReader of the store."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return ZarrManifestReader(path, fast=fast)
    if (path / SHARDS_DIR).is_dir():
        raise MissingFileError("sharded run directory without manifest.json (not all shards are published)",
                               path / MANIFEST_NAME)
    store = store_dir(path)
    if store is None:
        raise MissingFileError("no Zarr store here (.zgroup with arrays/, or activations.zarr/)", path / ".zgroup")
    return ZarrReader(store, fast=fast)
