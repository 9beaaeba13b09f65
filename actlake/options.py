"""`--option KEY=VALUE` parsing, one rule for every command (extract, convert)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from .errors import ConfigError


def parse_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """`k=v` strings to a dict: a value that parses as JSON (numbers, true, null, lists) is that value,
    `True`/`False`/`None` in any case are the Python constants, anything else is the string itself."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"option {pair!r} is not KEY=VALUE")
        low = raw.strip().lower()
        if low in ("true", "false", "none", "null"):
            value: Any = {"true": True, "false": False}.get(low)
        else:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
        out[key.strip()] = value
    return out
