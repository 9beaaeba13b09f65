"""Format registry: each format module exposes detect / open_reader / verify / create_writer."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from ..errors import FormatError, UnknownFormatError
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


def store_roots(path: str | Path, format: str | None = None) -> list[Path]:
    """The directories at `path` that each carry a checksums.json: the store itself, each slice of a run of
    machine slices, each shard store of a sharded zarr run (a format module's `store_roots`, where it has one)."""
    from ..slices import run_format, slice_stores

    sliced = run_format(path)
    if sliced is not None and format in (None, sliced):
        return [root for store in slice_stores(path) for root in _module_roots(sliced, store)]
    return _module_roots(format or detect_format(path), Path(path))


def _module_roots(name: str, path: Path) -> list[Path]:
    roots = getattr(format_module(name), "store_roots", None)
    return [Path(path)] if roots is None else list(roots(path))


def open_store(path: str | Path, format: str | None = None, *, verify: bool = False) -> Reader:
    """Open any stored layout with the one Reader protocol (a run directory of machine slices: all of them).

    `verify=True` first checks every file against the store's checksums.json (`actlake.checksums.check_store`):
    the first mismatch is raised as a typed error naming the file (HashMismatchError for changed bytes); a
    store without checksums.json gets a VerifyWarning saying its bytes were not checked."""
    from ..slices import open_run, run_format

    if verify:
        from ..checksums import check_store

        for root in store_roots(path, format):
            check_store(root)
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


def verify_staged(store: Path, final: Path, format: str) -> VerifyReport:
    """verify of a finished temporary store that will be published at `final` (saev checks `final`'s name)."""
    return VerifyReport.from_findings(format_module(format).verify(Path(store), published_as=Path(final)))


def verify_before_publish(writer: Writer, format: str, what: str) -> Callable[[], bool]:
    """Make `writer` verify its finished temporary store just before the rename that publishes it: a store with
    problems is never published (FormatError listing them; the writer removes its temporary directory).
    Returns a function saying whether that check ran (False: the store was already published earlier)."""
    ran: list[bool] = []

    def check(store: Path, final: Path) -> None:
        ran.append(True)
        report = verify_staged(store, final, format)
        for message in report.warnings:
            warnings.warn(message, VerifyWarning, stacklevel=2)
        if report.problems:
            more = f" (and {len(report.problems) - 5} more)" if len(report.problems) > 5 else ""
            raise FormatError(f"{what} fails verification, so it is not published: "
                              f"{'; '.join(report.problems[:5])}{more}", final)

    writer.before_publish = check
    return lambda: bool(ran)


def create_writer(format: str, out_root: str | Path, spec: StoreSpec) -> Writer:
    """A writer of format `format` under `out_root`."""
    return format_module(format).create_writer(Path(out_root), spec)
