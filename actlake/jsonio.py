"""Reading a JSON file a format requires, with typed errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import MetadataError, MissingFileError


def read_json(path: Path) -> Any:
    """Parsed UTF-8 JSON of `path`; MissingFileError if absent, MetadataError if not JSON."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"required file {path.name} is missing", path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise MetadataError(f"not valid UTF-8 JSON: {exc}", path) from exc


def peek_json(path: Path) -> Any | None:
    """Parsed JSON of `path` for format detection: None when it is absent or unreadable (never raises)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError):
        return None
