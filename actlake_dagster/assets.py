"""Assets: checkpoint -> activation shards (per machine) -> SAE run (per layer) -> inference dump (per layer).

Each asset calls the library and records exact lineage in its materialization metadata: the
published shard directory's content hash, the model weights' sha256, the dataset fingerprint,
the run id. `lineage.py` reads that back.
"""


import hashlib
import json
from pathlib import Path
from typing import Any

import dagster as dg

from .partitions import layer_partitions, machine_partitions
from .resources import DeviceResource, ModelSourceResource, StorageRootsResource

SHARDS_KEY = dg.AssetKey("activation_shards")
SAE_KEY = dg.AssetKey("sae_checkpoint")


class ExtractionConfig(dg.Config):
    """What to extract (the model comes from the model_source resource)."""

    data: str = "builtin:stdlib-docs"
    limit: int = 256
    layers: str = "all"
    max_seq_len: int = 64
    batch_size: int = 32
    format: str = "saev"
    patches_per_shard: int = 0  # 0: the format's default budget


class SAETrainingConfig(dg.Config):
    """How to train each layer's SAE."""

    k: int = 32
    expansion: int = 8
    epochs: int = 4
    batch_size: int = 4096
    lr: float = 1e-3
    seed: int = 0


@dg.observable_source_asset(group_name="extraction", required_resource_keys={"model_source"},
                            description="The model checkpoint; its data version is the sha256 of its weights.")
def model_checkpoint(context: dg.AssetExecutionContext) -> dg.DataVersion:
    return dg.DataVersion(context.resources.model_source.checkpoint_hash())


@dg.asset(
    deps=[model_checkpoint], partitions_def=machine_partitions, pool="gpu", group_name="extraction", kinds={"pytorch"},
    check_specs=[dg.AssetCheckSpec("conforms_to_spec", asset=SHARDS_KEY,
                                   description="actlake verify: every invariant of the format's spec")],
    description="Content-hashed activation directory of one machine's slice of the dataset.",
)
def activation_shards(context: dg.AssetExecutionContext, config: ExtractionConfig, model_source: ModelSourceResource,
                      device: DeviceResource, storage: StorageRootsResource) -> dg.MaterializeResult:
    import actlake
    from actlake.extract import ExtractConfig, extract

    machine = int(context.partition_key)
    num_machines = len(machine_partitions.get_partition_keys())
    layers: Any = "all" if config.layers == "all" else [int(x) for x in config.layers.split(",")]
    options = {"patches_per_shard": config.patches_per_shard} if config.patches_per_shard else {}
    cfg = ExtractConfig(model=model_source.model, data=config.data, out=storage.shards_root(), layers=layers,
                        format=config.format, max_seq_len=config.max_seq_len, batch_size=config.batch_size,
                        device=device.name, limit=config.limit, machine_id=machine, num_machines=num_machines,
                        options=options)
    context.log.info(f"extracting {cfg.model} over {cfg.data} (machine {machine}/{num_machines}) on {device.name}")
    result = extract(cfg)
    context.log.info(f"published {result.path} ({result.n_samples} samples, {result.n_tokens} tokens this run, "
                     f"resumed from {result.resumed_from}, {result.seconds:.1f}s)")
    problems = actlake.verify(result.path)
    for problem in problems:
        context.log.error(problem)
    prov = result.spec.provenance
    return dg.MaterializeResult(
        metadata={
            "shard_hash": result.path.name,
            "path": dg.MetadataValue.path(str(result.path)),
            "format": config.format,
            "model": result.spec.model_name,
            "weights_sha256": str(prov.get("weights_sha256")),
            "dataset_spec": str(prov.get("dataset_spec")),
            "dataset_fingerprint": str(prov.get("dataset_fingerprint")),
            "layers": list(result.spec.layers),
            "n_samples": result.n_samples,
            "sample_range": list(prov.get("sample_range", [])),
            "machine_id": machine,
        },
        data_version=dg.DataVersion(result.path.name),
        check_results=[dg.AssetCheckResult(check_name="conforms_to_spec", passed=not problems,
                                           metadata={"problems": len(problems)})],
    )


def latest_metadata(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str) -> dict[str, Any] | None:
    """Plain-value metadata of the newest materialization of one partition of an asset."""
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]),
                                              limit=1).records
    if not records or records[0].asset_materialization is None:
        return None
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def _shard_dirs(instance: dg.DagsterInstance) -> list[Path]:
    """Newest shard directory of every machine partition, in machine order (missing: a clear failure)."""
    dirs = []
    for machine in machine_partitions.get_partition_keys():
        md = latest_metadata(instance, SHARDS_KEY, machine)
        if md is None:
            raise dg.Failure(f"activation_shards partition {machine} has not been materialized")
        dirs.append(Path(str(md["path"])))
    return dirs


@dg.asset(
    deps=[dg.AssetDep(activation_shards, partition_mapping=dg.AllPartitionMapping())],
    partitions_def=layer_partitions, pool="gpu", group_name="sae", kinds={"pytorch"},
    automation_condition=dg.AutomationCondition.eager(),
    description="An SAE trained on one layer: a run directory linking machine 0's shards (train) and machine 1's (val).",
)
def sae_checkpoint(context: dg.AssetExecutionContext, config: SAETrainingConfig, device: DeviceResource,
                   storage: StorageRootsResource) -> dg.MaterializeResult:
    from actlake.runs import create_run, shard_hash_of
    from actlake.sae.train import TrainConfig, train_run

    layer = int(context.partition_key)
    dirs = _shard_dirs(context.instance)
    train, val = dirs[0], (dirs[1] if len(dirs) > 1 else None)
    cfg = TrainConfig(layer=layer, k=config.k, expansion=config.expansion, epochs=config.epochs,
                      batch_size=config.batch_size, lr=config.lr, seed=config.seed, device=device.name)
    digest = hashlib.sha256(json.dumps(cfg.to_json(), sort_keys=True).encode()).hexdigest()[:8]
    run_id = f"layer{layer}-{shard_hash_of(train)[:12]}-{digest}"
    run = create_run(storage.runs_root() / run_id, train, val, overwrite=True)
    context.log.info(f"training layer {layer} SAE in {run.path} on {device.name}")
    result = train_run(run, cfg, overwrite=True, progress=False)
    last = result.loss_curve[-1] if result.loss_curve else {}
    return dg.MaterializeResult(metadata={
        "run_id": run_id,
        "run_path": dg.MetadataValue.path(str(run.path.resolve())),
        "layer": layer,
        "train_shard_hash": shard_hash_of(train),
        "val_shard_hash": shard_hash_of(val) if val is not None else "",
        "n_tokens": result.n_tokens,
        "final_loss": float(last.get("loss", float("nan"))),
        "seconds": round(result.seconds, 2),
    })


@dg.asset(
    deps=[sae_checkpoint], partitions_def=layer_partitions, pool="gpu", group_name="sae",
    automation_condition=dg.AutomationCondition.eager(),
    check_specs=[dg.AssetCheckSpec("latents_alive", asset="inference_dump",
                                   description="fewer than 90% of latents dead on the held-out shards")],
    description="Latent activations of every held-out token (CSR npz), metrics and visuals of one layer's SAE.",
)
def inference_dump(context: dg.AssetExecutionContext, device: DeviceResource) -> dg.MaterializeResult:
    from actlake.runs import open_run
    from actlake.sae.infer import infer_run
    from actlake.sae.visuals import visuals_run

    md = latest_metadata(context.instance, SAE_KEY, context.partition_key)
    if md is None:
        raise dg.Failure(f"sae_checkpoint partition {context.partition_key} has not been materialized")
    run = open_run(str(md["run_path"]))
    out = Path(infer_run(run, device=device.name, overwrite=True, progress=False))
    visuals = visuals_run(run, out.name, progress=False)
    metrics = json.loads((out / "metrics.json").read_text())
    dead = float(metrics["dead_frac"])
    context.log.info(f"inference dump {out}: {metrics}")
    return dg.MaterializeResult(
        metadata={"run_id": str(md["run_id"]), "shard_hash": out.name, "path": dg.MetadataValue.path(str(out)),
                  "visuals": dg.MetadataValue.path(str(visuals)),
                  **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}},
        check_results=[dg.AssetCheckResult(check_name="latents_alive", passed=dead < 0.9, metadata={"dead": dead})],
    )
