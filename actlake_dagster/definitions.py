"""The Definitions object of the actlake code location."""

from __future__ import annotations

import dagster as dg

from .assets import activation_shards, inference_dump, model_checkpoint, sae_checkpoint
from .automation import automation_sensor, extraction_job, new_checkpoint_sensor, nightly_extraction, sae_job
from .resources import DeviceResource, ModelSourceResource, StorageRootsResource

defs = dg.Definitions(
    assets=[model_checkpoint, activation_shards, sae_checkpoint, inference_dump],
    jobs=[extraction_job, sae_job],
    sensors=[new_checkpoint_sensor, automation_sensor],
    schedules=[nightly_extraction],
    resources={
        "device": DeviceResource(device=dg.EnvVar("ACTLAKE_DEVICE").get_value("auto") or "auto"),
        "model_source": ModelSourceResource(model=dg.EnvVar("ACTLAKE_MODEL").get_value("minilm") or "minilm"),
        "storage": StorageRootsResource(),
    },
)
