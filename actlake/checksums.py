"""checksums.json: the size and digest of every file of a published store, written just before publication
(inside the directory that is renamed into place) and checked by `actlake verify` and
`actlake.open(path, verify=True)`.

Why: a flipped byte in a data file, or metadata edited after publication, changes no size and breaks no
structure, so only a digest recorded at publication finds it. Layout (docs/formats.md, "Checksums"), one
file per line so that a reader streams it in bounded memory (any JSON parser reads it whole):

    {"format": "actlake-checksums", "version": 1, "algorithm": "sha256-blocks", "block_bytes": 8388608, "files": [
    ["acts000000.bin", 314572800, "<64 hex>"],
    ["metadata.json", 512, "<64 hex>"]
    ]}

Entries list every file of the store but checksums.json itself, by POSIX path relative to the store root,
in component-wise name order (`actlake.store_walk.walk_store`). The digest `sha256-blocks` is the sha256 of
the concatenated 32-byte sha256 digests of the file's consecutive `block_bytes` blocks (the last one shorter;
an empty file has none): blocks hash on several threads, and a block inside a file hole (a saev shard's
zero tail) is known to be zeros without being read. sha256 (hashlib, SHA-NI) was measured faster than this
machine's disk (bench/checksum_speed.py); the numbers are in docs/formats.md.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import re
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .atomic import atomic_file
from .errors import (
    ActlakeError,
    FormatError,
    HashMismatchError,
    MetadataError,
    MissingFileError,
    TruncatedFileError,
)
from .store_walk import FILE, LINK, StoreEntry, link_error, open_regular, other_error, walk_store
from .verification import VerifyWarning, warning

CHECKSUMS_NAME = "checksums.json"
FORMAT = "actlake-checksums"
VERSION = 1
ALGORITHM = "sha256-blocks"
BLOCK_BYTES = 8 << 20
#: blocks one thread hashes in a row (a 64 MiB slice of a large file)
TASK_BLOCKS = 8
#: longest line the streaming reader accepts (an entry is ~100 bytes)
MAX_LINE_BYTES = 1 << 16
#: a checksums.json not in the line layout is parsed whole only up to this size
MAX_FULL_PARSE_BYTES = 16 << 20
#: problems one scan keeps (the rest are counted)
MAX_REPORTED = 1000
_HEX = re.compile(r"[0-9a-f]{64}")
_FILES_OPEN = '"files": ['

#: called with (file offset, bytes) of every data block read; returns (offset, message) of a problem, or None
Inspector = Callable[[int, memoryview], "tuple[int, str] | None"]


def hash_threads() -> int:
    """Threads that read and hash: min(4, CPUs) (hashlib and the kernel copy release the GIL)."""
    return max(1, min(4, os.cpu_count() or 1))


# ------------------------------------------------------------------------------------------
# digests
# ------------------------------------------------------------------------------------------

_zero_digests: dict[int, bytes] = {}
_local = threading.local()


def _zero_digest(n: int) -> bytes:
    """sha256 of n zero bytes (a block inside a file hole), computed once per size."""
    digest = _zero_digests.get(n)
    if digest is None:
        digest = _zero_digests[n] = hashlib.sha256(bytes(n)).digest()
    return digest


def _buffer(n: int) -> memoryview:
    """A reusable per-thread read buffer of at least `n` bytes."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = bytearray(max(n, BLOCK_BYTES))
    return memoryview(buf)[:n]


def _in_hole(fd: int, offset: int, n: int) -> bool:
    """Whether bytes [offset, offset + n) lie in a hole of the file (no data there: zeros, nothing to read)."""
    seek_data = getattr(os, "SEEK_DATA", None)
    if seek_data is None:
        return False
    try:
        data = os.lseek(fd, offset, seek_data)
    except OSError as exc:
        return exc.errno == errno.ENXIO  # no data at or after offset
    return data >= offset + n


def _pread_full(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise TruncatedFileError(f"ended after {offset + got} bytes while being read", path)
        got += n


@dataclass
class _Blocks:
    """What one task read: the digests of its blocks and the first problem its inspector reported."""

    digests: list[bytes]
    hit: tuple[int, str] | None


def _read_blocks(path: Path, first: int, stop: int, size: int, block: int, do_hash: bool,
                 inspect: Inspector | None) -> _Blocks:
    """Blocks [first, stop) of a file of `size` bytes: digested (when `do_hash`) and shown to `inspect`."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size != size:
            raise TruncatedFileError(f"changed size while being read (expected {size} bytes)", path)
        digests: list[bytes] = []
        hit: tuple[int, str] | None = None
        for b in range(first, stop):
            offset = b * block
            n = min(block, size - offset)
            if _in_hole(fd, offset, n):
                if do_hash:
                    digests.append(_zero_digest(n))
                continue  # zeros: nothing to inspect
            view = _buffer(n)
            _pread_full(fd, view, offset, path)
            if do_hash:
                digests.append(hashlib.sha256(view).digest())
            if inspect is not None:
                found = inspect(offset, view)
                if found is not None and (hit is None or found[0] < hit[0]):
                    hit = found
        return _Blocks(digests, hit)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Job:
    """One file to read: `tag` comes back with its result."""

    tag: Any
    path: Path
    size: int
    do_hash: bool
    inspect: Inspector | None = None


@dataclass(frozen=True)
class _Done:
    tag: Any
    path: Path
    digest: str | None
    hit: tuple[int, str] | None
    error: ActlakeError | None


def _collect(job: _Job, futures: list[Future[_Blocks]]) -> _Done:
    digests: list[bytes] = []
    hit: tuple[int, str] | None = None
    error: ActlakeError | None = None
    for f in futures:
        try:
            part = f.result()
        except ActlakeError as exc:
            error = error or exc
            continue
        except OSError as exc:
            error = error or FormatError(f"cannot be read: {exc.strerror or exc}", job.path)
            continue
        digests.extend(part.digests)
        if part.hit is not None and (hit is None or part.hit[0] < hit[0]):
            hit = part.hit
    digest = hashlib.sha256(b"".join(digests)).hexdigest() if job.do_hash and error is None else None
    return _Done(job.tag, job.path, digest, hit, error)


def digest_files(jobs: Iterable[_Job], *, block: int = BLOCK_BYTES) -> Iterator[_Done]:
    """Read every job's file on `hash_threads()` threads, yielding results in job order.

    Memory: one block buffer per thread, and a bounded window of queued tasks."""
    threads = hash_threads()
    window = 4 * threads
    pending: deque[tuple[_Job, list[Future[_Blocks]]]] = deque()
    queued = 0
    pool = ThreadPoolExecutor(threads, thread_name_prefix="actlake-checksums")
    try:
        for job in jobs:
            n_blocks = -(-job.size // block)
            futures = [pool.submit(_read_blocks, job.path, b, min(b + TASK_BLOCKS, n_blocks), job.size, block,
                                   job.do_hash, job.inspect) for b in range(0, n_blocks, TASK_BLOCKS)]
            pending.append((job, futures))
            queued += len(futures)
            while queued > window:
                done, fs = pending.popleft()
                queued -= len(fs)
                yield _collect(done, fs)
        while pending:
            done, fs = pending.popleft()
            yield _collect(done, fs)
    finally:  # a consumer that stops early (an error) does not wait for the queued rest
        pool.shutdown(wait=True, cancel_futures=True)


def file_digest(path: Path, *, block: int = BLOCK_BYTES) -> str:
    """The `sha256-blocks` hex digest of one file (a regular file, not a link)."""
    path = Path(path)
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    [done] = list(digest_files([_Job(None, path, size, True)], block=block))
    if done.error is not None:
        raise done.error
    assert done.digest is not None
    return done.digest


# ------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------


def _header(block: int) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "block_bytes": block}


def write_checksums(root: Path) -> Path:
    """Write `root/checksums.json` over every file under `root` (atomically; an old one is replaced).

    Called by every writer on its finished temporary directory, just before the rename that publishes it.
    A link or special file under `root` is refused (a published store holds none)."""
    root = Path(root)

    tmp_name = f".{CHECKSUMS_NAME}.tmp-{os.getpid()}"  # atomic_file's temporary name, beside the final one

    def jobs() -> Iterator[_Job]:
        for entry in walk_store(root, skip=frozenset({CHECKSUMS_NAME, tmp_name})):
            if entry.kind == LINK:
                raise link_error(entry.path)
            if entry.kind != FILE:
                raise other_error(entry.path)
            yield _Job(entry, entry.path, entry.size, True)

    head = json.dumps(_header(BLOCK_BYTES))[:-1] + ", " + _FILES_OPEN + "\n"
    with atomic_file(root / CHECKSUMS_NAME) as f:
        f.write(head.encode("utf-8"))
        sep = ""
        for done in digest_files(jobs()):
            if done.error is not None:
                raise done.error
            entry: StoreEntry = done.tag
            f.write(f"{sep}{json.dumps([entry.rel, entry.size, done.digest])}".encode("utf-8"))
            sep = ",\n"
        f.write(b"\n]}\n")
    return root / CHECKSUMS_NAME


# ------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    """One entry of checksums.json."""

    rel: str
    key: tuple[str, ...]
    size: int
    digest: str


def _check_header(obj: Any, source: Path) -> int:
    """The block size of a valid header object; MetadataError naming the field otherwise."""
    if not isinstance(obj, dict):
        raise MetadataError("must hold a JSON object", source)
    for key, want in (("format", FORMAT), ("version", VERSION), ("algorithm", ALGORITHM)):
        if obj.get(key) != want or isinstance(obj.get(key), bool):
            raise MetadataError(f"field {key!r} is {obj.get(key)!r}, expected {want!r}", source)
    block = obj.get("block_bytes")
    if not (isinstance(block, int) and not isinstance(block, bool) and 1 << 12 <= block <= 1 << 26
            and block & (block - 1) == 0):
        raise MetadataError(f"field 'block_bytes' is {block!r}, expected a power of two in [4096, 2**26]", source)
    return block


def _entry(value: Any, where: str, source: Path) -> Listed:
    """A validated entry: [relative path, size, digest]; the path stays inside the store."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and isinstance(value[1], int) and not isinstance(value[1], bool) and 0 <= value[1] < 1 << 60
            and isinstance(value[2], str) and _HEX.fullmatch(value[2])):
        raise MetadataError(f"{where} is not [path, size, 64-hex digest]", source)
    rel = value[0]
    key = tuple(rel.split("/"))
    if rel == CHECKSUMS_NAME or "\0" in rel or any(part in ("", ".", "..") for part in key):
        raise MetadataError(f"{where} names {rel!r}, not a path inside the store", source)
    return Listed(rel, key, value[1], value[2])


def _ordered(entries: Iterator[Listed], source: Path) -> Iterator[Listed]:
    """Entries, refused unless in strictly increasing component order (so none is listed twice)."""
    last: tuple[str, ...] | None = None
    for n, e in enumerate(entries, 1):
        if last is not None and e.key <= last:
            raise MetadataError(f"entry {n} ({e.rel!r}) is out of order or listed twice", source)
        last = e.key
        yield e


def _line_entries(f: BinaryIO, source: Path) -> Iterator[Listed]:
    n = 1
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        n += 1
        if not raw:
            raise MetadataError("ends before its closing ']}'", source)
        if len(raw) > MAX_LINE_BYTES:
            raise MetadataError(f"line {n} is longer than {MAX_LINE_BYTES} bytes", source)
        line = raw.strip()
        if line == b"]}":
            if f.read(MAX_LINE_BYTES).strip():
                raise MetadataError("has data after its closing ']}'", source)
            return
        if not line:
            continue
        if line.endswith(b","):
            line = line[:-1]
        try:
            value = json.loads(line)
        except ValueError:
            raise MetadataError(f"line {n} is not a JSON entry", source) from None
        yield _entry(value, f"line {n}", source)


def open_listing(root: Path) -> tuple[int, Iterator[Listed]]:
    """(block size, entries in order) of `root/checksums.json`, streamed; typed errors name the file.

    The line layout actlake writes is read line by line; any other JSON layout is parsed whole when it is
    at most MAX_FULL_PARSE_BYTES."""
    source = Path(root) / CHECKSUMS_NAME
    fd = open_regular(source)
    f = os.fdopen(fd, "rb")
    try:
        first = f.readline(MAX_LINE_BYTES + 1).rstrip()
        text = first.decode("utf-8", "replace")
        if text.startswith("{") and text.endswith(_FILES_OPEN):
            body = text[: -len(_FILES_OPEN)].rstrip().rstrip(",") + "}"
            try:
                block = _check_header(json.loads(body), source)
            except ValueError:
                raise MetadataError("its first line is not the header object", source) from None
            return block, _ordered(_closing(f, _line_entries(f, source)), source)
        size = os.fstat(fd).st_size
        if size > MAX_FULL_PARSE_BYTES:
            raise MetadataError(f"not in the line layout actlake writes, and {size} bytes is more than the "
                                f"{MAX_FULL_PARSE_BYTES} parsed whole", source)
        f.seek(0)
        from .jsonio import parse_json

        obj = parse_json(f.read(MAX_FULL_PARSE_BYTES + 1), source)
    except BaseException:
        f.close()
        raise
    f.close()
    block = _check_header(obj, source)
    files = obj.get("files")
    if not isinstance(files, list):
        raise MetadataError("field 'files' must be a list", source)
    return block, _ordered((_entry(v, f"files[{i}]", source) for i, v in enumerate(files)), source)


def _closing(f: BinaryIO, entries: Iterator[Listed]) -> Iterator[Listed]:
    try:
        yield from entries
    finally:
        f.close()


# ------------------------------------------------------------------------------------------
# checking
# ------------------------------------------------------------------------------------------


@dataclass
class Scan:
    """What a scan of a store's files found: typed problems (at most MAX_REPORTED, `more` counts the rest)
    and warnings (what could not be checked)."""

    problems: list[ActlakeError] = field(default_factory=list)
    more: int = 0
    warnings: list[str] = field(default_factory=list)
    _seq: list[int] = field(default_factory=list)

    def add(self, seq: int, problem: ActlakeError) -> None:
        if len(self.problems) >= MAX_REPORTED:
            self.more += 1
            return
        self.problems.append(problem)
        self._seq.append(seq)

    def ordered(self) -> list[ActlakeError]:
        """Problems in the order of the files they are about."""
        return [p for _, p in sorted(zip(self._seq, self.problems), key=lambda sp: sp[0])]


def scan_store(root: Path, *, inspector_for: Callable[[str], Inspector | None] | None = None) -> Scan:
    """Check every file under `root` against its checksums.json (streamed, hashed on several threads), refuse
    links and special files, and show each data block to `inspector_for(relative path)`'s inspector.

    No checksums.json (a store published before actlake recorded them): a warning, and the files are still
    walked (links refused) and inspected."""
    root = Path(root)
    scan = Scan()
    source = root / CHECKSUMS_NAME
    seq = itertools.count()
    block = BLOCK_BYTES
    listing: Iterator[Listed] | None = None
    if not os.path.lexists(source):
        scan.warnings.append(f"{source}: missing (a store published before actlake recorded checksums): the "
                             f"bytes of its files were not checked against a checksum")
    else:
        try:
            block, listing = open_listing(root)
        except ActlakeError as exc:
            scan.add(next(seq), exc)
    try:
        walk = walk_store(root, skip=frozenset({CHECKSUMS_NAME}))
        for done in digest_files(_join(root, listing, walk, scan, seq, inspector_for), block=block):
            tag_seq, want = done.tag
            if done.error is not None:
                scan.add(tag_seq, done.error)
                continue
            if want is not None and done.digest != want:
                scan.add(tag_seq, HashMismatchError(f"content does not match {CHECKSUMS_NAME} ({ALGORITHM} "
                                                    f"{done.digest}, recorded {want})", done.path))
            if done.hit is not None:
                scan.add(tag_seq, FormatError(done.hit[1], done.path))
    except OSError as exc:
        scan.add(next(seq), FormatError(f"cannot be walked: {exc.strerror or exc}", Path(exc.filename or root)))
    finally:
        if listing is not None and hasattr(listing, "close"):
            listing.close()
    scan.problems = scan.ordered()
    return scan


def _join(root: Path, listing: Iterator[Listed] | None, walk: Iterator[StoreEntry], scan: Scan,
          seq: Iterator[int], inspector_for: Callable[[str], Inspector | None] | None) -> Iterator[_Job]:
    """Merge the listing and the walk (both in component order): problems go to `scan`, files to read are yielded."""
    # unlisted files are a problem only against a usable listing (none, or one broken half-way: not reported)
    state: dict[str, Any] = {"it": listing, "usable": listing is not None}

    def pull() -> Listed | None:
        it = state["it"]
        if it is None:
            return None
        try:
            return next(it)
        except StopIteration:
            state["it"] = None
        except MetadataError as exc:
            scan.add(next(seq), exc)
            state["it"] = None
            state["usable"] = False
        return None

    def inspector(entry: StoreEntry) -> Inspector | None:
        return inspector_for(entry.rel) if inspector_for is not None else None

    entry_l = pull()
    entry_w = next(walk, None)
    while entry_l is not None or entry_w is not None:
        if entry_w is None or (entry_l is not None and entry_l.key < entry_w.key):
            assert entry_l is not None
            scan.add(next(seq), MissingFileError(f"is listed in {CHECKSUMS_NAME} but missing", root / entry_l.rel))
            entry_l = pull()
            continue
        w = entry_w
        same = entry_l is not None and entry_l.key == w.key
        n = next(seq)
        if w.kind == LINK:
            scan.add(n, link_error(w.path))
        elif w.kind != FILE:
            scan.add(n, other_error(w.path))
        elif same:
            assert entry_l is not None
            if w.size != entry_l.size:
                scan.add(n, TruncatedFileError(f"{w.size} bytes, {CHECKSUMS_NAME} records {entry_l.size}", w.path))
            else:
                yield _Job((n, entry_l.digest), w.path, w.size, True, inspector(w))
        else:
            if state["usable"]:
                scan.add(n, FormatError(f"is not listed in {CHECKSUMS_NAME} (added after publication?)", w.path))
            found = inspector(w)
            if found is not None:
                yield _Job((n, None), w.path, w.size, False, found)
        if same:
            entry_l = pull()
        entry_w = next(walk, None)


def store_findings(root: Path, *, inspector_for: Callable[[str], Inspector | None] | None = None) -> list[str]:
    """verify's findings about the files of a store: problems, then "warning: " findings (verification.warning)."""
    scan = scan_store(root, inspector_for=inspector_for)
    out = [str(p) for p in scan.problems]
    if scan.more:
        out.append(f"{root}: {scan.more} more problem(s) with its files (the first {MAX_REPORTED} are listed)")
    return out + [warning(w) for w in scan.warnings]


def check_store(root: Path) -> None:
    """Raise the first problem `scan_store` finds (a typed error naming the file); warn (VerifyWarning) when the
    store has no checksums.json. Used by `actlake.open(path, verify=True)`."""
    scan = scan_store(root)
    if scan.problems:
        raise scan.problems[0]
    for message in scan.warnings:
        warnings.warn(message, VerifyWarning, stacklevel=3)
