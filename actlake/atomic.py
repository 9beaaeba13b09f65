"""Atomic publication: build under a temporary name, fsync, rename into place, make read-only."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from .errors import FormatError, UnsafePathError


def fsync_file(path: Path) -> None:
    """Flush one file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (so a rename inside it is durable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` only complete: written under a temporary name, fsynced, renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, fsync and rename."""
    with atomic_file(path) as f:
        f.write(data)


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = 2) -> None:
    """Write `obj` as UTF-8 JSON to `path` atomically."""
    write_bytes_atomic(path, (json.dumps(obj, indent=indent) + "\n").encode("utf-8"))


def make_read_only(root: Path) -> None:
    """Remove write permission from every file and directory under `root` (published = immutable)."""
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        p = Path(dirpath)
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def make_writable(root: Path) -> None:
    """Give write permission back (used only to delete abandoned temporary directories)."""
    for dirpath, dirnames, filenames in os.walk(root):
        Path(dirpath).chmod(Path(dirpath).stat().st_mode | stat.S_IWUSR)
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | stat.S_IWUSR)


def remove_tree(root: Path) -> None:
    """Delete a directory tree, read-only parts included."""
    if root.exists():
        make_writable(root)
        shutil.rmtree(root)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                fsync_file(p)
        fsync_dir(Path(dirpath))


def replace_dir(tmp: Path, final: Path) -> Path:
    """Put a finished temporary directory in place of `final` (which may exist), never leaving neither.

    The old directory is first renamed aside (`.<name>.old-<pid>`), so a crash between the two
    renames leaves it recoverable; it is deleted once the new one is in place.
    """
    fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        remove_tree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    remove_tree(old)
    return final


def publish_dir(tmp: Path, final: Path, *, read_only: bool = True) -> Path:
    """Rename a finished temporary directory to its final name, fsyncing files first.

    If `final` already exists (a concurrent writer published identical content first), the
    temporary directory is discarded and `final` is returned unchanged.
    """
    fsync_tree(tmp)
    if read_only:
        make_read_only(tmp)
    try:
        os.rename(tmp, final)
    except OSError:
        if final.exists():
            remove_tree(tmp)
            return final
        raise
    fsync_dir(final.parent)
    return final


def resolve_inside(root: Path, relative: str, *, source: Path | None = None) -> Path:
    """Join `relative` (read from a file) to `root`, refusing anything that escapes `root`."""
    root_resolved = Path(root).resolve()
    if Path(relative).is_absolute():
        raise UnsafePathError(f"absolute path {relative!r} is not allowed", source or root)
    candidate = (root_resolved / relative).resolve()
    if candidate != root_resolved and root_resolved not in candidate.parents:
        raise UnsafePathError(f"path {relative!r} escapes the dataset root {root_resolved}", source or root)
    return candidate


class WriterLock:
    """An exclusive, non-blocking lock on `<tmp>.lock` beside a writer's temporary directory.

    Two writers of one store would corrupt each other's temporary files; the second one gets a
    FormatError naming the store. The kernel drops the lock when its process dies (kill -9), so
    a later run can resume.
    """

    def __init__(self, tmp_path: Path) -> None:
        import fcntl

        self.path = Path(tmp_path).with_name(Path(tmp_path).name + ".lock")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise FormatError("another process is writing this store right now", tmp_path) from None
        self._fd: int | None = fd

    def release(self, *, remove: bool) -> None:
        """Let go (closing the descriptor releases the flock); `remove` also deletes the lock file."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


PID_MAX = 1 << 22  # Linux's largest pid_max: a longer number ending a name is not a pid
_PID_SUFFIX = re.compile(r"^\.tmp-.+-(\d+)(\.[A-Za-z0-9]+)?$")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphaned_tmp(parent: Path) -> list[Path]:
    """Remove `.tmp-<name>-<pid>` entries under `parent` whose writing process is gone (a killed
    `infer` or `merge`); a live writer's temporary directory is left alone. Returns what was removed."""
    removed = []
    if not Path(parent).is_dir():
        return removed
    for entry in Path(parent).iterdir():
        m = _PID_SUFFIX.match(entry.name)
        pid = int(m.group(1)) if m else 0
        if 0 < pid <= PID_MAX and pid != os.getpid() and not pid_alive(pid):
            if entry.is_dir() and not entry.is_symlink():
                remove_tree(entry)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
