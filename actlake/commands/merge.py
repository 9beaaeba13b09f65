"""`actlake merge INPUTS... --out DIR`: merge per-machine outputs of one format into one store."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "merge"
HELP = "merge per-machine outputs (zarr shards / runs, pickle shard directories) of one format into one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="stores or run directories to merge, in output order")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", default=None, help="skip detection and merge as this format")


def merge_paths(inputs: list[Path], out: Path, format: str | None = None) -> Path:
    """Detect the one format of `inputs` and call that format module's `merge(inputs, out)`."""
    from ..errors import ConfigError
    from ..formats import detect_format, format_module

    names = {format} if format else {detect_format(p) for p in inputs}
    if len(names) != 1:
        raise ConfigError(f"inputs are of different formats {sorted(names)}; merge takes one format")
    name = names.pop()
    module = format_module(name)
    merge = getattr(module, "merge", None)
    if merge is None:
        raise ConfigError(f"format {name!r} has no merge")
    return Path(merge(inputs, out))


def run(args: argparse.Namespace) -> int:
    out = merge_paths([Path(p) for p in args.inputs], Path(args.out), args.format)
    print(out)
    return 0
