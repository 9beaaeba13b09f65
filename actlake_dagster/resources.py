"""Dagster resources: the compute device (one GPU per running step), the checkpoints, the storage roots, the SAE recipe."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from .checkpoints import Checkpoint, WeightsHashCache, discover

#: how long a step waits for a free GPU before it fails (the gpu pool normally prevents waiting)
GPU_WAIT_S = 600.0


class DeviceResource(dg.ConfigurableResource):
    """Where a step's model runs. "auto" takes a free GPU when torch sees one, else the CPU (said in the logs).

    Each concurrently running step gets its own device: a step holds an exclusive lock file
    `actlake-gpu-<i>.lock` for `cuda:i` until it ends, so steps in separate processes on one host
    never share a GPU. `gpus` (0: every visible GPU) should equal the `gpu` pool's limit.
    """

    device: str = "auto"
    gpus: int = 0
    lock_dir: str = ""
    _resolved: str = PrivateAttr(default="cpu")
    _lock_fd: int | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        from actlake.devices import check_device

        check_device(self.device)
        log = context.log
        if self.device == "cpu":
            self._resolved = "cpu"
            return
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            if self.device != "auto":
                from actlake.errors import ConfigError

                raise ConfigError(f"device {self.device!r} was asked for but torch sees no CUDA device")
            self._resolved = "cpu"
            if log is not None:
                log.info("device: CPU fallback (torch sees no CUDA device)")
            return
        if self.device.startswith("cuda:"):
            self._resolved = self.device
        else:
            n = min(self.gpus or visible, visible)
            self._resolved = self._claim_gpu(n)
        if log is not None:
            log.info(f"device: {self._resolved} ({torch.cuda.get_device_name(self._resolved)})")

    def _claim_gpu(self, n: int) -> str:
        """Lock the first free GPU index in [0, n) and return `cuda:i` (waits while all are busy)."""
        lock_dir = Path(self.lock_dir or tempfile.gettempdir())
        deadline = time.monotonic() + GPU_WAIT_S
        while True:
            for i in range(n):
                fd = os.open(lock_dir / f"actlake-gpu-{i}.lock", os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._lock_fd = fd
                return f"cuda:{i}"
            if time.monotonic() > deadline:
                from actlake.errors import ConfigError

                raise ConfigError(f"no free GPU among {n} after {GPU_WAIT_S:.0f} s (is the gpu pool limit above ACTLAKE_GPUS?)")
            time.sleep(1.0)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    @property
    def name(self) -> str:
        """The device this step runs on ("cpu" or "cuda:i")."""
        return self._resolved


class CheckpointsResource(dg.ConfigurableResource):
    """The checkpoints: subdirectories of `root`, or the one model `model` when no root is set."""

    model: str = "minilm"
    root: str = ""
    hash_cache: str = ""  # default: <scratch>/saev/.cache/weights-sha256.json
    _cache: Any = PrivateAttr(default=None)

    def all(self) -> list[Checkpoint]:
        return discover(self.model, self.root)

    def get(self, key: str) -> Checkpoint:
        for checkpoint in self.all():
            if checkpoint.key == key:
                return checkpoint
        raise dg.Failure(f"checkpoint {key!r} is not there any more (root {self.root or self.model!r})")

    def weights_sha256(self, checkpoint: Checkpoint) -> str:
        if self._cache is None:
            from actlake.runs import shards_root

            path = Path(self.hash_cache) if self.hash_cache else shards_root().parent / ".cache" / "weights-sha256.json"
            self._cache = WeightsHashCache(path)
        return str(self._cache.weights_sha256(checkpoint))


class StorageRootsResource(dg.ConfigurableResource):
    """Where things go: the shards root, the runs root, machine slices and dataset copies (absolute paths,
    so recorded metadata stays valid from any working directory).

    Empty values use the library's roots ($SAEV_SCRATCH / $ACTLAKE_SCRATCH and $SAEV_NFS / $ACTLAKE_NFS).
    """

    scratch: str = ""
    nfs: str = ""

    def shards_root(self) -> Path:
        from actlake.runs import shards_root

        return (Path(self.scratch) / "saev" / "shards" if self.scratch else shards_root()).resolve()

    def runs_root(self) -> Path:
        from actlake.runs import runs_root

        return (Path(self.nfs) / "saev" / "runs" if self.nfs else runs_root()).resolve()

    def slices_root(self) -> Path:
        """Per-machine slices of each extraction run (merged into shards_root)."""
        return self.shards_root().parent / "slices"

    def datasets_root(self) -> Path:
        """Materialised copies of built-in datasets, so run links have a target."""
        return self.shards_root().parent / "datasets"

    def converted_root(self, fmt: str) -> Path:
        """Other formats converted from the saev directories."""
        return self.shards_root().parent / fmt


class SAETrainingResource(dg.ConfigurableResource):
    """The SAE recipe every layer is trained with (part of each run id, so a new recipe is a new run)."""

    k: int = 32
    expansion: int = 8
    epochs: int = 4
    batch_size: int = 4096
    lr: float = 1e-3
    seed: int = 0

    def train_config(self, layer: int, device: str) -> Any:
        from actlake.sae.train import TrainConfig

        return TrainConfig(layer=layer, k=self.k, expansion=self.expansion, epochs=self.epochs,
                           batch_size=self.batch_size, lr=self.lr, seed=self.seed, device=device)

    def identity(self, layer: int) -> dict[str, Any]:
        """What decides the trained weights (the device does not)."""
        cfg = self.train_config(layer, "cpu").to_json()
        cfg.pop("device", None)
        cfg.pop("n_threads", None)
        return cfg
