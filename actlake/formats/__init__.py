"""Format registry: each format module exposes detect / open_reader / verify / create_writer."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from pathlib import Path
from types import ModuleType

from ..errors import UnknownFormatError
from ..reader import Reader
from ..spec import StoreSpec
from ..verification import VerifyReport, VerifyWarning
from ..writer import Writer

#: format name -> module implementing it (detect order: first match wins)
FORMAT_MODULES: dict[str, str] = {
    "saev": "actlake.formats.saev",
    "zarr": "actlake.formats.zarr_logger",
    "lmprobe": "actlake.formats.lmprobe",
    "pickle": "actlake.formats.pickle_shards",
}


def format_module(name: str) -> ModuleType:
    """The module implementing format `name`."""
    try:
        return importlib.import_module(FORMAT_MODULES[name])
    except KeyError:
        raise UnknownFormatError(f"unknown format {name!r}; known: {sorted(FORMAT_MODULES)}") from None


def available_formats() -> list[str]:
    """Format names whose implementation is importable."""
    out = []
    for name, module in FORMAT_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            out.append(name)
    return out


def detect_format(path: str | Path) -> str:
    """The name of the format stored at `path`, or UnknownFormatError."""
    p = Path(path)
    if not p.exists():
        raise UnknownFormatError("no such file or directory", p)
    from ..slices import run_format

    sliced = run_format(p)  # a run directory of machine slices: the format of its slices
    if sliced is not None:
        return sliced
    for name in available_formats():
        if format_module(name).detect(p):
            return name
    raise UnknownFormatError(f"not a recognised activation store (formats: {available_formats()})", p)


def open_store(path: str | Path, format: str | None = None) -> Reader:
    """Open any stored layout with the one Reader protocol (a run directory of machine slices: all of them)."""
    from ..slices import open_run, run_format

    sliced = run_format(path)
    if sliced is not None and format in (None, sliced):
        return open_run(path)
    name = format or detect_format(path)
    return format_module(name).open_reader(Path(path))


def verify_report(path: str | Path, format: str | None = None) -> VerifyReport:
    """Problems and warnings found checking `path` against its spec; a run of slices: each slice."""
    from ..slices import run_format, slice_stores

    sliced = run_format(path)
    if sliced is not None and sliced != "zarr" and format in (None, sliced):
        report = VerifyReport()
        for store in slice_stores(path):
            report += VerifyReport.from_findings(format_module(sliced).verify(store), prefix=f"{store}: ")
        return report
    name = format or detect_format(path)
    return VerifyReport.from_findings(format_module(name).verify(Path(path)))


def verify_store(path: str | Path, format: str | None = None) -> list[str]:
    """Every problem found checking `path` against its spec (empty list: valid).

    Warnings (what could not be checked) are not problems: each is issued as a `VerifyWarning`
    (Python's warnings, shown on stderr by default) so that callers of this list still see them.
    """
    report = verify_report(path, format)
    for message in report.warnings:
        warnings.warn(message, VerifyWarning, stacklevel=3)
    return list(report.problems)


def create_writer(format: str, out_root: str | Path, spec: StoreSpec) -> Writer:
    """A writer of format `format` under `out_root`."""
    return format_module(format).create_writer(Path(out_root), spec)
