"""Stores on object storage through fsspec (s3://, gs://, memory://; file:// is a local path): docs/remote.md.

Modules, one job each: `url` (what is a URL, its filesystem and the listing of a remote store), `publish`
(a store published locally first, then uploaded with checksums.json last), `cache` (a remote saev store's
local copy keyed by its content hash), `readers` (zarr, lmprobe and pickle read in place), `verify`.
Nothing here is imported by `import actlake`; fsspec's backends (s3fs, gcsfs) load on first use.
"""

from __future__ import annotations

from .url import is_url, local_path

__all__ = ["is_url", "local_path"]
