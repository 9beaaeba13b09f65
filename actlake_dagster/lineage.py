"""Lineage queries over the Dagster event log: from an SAE run back to its shards, model and dataset."""

from __future__ import annotations

from typing import Any

import dagster as dg

from .assets import SAE_KEY, SHARDS_KEY


def _materializations(instance: dg.DagsterInstance, key: dg.AssetKey, limit: int = 1000) -> list[dict[str, Any]]:
    out = []
    for record in instance.fetch_materializations(key, limit=limit).records:
        mat = record.asset_materialization
        if mat is not None:
            out.append({"partition": mat.partition, "run_id": record.run_id, "timestamp": record.timestamp,
                        **{k: v.value for k, v in mat.metadata.items()}})
    return out


def shards_by_hash(instance: dg.DagsterInstance, shard_hash: str) -> dict[str, Any] | None:
    """The extraction that published the shard directory `shard_hash` (newest first)."""
    for md in _materializations(instance, SHARDS_KEY):
        if md.get("shard_hash") == shard_hash:
            return md
    return None


def lineage_of_run(instance: dg.DagsterInstance, run_id: str) -> dict[str, Any]:
    """SAE run id -> its training event, train/val shard hashes and the extractions that made them."""
    for md in _materializations(instance, SAE_KEY):
        if md.get("run_id") == run_id:
            train = shards_by_hash(instance, str(md["train_shard_hash"]))
            val = shards_by_hash(instance, str(md["val_shard_hash"])) if md.get("val_shard_hash") else None
            return {
                "run_id": run_id,
                "layer": md.get("layer"),
                "run_path": md.get("run_path"),
                "shard_hash": md["train_shard_hash"],
                "val_shard_hash": md.get("val_shard_hash") or None,
                "model": None if train is None else train.get("model"),
                "weights_sha256": None if train is None else train.get("weights_sha256"),
                "dataset_spec": None if train is None else train.get("dataset_spec"),
                "dataset_fingerprint": None if train is None else train.get("dataset_fingerprint"),
                "train_extraction": train,
                "val_extraction": val,
            }
    raise KeyError(f"no sae_checkpoint materialization with run_id {run_id!r}")
