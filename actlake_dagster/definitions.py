"""The Definitions of the actlake code location, built from GraphSettings (the ACTLAKE_* environment)."""

from __future__ import annotations

import dagster as dg

from .assets import build_assets
from .assets.keys import ACTIVATION_SHARDS, INFERENCE_DUMP, MACHINE_SLICES, SAE_CHECKPOINT, SAE_RUN
from .automation import build_automation_sensor, build_checkpoint_sensor
from .executors import ExecutorChoice, build_executor
from .partitions import GraphPartitions
from .resources import CheckpointsResource, DeviceResource, SAETrainingResource, StorageRootsResource
from .settings import GraphSettings


def build_resources(settings: GraphSettings) -> dict[str, dg.ConfigurableResource]:
    """The resources of a graph (storage roots from the library's environment variables)."""
    return {
        "checkpoints": CheckpointsResource(model=settings.model, root=settings.checkpoints_root),
        "device": DeviceResource(device=settings.device, gpus=settings.gpus),
        "storage": StorageRootsResource(),
        "sae": SAETrainingResource(),
    }


def build_defs(settings: GraphSettings, resources: dict[str, object] | None = None,
               executor: dg.ExecutorDefinition | None = None) -> dg.Definitions:
    """The whole code location for one set of settings (tests pass their own settings and resources).

    `executor`: what runs the steps (None: Dagster's default multiprocess executor); the loaded code
    location takes it from $ACTLAKE_EXECUTOR (docs/deploy.md).
    """
    parts = GraphPartitions.from_settings(settings)
    assets = build_assets(settings, parts)
    jobs = [
        dg.define_asset_job("extract_slices", selection=[MACHINE_SLICES],
                            description="Extract machine slices (one run per checkpoint x machine partition)."),
        dg.define_asset_job("merge_shards", selection=[ACTIVATION_SHARDS]),
        dg.define_asset_job("train_saes", selection=[SAE_RUN, SAE_CHECKPOINT, INFERENCE_DUMP]),
    ]
    if settings.formats:
        jobs.append(dg.define_asset_job("convert_formats", selection=[f"{fmt}_shards" for fmt in settings.formats]))
    return dg.Definitions(
        assets=assets,
        jobs=jobs,
        sensors=[build_checkpoint_sensor(settings.automation), build_automation_sensor(settings.automation)],
        resources=resources if resources is not None else build_resources(settings),
        executor=executor,
    )


defs = build_defs(GraphSettings.from_env(), executor=build_executor(ExecutorChoice.from_env()))
