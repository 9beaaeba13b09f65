"""Lineage from files alone: an SAE run directory back to its shards, machine slices, checkpoint and dataset,
and the reverse (every run that used a shard directory).

The Dagster code location adds the instance's records (which Dagster run wrote each piece);
this module needs no instance and never imports dagster.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .runs import LINK_NAMES, Run, open_run, run_lineage, runs_root, shard_hash_of


def _slices(prov: dict[str, Any]) -> list[dict[str, Any]]:
    """The machine slices a merged directory was built from, as its provenance records them."""
    for key in ("source_slices", "slices", "merged_from"):
        value = prov.get(key)
        if isinstance(value, list):
            return [v if isinstance(v, dict) else {"hash": str(v)} for v in value]
    return []


def _shards(facts: dict[str, Any] | None) -> dict[str, Any] | None:
    if facts is None:
        return None
    prov = facts.get("provenance") or {}
    return {"shard_hash": facts["shard_hash"], "path": facts["path"], "format": facts["format"],
            "n_samples": facts["n_samples"], "layers": facts["layers"], "machine_slices": _slices(prov)}


def lineage_from_files(run: Run | str | Path) -> dict[str, Any]:
    """run -> SAE checkpoint sha -> train/val shard hashes -> machine slices -> checkpoint and weights sha -> dataset."""
    base = run_lineage(run)
    if not isinstance(run, Run):
        run = open_run(run)
    train = base["train_shards"]
    prov = train.get("provenance") or {}
    links = {name: str(t) for name in LINK_NAMES if (t := run.link(name, required=False)) is not None}
    return {
        "run": {"run_id": base["run_id"], "path": base["run"], "layer": base["layer"], "links": links},
        "sae_checkpoint": base["checkpoint"],
        "train_shards": _shards(train),
        "val_shards": _shards(base["val_shards"]),
        "checkpoint": {"model": base["model"], "path": prov.get("checkpoint_path"),
                       "weights_sha256": prov.get("weights_sha256")},
        "dataset": {"spec": prov.get("dataset_spec") or base["dataset"], "fingerprint": prov.get("dataset_fingerprint"),
                    "link": links.get("train-dataset")},
        "inference": base["inference"],
    }


def runs_using_shards(shard_hash: str, root: Path | None = None) -> list[dict[str, Any]]:
    """Every run directory under the runs root whose train or val link resolves to a directory named `shard_hash`."""
    root = Path(root) if root is not None else runs_root()
    out: list[dict[str, Any]] = []
    if not root.is_dir():
        return out
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        run = Run(Path(entry.path))
        for role in ("train", "val"):
            link = run.links_dir / f"{role}-shards"
            if link.is_symlink() and link.exists() and shard_hash_of(link) == shard_hash:
                out.append({"run_id": entry.name, "run_path": str(run.path.resolve()), "role": role,
                            "trained": run.has_checkpoint, "inference": run.inference_hashes()})
    return out
