"""Extraction: each machine slice of a checkpoint (both splits, one model load), then one merged shard directory per split."""


import hashlib
from pathlib import Path
from typing import Any

import dagster as dg

from ..partitions import ALL_MACHINES_OF_CHECKPOINT, SPLITS, GraphPartitions, dims, slice_key
from ..records import WRITTEN_BY, require_latest, writer_of
from ..resources import CheckpointsResource, DeviceResource, StorageRootsResource
from ..settings import GraphSettings
from .keys import ACTIVATION_SHARDS, CODE_VERSION, GPU_OP_TAGS, GPU_POOL, MACHINE_SLICES, MODEL_CHECKPOINT


def slices_version(hashes: dict[str, str]) -> str:
    """Data version of one machine's slices: sha256 over the per-split slice hashes."""
    blob = "|".join(f"{split}:{hashes[split]}" for split in sorted(hashes))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def build_extraction_assets(settings: GraphSettings, parts: GraphPartitions,
                            condition: dg.AutomationCondition) -> list[dg.AssetsDefinition]:
    """`machine_slices` (checkpoint x machine) and `activation_shards` (checkpoint x split)."""

    @dg.asset(
        key=MACHINE_SLICES, partitions_def=parts.per_machine, group_name="extraction", kinds={"pytorch"},
        deps=[dg.AssetDep(MODEL_CHECKPOINT, partition_mapping=dg.MultiToSingleDimensionPartitionMapping("checkpoint"))],
        pool=GPU_POOL, op_tags=GPU_OP_TAGS, automation_condition=condition, code_version=CODE_VERSION,
        description="One machine's slice of the dataset, both splits, extracted in one model load into saev "
                    "slices of the extraction run. Data version: the slices' content hashes.",
    )
    def machine_slices(context: dg.AssetExecutionContext, checkpoints: CheckpointsResource, device: DeviceResource,
                       storage: StorageRootsResource) -> dg.MaterializeResult:
        from actlake.extract import ExtractConfig, extract
        from actlake.extract.models import load_model
        from actlake.runs import shard_hash_of

        d = dims(context)
        ckpt, machine = checkpoints.get(d["checkpoint"]), int(d["machine"])
        context.log.info(f"loading {ckpt.model} on {device.name}")
        loaded = load_model(ckpt.model, device=device.name)
        md: dict[str, Any] = {"checkpoint": ckpt.key, "machine": machine, "num_machines": settings.num_machines,
                              "model": ckpt.model, "weights_sha256": loaded.weights_sha256, "device": device.name}
        hashes: dict[str, str] = {}
        wrote = False
        for split in SPLITS:
            cfg = ExtractConfig(model=ckpt.model, data=settings.data, out=storage.slices_root(),
                                layers=list(settings.layers), format="saev", max_seq_len=settings.max_seq_len,
                                batch_size=settings.batch_size, device=device.name, limit=settings.limit,
                                machine_id=machine, num_machines=settings.num_machines, split=split,
                                val_fraction=settings.val_fraction, datasets_root=storage.datasets_root())
            result = extract(cfg, model=loaded)
            wrote = wrote or result.n_tokens > 0
            hashes[split] = shard_hash_of(result.path)
            prov = result.spec.provenance
            context.log.info(f"{split} slice {machine}/{settings.num_machines}: {result.path} "
                             f"({result.n_samples} samples, {result.n_tokens} new tokens, {result.seconds:.1f} s)")
            md.update({f"{split}_slice_hash": hashes[split], f"{split}_slice_path": str(result.path),
                       f"{split}_run_dir": str(result.run_dir), f"{split}_n_samples": result.n_samples,
                       f"{split}_sample_range": list(prov.get("sample_range", []))})
            md.setdefault("dataset_fingerprint", str(prov.get("dataset_fingerprint")))
            md.setdefault("dataset_spec", str(prov.get("dataset_spec")))
            md.setdefault("checkpoint_path", str(prov.get("checkpoint_path")))
        version = slices_version(hashes)
        md[WRITTEN_BY] = writer_of(context, version, wrote)
        return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(version))

    @dg.asset(
        key=ACTIVATION_SHARDS, partitions_def=parts.per_split, group_name="extraction",
        deps=[dg.AssetDep(MACHINE_SLICES, partition_mapping=ALL_MACHINES_OF_CHECKPOINT)],
        automation_condition=condition, code_version=CODE_VERSION,
        check_specs=[dg.AssetCheckSpec("conforms_to_spec", asset=ACTIVATION_SHARDS, blocking=True,
                                       description="actlake verify: every invariant of the saev 2.1 spec, checksums included")],
        description="The content-hashed saev directory of one split, merged from every machine's slice "
                    "(<shards_root>/<shard_hash>). Data version: the shard hash.",
    )
    def activation_shards(context: dg.AssetExecutionContext, storage: StorageRootsResource) -> dg.MaterializeResult:
        import actlake
        from actlake.slices import merge_run

        d = dims(context)
        ckpt, split = d["checkpoint"], d["split"]
        slices = [require_latest(context.instance, MACHINE_SLICES, slice_key(ckpt, m))
                  for m in range(settings.num_machines)]
        run_dirs = sorted({str(s.get(f"{split}_run_dir")) for s in slices})
        if len(run_dirs) != 1:
            raise dg.Failure(f"the machine slices of {ckpt} belong to different extraction runs: {run_dirs}")
        root = storage.shards_root()
        before = set(p.name for p in root.iterdir()) if root.is_dir() else set()
        merged = Path(merge_run(Path(run_dirs[0]), root, verify=False))  # verified once, below, as the asset check
        shard_hash = merged.name
        problems = actlake.verify(merged)
        for problem in problems:
            context.log.error(problem)
        with actlake.open(merged) as reader:
            facts = {"n_samples": int(reader.n_samples), "n_tokens": int(reader.n_tokens),
                     "layers": list(reader.layers), "d_model": int(reader.d_model)}
        context.log.info(f"{split} shards of {ckpt}: {merged} ({facts['n_samples']} samples, {facts['n_tokens']} tokens)")
        md: dict[str, Any] = {
            "shard_hash": shard_hash, "path": dg.MetadataValue.path(str(merged)), "checkpoint": ckpt, "split": split,
            **facts,
            "slice_hashes": [str(s.get(f"{split}_slice_hash")) for s in slices],
            "slice_storage_ids": [s.storage_id for s in slices],
            "slice_written_by": [str(s.get(WRITTEN_BY, s.run_id)) for s in slices],
            "weights_sha256": str(slices[0].get("weights_sha256")),
            "checkpoint_path": str(slices[0].get("checkpoint_path")),
            "dataset_fingerprint": str(slices[0].get("dataset_fingerprint")),
            "dataset_spec": str(slices[0].get("dataset_spec")),
        }
        md[WRITTEN_BY] = writer_of(context, shard_hash, shard_hash not in before)
        return dg.MaterializeResult(
            metadata=md, data_version=dg.DataVersion(shard_hash),
            check_results=[dg.AssetCheckResult(check_name="conforms_to_spec", passed=not problems,
                                               metadata={"problems": len(problems),
                                                         "first": problems[0] if problems else ""})],
        )

    return [machine_slices, activation_shards]
