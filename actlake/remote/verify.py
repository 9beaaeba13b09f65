"""`actlake verify URL`: every byte of a remote store downloaded once into a temporary directory and checked
there by the local verify (checksums.json, then every invariant of the format's spec); findings name the URL."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import IncompleteUploadError
from ..verification import VerifyReport
from .cache import download
from .publish import cache_root
from .url import RemoteStore


@contextmanager
def downloaded(store: RemoteStore) -> Iterator[Path]:
    """A temporary local copy of `store` (under the cache root), named as the store's last URL component (a saev
    store's name is checked against its metadata)."""
    from ..atomic import remove_tree

    cache_root().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".verify-", dir=cache_root()))
    try:
        local = tmp / (store.url.rstrip("/").rsplit("/", 1)[-1] or "store")
        download(store, local)
        yield local
    finally:
        remove_tree(tmp)


def _named(report: VerifyReport, local: Path, url: str) -> VerifyReport:
    fix = lambda m: m.replace(str(local), url)  # noqa: E731
    return VerifyReport(tuple(map(fix, report.problems)), tuple(map(fix, report.warnings)))


def remote_verify_report(url: str, format: str | None = None) -> VerifyReport:
    """Problems and warnings of the remote store at `url`; an incomplete upload (no checksums.json) is a problem."""
    from ..formats import verify_report
    from .readers import detect, require_marker

    try:
        store = RemoteStore.open(url)
        require_marker(detect(store)[1])
    except IncompleteUploadError as exc:
        return VerifyReport((str(exc),), ())
    with downloaded(store) as local:
        return _named(verify_report(local, format), local, store.url)


def check_remote(store: RemoteStore) -> None:
    """Every file of `store` against its checksums.json (`actlake.checksums.check_store` on a downloaded copy): the
    first mismatch is raised as a typed error naming the file's URL."""
    from ..checksums import check_store
    from ..errors import ActlakeError
    from ..formats import store_roots

    with downloaded(store) as local:
        try:
            for root in store_roots(local):
                check_store(root)
        except ActlakeError as exc:
            where = str(exc.path).replace(str(local), store.url) if exc.path is not None else store.url
            raise type(exc)(exc.problem, where) from None
