"""Reading a JSON file a format requires, with typed errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import MetadataError, MissingFileError


#: no metadata file actlake reads is anywhere near this; a bigger one is refused before it is read
MAX_JSON_BYTES = 256 * 2**20


def _bounded_text(path: Path, max_bytes: int) -> str:
    size = path.stat().st_size
    if size > max_bytes:
        raise MetadataError(f"{size} bytes is more than a metadata file may hold ({max_bytes}); refused unread", path)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # the file may grow between stat and read
    if len(data) > max_bytes:
        raise MetadataError(f"more than {max_bytes} bytes; refused", path)
    return data.decode("utf-8")


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parsed UTF-8 JSON of `path`; MissingFileError if absent, MetadataError if not JSON, larger than
    `max_bytes` (checked before reading), or nested too deeply to parse."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"required file {path.name} is missing", path)
    try:
        return json.loads(_bounded_text(path, max_bytes))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise MetadataError(f"not valid UTF-8 JSON: {str(exc)[:200]}", path) from exc
    except RecursionError:
        raise MetadataError("JSON nested too deeply to parse", path) from None


def peek_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any | None:
    """Parsed JSON of `path` for format detection: None when it is absent, unreadable, too large or too
    deep (never raises)."""
    try:
        return json.loads(_bounded_text(Path(path), max_bytes))
    except (ValueError, UnicodeDecodeError, OSError, RecursionError, MetadataError):
        return None
