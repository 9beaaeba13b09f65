"""The asset graph's overhead and its automation, measured in one run.

  (a) the demo's graph materialized through Dagster (one run per partition step, sqlite instance)
      vs the same extraction + merge + training + inference called through the library directly,
      each into fresh roots                                                   target <= 1.3x wall
  (b) a checkpoint-sensor tick on an unchanged 1 GiB checkpoint (weights hash cached on size+mtime)
      vs the first tick that hashes it                                         target < 0.1 s
  (c) runs requested by the automation condition after an unchanged re-extraction  target 0
Prints one JSON line of results last. `--quick` for a small run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")


def settings_for(args: argparse.Namespace):  # noqa: ANN201 - GraphSettings
    from actlake_dagster.settings import GraphSettings

    return GraphSettings(model="minilm", limit=args.limit, max_seq_len=args.max_seq_len, num_machines=2,
                         layers=tuple(args.layers), device="cpu")


def library_seconds(settings, root: Path, sae) -> float:  # noqa: ANN001
    """Extraction (both splits per machine, one model load each), merge, then per layer: run dir, train, infer, visuals."""
    from actlake.extract import ExtractConfig, extract
    from actlake.extract.models import load_model
    from actlake.runs import create_run
    from actlake.sae.infer import infer_run
    from actlake.sae.train import train_run
    from actlake.sae.visuals import visuals_run
    from actlake.slices import merge_run

    t0 = time.perf_counter()
    run_dirs = {}
    for machine in range(settings.num_machines):
        loaded = load_model(settings.model, device="cpu")
        for split in ("train", "val"):
            cfg = ExtractConfig(model=settings.model, data=settings.data, out=root / "slices", layers=list(settings.layers),
                                format="saev", max_seq_len=settings.max_seq_len, batch_size=settings.batch_size,
                                device="cpu", limit=settings.limit, machine_id=machine,
                                num_machines=settings.num_machines, split=split, val_fraction=settings.val_fraction)
            run_dirs[split] = extract(cfg, model=loaded).run_dir
    merged = {split: merge_run(run_dirs[split], root / "shards") for split in run_dirs}
    for layer in settings.layers:
        run = create_run(root / "runs" / f"l{layer}", merged["train"], merged["val"])
        train_run(run, sae.train_config(layer, "cpu"), progress=False)
        out = infer_run(run, device="cpu", progress=False)
        visuals_run(run, Path(out).name, progress=False)
    return time.perf_counter() - t0


def dagster_pass(settings, root: Path, sae):  # noqa: ANN001, ANN201
    """The same work through Dagster: a fresh sqlite instance, the demo's step runner."""
    from actlake_dagster.definitions import build_defs
    from actlake_dagster.demo import materialize_graph
    from actlake_dagster.instance import open_instance
    from actlake_dagster.resources import CheckpointsResource, DeviceResource, StorageRootsResource

    resources = {"checkpoints": CheckpointsResource(model=settings.model, hash_cache=str(root / "cache.json")),
                 "device": DeviceResource(device="cpu"), "storage": StorageRootsResource(scratch=str(root / "scratch"), nfs=str(root / "nfs")),
                 "sae": sae}
    defs = build_defs(settings, resources)
    instance = open_instance(root / "dagster")
    t0 = time.perf_counter()
    materialize_graph(defs, settings, instance, say=lambda line: print("   ", line))
    return time.perf_counter() - t0, defs, instance


def unchanged_reextraction_requests(settings, defs, instance) -> int:  # noqa: ANN001
    """Re-run every machine slice (a no-op: same content hashes), then count what automation requests."""
    import dagster as dg

    from actlake_dagster.partitions import slice_key

    first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    for ckpt in instance.get_dynamic_partitions("checkpoints"):
        for m in range(settings.num_machines):
            defs.resolve_job_def("extract_slices").execute_in_process(
                partition_key=slice_key(ckpt, m), instance=instance,
                run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}})
    second = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=first.cursor)
    return int(first.total_requested + second.total_requested)


def new_checkpoint_requests(defs, instance) -> dict[str, int]:  # noqa: ANN001
    """Add a checkpoint partition with a new weights version, then count what automation requests per asset."""
    import dagster as dg

    from actlake_dagster.assets.keys import MODEL_CHECKPOINT
    from actlake_dagster.records import DATA_VERSION_TAG

    first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    instance.add_dynamic_partitions("checkpoints", ["bench-new-checkpoint"])
    instance.report_runless_asset_event(dg.AssetObservation(MODEL_CHECKPOINT, partition="bench-new-checkpoint",
                                                            tags={DATA_VERSION_TAG: "new-weights"}))
    second = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=first.cursor)
    out: dict[str, int] = {}
    for key in defs.resolve_asset_graph().get_all_asset_keys():
        n = len(second.get_requested_partitions(key))
        if n:
            out[key.to_user_string()] = n
    return out


def sensor_tick_seconds(root: Path, size: int) -> tuple[float, float]:
    """(first tick, second tick) of the checkpoint sensor's work on a checkpoint of `size` bytes."""
    from actlake_dagster.automation import checkpoint_events
    from actlake_dagster.resources import CheckpointsResource

    ckpt = root / "checkpoints" / "step-001000"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    with open(ckpt / "model.safetensors", "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(block)
    times = []
    cursor: dict[str, str] = {}
    for _ in range(2):
        resource = CheckpointsResource(root=str(root / "checkpoints"), hash_cache=str(root / "weights.json"))
        t0 = time.perf_counter()
        _, _, cursor = checkpoint_events(resource, set(), cursor)
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="64 texts, 2 layers, a 128 MiB checkpoint")
    args = p.parse_args()
    args.limit, args.max_seq_len = (64, 32) if args.quick else (256, 64)
    args.layers = [1, 5] if args.quick else [1, 3, 5]
    checkpoint_bytes = (128 << 20) if args.quick else (1 << 30)
    from actlake_dagster.resources import SAETrainingResource

    settings = settings_for(args)
    sae = SAETrainingResource(epochs=2 if args.quick else 4)
    with tempfile.TemporaryDirectory(prefix="actlake-bench-graph-") as tmp:
        root = Path(tmp)
        print(f"graph: {settings.limit} texts x {settings.max_seq_len} tokens, {settings.num_machines} machines, "
              f"layers {list(settings.layers)}")
        lib = library_seconds(settings, root / "lib", sae)
        print(f"  library directly: {lib:.1f} s")
        dag, defs, instance = dagster_pass(settings, root / "dag", sae)
        print(f"  through Dagster:  {dag:.1f} s   ratio {dag / lib:.2f}x (target <= 1.3)")
        requested = unchanged_reextraction_requests(settings, defs, instance)
        print(f"  runs requested after an unchanged re-extraction: {requested} (target 0)")
        fresh = new_checkpoint_requests(defs, instance)
        print(f"  a new checkpoint requests: {fresh} (target: one machine_slices per machine, nothing else yet)")
        first, second = sensor_tick_seconds(root / "sensor", checkpoint_bytes)
        print(f"  sensor tick on an unchanged {checkpoint_bytes >> 20} MiB checkpoint: {second * 1e3:.1f} ms "
              f"(first tick, hashing it: {first:.2f} s; target < 0.1 s)")
    print(json.dumps({"bench": "graph", "library_s": round(lib, 2), "dagster_s": round(dag, 2),
                      "ratio": round(dag / lib, 3), "requested_after_unchanged": requested,
                      "requested_for_new_checkpoint": fresh,
                      "sensor_tick_unchanged_s": round(second, 4), "sensor_tick_first_s": round(first, 3),
                      "checkpoint_mib": checkpoint_bytes >> 20, "quick": args.quick}))


if __name__ == "__main__":
    main()
