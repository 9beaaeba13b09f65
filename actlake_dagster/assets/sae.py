"""SAE assets per (checkpoint, layer): the run directory (symlink tree), the trained checkpoint, the inference dump.

A run id is derived from everything that decides its contents (train and val shard hashes, the
layer, the SAE recipe), so a published run directory is never rewritten: new inputs make a new run.
"""


import hashlib
import json
from pathlib import Path
from typing import Any

import dagster as dg

from ..partitions import BOTH_SPLITS_OF_CHECKPOINT, GraphPartitions, dims, split_key
from ..records import WRITTEN_BY, require_latest, writer_of
from ..resources import DeviceResource, SAETrainingResource, StorageRootsResource
from ..settings import GraphSettings
from .keys import ACTIVATION_SHARDS, CODE_VERSION, GPU_OP_TAGS, GPU_POOL, INFERENCE_DUMP, SAE_CHECKPOINT, SAE_RUN


def run_id_for(checkpoint: str, layer: int, train_hash: str, val_hash: str, recipe: dict[str, Any]) -> str:
    """`<checkpoint>-l<layer>-<12 hex>`: the hex is a sha256 of every input of the run."""
    blob = json.dumps({"layer": layer, "train": train_hash, "val": val_hash, "sae": recipe}, sort_keys=True)
    return f"{checkpoint}-l{layer}-{hashlib.sha256(blob.encode('utf-8')).hexdigest()[:12]}"


def build_sae_assets(settings: GraphSettings, parts: GraphPartitions,
                     condition: dg.AutomationCondition) -> list[dg.AssetsDefinition]:
    """`sae_run`, `sae_checkpoint` and `inference_dump`, each partitioned checkpoint x layer."""

    @dg.asset(
        key=SAE_RUN, partitions_def=parts.per_layer, group_name="sae",
        deps=[dg.AssetDep(ACTIVATION_SHARDS, partition_mapping=BOTH_SPLITS_OF_CHECKPOINT)],
        automation_condition=condition, code_version=CODE_VERSION,
        description="The run directory of one layer's SAE: links/train-shards, val-shards, train-dataset, val-dataset "
                    "(storage spec). Data version: the run id, a hash of every input.",
    )
    def sae_run(context: dg.AssetExecutionContext, storage: StorageRootsResource,
                sae: SAETrainingResource) -> dg.MaterializeResult:
        from actlake.runs import LINK_NAMES, create_run

        d = dims(context)
        ckpt, layer = d["checkpoint"], int(d["layer"])
        train = require_latest(context.instance, ACTIVATION_SHARDS, split_key(ckpt, "train"))
        val = require_latest(context.instance, ACTIVATION_SHARDS, split_key(ckpt, "val"))
        train_hash, val_hash = str(train.get("shard_hash")), str(val.get("shard_hash"))
        run_id = run_id_for(ckpt, layer, train_hash, val_hash, sae.identity(layer))
        path = storage.runs_root() / run_id
        existed = path.is_dir()
        run = create_run(path, Path(str(train.get("path"))), Path(str(val.get("path"))))  # refuses re-pointing
        links = {name: str(target) for name in LINK_NAMES if (target := run.link(name, required=False)) is not None}
        missing = [name for name in LINK_NAMES if name not in links]
        if missing:
            raise dg.Failure(f"run directory {path} lacks links {missing}")
        context.log.info(f"run directory {path} ({'existing' if existed else 'new'})")
        md: dict[str, Any] = {"run_id": run_id, "run_path": dg.MetadataValue.path(str(path.resolve())),
                              "checkpoint": ckpt, "layer": layer, "train_shard_hash": train_hash,
                              "val_shard_hash": val_hash, "train_storage_id": train.storage_id,
                              "val_storage_id": val.storage_id, "links": links}
        md[WRITTEN_BY] = writer_of(context, run_id, not existed)
        return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(run_id))

    @dg.asset(
        key=SAE_CHECKPOINT, partitions_def=parts.per_layer, group_name="sae", kinds={"pytorch"}, deps=[SAE_RUN],
        pool=GPU_POOL, op_tags=GPU_OP_TAGS, automation_condition=condition, code_version=CODE_VERSION,
        description="The SAE trained on one layer's train shards (checkpoint/sae.pt in its run directory). "
                    "Data version: sha256 of sae.pt.",
    )
    def sae_checkpoint(context: dg.AssetExecutionContext, device: DeviceResource,
                       sae: SAETrainingResource) -> dg.MaterializeResult:
        from actlake.hashing import file_sha256
        from actlake.runs import open_run
        from actlake.sae.train import train_run

        d = dims(context)
        layer = int(d["layer"])
        source = require_latest(context.instance, SAE_RUN, context.partition_key)
        run = open_run(Path(str(source.get("run_path"))))
        cfg = sae.train_config(layer, device.name)
        wrote = not run.has_checkpoint
        if wrote:
            context.log.info(f"training the layer {layer} SAE in {run.path} on {device.name}")
            result = train_run(run, cfg, progress=False)
            final = result.loss_curve[-1] if result.loss_curve else {}
        else:
            recorded = run.read_config()
            if {k: v for k, v in recorded.get("train", {}).items() if k not in ("device", "n_threads")} != sae.identity(layer):
                raise dg.Failure(f"{run.config_path} was trained with another recipe than its run id says")
            context.log.info(f"{run.sae_path} exists: reused (run directories are immutable)")
            final = recorded.get("final") or {}
        sha = file_sha256(run.sae_path)
        md: dict[str, Any] = {"run_id": run.run_id, "run_path": dg.MetadataValue.path(str(run.path.resolve())),
                              "layer": layer, "sae_sha256": sha, "sae_path": str(run.sae_path),
                              **{f"final_{k}": float(v) for k, v in final.items() if isinstance(v, (int, float))}}
        md[WRITTEN_BY] = writer_of(context, sha, wrote)
        return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(sha))

    @dg.asset(
        key=INFERENCE_DUMP, partitions_def=parts.per_layer, group_name="sae", deps=[SAE_CHECKPOINT],
        pool=GPU_POOL, op_tags=GPU_OP_TAGS, automation_condition=condition, code_version=CODE_VERSION,
        check_specs=[dg.AssetCheckSpec("latents_alive", asset=INFERENCE_DUMP,
                                       description="fewer than 90% of latents dead on the held-out shards")],
        description="Latents of every held-out token (CSR patch_acts.npz), metrics and visuals of one layer's SAE. "
                    "Data version: sha256 of patch_acts.npz.",
    )
    def inference_dump(context: dg.AssetExecutionContext, device: DeviceResource) -> dg.MaterializeResult:
        from actlake.hashing import file_sha256
        from actlake.runs import open_run
        from actlake.sae.infer import infer_run
        from actlake.sae.visuals import visuals_run

        source = require_latest(context.instance, SAE_CHECKPOINT, context.partition_key)
        run = open_run(Path(str(source.get("run_path"))))
        val = run.val_shards or run.train_shards
        existed = (run.inference_dir(val.name) / "patch_acts.npz").is_file()
        out = Path(infer_run(run, device=device.name, progress=False))  # an existing dump of this checkpoint is kept
        visuals = out / "visuals"
        if not existed or not visuals.is_dir():
            visuals = Path(visuals_run(run, out.name, progress=False))
        metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
        sha = file_sha256(out / "patch_acts.npz")
        dead = float(metrics.get("dead_frac", 1.0))
        context.log.info(f"inference dump {out}: " + ", ".join(f"{k}={v}" for k, v in metrics.items()
                                                               if isinstance(v, (int, float))))
        md: dict[str, Any] = {"run_id": run.run_id, "shard_hash": out.name, "path": dg.MetadataValue.path(str(out)),
                              "visuals": dg.MetadataValue.path(str(visuals)), "patch_acts_sha256": sha,
                              **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        md[WRITTEN_BY] = writer_of(context, sha, not existed)
        return dg.MaterializeResult(
            metadata=md, data_version=dg.DataVersion(sha),
            check_results=[dg.AssetCheckResult(check_name="latents_alive", passed=dead < 0.9, metadata={"dead": dead})],
        )

    return [sae_run, sae_checkpoint, inference_dump]
