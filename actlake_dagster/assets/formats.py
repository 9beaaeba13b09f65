"""Other stored layouts (lmprobe, zarr, pickle), each its own asset converted from a split's saev directory.

Asked for with ACTLAKE_FORMATS; each format is a separate asset key, so asking for one never
changes what an existing key means.
"""


from pathlib import Path

import dagster as dg

from ..partitions import GraphPartitions
from ..records import WRITTEN_BY, require_latest, writer_of
from ..resources import StorageRootsResource
from ..settings import GraphSettings
from .keys import ACTIVATION_SHARDS, CODE_VERSION

#: options that keep each conversion lossless where the format allows (lmprobe stores full sequences)
FORMAT_OPTIONS: dict[str, dict[str, object]] = {"lmprobe": {"storage": "full_sequence"}, "zarr": {}, "pickle": {}}


def _build(fmt: str, parts: GraphPartitions, condition: dg.AutomationCondition) -> dg.AssetsDefinition:
    @dg.asset(
        key=dg.AssetKey(f"{fmt}_shards"), partitions_def=parts.per_split, group_name="formats", deps=[ACTIVATION_SHARDS],
        automation_condition=condition, code_version=CODE_VERSION,
        description=f"The split's activations in the {fmt} layout, converted from its saev directory.",
    )
    def converted(context: dg.AssetExecutionContext, storage: StorageRootsResource) -> dg.MaterializeResult:
        from actlake.convert import convert

        source = require_latest(context.instance, ACTIVATION_SHARDS, context.partition_key)
        root = storage.converted_root(fmt)
        before = set(p.name for p in root.iterdir()) if root.is_dir() else set()
        out = Path(convert(str(source.get("path")), fmt, root, FORMAT_OPTIONS[fmt]))
        md = {"path": dg.MetadataValue.path(str(out)), "source_shard_hash": str(source.get("shard_hash")),
              "source_storage_id": source.storage_id, "format": fmt}
        md[WRITTEN_BY] = writer_of(context, out.name, out.name not in before)
        return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(out.name))

    return converted


def build_format_assets(settings: GraphSettings, parts: GraphPartitions,
                        condition: dg.AutomationCondition) -> list[dg.AssetsDefinition]:
    return [_build(fmt, parts, condition) for fmt in settings.formats]
