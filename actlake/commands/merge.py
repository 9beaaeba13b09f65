"""`actlake merge INPUTS... --out DIR`: merge per-machine outputs of one format into one store.

One run directory of `actlake extract --num-machines M` (any format) is merged with
`actlake.slices.merge_run`: the published store under `--out` is the one a 1-machine run makes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "merge"
HELP = ("merge the machine slices of one extraction run (any format) into one published store under --out, "
        "or several zarr / pickle stores into one")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="a run directory of machine slices, or stores to merge in output order")
    p.add_argument("--out", required=True, help="output root (a run directory's store is published under it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
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


def is_extraction_run(inputs: list[Path], format: str | None) -> bool:
    """Whether `inputs` is one run directory of slices written by `actlake extract` (merged by merge_run)."""
    from ..slices import run_format, run_spec, slice_stores

    if len(inputs) != 1:
        return False
    fmt = run_format(inputs[0])
    if fmt is None or format not in (None, fmt):
        return False
    return run_spec(slice_stores(inputs[0])[0], fmt) is not None  # hand-written slices: the format's own merge


def run(args: argparse.Namespace) -> int:
    from ..slices import merge_run

    inputs = [Path(p) for p in args.inputs]
    if is_extraction_run(inputs, args.format):
        print(merge_run(inputs[0], Path(args.out), progress=not args.no_progress))
        return 0
    out = merge_paths(inputs, Path(args.out), args.format)
    print(out)
    return 0
