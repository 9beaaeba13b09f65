"""The Writer protocol: what the extraction engine and `convert` feed Batches into."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from .batch import Batch
from .errors import ConfigError, FormatError


class Writer(ABC):
    """Streams Batches into one store and publishes it atomically on `close()`.

    `resume_from` is the number of samples already durably written by an earlier, interrupted
    run with the same spec: the caller skips that many samples before the first `write_batch`.
    A writer whose store is already published has `resume_from == n_samples`.
    """

    resume_from: int = 0

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

    def abort(self) -> None:
        """Stop without publishing; what is durable stays for a later resume."""

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
