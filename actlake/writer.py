"""The Writer protocol: what the extraction engine and `convert` feed Batches into."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from .atomic import publish_dir, remove_tree
from .batch import Batch
from .checksums import write_checksums
from .errors import ActlakeError, ConfigError, FormatError


class Writer(ABC):
    """Streams Batches into one store and publishes it atomically on `close()`.

    `resume_from` is the number of samples already durably written by an earlier, interrupted
    run with the same spec: the caller skips that many samples before the first `write_batch`.
    A writer whose store is already published has `resume_from == n_samples`.
    """

    resume_from: int = 0
    #: called as `before_publish(store, final)` on the finished temporary store (checksums.json written) just
    #: before the rename that publishes it at `final`; an ActlakeError it raises stops publication: the
    #: temporary directory is removed and the error re-raised (`convert` verifies the output here)
    before_publish: Callable[[Path, Path], None] | None = None

    @abstractmethod
    def write_batch(self, batch: Batch) -> None:
        """Append a batch (any size; samples in order)."""

    @abstractmethod
    def close(self) -> Path:
        """Finish, publish under the final name, and return the published path."""

    def accepts(self, batch: Batch, *, n_layers: int, d_model: int, max_tokens: int | None, written: int,
                n_samples: int, count_name: str = "n_samples") -> bool:
        """Check a batch against the store's shape; False if the store is already published (write nothing).

        Needs the writer's `_closed`, `final_path` and `tmp_path`. `max_tokens=None` accepts any
        token count (a format that truncates).
        """
        if self._closed:  # type: ignore[attr-defined]
            if self.final_path.exists():  # type: ignore[attr-defined]
                return False
            raise FormatError("writer is closed", self.tmp_path)  # type: ignore[attr-defined]
        b, layers, t, d = batch.acts_bltd.shape
        if layers != n_layers or d != d_model or (max_tokens is not None and t > max_tokens):
            raise ConfigError(f"batch shape {batch.acts_bltd.shape} does not fit "
                              f"[B, {n_layers}, {'T' if max_tokens is None else f'<={max_tokens}'}, {d_model}]",
                              self.tmp_path)  # type: ignore[attr-defined]
        if written + b > n_samples:
            raise ConfigError(f"more samples than {count_name}={n_samples}", self.tmp_path)  # type: ignore[attr-defined]
        return True

    def publish(self, tmp: Path, final: Path, store: Path | None = None) -> Path:
        """Seal and publish a finished temporary directory: checksums.json written over `store` (the store
        inside `tmp`; default `tmp` itself), `before_publish` run, then the atomic rename to `final`."""
        root = tmp if store is None else store
        write_checksums(root)
        if self.before_publish is not None:
            try:
                self.before_publish(root, final)
            except ActlakeError:
                remove_tree(tmp)
                raise
        return publish_dir(tmp, final)

    def abort(self) -> None:
        """Stop without publishing; what is durable stays for a later resume."""

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
