"""Dagster resources: the compute device, the model source and the storage roots."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from pydantic import PrivateAttr


class DeviceResource(dg.ConfigurableResource):
    """Where models run: "auto" picks CUDA when present. Resolved once per run, in setup."""

    device: str = "auto"
    _resolved: str = PrivateAttr(default="cpu")

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        from actlake.devices import resolve_device

        self._resolved = resolve_device(self.device)

    @property
    def name(self) -> str:
        """The resolved device name ("cpu", "cuda", "cuda:N")."""
        return self._resolved


class ModelSourceResource(dg.ConfigurableResource):
    """Which model to extract from: a local HF directory, "minilm", or "tiny-random:<arch>"."""

    model: str = "minilm"

    def checkpoint_hash(self) -> str:
        """sha256 identifying the checkpoint's weights (what a new checkpoint changes)."""
        from actlake.extract.models import resolve_model, weights_sha256

        source = resolve_model(self.model)
        if source.path is None:  # tiny-random: identified by its arch and fixed seed
            import hashlib

            return hashlib.sha256(source.spec.encode("utf-8")).hexdigest()
        return weights_sha256(source.path)[0]


class StorageRootsResource(dg.ConfigurableResource):
    """Shards root and runs root; empty values fall back to $ACTLAKE_SCRATCH / $ACTLAKE_NFS."""

    scratch: str = ""
    nfs: str = ""

    def shards_root(self) -> Path:
        from actlake.runs import shards_root

        return Path(self.scratch) / "shards" if self.scratch else shards_root()

    def runs_root(self) -> Path:
        from actlake.runs import runs_root

        return Path(self.nfs) / "runs" if self.nfs else runs_root()
