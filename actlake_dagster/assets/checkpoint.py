"""The checkpoint: an observable source asset, one dynamic partition per checkpoint; its data version is the weights' sha256."""


import dagster as dg

from ..partitions import checkpoint_partitions
from ..resources import CheckpointsResource


@dg.observable_source_asset(
    name="model_checkpoint", partitions_def=checkpoint_partitions, group_name="checkpoints",
    description="A model checkpoint (a directory under the checkpoints root, or the configured model). "
                "Data version: sha256 of its weight files. Observed by `checkpoint_sensor`.",
)
def model_checkpoint(context: dg.AssetExecutionContext, checkpoints: CheckpointsResource) -> dg.DataVersionsByPartition:
    known = set(context.instance.get_dynamic_partitions(checkpoint_partitions.name or "checkpoints"))
    return dg.DataVersionsByPartition({c.key: dg.DataVersion(checkpoints.weights_sha256(c))
                                       for c in checkpoints.all() if c.key in known})
