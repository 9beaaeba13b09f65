"""The Writer protocol: what the extraction engine and `convert` feed Batches into."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from .batch import Batch


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

    def abort(self) -> None:
        """Stop without publishing; what is durable stays for a later resume."""

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
