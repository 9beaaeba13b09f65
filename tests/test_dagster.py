"""The Dagster code location: definitions load, assets materialize in-process, lineage, sensor."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from actlake_dagster.assets import activation_shards, inference_dump, model_checkpoint, sae_checkpoint
from actlake_dagster.automation import new_checkpoint_sensor
from actlake_dagster.definitions import defs
from actlake_dagster.lineage import lineage_of_run
from actlake_dagster.resources import DeviceResource, ModelSourceResource, StorageRootsResource

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")


def test_definitions_load() -> None:
    dg.Definitions.validate_loadable(defs)
    keys = {a.key.to_user_string() for a in defs.resolve_all_asset_specs()}
    assert keys == {"model_checkpoint", "activation_shards", "sae_checkpoint", "inference_dump"}
    assert defs.resolve_job_def("extract_activations").partitions_def is not None


@pytest.fixture
def resources(tmp_path: Path) -> dict[str, object]:
    return {
        "device": DeviceResource(device="cpu"),
        "model_source": ModelSourceResource(model="tiny-random:bert"),
        "storage": StorageRootsResource(scratch=str(tmp_path / "scratch"), nfs=str(tmp_path / "nfs")),
    }


def test_pipeline_materializes_with_exact_lineage(tmp_path: Path, resources: dict[str, object]) -> None:
    instance = dg.DagsterInstance.ephemeral()
    run_config = {"ops": {"activation_shards": {"config": {"limit": 24, "max_seq_len": 16, "batch_size": 8}},
                          "sae_checkpoint": {"config": {"k": 4, "expansion": 2, "epochs": 2, "batch_size": 64}}}}
    for machine in ("0", "1"):
        result = dg.materialize([model_checkpoint, activation_shards], partition_key=machine, resources=resources,
                                instance=instance, run_config={"ops": {"activation_shards": run_config["ops"]["activation_shards"]}},
                                selection=[activation_shards])
        assert result.success
        checks = result.get_asset_check_evaluations()
        assert checks and all(c.passed for c in checks)
    shard_dirs = sorted(p for p in (tmp_path / "scratch" / "shards").iterdir() if not p.name.startswith("."))
    assert len(shard_dirs) == 2  # one content-hashed directory per machine slice

    result = dg.materialize([activation_shards, sae_checkpoint, inference_dump], partition_key="1", resources=resources,
                            instance=instance, selection=[sae_checkpoint, inference_dump],
                            run_config={"ops": {"sae_checkpoint": run_config["ops"]["sae_checkpoint"]}})
    assert result.success
    sae_md = result.asset_materializations_for_node("sae_checkpoint")[0].metadata
    run_id = sae_md["run_id"].value
    run_path = Path(sae_md["run_path"].value)
    assert (run_path / "checkpoint" / "sae.pt").is_file()
    assert (run_path / "links" / "train-shards").resolve() in [d.resolve() for d in shard_dirs]

    lineage = lineage_of_run(instance, run_id)
    train_dir = (run_path / "links" / "train-shards").resolve()
    assert lineage["shard_hash"] == train_dir.name
    assert lineage["val_shard_hash"] == (run_path / "links" / "val-shards").resolve().name
    assert lineage["model"] == "tiny-random:bert" and lineage["weights_sha256"]
    assert lineage["train_extraction"]["machine_id"] == 0 and lineage["val_extraction"]["machine_id"] == 1
    inf_md = result.asset_materializations_for_node("inference_dump")[0].metadata
    assert inf_md["shard_hash"].value == lineage["val_shard_hash"]
    assert (Path(inf_md["path"].value) / "patch_acts.npz").is_file()
    with pytest.raises(KeyError):
        lineage_of_run(instance, "no-such-run")


def test_new_checkpoint_sensor_requests_each_machine_once(resources: dict[str, object]) -> None:
    with dg.build_sensor_context(resources={"model_source": resources["model_source"]}) as context:
        requests = new_checkpoint_sensor(context)
        assert sorted(r.partition_key for r in requests) == ["0", "1"]
        assert len({r.run_key for r in requests}) == 2
        cursor = context.cursor
    with dg.build_sensor_context(cursor=cursor, resources={"model_source": resources["model_source"]}) as context:
        assert isinstance(new_checkpoint_sensor(context), dg.SkipReason)
    other = ModelSourceResource(model="tiny-random:gpt2")
    with dg.build_sensor_context(cursor=cursor, resources={"model_source": other}) as context:
        assert len(new_checkpoint_sensor(context)) == 2
