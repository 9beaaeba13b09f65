"""Lineage from the instance's records: an SAE run back to the Dagster runs that wrote each of its inputs.

Every step records what it read (shard hashes, storage ids) and which Dagster run first wrote
the bytes (`written_by_run`), so a later no-op re-materialization never hides the real writer.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from .assets.keys import ACTIVATION_SHARDS, INFERENCE_DUMP, MACHINE_SLICES, MODEL_CHECKPOINT, SAE_CHECKPOINT, SAE_RUN
from .records import DATA_VERSION_TAG, WRITTEN_BY, Materialization, materializations


def _brief(m: Materialization | None, *fields: str) -> dict[str, Any] | None:
    if m is None:
        return None
    return {"partition": m.partition, "storage_id": m.storage_id, "dagster_run": m.run_id,
            "written_by_run": m.get(WRITTEN_BY, m.run_id), "data_version": m.data_version,
            **{f: m.get(f) for f in fields}}


def _first(items: list[Materialization], **match: Any) -> Materialization | None:
    for m in items:
        if all(str(m.get(k)) == str(v) for k, v in match.items()):
            return m
    return None


def actlake_run_of_dagster_run(instance: dg.DagsterInstance, dagster_run_id: str) -> str | None:
    """The actlake run id an SAE step of this Dagster run worked on (None if the run touched no SAE asset)."""
    for key in (SAE_CHECKPOINT, SAE_RUN, INFERENCE_DUMP):
        for m in materializations(instance, key):
            if m.run_id == dagster_run_id and m.get("run_id"):
                return str(m.get("run_id"))
    return None


def run_path_of(instance: dg.DagsterInstance, run_id: str) -> str | None:
    """Where the instance recorded the run directory of an actlake run id."""
    m = _first(materializations(instance, SAE_RUN), run_id=run_id)
    return None if m is None else str(m.get("run_path"))


def checkpoint_observation(instance: dg.DagsterInstance, checkpoint: str) -> dict[str, Any] | None:
    """The newest observation of a checkpoint partition: its data version (weights sha256)."""
    flt = dg.AssetRecordsFilter(asset_key=MODEL_CHECKPOINT, asset_partitions=[checkpoint])
    records = instance.fetch_observations(flt, limit=1).records
    if not records:
        return None
    obs = records[0].asset_observation
    tags = (obs.tags or {}) if obs is not None else {}
    return {"partition": checkpoint, "storage_id": records[0].storage_id, "weights_sha256": tags.get(DATA_VERSION_TAG)}


def instance_lineage(instance: dg.DagsterInstance, run_id: str) -> dict[str, Any] | None:
    """run -> SAE checkpoint -> train/val shard directories -> machine slices -> checkpoint, with the Dagster
    run that wrote each; None when the instance has no record of `run_id`."""
    run_m = _first(materializations(instance, SAE_RUN), run_id=run_id)
    if run_m is None:
        return None
    sae_m = _first(materializations(instance, SAE_CHECKPOINT), run_id=run_id)
    inf_m = _first(materializations(instance, INFERENCE_DUMP), run_id=run_id)
    shards = materializations(instance, ACTIVATION_SHARDS)
    slices = {m.storage_id: m for m in materializations(instance, MACHINE_SLICES)}
    out: dict[str, Any] = {
        "run": _brief(run_m, "run_id", "run_path", "layer", "checkpoint"),
        "sae_checkpoint": _brief(sae_m, "sae_sha256"),
        "inference_dump": _brief(inf_m, "shard_hash", "patch_acts_sha256"),
    }
    for split in ("train", "val"):
        shard_m = _first(shards, shard_hash=run_m.get(f"{split}_shard_hash"))
        entry = _brief(shard_m, "shard_hash", "path", "n_samples")
        if shard_m is not None and entry is not None:
            ids = shard_m.get("slice_storage_ids") or []
            entry["machine_slices"] = [
                {**(_brief(slices.get(int(i)), "machine", f"{split}_slice_hash") or {"storage_id": int(i)})}
                for i in ids]
        out[f"{split}_shards"] = entry
    checkpoint = run_m.get("checkpoint")
    out["checkpoint"] = checkpoint_observation(instance, str(checkpoint)) if checkpoint else None
    return out


def runs_using_shards(instance: dg.DagsterInstance, shard_hash: str) -> list[dict[str, Any]]:
    """Every run directory the instance recorded as trained or evaluated on `shard_hash`."""
    out = []
    seen = set()
    for m in materializations(instance, SAE_RUN):
        role = "train" if m.get("train_shard_hash") == shard_hash else "val" if m.get("val_shard_hash") == shard_hash else None
        if role and m.get("run_id") not in seen:
            seen.add(m.get("run_id"))
            out.append({"run_id": m.get("run_id"), "run_path": m.get("run_path"), "role": role,
                        "dagster_run": m.get(WRITTEN_BY, m.run_id), "layer": m.get("layer")})
    return out
