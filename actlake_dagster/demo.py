"""Materialize the whole graph in dependency order, one Dagster run per partition step, on a persistent instance.

Used by `actlake demo` (the embedded default: MiniLM over built-in texts) and by tests and the
graph benchmark; the runs it makes are ordinary runs of the code location's jobs, so the UI
shows them on the same instance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import dagster as dg

from .assets.keys import MODEL_CHECKPOINT
from .automation import checkpoint_events
from .partitions import SPLITS, checkpoint_partitions, layer_key, slice_key, split_key
from .records import WRITTEN_BY
from .settings import GraphSettings

#: run config that keeps Dagster's console logger to warnings (the demo prints its own progress)
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


@dataclass
class GraphRun:
    """What one pass over the graph did: the Dagster run ids per step and the wall time."""

    checkpoints: list[str] = field(default_factory=list)
    runs: list[tuple[str, str, str, str]] = field(default_factory=list)  # (job, partition, run id, written_by_run)
    seconds: float = 0.0


def observe_checkpoints(defs: dg.Definitions, instance: dg.DagsterInstance) -> list[str]:
    """What the checkpoint sensor does on a tick: add new checkpoint partitions, record changed weights hashes."""
    checkpoints = defs.resources["checkpoints"]
    known = set(instance.get_dynamic_partitions(checkpoint_partitions.name or "checkpoints"))
    latest: dict[str, str] = {}
    for key in known:
        records = instance.fetch_observations(
            dg.AssetRecordsFilter(asset_key=MODEL_CHECKPOINT, asset_partitions=[key]), limit=1).records
        obs = records[0].asset_observation if records else None
        if obs is not None and obs.tags:
            latest[key] = obs.tags.get("dagster/data_version", "")
    new, events, versions = checkpoint_events(checkpoints, known, latest)
    if new:
        instance.add_dynamic_partitions(checkpoint_partitions.name or "checkpoints", new)
    for event in events:
        instance.report_runless_asset_event(event)
    return sorted(versions)


def materialize_graph(defs: dg.Definitions, settings: GraphSettings, instance: dg.DagsterInstance,
                      say: Callable[[str], None] = print, verbose: bool = False) -> GraphRun:
    """Every partition of every asset, for every checkpoint, in dependency order (one progress line per run)."""
    t0 = time.perf_counter()
    out = GraphRun(checkpoints=observe_checkpoints(defs, instance))
    steps: list[tuple[str, dg.MultiPartitionKey]] = []
    for ckpt in out.checkpoints:
        steps += [("extract_slices", slice_key(ckpt, m)) for m in range(settings.num_machines)]
        steps += [("merge_shards", split_key(ckpt, s)) for s in SPLITS]
        steps += [("train_saes", layer_key(ckpt, layer)) for layer in settings.layers]
        if settings.formats:
            steps += [("convert_formats", split_key(ckpt, s)) for s in SPLITS]
    for i, (job_name, pk) in enumerate(steps, 1):
        t = time.perf_counter()
        result = defs.resolve_job_def(job_name).execute_in_process(partition_key=pk, instance=instance,
                                                               run_config=None if verbose else QUIET)
        writers = {str(m.metadata[WRITTEN_BY].value) for m in result.get_asset_materialization_events()
                   for m in [m.materialization] if WRITTEN_BY in m.metadata}
        by = result.run_id if result.run_id in writers else (sorted(writers)[0] if writers else "")
        out.runs.append((job_name, str(pk), result.run_id, by))
        note = "" if by == result.run_id else "  (unchanged: already published)"
        say(f"[{i:>2}/{len(steps)}] {job_name:<14} {str(pk):<28} {time.perf_counter() - t:6.1f} s  "
            f"run {result.run_id[:8]}{note}")
    out.seconds = time.perf_counter() - t0
    return out
