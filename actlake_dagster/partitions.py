"""Partitions: one per machine slice of the dataset, one per layer an SAE is trained on.

Both are fixed when the code location loads, from $ACTLAKE_NUM_MACHINES (default 2: machine 0's
slice trains the SAEs, machine 1's validates them) and $ACTLAKE_LAYERS (default MiniLM's 0-5).
"""

from __future__ import annotations

import os

import dagster as dg


def _num_machines() -> int:
    return max(1, int(os.environ.get("ACTLAKE_NUM_MACHINES", "2")))


def _layers() -> list[str]:
    raw = os.environ.get("ACTLAKE_LAYERS", "0,1,2,3,4,5")
    return [str(int(x)) for x in raw.split(",") if x.strip()]


machine_partitions = dg.StaticPartitionsDefinition([str(i) for i in range(_num_machines())])
layer_partitions = dg.StaticPartitionsDefinition(_layers())
