"""Executor selection ($ACTLAKE_EXECUTOR) and the Celery queue rule, without a broker (tests/test_celery.py
runs them on a real Redis with real workers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import dagster as dg
import pytest

from actlake.errors import ConfigError
from actlake_dagster.executors import CELERY_ENV_CONFIG, ExecutorChoice, build_executor, execution_config

from .services import REPO, require

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def celery() -> None:
    require("dagster-celery (Python)", importlib.util.find_spec("dagster_celery"), "pip install 'dagster-celery==0.29.*'")


def test_the_default_is_dagsters_multiprocess_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ACTLAKE_EXECUTOR", "ACTLAKE_EXECUTOR_CONFIG", "ACTLAKE_CELERY_MACHINE_QUEUE"):
        monkeypatch.delenv(var, raising=False)
    choice = ExecutorChoice.from_env()
    assert choice == ExecutorChoice(kind="multiprocess", config_file="", machine_queue="machine-{machine}")
    assert build_executor(choice) is None  # Definitions keep Dagster's default
    with pytest.raises(ConfigError, match="ACTLAKE_EXECUTOR"):
        ExecutorChoice(kind="slurm")
    with pytest.raises(ConfigError, match="machine"):
        ExecutorChoice(kind="celery", machine_queue="gpu")


def test_execution_config_reads_the_execution_block(tmp_path: Path) -> None:
    assert execution_config(REPO / "deploy" / "celery" / "celery.yaml") == CELERY_ENV_CONFIG  # the default, as a file
    bad = tmp_path / "bad.yaml"
    bad.write_text("broker: redis://x\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="execution: config:"):
        execution_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        execution_config(tmp_path / "missing.yaml")


def test_celery_executor_from_the_environment(celery: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from actlake_dagster.definitions import build_defs
    from actlake_dagster.settings import GraphSettings

    monkeypatch.delenv("ACTLAKE_CELERY_BROKER", raising=False)
    monkeypatch.delenv("ACTLAKE_CELERY_BACKEND", raising=False)
    with pytest.raises(ConfigError, match="ACTLAKE_CELERY_BROKER"):
        build_executor(ExecutorChoice(kind="celery"))
    monkeypatch.setenv("ACTLAKE_CELERY_BROKER", "redis://127.0.0.1:6399/0")
    executor = build_executor(ExecutorChoice(kind="celery"))
    assert executor is not None and executor.name == "celery"
    defs = build_defs(GraphSettings(model="tiny-random:bert", device="cpu"), executor=executor)
    dg.Definitions.validate_loadable(defs)
    config = dg.validate_run_config(defs.resolve_job_def("extract_slices"), {})["execution"]["celery"]
    # env sources resolved at run time; no backend set: a Redis broker is its own result backend
    assert config["broker"] == config["backend"] == "redis://127.0.0.1:6399/0"
    monkeypatch.setenv("ACTLAKE_CELERY_BACKEND", "redis://127.0.0.1:6399/1")
    defs = build_defs(GraphSettings(model="tiny-random:bert", device="cpu"),
                      executor=build_executor(ExecutorChoice(kind="celery")))
    config = dg.validate_run_config(defs.resolve_job_def("extract_slices"), {})["execution"]["celery"]
    assert config["backend"] == "redis://127.0.0.1:6399/1"
    monkeypatch.delenv("ACTLAKE_CELERY_BACKEND")
    monkeypatch.setenv("ACTLAKE_CELERY_BROKER", "pyamqp://guest@rabbit//")
    executor = build_executor(ExecutorChoice(kind="celery"))
    defs = build_defs(GraphSettings(model="tiny-random:bert", device="cpu"), executor=executor)
    assert dg.validate_run_config(defs.resolve_job_def("extract_slices"), {})["execution"]["celery"]["backend"] == "rpc://"


def test_celery_queue_of_each_step(celery: None) -> None:
    from actlake_dagster.assets.keys import GPU_OP_TAGS
    from actlake_dagster.celery_executor import machine_of_run, step_queue
    from actlake_dagster.partitions import GraphPartitions
    from actlake_dagster.settings import GraphSettings

    gpu = {"dagster-celery/queue": str(GPU_OP_TAGS["dagster-celery/queue"])}
    assert step_queue(gpu, "1", "dagster") == "machine-1"  # a machine partition: that machine's queue
    assert step_queue(gpu, "1", "dagster", "gpu-host-{machine}") == "gpu-host-1"
    assert step_queue(gpu, None, "dagster") == "gpu"  # other GPU steps (SAE training, inference): GPU workers
    assert step_queue({}, None, "dagster") == "dagster"  # CPU steps (merges, run directories)

    parts = GraphPartitions.from_settings(GraphSettings(num_machines=3))
    assert machine_of_run({"dagster/partition/machine": "2", "dagster/partition": "c|2"}, parts.per_machine) == "2"
    assert machine_of_run({"dagster/partition": "c|1"}, parts.per_machine) == "1"  # key only: parsed
    assert machine_of_run({"dagster/partition": "c|val"}, parts.per_split) is None
    assert machine_of_run({}, parts.per_machine) is None
