"""Shards root, runs root and SAE run directories (shared/specs/storage-and-run-manifest.md).

A run directory is the one handle every SAE command takes (`--run PATH`); everything else is
resolved from it:

    <runs_root>/<run_id>/
      checkpoint/{sae.pt, config.json}
      links/{train-shards, train-dataset, val-shards, val-dataset}   (symlinks)
      inference/<shard_hash>/{config.json, patch_acts.npz, metrics.json, visuals/}

Choices are recorded in docs/formats/runs.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MetadataError, RunError
from .hashing import file_sha256
from .jsonio import read_json

#: the storage spec's variables; each wins over its ACTLAKE_* alias when both are set (non-empty)
ENV_SCRATCH = "SAEV_SCRATCH"
ENV_NFS = "SAEV_NFS"
#: actlake's earlier names for the same two bases, still honoured (same meaning, `saev/` level included)
ALIAS_SCRATCH = "ACTLAKE_SCRATCH"
ALIAS_NFS = "ACTLAKE_NFS"
#: the base when neither variable is set (relative: resolved against the working directory)
DEFAULT_BASE = Path("actlake-data")
#: the spec's level under each base; upstream saev asserts `.../saev/shards/<hash>` and `.../saev/runs/<id>`
SAEV_DIR = "saev"
LINK_NAMES = ("train-shards", "train-dataset", "val-shards", "val-dataset")
#: the spec's resolution example names `links/shards` and `links/dataset`; read as aliases
LEGACY_LINKS = {"train-shards": "shards", "train-dataset": "dataset"}
RUN_CONFIG_FORMAT = "actlake-run/1"


def _base(name: str, alias: str) -> Path:
    """The base directory one of the spec's variables names: `$name`, else `$alias`, else DEFAULT_BASE
    (an empty value counts as unset)."""
    for var in (name, alias):
        value = os.environ.get(var)
        if value:
            return Path(value).expanduser()
    return DEFAULT_BASE


def shards_root() -> Path:
    """Where activation directories live: `$SAEV_SCRATCH/saev/shards` (storage spec; `$ACTLAKE_SCRATCH` is an
    alias that SAEV_SCRATCH overrides; default `./actlake-data/saev/shards`), so a directory written with
    default settings sits at the `saev/shards/<hash>` path upstream saev asserts."""
    return _base(ENV_SCRATCH, ALIAS_SCRATCH) / SAEV_DIR / "shards"


def runs_root() -> Path:
    """Where SAE runs live: `$SAEV_NFS/saev/runs` (`$ACTLAKE_NFS` an alias SAEV_NFS overrides; default
    `./actlake-data/saev/runs`), the `saev/runs/<run_id>` path upstream saev's run directories assert."""
    return _base(ENV_NFS, ALIAS_NFS) / SAEV_DIR / "runs"


def new_run_id(payload: dict[str, Any]) -> str:
    """`<UTC yyyymmdd-HHMMSS>-<8 hex of sha256(payload)>`: sortable by time, distinct per config."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stamp}-{hashlib.sha256(blob).hexdigest()[:8]}"


def _bare_name(value: str) -> bool:
    return os.sep not in value and (os.altsep is None or os.altsep not in value) and value not in {".", ".."}


def resolve_run_arg(value: str | Path) -> Path:
    """`--run` value -> run directory: a path as given; a bare name that is not a directory here is a run id under runs_root()."""
    p = Path(value).expanduser()
    if isinstance(value, str) and _bare_name(value) and not p.exists():
        return runs_root() / value
    return p


def resolve_shards_arg(value: str | Path) -> Path:
    """`--shards` value -> directory: a path as given; a bare name missing here is a shard hash under shards_root();
    a URL of a remote saev store (s3://...) its local cache, `$ACTLAKE_CACHE/saev/shards/<hash>` (docs/remote.md)."""
    from .remote.url import is_url, local_path

    if is_url(value):
        from .remote.cache import cached_saev

        return cached_saev(str(value))
    value = local_path(value)
    p = Path(value).expanduser()
    if isinstance(value, str) and _bare_name(value) and not p.exists() and (shards_root() / value).exists():
        return shards_root() / value
    return p


def shard_hash_of(path: Path) -> str:
    """The `<shard_hash>` of an activation directory: its (resolved) directory name, as under shards_root."""
    return Path(path).resolve().name


def dataset_of(shards: Path) -> str:
    """The dataset a shard directory was extracted from: the copy on disk the extractor recorded
    (`dataset_root`, e.g. a materialised built-in dataset), else the saev `dataset` field or provenance."""
    import actlake

    with actlake.open(shards) as reader:
        root = reader.provenance.get("dataset_root")
        if isinstance(root, str) and root and Path(root).exists():
            return root
        md = getattr(reader, "metadata", None)
        value = getattr(md, "dataset", "") if md is not None else ""
        return str(value or reader.provenance.get("dataset", "") or "")


@dataclass(frozen=True)
class Run:
    """A run directory; every path of a run is derived here and nowhere else."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def run_id(self) -> str:
        return self.path.resolve().name

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def sae_path(self) -> Path:
        return self.checkpoint_dir / "sae.pt"

    @property
    def config_path(self) -> Path:
        return self.checkpoint_dir / "config.json"

    @property
    def links_dir(self) -> Path:
        return self.path / "links"

    @property
    def inference_root(self) -> Path:
        return self.path / "inference"

    def inference_dir(self, shard_hash: str) -> Path:
        if not shard_hash or not _bare_name(shard_hash) or shard_hash.startswith("."):
            raise RunError(f"bad shard hash {shard_hash!r}", self.inference_root)
        return self.inference_root / shard_hash

    @property
    def has_checkpoint(self) -> bool:
        return self.sae_path.is_file()

    # ---- links -------------------------------------------------------------------------
    def link(self, name: str, *, required: bool = True) -> Path | None:
        """Resolved target of `links/<name>`; RunError naming the link if it is broken (or absent and required)."""
        if name not in LINK_NAMES:
            raise RunError(f"unknown link {name!r}; links are {LINK_NAMES}", self.links_dir)
        candidates = [self.links_dir / name]
        if name in LEGACY_LINKS:
            candidates.append(self.links_dir / LEGACY_LINKS[name])
        for link in candidates:
            if link.is_symlink():
                target = Path(os.readlink(link))
                if not target.is_absolute():
                    target = link.parent / target
                if not link.exists():
                    raise RunError(f"link {link.relative_to(self.path)} points to {target}, which no longer exists", link)
                return link.resolve()
            if link.exists():
                return link.resolve()  # a plain directory in place of a link is accepted as is
        if required:
            raise RunError(f"run has no links/{name} (is this a run directory? create it with `actlake train`)",
                           candidates[0])
        return None

    @property
    def train_shards(self) -> Path:
        path = self.link("train-shards")
        assert path is not None
        return path

    @property
    def val_shards(self) -> Path | None:
        return self.link("val-shards", required=False)

    def dataset_for(self, shard_hash: str) -> Path | None:
        """Dataset root of the shards with this hash: val-dataset for the val shards, else train-dataset."""
        val = self.val_shards
        if val is not None and shard_hash_of(val) == shard_hash:
            return self.link("val-dataset", required=False)
        return self.link("train-dataset", required=False)

    def shards_for(self, shard_hash: str) -> Path | None:
        """The linked shard directory with this hash, if any."""
        for name in ("train-shards", "val-shards"):
            p = self.link(name, required=False)
            if p is not None and shard_hash_of(p) == shard_hash:
                return p
        return None

    def read_config(self) -> dict[str, Any]:
        """checkpoint/config.json (RunError when the run has not been trained)."""
        if not self.config_path.is_file():
            raise RunError("run has no checkpoint/config.json (train it first with `actlake train --run`)",
                           self.config_path)
        obj = read_json(self.config_path)
        if not isinstance(obj, dict) or obj.get("format") != RUN_CONFIG_FORMAT:
            raise MetadataError(f"not an {RUN_CONFIG_FORMAT} run config", self.config_path)
        layer = obj.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise MetadataError(f"field 'layer' must be an integer, got {layer!r}", self.config_path)
        return obj

    def inference_hashes(self) -> list[str]:
        """Shard hashes with a finished inference dump."""
        if not self.inference_root.is_dir():
            return []
        return sorted(p.name for p in self.inference_root.iterdir()
                      if not p.name.startswith(".") and (p / "patch_acts.npz").is_file())


def open_run(path: str | Path) -> Run:
    """An existing run directory (RunError if absent)."""
    run = Run(resolve_run_arg(path) if isinstance(path, str) else Path(path))
    if not run.path.is_dir():
        raise RunError("run directory does not exist", run.path)
    return run


def _set_link(link: Path, target: Path, *, overwrite: bool) -> None:
    """Point `link` at `target` (absolute); an existing link elsewhere is a RunError unless overwrite."""
    target = target.resolve()
    if link.is_symlink() or link.exists():
        current = Path(os.readlink(link)) if link.is_symlink() else link
        if link.is_symlink() and (current == target or (link.exists() and link.resolve() == target)):
            return
        if not overwrite:
            raise RunError(f"already points to {current}, not {target} (use --overwrite to re-point it)", link)
        if not link.is_symlink():
            raise RunError("is not a symlink; refusing to replace it", link)
        link.unlink()
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp, target_is_directory=target.is_dir())
    os.replace(tmp, link)


def create_run(path: str | Path, train_shards: str | Path, val_shards: str | Path | None = None, *,
               overwrite: bool = False) -> Run:
    """Make (or re-use) a run directory whose links point at the given shard directories and their datasets.

    Dataset links are made only when the shards' `dataset` names an existing path (a hub name
    or a synthetic dataset has nothing to link; lineage still records the string).
    """
    run = Run(Path(path))
    train = Path(train_shards)
    if not train.is_dir():
        raise RunError("train shards directory does not exist", train)
    val = None if val_shards is None else Path(val_shards)
    if val is not None and not val.is_dir():
        raise RunError("val shards directory does not exist", val)
    for sub in (run.checkpoint_dir, run.links_dir, run.inference_root):
        sub.mkdir(parents=True, exist_ok=True)
    _set_link(run.links_dir / "train-shards", train, overwrite=overwrite)
    ds = dataset_of(train)
    if ds and Path(ds).exists():
        _set_link(run.links_dir / "train-dataset", Path(ds), overwrite=overwrite)
    if val is not None:
        _set_link(run.links_dir / "val-shards", val, overwrite=overwrite)
        vds = dataset_of(val)
        if vds and Path(vds).exists():
            _set_link(run.links_dir / "val-dataset", Path(vds), overwrite=overwrite)
    return run


def _shards_facts(path: Path | None) -> dict[str, Any] | None:
    """What a shard directory says about where it came from."""
    if path is None:
        return None
    import actlake

    with actlake.open(path) as reader:
        md = getattr(reader, "metadata", None)
        prov = reader.provenance
        return {
            "path": str(path),
            "shard_hash": shard_hash_of(path),
            "format": reader.format,
            "model": getattr(md, "ckpt", None) or prov.get("ckpt") or prov.get("model_name") or prov.get("model"),
            "family": getattr(md, "family", None) or prov.get("family"),
            "layers": list(reader.layers),
            "d_model": int(reader.d_model),
            "n_samples": int(reader.n_samples),
            "dataset": str(getattr(md, "dataset", "") or prov.get("dataset", "") or ""),
            "provenance": prov,
        }


def run_lineage(run: Run | str | Path) -> dict[str, Any]:
    """Where a run's SAE came from: shard hash, model, dataset, SAE and training config, inference dumps.

    Raises RunError naming the link when a linked directory has vanished.
    """
    if not isinstance(run, Run):
        run = open_run(run)
    train = _shards_facts(run.train_shards)
    val = _shards_facts(run.val_shards)
    cfg = run.read_config() if run.config_path.is_file() else None
    ckpt_sha = file_sha256(run.sae_path) if run.sae_path.is_file() else None
    train_ds = run.link("train-dataset", required=False)
    assert train is not None
    return {
        "run_id": run.run_id,
        "run": str(run.path.resolve()),
        "shard_hash": train["shard_hash"],
        "model": train["model"],
        "family": train["family"],
        "layer": None if cfg is None else cfg.get("layer"),
        "dataset": str(train_ds) if train_ds is not None else train["dataset"],
        "train_shards": train,
        "val_shards": val,
        "sae": None if cfg is None else cfg.get("sae"),
        "train": None if cfg is None else cfg.get("train"),
        "checkpoint": {"path": str(run.sae_path), "sha256": ckpt_sha},
        "inference": run.inference_hashes(),
    }


__all__ = [
    "LINK_NAMES", "Run", "RunError", "create_run", "new_run_id", "open_run", "resolve_run_arg",
    "resolve_shards_arg", "run_lineage", "runs_root", "shard_hash_of", "shards_root",
]
