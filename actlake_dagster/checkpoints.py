"""Checkpoints: discover them (one directory each under a root, or one configured model) and hash their weights.

The weights' sha256 is the checkpoint's data version. Hashing a multi-GB checkpoint on every
sensor tick is wasteful, so per-file digests are cached in a JSON file keyed by path, size and
mtime: an unchanged file is never read again, a rewritten one is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from actlake.atomic import write_json_atomic
from actlake.errors import ConfigError
from actlake.hashing import file_sha256

#: a checkpoint key is a dynamic partition key: a directory name, or the model spec made safe
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
CACHE_FORMAT = "actlake-weights-cache/1"


def checkpoint_key(model_spec: str) -> str:
    """Partition key of a single configured model ("minilm", "tiny-random:bert" -> "tiny-random-bert", a dir -> its name)."""
    spec = model_spec.rstrip("/")
    name = Path(spec).name if ("/" in spec or os.sep in spec) else spec
    return _UNSAFE.sub("-", name).strip("-") or "model"


def is_checkpoint_dir(path: Path) -> bool:
    """A Hugging Face model directory: config.json plus at least one weight file."""
    from actlake.extract.models import WEIGHT_SUFFIXES

    return (path / "config.json").is_file() and any(
        p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir())


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: its partition key and the model spec the library loads it from."""

    key: str
    model: str
    path: Path | None  # None for tiny-random models (no files)


def discover(model: str, checkpoints_root: str) -> list[Checkpoint]:
    """Every checkpoint, sorted by key: the root's model subdirectories, else the one configured model."""
    from actlake.extract.models import resolve_model

    if checkpoints_root:
        root = Path(checkpoints_root).expanduser()
        if not root.is_dir():
            raise ConfigError(f"checkpoints root {root} is not a directory (ACTLAKE_CHECKPOINTS)")
        found = [Checkpoint(p.name, str(p.resolve()), p.resolve()) for p in sorted(root.iterdir())
                 if p.is_dir() and not p.name.startswith(".") and is_checkpoint_dir(p)]
        return found
    source = resolve_model(model)
    return [Checkpoint(checkpoint_key(model), model, source.path)]


class WeightsHashCache:
    """sha256 of a checkpoint's weights, the same value the extraction records (`weights_sha256`),
    with per-file digests cached on (size, mtime_ns) in one JSON file."""

    def __init__(self, cache_file: Path) -> None:
        self.cache_file = Path(cache_file)
        self._entries: dict[str, dict[str, object]] | None = None
        self.files_hashed = 0  # files read this process (the sensor tick's cost)
        self._dirty = False

    def _load(self) -> dict[str, dict[str, object]]:
        if self._entries is None:
            try:
                obj = json.loads(self.cache_file.read_text(encoding="utf-8"))
                ok = isinstance(obj, dict) and obj.get("format") == CACHE_FORMAT and isinstance(obj.get("files"), dict)
                self._entries = dict(obj["files"]) if ok else {}
            except (OSError, ValueError):
                self._entries = {}  # a missing or damaged cache only costs a re-hash
        return self._entries

    def _file_digest(self, path: Path) -> str:
        entries = self._load()
        st = path.stat()
        entry = entries.get(str(path))
        if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            return str(entry["sha256"])
        digest = file_sha256(path)
        self.files_hashed += 1
        entries[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        self._dirty = True
        return digest

    def weights_sha256(self, checkpoint: Checkpoint) -> str:
        """Combined sha256 of the checkpoint's weight files (tiny-random models: sha256 of the spec)."""
        from actlake.extract.models import weights_sha256

        if checkpoint.path is None:
            return hashlib.sha256(checkpoint.model.encode("utf-8")).hexdigest()
        self._dirty = False
        combined, _ = weights_sha256(checkpoint.path, digest=lambda p: self._file_digest(p.resolve()))
        if self._dirty:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.cache_file, {"format": CACHE_FORMAT, "files": self._load()})
        return combined
