"""Direct reads of uncompressed fp16 chunk files: a bounded per-process descriptor cache and pread into the destination."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, MissingFileError, TruncatedFileError
from ...store_walk import open_regular
from .layout import FD_CACHE_MAX


def default_fd_capacity() -> int:
    """Descriptors a reader may keep open: FD_CACHE_MAX, or an eighth of RLIMIT_NOFILE if that is less."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 128
    if soft == resource.RLIM_INFINITY:
        return FD_CACHE_MAX
    return max(16, min(FD_CACHE_MAX, soft // 8))


class FdCache:
    """A bounded LRU of read-only chunk-file descriptors, shared by one reader's arrays, per process.

    Opening a chunk file costs more than reading it from the page cache, so descriptors stay open
    (at most `capacity`, plus any pinned by reads in flight on other threads). Entries are pinned
    while read, so eviction never closes a descriptor a thread is reading; a fork, pickling or
    `close()` drops them all. Missing files are cached too (a read that needs one raises).
    """

    def __init__(self, capacity: int | None = None) -> None:
        capacity = default_fd_capacity() if capacity is None else capacity
        if capacity < 1:
            raise ConfigError(f"fd cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd (-1: missing), size, pins, evicted]
        self._pid = os.getpid()

    def acquire(self, path: str) -> list[int]:
        """The pinned entry [fd, size, pins, evicted] of `path`; release() it after reading."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's descriptors are not ours to share
                self._entries = OrderedDict()
                self._pid = os.getpid()
            entry = self._entries.get(path)
            if entry is not None:
                self._entries.move_to_end(path)
                entry[2] += 1
                return entry
        try:
            fd = open_regular(Path(path))  # a chunk replaced by a link is refused, never followed
        except MissingFileError:
            fd, size = -1, 0
        else:
            size = os.fstat(fd).st_size
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None:  # another thread opened it meanwhile
                if fd >= 0:
                    os.close(fd)
                entry[2] += 1
                return entry
            entry = [fd, size, 1, 0]
            self._entries[path] = entry
            while len(self._entries) > self.capacity:
                _, old = self._entries.popitem(last=False)
                old[3] = 1
                if old[2] == 0 and old[0] >= 0:
                    os.close(old[0])
            return entry

    def release(self, entry: list[int]) -> None:
        with self._lock:
            entry[2] -= 1
            if entry[2] == 0 and entry[3] and entry[0] >= 0:
                os.close(entry[0])
                entry[0] = -1

    def close(self) -> None:
        """Close every descriptor not pinned by a read in flight (those close on release)."""
        with self._lock:
            entries, self._entries = self._entries, OrderedDict()
            mine = self._pid == os.getpid()
            for entry in entries.values():
                entry[3] = 1
                if mine and entry[2] == 0 and entry[0] >= 0:
                    os.close(entry[0])
                    entry[0] = -1

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity}  # descriptors never travel to another process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"])  # type: ignore[misc]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: os may be gone
            pass


def missing_chunk(path: str | os.PathLike[str], sample: int, li: int, chunk: int, t_chunk: int) -> MissingFileError:
    """The error for an absent chunk file that holds real tokens (the writer writes every such chunk; only
    chunks entirely in padding may be absent)."""
    return MissingFileError(f"chunk file is missing; it holds real tokens (sample {sample}, layer position {li}, "
                            f"tokens from {chunk * t_chunk}), so it was deleted, not left out as padding", path)


@dataclass(frozen=True)
class ChunkFiles:
    """Direct reads of an uncompressed, C-order, fp16 v2 activation array's chunk files."""

    folder: str
    separator: str
    t_chunk: int
    hidden: int
    fds: FdCache

    def chunk_path(self, sample: int, li: int, chunk: int) -> str:
        """The chunk file of (sample, layer position, token chunk)."""
        sep = self.separator
        return f"{self.folder}/{sample}{sep}{li}{sep}{chunk}{sep}0"

    def _pread(self, path: str, buf: memoryview, offset: int) -> bool:
        """Fill `buf` from `path` at byte `offset` (short reads finished); False if the chunk file is absent."""
        entry = self.fds.acquire(path)
        try:
            fd, size = entry[0], entry[1]
            if fd < 0:
                return False
            want = self.t_chunk * self.hidden * 2
            if size != want:
                raise TruncatedFileError(f"chunk file has {size} bytes, expected {want}", path)
            n, got = len(buf), 0
            while got < n:  # short reads are legal; finish them
                more = os.preadv(fd, [buf[got:]], offset + got)
                if more <= 0:
                    raise TruncatedFileError(f"chunk file ended after {offset + got} bytes", path)
                got += more
            return True
        finally:
            self.fds.release(entry)

    def read(self, sample: int, li: int, t0: int, t1: int, out: np.ndarray) -> None:
        """Fill `out` ((t1 - t0, H) C-contiguous float16) with tokens [t0, t1) of (sample, li).

        One `os.preadv` per chunk straight into `out`, through the reader's descriptor cache. Reads ask only
        for real tokens, so every chunk they touch must exist (MissingFileError naming it otherwise).
        """
        tc, row = self.t_chunk, self.hidden * 2
        buf = memoryview(out).cast("B")
        t = t0
        while t < t1:
            c, within = divmod(t, tc)
            rows = min(tc - within, t1 - t)
            pos = (t - t0) * row
            path = self.chunk_path(sample, li, c)
            if not self._pread(path, buf[pos : pos + rows * row], within * row):
                raise missing_chunk(path, sample, li, c, tc)
            t += rows

    def read_rows(self, samples: np.ndarray, li: int, tokens: np.ndarray, out: np.ndarray) -> None:
        """Fill `out[k]` ((n, H) C-contiguous float16) with token `tokens[k]` of (samples[k], li).

        The chunk file and offset of every row are computed in one vectorised pass; then one
        `pread` per row (the last-token gather).
        """
        row = self.hidden * 2
        chunk, within = np.divmod(np.asarray(tokens, dtype=np.int64), self.t_chunk)
        sep = self.separator
        paths = [f"{self.folder}/{s}{sep}{li}{sep}{c}{sep}0" for s, c in zip(samples.tolist(), chunk.tolist())]
        buf = memoryview(out).cast("B")
        for k, (path, offset) in enumerate(zip(paths, (within * row).tolist())):
            if not self._pread(path, buf[k * row : (k + 1) * row], offset):
                raise missing_chunk(path, int(samples[k]), li, int(chunk[k]), self.t_chunk)
