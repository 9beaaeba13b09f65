"""The asset graph, left to right: checkpoint -> machine slices -> shard directory per split -> run directory
-> SAE checkpoint -> inference dump (plus other stored formats converted from the shard directories).

Assets are built by factories because their partitions come from the settings (machine count, layers).
"""


import dagster as dg

from ..automation import refresh_condition
from ..partitions import GraphPartitions
from ..settings import GraphSettings
from .checkpoint import model_checkpoint
from .extraction import build_extraction_assets
from .formats import build_format_assets
from .keys import ACTIVATION_SHARDS, INFERENCE_DUMP, MACHINE_SLICES, MODEL_CHECKPOINT, SAE_CHECKPOINT, SAE_RUN
from .sae import build_sae_assets


def build_assets(settings: GraphSettings, parts: GraphPartitions) -> list[dg.AssetsDefinition | dg.SourceAsset]:
    """Every asset of one graph."""
    condition = refresh_condition()
    return [
        model_checkpoint,
        *build_extraction_assets(settings, parts, condition),
        *build_sae_assets(settings, parts, condition),
        *build_format_assets(settings, parts, condition),
    ]


__all__ = ["ACTIVATION_SHARDS", "INFERENCE_DUMP", "MACHINE_SLICES", "MODEL_CHECKPOINT", "SAE_CHECKPOINT", "SAE_RUN",
           "build_assets"]
