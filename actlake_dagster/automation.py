"""Jobs, the new-checkpoint sensor, the nightly schedule and the automation sensor."""


import dagster as dg

from .assets import activation_shards, inference_dump, sae_checkpoint
from .partitions import machine_partitions
from .resources import ModelSourceResource

extraction_job = dg.define_asset_job("extract_activations", selection=[activation_shards])
sae_job = dg.define_asset_job("train_saes", selection=[sae_checkpoint, inference_dump])


def extraction_requests(checkpoint_hash: str) -> list[dg.RunRequest]:
    """One extraction run per machine partition, keyed by the checkpoint (so each runs once per checkpoint)."""
    return [dg.RunRequest(run_key=f"{checkpoint_hash[:16]}-machine-{m}", partition_key=m,
                          tags={"actlake/checkpoint": checkpoint_hash})
            for m in machine_partitions.get_partition_keys()]


@dg.sensor(job=extraction_job, default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=60,
           description="Re-extracts every machine slice when the model checkpoint's weights change.")
def new_checkpoint_sensor(context: dg.SensorEvaluationContext, model_source: ModelSourceResource):
    checkpoint = model_source.checkpoint_hash()
    if context.cursor == checkpoint:
        return dg.SkipReason(f"checkpoint unchanged ({checkpoint[:16]})")
    context.update_cursor(checkpoint)
    return extraction_requests(checkpoint)


@dg.schedule(job=extraction_job, cron_schedule="0 3 * * *", default_status=dg.DefaultScheduleStatus.STOPPED,
             description="Nightly extraction of every machine slice; a no-op when nothing changed (content hashing).")
def nightly_extraction(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest]:
    return [dg.RunRequest(partition_key=m) for m in machine_partitions.get_partition_keys()]


automation_sensor = dg.AutomationConditionSensorDefinition(
    "sae_automation", target=dg.AssetSelection.assets(sae_checkpoint, inference_dump),
    default_status=dg.DefaultSensorStatus.RUNNING,
)
