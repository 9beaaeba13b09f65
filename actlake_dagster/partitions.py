"""Partitions: a dynamic dimension of checkpoints, crossed with machine slices, splits or layers.

Multi-partition keys join dimension values with `|` in alphabetical order of dimension name
(`checkpoint|machine`, `checkpoint|split`, `checkpoint|layer`); build them with `slice_key` etc.
"""

from __future__ import annotations

from dataclasses import dataclass

import dagster as dg

from .settings import GraphSettings

CHECKPOINTS = "checkpoints"
SPLITS = ("train", "val")

checkpoint_partitions = dg.DynamicPartitionsDefinition(name=CHECKPOINTS)


@dataclass(frozen=True)
class GraphPartitions:
    """Every partitions definition of one graph (machine count and layers come from settings)."""

    machines: dg.StaticPartitionsDefinition
    layers: dg.StaticPartitionsDefinition
    per_machine: dg.MultiPartitionsDefinition
    per_split: dg.MultiPartitionsDefinition
    per_layer: dg.MultiPartitionsDefinition

    @classmethod
    def from_settings(cls, settings: GraphSettings) -> "GraphPartitions":
        machines = dg.StaticPartitionsDefinition([str(i) for i in range(settings.num_machines)])
        layers = dg.StaticPartitionsDefinition([str(x) for x in settings.layers])
        splits = dg.StaticPartitionsDefinition(list(SPLITS))
        return cls(
            machines=machines, layers=layers,
            per_machine=dg.MultiPartitionsDefinition({"checkpoint": checkpoint_partitions, "machine": machines}),
            per_split=dg.MultiPartitionsDefinition({"checkpoint": checkpoint_partitions, "split": splits}),
            per_layer=dg.MultiPartitionsDefinition({"checkpoint": checkpoint_partitions, "layer": layers}),
        )


def slice_key(checkpoint: str, machine: int | str) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"checkpoint": checkpoint, "machine": str(machine)})


def split_key(checkpoint: str, split: str) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"checkpoint": checkpoint, "split": split})


def layer_key(checkpoint: str, layer: int | str) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"checkpoint": checkpoint, "layer": str(layer)})


def dims(context: dg.AssetExecutionContext) -> dict[str, str]:
    """The dimension values of the partition a step materializes."""
    key = context.partition_key
    if isinstance(key, dg.MultiPartitionKey):
        return dict(key.keys_by_dimension)
    return dict(dg.MultiPartitionKey.from_str(key).keys_by_dimension) if "|" in key else {"key": key}


#: machine slices (checkpoint x machine) -> merged directory (checkpoint x split): every machine of the checkpoint
ALL_MACHINES_OF_CHECKPOINT = dg.MultiPartitionMapping({
    "checkpoint": dg.DimensionPartitionMapping("checkpoint", dg.IdentityPartitionMapping()),
    "machine": dg.DimensionPartitionMapping("split", dg.AllPartitionMapping()),
})
#: merged directories (checkpoint x split) -> run directory (checkpoint x layer): both splits of the checkpoint
BOTH_SPLITS_OF_CHECKPOINT = dg.MultiPartitionMapping({
    "checkpoint": dg.DimensionPartitionMapping("checkpoint", dg.IdentityPartitionMapping()),
    "split": dg.DimensionPartitionMapping("layer", dg.AllPartitionMapping()),
})
