"""Reading a JSON file a format requires, with typed errors that name the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import FormatError, MetadataError, MissingFileError


#: no metadata file actlake reads is anywhere near this; a bigger one is refused before it is read
MAX_JSON_BYTES = 256 * 2**20


def parse_json(data: bytes | str, source: Path, what: str = "") -> Any:
    """Parsed JSON of bytes or text read from `source`; MetadataError naming the file (and `what` in it)
    when it is not UTF-8, not JSON, or nested too deeply to parse."""
    where = f"{what} " if what else ""
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise MetadataError(f"{where}is not valid UTF-8 JSON: {str(exc)[:200]}", source) from None
    except RecursionError:
        raise MetadataError(f"{where}is JSON nested too deeply to parse", source) from None


def read_jsonl(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> list[Any]:
    """One parsed value per line of a UTF-8 JSON-lines file (typed errors name the file and line)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"required file {path.name} is missing", path)
    size = path.stat().st_size
    if size > max_bytes:
        raise MetadataError(f"{size} bytes is more than a JSON-lines file may hold ({max_bytes})", path)
    with open(path, "rb") as f:
        return parse_jsonl(f.read(max_bytes + 1), path)


def parse_jsonl(data: bytes, source: Path) -> list[Any]:
    """One parsed value per line of UTF-8 JSON-lines bytes read from `source` (errors name file and line)."""
    return [parse_json(line, source, f"line {n}") for n, line in enumerate(data.splitlines(), 1)]


def refuse_oversized(paths: list[Path], *, max_bytes: int = MAX_JSON_BYTES) -> None:
    """MetadataError naming the first existing file of `paths` larger than `max_bytes`: for metadata another
    library (zarr-python) reads whole, with no cap of its own."""
    for path in paths:
        try:
            size = os.stat(path).st_size
        except OSError:
            continue
        if size > max_bytes:
            raise MetadataError(f"{size} bytes is more than a metadata file may hold ({max_bytes}); refused unread",
                                Path(path))


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parsed UTF-8 JSON of `path`; MissingFileError if absent, MetadataError if not JSON, larger than
    `max_bytes` (checked before reading), or nested too deeply to parse."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"required file {path.name} is missing", path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise MetadataError(f"{size} bytes is more than a metadata file may hold ({max_bytes}); refused unread",
                                path)
        data = f.read(max_bytes + 1)  # the file may grow between fstat and read
    if len(data) > max_bytes:
        raise MetadataError(f"more than {max_bytes} bytes; refused", path)
    return parse_json(data, path)


def peek_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any | None:
    """Parsed JSON of `path` for format detection: None when it is absent, unreadable, too large or too
    deep (never raises)."""
    try:
        return read_json(Path(path), max_bytes=max_bytes)
    except (OSError, FormatError):
        return None
