"""The Dagster code location: definitions, automation conditions, the checkpoint sensor, the GPU resource,
and the whole graph materialized on a real sqlite instance with exact lineage."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import dagster as dg
import pytest

from actlake_dagster.assets.keys import GPU_OP_TAGS, GPU_POOL
from actlake_dagster.automation import build_checkpoint_sensor
from actlake_dagster.definitions import build_defs
from actlake_dagster.partitions import checkpoint_partitions, layer_key, slice_key, split_key
from actlake_dagster.records import DATA_VERSION_TAG
from actlake_dagster.resources import CheckpointsResource, DeviceResource, SAETrainingResource, StorageRootsResource
from actlake_dagster.settings import GraphSettings

pytestmark = [pytest.mark.filterwarnings("ignore::dagster.BetaWarning"),
              pytest.mark.filterwarnings("ignore::dagster.PreviewWarning")]
warnings.filterwarnings("ignore", message=".*is currently in beta.*")

SMALL = GraphSettings(model="tiny-random:bert", data="builtin:stdlib-docs", limit=24, max_seq_len=16, batch_size=8,
                      num_machines=2, layers=(0, 1), val_fraction=0.25, device="cpu")
DOWNSTREAM = ("machine_slices", "activation_shards", "sae_run", "sae_checkpoint", "inference_dump")


def test_definitions_load_and_read_left_to_right() -> None:
    defs = build_defs(SMALL)
    dg.Definitions.validate_loadable(defs)
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    assert set(specs) == {"model_checkpoint", *DOWNSTREAM}
    assert specs["machine_slices"].group_name == "extraction" and specs["sae_run"].group_name == "sae"
    graph = defs.resolve_asset_graph()
    parents = {k.to_user_string(): {p.to_user_string() for p in graph.get(k).parent_keys} for k in graph.get_all_asset_keys()}
    assert parents["machine_slices"] == {"model_checkpoint"}
    assert parents["activation_shards"] == {"machine_slices"}
    assert parents["sae_run"] == {"activation_shards"}
    assert parents["sae_checkpoint"] == {"sae_run"} and parents["inference_dump"] == {"sae_checkpoint"}
    for key in ("machine_slices", "sae_checkpoint", "inference_dump"):
        node = graph.get(dg.AssetKey(key))
        assert node.pools == {GPU_POOL}
        assert json.loads(defs.get_assets_def(key).op.tags["dagster-k8s/config"]) == GPU_OP_TAGS["dagster-k8s/config"]
    dims = graph.get(dg.AssetKey("machine_slices")).partitions_def.partitions_defs  # type: ignore[union-attr]
    assert [d.name for d in dims] == ["checkpoint", "machine"]
    assert build_defs(GraphSettings(num_machines=3, layers=(2,))).resolve_job_def(
        "extract_slices").partitions_def.get_partition_keys(dynamic_partitions_store=_store(["c"])) == [  # type: ignore[union-attr]
        "c|0", "c|1", "c|2"]


def _store(keys: list[str]) -> dg.DagsterInstance:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(checkpoint_partitions.name or "checkpoints", keys)
    return instance


def _requested(result: dg.AutomationResult | object) -> dict[str, list[str]]:  # type: ignore[name-defined]
    out = {}
    for key in DOWNSTREAM:
        parts = sorted(result.get_requested_partitions(dg.AssetKey(key)))  # type: ignore[attr-defined]
        if parts:
            out[key] = parts
    return out


def test_automation_fires_on_new_or_changed_data_only() -> None:
    """New checkpoint: one extraction per machine, then one merge per split, one training per layer.
    Unchanged re-extraction (same data versions) or an unchanged observation: nothing."""
    defs = build_defs(SMALL)
    instance = dg.DagsterInstance.ephemeral()

    def observe(ckpt: str, version: str) -> None:
        instance.report_runless_asset_event(dg.AssetObservation("model_checkpoint", partition=ckpt,
                                                                tags={DATA_VERSION_TAG: version}))

    def materialize(key: str, pk: str, version: str) -> None:
        instance.report_runless_asset_event(dg.AssetMaterialization(key, partition=pk, tags={DATA_VERSION_TAG: version}))

    def tick(cursor: object = None) -> tuple[dict[str, list[str]], object]:
        result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        return _requested(result), result.cursor

    instance.add_dynamic_partitions("checkpoints", ["a"])  # present before the first tick: still filled
    observe("a", "weights-1")
    req, cursor = tick()
    assert req == {"machine_slices": ["a|0", "a|1"]}
    for m in "01":
        materialize("machine_slices", slice_key("a", m), f"slices-{m}")
    req, cursor = tick(cursor)
    assert req == {"activation_shards": ["a|train", "a|val"]}
    for split in ("train", "val"):
        materialize("activation_shards", split_key("a", split), f"hash-{split}")
    req, cursor = tick(cursor)
    assert req == {"sae_run": ["a|0", "a|1"], "sae_checkpoint": ["a|0", "a|1"], "inference_dump": ["a|0", "a|1"]}
    for layer in "01":
        for key in ("sae_run", "sae_checkpoint", "inference_dump"):
            materialize(key, layer_key("a", layer), f"{key}-{layer}")
    req, cursor = tick(cursor)
    assert req == {}
    for m in "01":  # an unchanged re-extraction: same content hashes
        materialize("machine_slices", slice_key("a", m), f"slices-{m}")
    observe("a", "weights-1")
    for _ in range(2):
        req, cursor = tick(cursor)
        assert req == {}
    materialize("machine_slices", slice_key("a", "1"), "slices-1-changed")  # changed content: only its merges
    req, cursor = tick(cursor)
    assert req == {"activation_shards": ["a|train", "a|val"]}
    instance.add_dynamic_partitions("checkpoints", ["b"])
    observe("b", "weights-2")
    req, cursor = tick(cursor)
    assert req.get("machine_slices") == ["b|0", "b|1"]


def _save_checkpoint(root: Path, name: str, seed: int) -> Path:
    import torch

    from actlake.extract.models import load_model

    loaded = load_model("tiny-random:bert", device="cpu")
    if seed:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in loaded.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    out = root / name
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return out


def test_checkpoint_sensor_adds_partitions_and_hashes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import actlake_dagster.checkpoints as ck

    root = tmp_path / "checkpoints"
    _save_checkpoint(root, "step-000100", 0)
    (root / "not-a-checkpoint").mkdir()
    calls: list[Path] = []
    real = ck.file_sha256
    monkeypatch.setattr(ck, "file_sha256", lambda p: calls.append(Path(p)) or real(p))
    resource = CheckpointsResource(root=str(root), hash_cache=str(tmp_path / "cache.json"))
    sensor = build_checkpoint_sensor(running=False)
    instance = dg.DagsterInstance.ephemeral()

    def tick(cursor: str | None) -> tuple[dg.SensorResult, str | None]:
        with dg.build_sensor_context(instance=instance, cursor=cursor, resources={"checkpoints": resource}) as ctx:
            result = sensor(ctx)
            for req in result.dynamic_partitions_requests or []:
                instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys or []))
            return result, ctx.cursor

    result, cursor = tick(None)
    assert [list(r.partition_keys or []) for r in result.dynamic_partitions_requests] == [["step-000100"]]
    [obs] = result.asset_events
    from actlake.extract.models import weights_sha256

    assert obs.tags[DATA_VERSION_TAG] == weights_sha256(root / "step-000100")[0]  # what the extraction records
    hashed = len(calls)
    assert hashed >= 1
    result, cursor = tick(cursor)
    assert not result.dynamic_partitions_requests and not result.asset_events
    fresh = CheckpointsResource(root=str(root), hash_cache=str(tmp_path / "cache.json"))  # a new process: cache file
    assert fresh.weights_sha256(fresh.all()[0]) == obs.tags[DATA_VERSION_TAG]
    assert len(calls) == hashed  # unchanged files are never read again
    _save_checkpoint(root, "step-000200", 1)
    result, cursor = tick(cursor)
    assert [list(r.partition_keys or []) for r in result.dynamic_partitions_requests] == [["step-000200"]]
    assert [e.partition for e in result.asset_events] == ["step-000200"]
    assert sorted(instance.get_dynamic_partitions("checkpoints")) == ["step-000100", "step-000200"]


def test_device_resource_gives_each_step_its_own_gpu(tmp_path: Path) -> None:
    a, b, c = (DeviceResource(device="auto", lock_dir=str(tmp_path)) for _ in range(3))
    assert a._claim_gpu(2) == "cuda:0"
    assert b._claim_gpu(2) == "cuda:1"
    a.teardown_after_execution(None)  # type: ignore[arg-type]
    assert c._claim_gpu(2) == "cuda:0"
    b.teardown_after_execution(None)  # type: ignore[arg-type]
    c.teardown_after_execution(None)  # type: ignore[arg-type]
    with dg.build_init_resource_context() as ctx:
        cpu = DeviceResource(device="auto")
        cpu.setup_for_execution(ctx)
        import torch

        assert cpu.name == ("cpu" if not torch.cuda.is_available() else cpu.name)


@pytest.fixture
def graph_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Roots and a persistent sqlite instance under tmp_path, as `actlake demo` would use them."""
    paths = {"scratch": tmp_path / "scratch", "nfs": tmp_path / "nfs", "home": tmp_path / "dagster",
             "checkpoints": tmp_path / "checkpoints"}
    for var in ("SAEV_SCRATCH", "SAEV_NFS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ACTLAKE_SCRATCH", str(paths["scratch"]))
    monkeypatch.setenv("ACTLAKE_NFS", str(paths["nfs"]))
    monkeypatch.setenv("DAGSTER_HOME", str(paths["home"]))
    _save_checkpoint(paths["checkpoints"], "step-000100", 0)
    return paths


def test_graph_materializes_with_exact_lineage(graph_env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The whole graph on a real sqlite instance; lineage from files and from the instance agree with the disk;
    a second pass writes nothing and names the first writers; automation then requests nothing, and a new
    checkpoint directory requests exactly one extraction per machine."""
    import actlake
    from actlake.cli import main
    from actlake.hashing import file_sha256
    from actlake.lineage import lineage_from_files
    from actlake.runs import open_run, runs_root, shards_root
    from actlake_dagster.demo import materialize_graph, observe_checkpoints
    from actlake_dagster.instance import open_instance
    from actlake_dagster.lineage import instance_lineage

    settings = GraphSettings(**{**SMALL.__dict__, "checkpoints_root": str(graph_env["checkpoints"]), "model": ""})
    resources = {"checkpoints": CheckpointsResource(root=str(graph_env["checkpoints"])),
                 "device": DeviceResource(device="cpu"), "storage": StorageRootsResource(),
                 "sae": SAETrainingResource(k=4, expansion=2, epochs=2, batch_size=64)}
    defs = build_defs(settings, resources)
    instance = open_instance(graph_env["home"])
    first = materialize_graph(defs, settings, instance, say=lambda _: None)
    assert first.checkpoints == ["step-000100"] and len(first.runs) == 2 + 2 + 2
    assert all(by == run_id for _, _, run_id, by in first.runs)  # the first pass wrote everything

    merged = sorted(p for p in shards_root().iterdir() if not p.name.startswith("."))
    assert len(merged) == 2  # one content-hashed directory per split
    with actlake.open(merged[0]) as a, actlake.open(merged[1]) as b:
        assert a.n_samples + b.n_samples == SMALL.limit
    runs = sorted(p for p in runs_root().iterdir() if p.is_dir())
    assert len(runs) == 2  # one run directory per layer
    run = open_run(runs[-1])
    for name in ("train-shards", "val-shards", "train-dataset", "val-dataset"):
        target = (run.links_dir / name).resolve()
        assert target.exists() and str(target).startswith(str(graph_env["scratch"].resolve())), name
    assert {(run.links_dir / "train-shards").resolve(), (run.links_dir / "val-shards").resolve()} == set(merged)

    lineage = lineage_from_files(run.path)
    assert lineage["sae_checkpoint"]["sha256"] == file_sha256(run.sae_path)
    assert lineage["train_shards"]["shard_hash"] == (run.links_dir / "train-shards").resolve().name
    from actlake.extract.models import weights_sha256

    assert lineage["checkpoint"]["weights_sha256"] == weights_sha256(graph_env["checkpoints"] / "step-000100")[0]
    recorded = instance_lineage(instance, run.run_id)
    assert recorded is not None
    writers = {r[2] for r in first.runs}
    assert recorded["sae_checkpoint"]["written_by_run"] in writers
    assert recorded["train_shards"]["shard_hash"] == lineage["train_shards"]["shard_hash"]
    assert len(recorded["train_shards"]["machine_slices"]) == 2
    assert recorded["checkpoint"]["weights_sha256"] == lineage["checkpoint"]["weights_sha256"]

    second = materialize_graph(defs, settings, instance, say=lambda _: None)  # nothing changed: no-ops
    assert all(by != run_id and by in writers for _, _, run_id, by in second.runs)
    again = instance_lineage(instance, run.run_id)
    assert again is not None and again["sae_checkpoint"]["written_by_run"] == recorded["sae_checkpoint"]["written_by_run"]
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    assert result.total_requested == 0

    # the CLI: by Dagster run id (the sae run's writer), then the reverse query by shard hash
    dagster_run = recorded["sae_checkpoint"]["written_by_run"]
    assert main(["lineage", dagster_run, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["run_id"] == run.run_id and out["dagster"]["sae_checkpoint"]["written_by_run"] == dagster_run
    assert main(["lineage", "--shards", lineage["train_shards"]["shard_hash"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["run_id"] for r in out["runs"]) == sorted(p.name for p in runs)
    assert main(["lineage", str(run.path)]) == 0
    assert lineage["train_shards"]["shard_hash"] in capsys.readouterr().out

    _save_checkpoint(graph_env["checkpoints"], "step-000200", 1)
    observe_checkpoints(defs, instance)
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert _requested(result) == {"machine_slices": ["step-000200|0", "step-000200|1"]}


def test_demo_runs_the_graph_and_prints_lineage_that_matches_the_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`actlake demo` (the README's first command) on the packaged MiniLM, kept small by the documented
    ACTLAKE_* settings: every step is a Dagster run on a persistent instance under ./actlake-data, and the
    printed lineage names the shard directories, sae.pt and weights actually on disk."""
    import re

    from actlake.cli import main
    from actlake.extract.models import minilm_dir, weights_sha256
    from actlake.hashing import file_sha256

    for var in ("SAEV_SCRATCH", "SAEV_NFS", "ACTLAKE_SCRATCH", "ACTLAKE_NFS", "DAGSTER_HOME", "ACTLAKE_MODEL",
                "ACTLAKE_CHECKPOINTS"):
        monkeypatch.setenv(var, "")  # recorded, so the demo's own setting of DAGSTER_HOME is undone after
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    for var, value in {"ACTLAKE_LIMIT": "10", "ACTLAKE_MAX_SEQ_LEN": "12", "ACTLAKE_LAYERS": "2,4"}.items():
        monkeypatch.setenv(var, value)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    home = tmp_path / "actlake-data"
    assert (home / "dagster" / "dagster.yaml").is_file()
    assert len(re.findall(r"^\[ ?\d+/6\] ", out, flags=re.M)) == 6  # one progress line per Dagster run
    run_id = re.search(r"lineage (minilm-l4-[0-9a-f]{12})", out).group(1)  # type: ignore[union-attr]
    from actlake.runs import runs_root, shards_root

    run = (tmp_path / runs_root()) / run_id  # the default roots: ./actlake-data/saev/{runs,shards}
    assert file_sha256(run / "checkpoint" / "sae.pt") in out
    for link in ("train-shards", "val-shards"):
        target = (run / "links" / link).resolve()
        assert target.parent == (tmp_path / shards_root()).resolve() and target.name in out
        assert (target / "labels.bin").is_file()
    assert weights_sha256(minilm_dir())[0] in out
    assert (run / "links" / "train-dataset").resolve().is_dir()
    assert "actlake ui" in out and f"lineage {run_id}" in out
    assert main(["lineage", run_id, "--json"]) == 0  # the printed command, from the same folder
    printed = json.loads(capsys.readouterr().out)
    assert printed["train_shards"]["shard_hash"] == (run / "links" / "train-shards").resolve().name
