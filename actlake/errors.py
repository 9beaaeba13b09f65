"""The one exception hierarchy of actlake: every error a user can cause names the file and the problem."""

from __future__ import annotations

from pathlib import Path


class ActlakeError(Exception):
    """Root of every error actlake raises on purpose."""

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.problem = message
        # an object-store URL (s3://...) is named as given: Path() would fold its "//"
        where = path if isinstance(path, str) and "://" in path else self.path
        super().__init__(f"{where}: {message}" if where is not None else message)


class FormatError(ActlakeError):
    """A file on disk does not follow its format's spec (bad JSON, wrong size, missing field...)."""


class MissingFileError(FormatError):
    """A file the format requires is absent."""


class MetadataError(FormatError):
    """A metadata file is not valid JSON, lacks a field, or has a field of the wrong type or value."""


class TruncatedFileError(FormatError):
    """A data file is shorter (or longer) than its metadata says."""


class ProtocolVersionError(FormatError):
    """The directory was written with an incompatible (major) protocol version."""


class HashMismatchError(FormatError):
    """A content-hashed directory's name, or a checksum, does not match its content."""


class UnknownFormatError(FormatError):
    """actlake.open() could not recognise the layout at a path."""


class UnsafePathError(FormatError):
    """A path read from a file would escape the root it must stay under."""


class UnsafePickleError(FormatError):
    """A pickle tried to load something the restricted unpickler does not admit."""


class IncompleteUploadError(MissingFileError):
    """A remote store has no checksums.json: its upload never finished (checksums.json is uploaded last, as the
    commit marker), so it is refused."""


class DuplicateSampleError(MetadataError):
    """The same global sample id occurs twice (across shards, or across stores being merged)."""


class LayerNotStoredError(ActlakeError, KeyError):
    """A layer was requested that the store does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class SampleIndexError(ActlakeError, IndexError):
    """A sample index is out of range."""


class ConfigError(ActlakeError, ValueError):
    """A configuration value is invalid (checked when a config object is built)."""


class ModelNotFoundError(ActlakeError):
    """A model could not be found locally (nothing is downloaded at run time)."""


class DatasetError(ActlakeError):
    """A dataset could not be read or is empty."""


class WriteError(ActlakeError):
    """Writing failed: a read-only filesystem, a full disk, no permission (the path says where)."""


class RunError(ActlakeError):
    """A run directory is incomplete or one of its links is broken."""


class MissingSliceError(MissingFileError):
    """A machine slice of a multi-machine run is not published (yet); `missing` lists the machine ids."""

    def __init__(self, message: str, path: str | Path | None = None, *, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message, path)
        self.missing = tuple(missing)
