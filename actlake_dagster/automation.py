"""What starts work by itself: the checkpoint sensor (new checkpoints, changed weights) and the automation condition.

The condition re-materializes a partition only when it is missing (and its last attempt did
not fail) or when an upstream data version changed since it was last handled. Data versions
are content hashes, so an unchanged re-extraction (same hashes) triggers nothing downstream;
a new checkpoint is a new partition, missing everywhere, so it gets exactly one extraction per
machine, one merge per split and one training per layer.
"""

from __future__ import annotations

import json

import dagster as dg

from .partitions import checkpoint_partitions
from .records import DATA_VERSION_TAG
from .resources import CheckpointsResource

AC = dg.AutomationCondition
CHECKPOINT_SENSOR_INTERVAL_S = 30


def refresh_condition() -> dg.AutomationCondition:
    """Missing (never failed) or an upstream data version changed; never while upstream is missing or running."""
    missing = (AC.missing() & ~AC.execution_failed()).with_label("missing (last attempt did not fail)")
    changed = AC.any_deps_match(AC.data_version_changed()).since_last_handled().with_label(
        "upstream data version changed since last handled")
    return ((missing | changed) & ~AC.any_deps_missing() & ~AC.any_deps_in_progress()
            & ~AC.in_progress()).with_label("actlake_refresh")


def checkpoint_events(checkpoints: CheckpointsResource, known: set[str],
                      cursor: dict[str, str]) -> tuple[list[str], list[dg.AssetObservation], dict[str, str]]:
    """(new partition keys, observations of checkpoints whose weights hash changed, the next cursor)."""
    new: list[str] = []
    events: list[dg.AssetObservation] = []
    versions: dict[str, str] = {}
    for checkpoint in checkpoints.all():
        version = checkpoints.weights_sha256(checkpoint)
        versions[checkpoint.key] = version
        if checkpoint.key not in known:
            new.append(checkpoint.key)
        if cursor.get(checkpoint.key) != version:
            events.append(dg.AssetObservation(
                asset_key="model_checkpoint", partition=checkpoint.key, tags={DATA_VERSION_TAG: version},
                metadata={"weights_sha256": version, "model": checkpoint.model,
                          "path": str(checkpoint.path) if checkpoint.path else ""}))
    return new, events, versions


def build_checkpoint_sensor(running: bool) -> dg.SensorDefinition:
    @dg.sensor(
        name="checkpoint_sensor", minimum_interval_seconds=CHECKPOINT_SENSOR_INTERVAL_S,
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        description="Adds a checkpoint partition for every new checkpoint directory and records the weights' sha256 "
                    "as model_checkpoint's data version (cached on size + mtime: unchanged files are not re-read).",
    )
    def checkpoint_sensor(context: dg.SensorEvaluationContext, checkpoints: CheckpointsResource) -> dg.SensorResult:
        known = set(context.instance.get_dynamic_partitions(checkpoint_partitions.name or "checkpoints"))
        try:
            cursor = json.loads(context.cursor) if context.cursor else {}
        except ValueError:
            cursor = {}
        new, events, versions = checkpoint_events(checkpoints, known, cursor if isinstance(cursor, dict) else {})
        context.update_cursor(json.dumps(versions, sort_keys=True))
        if new:
            context.log.info(f"new checkpoints: {new}")
        return dg.SensorResult(
            dynamic_partitions_requests=[checkpoint_partitions.build_add_request(new)] if new else [],
            asset_events=events,
        )

    return checkpoint_sensor


def build_automation_sensor(running: bool) -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        "actlake_automation", target=dg.AssetSelection.all(),
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=30,
        description="Evaluates every asset's automation condition (missing, or upstream data version changed).",
    )
