"""`actlake lineage RUN` / `actlake lineage --shards HASH`: where an SAE came from, or who used a shard directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

NAME = "lineage"
HELP = "trace an SAE run to its shards, machine slices, checkpoint and dataset (or, with --shards, the reverse)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="a run directory, an actlake run id (under the runs root) or a Dagster run id")
    p.add_argument("--shards", metavar="HASH", help="list every run trained or evaluated on this shard directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-instance", action="store_true",
                   help="files only: ignore the Dagster instance ($DAGSTER_HOME or ./actlake-data/dagster)")


def _instance(args: argparse.Namespace) -> Any:
    """The configured Dagster instance, or None (no instance, or dagster not importable)."""
    if args.no_instance:
        return None
    try:
        from actlake_dagster.instance import existing_instance
    except ImportError:
        return None
    return existing_instance()


def _resolve_run(ref: str, instance: Any) -> Path:
    from ..errors import RunError
    from ..runs import resolve_run_arg

    path = resolve_run_arg(ref)
    if path.is_dir():
        return path
    if instance is not None:
        from actlake_dagster.lineage import actlake_run_of_dagster_run, run_path_of

        run_id = actlake_run_of_dagster_run(instance, ref) or ref
        recorded = run_path_of(instance, run_id)
        if recorded and Path(recorded).is_dir():
            return Path(recorded)
    raise RunError("not a run directory, a run id under the runs root, nor a Dagster run id the instance knows", path)


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..lineage import lineage_from_files, runs_using_shards

    if (args.run is None) == (args.shards is None):
        raise ConfigError("give a RUN or --shards HASH (not both)")
    instance = _instance(args)
    if args.shards:
        out: dict[str, Any] = {"shard_hash": args.shards, "runs": runs_using_shards(args.shards)}
        if instance is not None:
            from actlake_dagster.lineage import runs_using_shards as recorded

            out["dagster"] = recorded(instance, args.shards)
        if args.json:
            print(json.dumps(out, indent=2, default=str))
        else:
            print(f"shards {args.shards}")
            for r in out["runs"]:
                print(f"  {r['role']:<5} {r['run_id']}  {r['run_path']}  trained={r['trained']}")
            for r in out.get("dagster") or []:
                print(f"  {r['role']:<5} {r['run_id']}  (instance: written by Dagster run {r['dagster_run']})")
        return 0
    path = _resolve_run(args.run, instance)
    lineage = lineage_from_files(path)
    if instance is not None:
        from actlake_dagster.lineage import instance_lineage

        lineage["dagster"] = instance_lineage(instance, lineage["run"]["run_id"])
    if args.json:
        print(json.dumps(lineage, indent=2, default=str))
    else:
        print(render(lineage))
    return 0


def _by(entry: dict[str, Any] | None) -> str:
    return f"  [Dagster run {entry['written_by_run']}]" if entry and entry.get("written_by_run") else ""


def render(lineage: dict[str, Any]) -> str:
    """The lineage as an indented tree, one fact per line."""
    dag = lineage.get("dagster") or {}
    run, sae, ckpt, ds = lineage["run"], lineage["sae_checkpoint"], lineage["checkpoint"], lineage["dataset"]
    lines = [f"run {run['run_id']}  {run['path']}  (layer {run['layer']}){_by(dag.get('run'))}",
             f"└─ SAE checkpoint sha256 {sae.get('sha256')}  {sae.get('path')}{_by(dag.get('sae_checkpoint'))}"]
    for split in ("train", "val"):
        shards = lineage.get(f"{split}_shards")
        if shards is None:
            continue
        lines.append(f"   ├─ {split} shards {shards['shard_hash']}  {shards['path']} "
                     f"({shards['n_samples']} samples){_by(dag.get(f'{split}_shards'))}")
        recorded = (dag.get(f"{split}_shards") or {}).get("machine_slices") or []
        slices = shards["machine_slices"] or [{"hash": s.get(f"{split}_slice_hash"), "machine": s.get("machine")}
                                              for s in recorded]
        for i, s in enumerate(slices):
            by = _by(recorded[i]) if i < len(recorded) else ""
            lines.append(f"   │  └─ machine slice {s.get('machine', i)}: {s.get('hash') or s.get('shard_hash')}{by}")
    lines.append(f"   ├─ checkpoint {ckpt.get('path') or ckpt.get('model')}  weights sha256 {ckpt.get('weights_sha256')}")
    lines.append(f"   └─ dataset {ds.get('spec')}  fingerprint {ds.get('fingerprint')}  (link {ds.get('link')})")
    if lineage.get("dagster") is None:
        lines.append("(no Dagster instance records for this run: files only)")
    return "\n".join(lines)
