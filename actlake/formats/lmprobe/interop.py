"""Upstream interop: serve a local dataset directory to the upstream `lmprobe` package's hub-only loader."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from actlake.atomic import resolve_inside
from actlake.errors import MissingFileError


@contextlib.contextmanager
def local_hub(root: str | Path, repo_id: str) -> Iterator[None]:
    """Within the block, `huggingface_hub.hf_hub_download(repo_id, name, ...)` returns `root/name`.

    Upstream lmprobe's `load_activations` / `pull_dataset` only fetch through the hub client
    (imported at call time), so this lets it read an actlake-written directory with no
    network. Other repositories go to the real function. Paths stay inside `root`.
    """
    import huggingface_hub

    original = huggingface_hub.hf_hub_download
    root = Path(root)

    def fake(repo: str, filename: str, *args: Any, **kwargs: Any) -> str:
        if repo != repo_id:
            return original(repo, filename, *args, **kwargs)
        target = resolve_inside(root, filename)
        if not target.is_file():
            raise MissingFileError("requested by lmprobe but not in the dataset", target)
        return str(target)

    huggingface_hub.hf_hub_download = fake
    try:
        yield
    finally:
        huggingface_hub.hf_hub_download = original
