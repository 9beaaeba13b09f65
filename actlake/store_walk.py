"""The files of a published store, walked without following links: a published store holds regular files and
directories only, so a symbolic link (or a FIFO, a device...) inside one is refused, never followed.

Why: a data file replaced by a link to a right-sized file outside the store would otherwise be read as the
store's own data. Readers refuse links where they open files (`refuse_links`, `refuse_link_path`,
`open_regular`); `verify` walks every entry (`walk_store`). Recorded in docs/formats.md ("Checksums").
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import FormatError, MissingFileError, UnsafePathError

#: what a store entry is, as `walk_store` reports it
FILE, LINK, OTHER = "file", "link", "other"


def link_error(path: Path) -> UnsafePathError:
    """The one error (and verify message) for a link inside a store."""
    return UnsafePathError("is a symbolic link; a published store holds no links (it is not followed)", path)


def other_error(path: Path) -> FormatError:
    """The error for an entry that is neither a regular file nor a directory (FIFO, socket, device)."""
    return FormatError("is not a regular file or directory; a published store holds only those", path)


@dataclass(frozen=True)
class StoreEntry:
    """One entry under a store root: `rel` is its POSIX path relative to the root, `key` its components."""

    rel: str
    key: tuple[str, ...]
    path: Path
    kind: str
    size: int


def walk_store(root: Path, *, skip: frozenset[str] = frozenset()) -> Iterator[StoreEntry]:
    """Every file, link and special entry under `root` (directories are descended, never links), in
    component-wise name order: names sorted within each directory, a directory's entries where its name
    sorts. `skip` names root-level entries to leave out (the checksums file itself)."""
    yield from _walk(Path(root), (), skip)


def _walk(folder: Path, prefix: tuple[str, ...], skip: frozenset[str]) -> Iterator[StoreEntry]:
    for name in sorted(os.listdir(folder)):  # names only: the listing of a big chunk folder stays small
        if not prefix and name in skip:
            continue
        key = (*prefix, name)
        path = folder / name
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(path, key, skip)
            continue
        kind = FILE if stat.S_ISREG(st.st_mode) else LINK if stat.S_ISLNK(st.st_mode) else OTHER
        yield StoreEntry("/".join(key), key, path, kind, st.st_size)


def refuse_links(folder: Path) -> None:
    """Raise UnsafePathError naming the first link directly inside `folder` (not recursive: cheap on open)."""
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.is_symlink():
            raise link_error(Path(folder) / entry.name)


def refuse_link_path(root: Path, relative: str) -> None:
    """Raise UnsafePathError when any component of `root/relative` (below `root`) is a link."""
    path = Path(root)
    for part in Path(relative).parts:
        path = path / part
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise link_error(path)
        except FileNotFoundError:
            return


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file and not a link (typed errors name it).

    O_NOFOLLOW refuses a link in the last component; O_NONBLOCK keeps a FIFO from blocking the open."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MissingFileError("is missing", path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise link_error(Path(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise other_error(Path(path))
    return fd
