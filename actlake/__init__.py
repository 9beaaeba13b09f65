"""actlake: transformer activations on disk, in the layouts downstream work wants."""

from __future__ import annotations

from pathlib import Path

from . import errors
from .batch import Batch
from .reader import Reader, TokenSegment
from .spec import StoreSpec
from .verification import VerifyReport
from .writer import Writer

__version__ = "0.1.0"


def open(path: str | Path, format: str | None = None, *, verify: bool = False) -> Reader:  # noqa: A001 - the public name
    """Open any stored layout (saev, zarr, lmprobe, pickle) with the one Reader protocol.

    `verify=True` first checks every file against the store's checksums.json, streaming (a typed error naming
    the first file that does not match: HashMismatchError for changed bytes, MissingFileError, UnsafePathError
    for a link); a store published without checksums.json is opened with a VerifyWarning."""
    from .remote.url import is_url, local_path

    if is_url(path):  # s3://, gs://, memory://, ... (docs/remote.md); file:// is a local path
        from .remote.readers import open_remote

        return open_remote(str(path), format, verify=verify)
    from .formats import open_store

    return open_store(local_path(path), format, verify=verify)


def verify(path: str | Path, format: str | None = None) -> list[str]:
    """Every problem found checking a store against its spec (empty: valid). Warnings (what could not be
    checked) are not in the list: they are issued as `actlake.verification.VerifyWarning`s."""
    from .formats import verify_store
    from .verification import VerifyWarning
    from .remote.url import is_url, local_path

    if is_url(path):
        report = verify_report(path, format)
        for message in report.warnings:
            import warnings

            warnings.warn(message, VerifyWarning, stacklevel=2)
        return list(report.problems)
    return verify_store(local_path(path), format)


def verify_report(path: str | Path, format: str | None = None) -> VerifyReport:
    """Problems (the store fails its spec) and warnings (what could not be checked) of a store, apart."""
    from .formats import verify_report as report
    from .remote.url import is_url, local_path

    if is_url(path):
        from .remote.verify import remote_verify_report

        return remote_verify_report(str(path), format)
    return report(local_path(path), format)


__all__ = ["Batch", "Reader", "StoreSpec", "TokenSegment", "VerifyReport", "Writer", "errors", "open", "verify",
           "verify_report", "__version__"]
