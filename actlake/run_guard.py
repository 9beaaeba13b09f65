"""Guards that keep a run directory honest: its links must point at the shards its config recorded, and
only one process may train or infer in it at a time.

A run directory is a tree of symlinks; anyone can re-point `links/train-shards`. Training records the
shard hash it read in `checkpoint/config.json`, so every later use (inference, visuals)
checks the link against that record, and checks that a saev directory's name is still the hash of
its metadata, before it reads a byte.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .errors import FormatError, HashMismatchError, RunError

if TYPE_CHECKING:
    from .runs import Run

LOCK_NAME = ".run"  # WriterLock adds ".lock": <run>/checkpoint/.run.lock, removed when released


def _saev_name_matches(path: Path) -> bool | None:
    """Whether a saev directory's name is the spec's HASH of its metadata.json (None: not saev)."""
    from .formats.saev.metadata import metadata_hash
    from .jsonio import read_json

    if not (path / "shards.json").is_file() or not (path / "metadata.json").is_file():
        return None
    md = read_json(path / "metadata.json")
    if not isinstance(md, dict):
        return False
    digest = metadata_hash(md)
    return path.name == digest or (len(path.name) == 8 and digest.startswith(path.name))


def check_links(run: "Run", config: dict[str, Any] | None = None) -> None:
    """RunError when links/train-shards or links/val-shards no longer point at the directories whose
    hashes checkpoint/config.json recorded; HashMismatchError when a linked saev directory's name no
    longer matches its metadata. A run without a config (not trained yet) has nothing recorded."""
    from .runs import shard_hash_of

    if config is None:
        if not run.config_path.is_file():
            return
        config = run.read_config()
    for key, link in (("train_shards", "train-shards"), ("val_shards", "val-shards")):
        recorded = config.get(key)
        if not isinstance(recorded, dict):
            continue
        want = recorded.get("shard_hash")
        target = run.link(link, required=True)
        assert target is not None
        got = shard_hash_of(target)
        if got != want:
            raise RunError(f"points at shards {got}, but the SAE was trained with {key.replace('_', ' ')} {want} "
                           f"(checkpoint/config.json); re-point it or train a new run", run.links_dir / link)
        if _saev_name_matches(target) is False:
            raise HashMismatchError("the directory's name is not the sha256 of its metadata.json: it was "
                                    "edited after publication", target)


@contextmanager
def run_lock(run: "Run", action: str) -> Iterator[None]:
    """Hold the run directory's exclusive lock while `action` writes into it (a second process gets a
    RunError at once, never a lost checkpoint); the kernel drops it if the process dies."""
    from .atomic import WriterLock

    run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = WriterLock(run.checkpoint_dir / LOCK_NAME)
    except FormatError:
        raise RunError(f"another process is working in this run directory; {action} refused", run.path) from None
    try:
        yield
    finally:
        lock.release(remove=True)
