"""Reading the instance's records: the newest materialization of a partition, and who first wrote some bytes.

Dagster's automatic provenance keeps one upstream pointer when many partitions feed one, so
exact lineage lives in each materialization's metadata (plain values), read back from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dagster as dg

WRITTEN_BY = "written_by_run"
#: the tag a materialization or observation carries its data version in (dagster's DATA_VERSION_TAG)
DATA_VERSION_TAG = "dagster/data_version"


@dataclass(frozen=True)
class Materialization:
    """One materialization: its event-log storage id, the Dagster run, the partition and plain metadata."""

    storage_id: int
    run_id: str
    partition: str | None
    timestamp: float
    metadata: dict[str, Any]
    data_version: str | None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _plain(record: Any) -> Materialization | None:
    mat = record.asset_materialization
    if mat is None:
        return None
    md = {k: v.value for k, v in mat.metadata.items()}
    return Materialization(record.storage_id, record.run_id, mat.partition, record.timestamp, md,
                           (mat.tags or {}).get(DATA_VERSION_TAG))


def materializations(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None = None,
                     limit: int = 1000) -> list[Materialization]:
    """Materializations of an asset (one partition, or all), newest first."""
    flt = dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition is not None else None)
    out = []
    for record in instance.fetch_materializations(flt, limit=limit, ascending=False).records:
        plain = _plain(record)
        if plain is not None:
            out.append(plain)
    return out


def latest(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str) -> Materialization | None:
    """The newest materialization of one partition, or None."""
    found = materializations(instance, key, partition, limit=1)
    return found[0] if found else None


def require_latest(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str) -> Materialization:
    """The newest materialization of one partition; a clear failure when it was never materialized."""
    found = latest(instance, key, partition)
    if found is None:
        raise dg.Failure(f"{key.to_user_string()} partition {partition} has not been materialized yet")
    return found


def writer_of(context: dg.AssetExecutionContext, data_version: str, wrote: bool) -> str:
    """The Dagster run that wrote the bytes behind `data_version`: this one if it wrote them, else the
    run recorded by the newest earlier materialization of this partition with the same version."""
    if wrote:
        return context.run.run_id
    key = context.asset_key
    for earlier in materializations(context.instance, key, context.partition_key, limit=100):
        if earlier.data_version == data_version and earlier.get(WRITTEN_BY):
            return str(earlier.get(WRITTEN_BY))
    return context.run.run_id  # the bytes predate this instance's records: this run is the first to publish them
