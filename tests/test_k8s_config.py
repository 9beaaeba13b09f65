"""deploy/k8s/*.yaml checked by dagster-k8s itself, without a cluster: the instance file through Dagster's
instance schema, the K8sRunLauncher's and the k8s_job_executor's config schemas and dagster-postgres's,
then the Kubernetes Job each step would get, built by dagster-k8s's own step handler and job builder
(which parse every field into kubernetes client models): GPU steps ask for `nvidia.com/gpu` through
their `dagster-k8s/config` op tag, every step mounts the shard and run roots. A typo fails here."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from .services import REPO, require

K8S = REPO / "deploy" / "k8s"
GPU_STEPS = ("machine_slices", "sae_checkpoint", "inference_dump")
CPU_STEPS = ("activation_shards", "sae_run")
PG_ENV = {"DAGSTER_PG_HOST": "postgres.actlake.svc", "DAGSTER_PG_PORT": "5432", "DAGSTER_PG_DB": "dagster",
          "DAGSTER_PG_USERNAME": "dagster", "DAGSTER_PG_PASSWORD": "secret"}

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _dagster_k8s() -> None:
    require("dagster-k8s (Python)", importlib.util.find_spec("dagster_k8s"), "pip install 'dagster-k8s==0.29.*'")


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / name).read_text(encoding="utf-8"))


def _check(schema: Any, value: Any, what: str) -> Any:
    """`value` processed by a Dagster config schema (defaults filled, env sources resolved); fails with its errors."""
    from dagster._config import process_config
    from dagster._config.config_type import ConfigType
    from dagster._config.field import resolve_to_config_type

    config_type = schema if isinstance(schema, ConfigType) else resolve_to_config_type(schema)
    result = process_config(config_type, value)
    assert result.success, f"{what}: " + "; ".join(e.message for e in result.errors or [])
    return result.value


def _kubeconfig(tmp_path: Path) -> Path:
    """A kubeconfig for an address nothing listens on: dagster-k8s loads it; nothing here connects."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": "https://127.0.0.1:9"}}],
        "users": [{"name": "test", "user": {"token": "unused"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "actlake"}}],
    }), encoding="utf-8")
    return path


def _launcher_and_handler(tmp_path: Path) -> tuple[Any, Any]:
    """The K8sRunLauncher of deploy/k8s/dagster.yaml and the step handler the k8s_job_executor of
    deploy/k8s/executor.yaml builds on it (kube config from a file instead of the cluster's)."""
    from dagster_k8s import K8sRunLauncher, k8s_job_executor

    outside = {"load_incluster_config": False, "kubeconfig_file": str(_kubeconfig(tmp_path))}
    launcher_cfg = _check(K8sRunLauncher.config_type(), _load("dagster.yaml")["run_launcher"]["config"], "run_launcher")
    launcher = K8sRunLauncher(**{**launcher_cfg, **outside})
    executor_cfg = _check(k8s_job_executor.config_schema.config_type,
                          {**_load("executor.yaml")["execution"]["config"], **outside}, "executor")
    executor = k8s_job_executor.executor_creation_fn(  # type: ignore[misc]
        SimpleNamespace(instance=SimpleNamespace(run_launcher=launcher), executor_config=executor_cfg))
    return launcher, executor._step_handler  # noqa: SLF001


def _step_job(launcher: Any, handler: Any, op: str, op_tags: dict[str, str]) -> dict[str, Any]:
    """The Kubernetes Job dagster-k8s would create for step `op` (K8sStepHandler.launch_step, minus the API call)."""
    import kubernetes
    from dagster._core.storage.dagster_run import DagsterRun
    from dagster_k8s.job import construct_dagster_k8s_job

    run = DagsterRun(job_name="extract_slices", run_id="4a1c5a7e-0000-4000-8000-000000000000")
    step_context = SimpleNamespace(
        execute_step_args=SimpleNamespace(step_keys_to_execute=[op]), dagster_run=run,
        instance=SimpleNamespace(run_launcher=launcher), step_tags={op: op_tags},
        get_step_context=lambda key: SimpleNamespace(step=SimpleNamespace(op_name=op)))
    context = handler._get_container_context(step_context)  # noqa: SLF001
    job_config = context.get_k8s_job_config(handler._executor_image, launcher)  # noqa: SLF001
    name = f"dagster-step-{op.replace('_', '-')}"
    job = construct_dagster_k8s_job(job_config=job_config, args=["dagster", "api", "execute_step"], job_name=name,
                                    pod_name=name, component="step_worker",
                                    user_defined_k8s_config=context.run_k8s_config, labels={}, env_vars=[])
    return kubernetes.client.ApiClient().sanitize_for_serialization(job)


def _op_tags() -> dict[str, dict[str, str]]:
    from actlake_dagster.definitions import build_defs
    from actlake_dagster.settings import GraphSettings

    defs = build_defs(GraphSettings(model="tiny-random:bert", device="cpu"))
    return {op: dict(defs.get_assets_def(op).op.tags) for op in GPU_STEPS + CPU_STEPS}


def test_instance_yaml_passes_dagster_and_its_plugins_schemas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster._core.instance.config import dagster_instance_config
    from dagster._core.storage.config import pg_config
    from dagster_k8s import K8sRunLauncher

    for var, value in PG_ENV.items():
        monkeypatch.setenv(var, value)
    shutil.copy(K8S / "dagster.yaml", tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))  # top-level keys, storage, concurrency
    assert config["run_launcher"]["module"] == "dagster_k8s" and config["run_launcher"]["class"] == "K8sRunLauncher"
    launcher = _check(K8sRunLauncher.config_type(), config["run_launcher"]["config"], "run_launcher")
    assert launcher["job_namespace"] == "actlake" and launcher["instance_config_map"] == "actlake-dagster-instance"
    pg = _check(pg_config(), config["storage"]["postgres"], "storage.postgres")
    assert pg["postgres_db"]["port"] == 5432 and pg["postgres_db"]["scheme"] == "postgresql+psycopg2"
    assert config["concurrency"]["pools"]["default_limit"] >= 1
    # the Postgres block is the one docs/deploy.md gives (and tests/test_postgres.py runs against a real server)
    assert config["storage"] == yaml.safe_load((REPO / "deploy" / "postgres" / "dagster.yaml").read_text())["storage"]


def test_gpu_steps_get_a_gpu_and_every_step_the_shared_roots(tmp_path: Path) -> None:
    launcher, handler = _launcher_and_handler(tmp_path)
    tags = _op_tags()
    for op in GPU_STEPS + CPU_STEPS:
        pod = _step_job(launcher, handler, op, tags[op])["spec"]["template"]["spec"]
        [container] = pod["containers"]
        resources = container["resources"]
        gpu = op in GPU_STEPS
        assert (resources["requests"].get("nvidia.com/gpu"), resources["limits"].get("nvidia.com/gpu")) == \
            (("1", "1") if gpu else (None, None)), (op, resources)
        assert resources["requests"]["cpu"] == "2", (op, resources)  # executor.yaml's step_k8s_config, deep-merged
        assert bool(pod.get("tolerations")) == gpu and bool(pod.get("nodeSelector")) == gpu, (op, pod)
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for var in ("SAEV_SCRATCH", "SAEV_NFS"):  # the roots are shared volumes mounted where the variables point
            assert mounts.get(env[var]) in volumes, (op, var, env[var], mounts)
            assert volumes[mounts[env[var]]]["persistentVolumeClaim"]["claimName"], volumes
        assert env["ACTLAKE_EXECUTOR"] == "k8s"
        config_dir = str(Path(env["ACTLAKE_EXECUTOR_CONFIG"]).parent)
        assert volumes[mounts[config_dir]]["configMap"]["name"] == "actlake-executor"
        assert container["image"] == "registry.example.com/actlake:0.1.0" and pod["serviceAccountName"]


def test_gpu_op_tag_is_dagster_k8s_config() -> None:
    from dagster_k8s.job import UserDefinedDagsterK8sConfig, get_user_defined_k8s_config

    from actlake_dagster.assets.keys import GPU_OP_TAGS

    tags = _op_tags()
    for op in GPU_STEPS:
        parsed = get_user_defined_k8s_config(tags[op])  # validates against dagster-k8s's tag schema
        assert parsed == UserDefinedDagsterK8sConfig.from_dict(GPU_OP_TAGS["dagster-k8s/config"])
        assert parsed.container_config["resources"]["requests"] == {"nvidia.com/gpu": "1"}
    for op in CPU_STEPS:
        assert get_user_defined_k8s_config(tags[op]).container_config == {}


def test_the_code_location_uses_the_k8s_executor_file(monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg

    from actlake_dagster.definitions import build_defs
    from actlake_dagster.executors import ExecutorChoice, build_executor
    from actlake_dagster.settings import GraphSettings

    monkeypatch.setenv("ACTLAKE_EXECUTOR", "k8s")
    monkeypatch.setenv("ACTLAKE_EXECUTOR_CONFIG", str(K8S / "executor.yaml"))
    executor = build_executor(ExecutorChoice.from_env())
    assert executor is not None and executor.name == "k8s"
    defs = build_defs(GraphSettings(model="tiny-random:bert", device="cpu"), executor=executor)
    dg.Definitions.validate_loadable(defs)
    job = defs.resolve_job_def("extract_slices")
    assert job.executor_def.name == "k8s"
    result = dg.validate_run_config(job, {})  # the file's config through the configured executor's schema
    assert result["execution"]["k8s"]["max_concurrent"] == 16


def test_a_typo_fails(tmp_path: Path) -> None:
    """What this file's checks catch: a misspelt launcher or executor field, a misspelt Kubernetes field."""
    from dagster._config import process_config
    from dagster._config.field import resolve_to_config_type
    from dagster_k8s import K8sRunLauncher, k8s_job_executor

    launcher = copy.deepcopy(_load("dagster.yaml")["run_launcher"]["config"])
    launcher["job_namespce"] = launcher.pop("job_namespace")
    assert not process_config(resolve_to_config_type(K8sRunLauncher.config_type()), launcher).success
    executor = copy.deepcopy(_load("executor.yaml")["execution"]["config"])
    executor["max_concurent"] = executor.pop("max_concurrent")
    assert not process_config(k8s_job_executor.config_schema.config_type, executor).success
    # container_config is free-form for Dagster; the Kubernetes model parse catches it when the Job is built
    launcher_def, handler = _launcher_and_handler(tmp_path)
    bad = {"container_config": {"resouces": {"requests": {"nvidia.com/gpu": "1"}}}}
    with pytest.raises(Exception, match="resouces"):
        _step_job(launcher_def, handler, "machine_slices", {"dagster-k8s/config": json.dumps(bad)})
