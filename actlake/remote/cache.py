"""The local cache of remote saev stores (a memmap format is read from local files): one directory per store,
named by its content hash, filled once and then read locally with no request to the remote."""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from ..errors import HashMismatchError
from .publish import cache_root
from .url import CHECKSUMS, RemoteStore


HASH_NAME = re.compile(r"[0-9a-f]{64}")


def download(store: RemoteStore, dest: Path) -> None:
    """Copy every object of `store` into the new directory `dest` (checksums.json last)."""
    dest.mkdir(parents=True)
    for rel in sorted(store.sizes, key=lambda p: (posixpath.basename(p) == CHECKSUMS, p)):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        store.fs.get_file(store.path(rel), str(target))


def saev_cache_dir(name: str) -> Path:
    """Where the saev store of content hash `name` is cached: `$ACTLAKE_CACHE/saev/shards/<hash>` (the storage
    spec's `saev/shards/<hash>` path, so a run's links resolve to a name run_guard can check)."""
    return cache_root() / "saev" / "shards" / name


def cached_by_name(url: str) -> Path | None:
    """The cached copy of a URL whose last component is a content hash (as actlake publishes saev stores), when it
    is in the cache (it was checked when it was filled): found with no request to the remote."""
    named = saev_cache_dir(url.rstrip("/").rsplit("/", 1)[-1])
    return named if HASH_NAME.fullmatch(named.name) and named.is_dir() else None


def cached_saev(url: str) -> Path:
    """The local copy of the remote saev store at `url`, downloaded on first use.

    The cache key is the content hash: the sha256 of the remote metadata.json (the saev directory name),
    computed here, not read from the URL. A first use downloads into `.tmp-<hash>-<pid>` beside it, checks every
    file against checksums.json and the name against the metadata (the local saev verify of the copy, so a
    flipped byte or a missing file is a typed error naming it), then renames it into place; a later use is a
    pure local read: a URL whose last component is a content hash already in the cache is not contacted."""
    from ..atomic import make_read_only, remove_tree
    from ..checksums import check_store
    from ..formats.saev.metadata import metadata_hash

    named = cached_by_name(url)
    if named is not None:
        return named
    store = RemoteStore.open(url)
    if not store.has(CHECKSUMS):
        from ..errors import IncompleteUploadError

        raise IncompleteUploadError(f"no {CHECKSUMS} at the store root: an incomplete upload; refused",
                                    store.where(CHECKSUMS))
    name = metadata_hash(store.json("metadata.json"))
    final = saev_cache_dir(name)
    if final.is_dir():
        return final
    tmp = final.with_name(f".tmp-{name}-{os.getpid()}")
    remove_tree(tmp)
    try:
        download(store, tmp)
        check_store(tmp)
        from ..formats.saev.verify import verify as saev_verify

        problems = [m for m in saev_verify(tmp, published_as=final) if not m.startswith("warning: ")]
        if problems:
            raise HashMismatchError(f"the downloaded copy fails verification: {'; '.join(problems[:3])}", url)
        make_read_only(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # another process put the same content there first: keep theirs
                raise
    finally:
        remove_tree(tmp)
    return final
