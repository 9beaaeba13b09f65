"""Which executor runs the graph's steps, chosen by $ACTLAKE_EXECUTOR when the code location loads.

- `multiprocess` (default): Dagster's default executor, every step a subprocess on the run's host.
- `celery`: dagster-celery on a real broker. The broker and the result backend are read at run time
  from $ACTLAKE_CELERY_BROKER and $ACTLAKE_CELERY_BACKEND (default: the broker when it is Redis, else
  `rpc://`); a machine partition's steps go to the queue `machine-<i>` ($ACTLAKE_CELERY_MACHINE_QUEUE,
  a template with `{machine}`), the other GPU steps to `gpu`, the rest to `dagster`
  (`celery_executor.py`).
- `k8s`: dagster-k8s's `k8s_job_executor`, one Kubernetes Job per step; GPU steps ask for a GPU
  through their `dagster-k8s/config` op tag.

$ACTLAKE_EXECUTOR_CONFIG names a YAML file whose `execution: config:` block configures the chosen
executor (the file `dagster-celery worker start -y FILE` reads too; `deploy/celery/celery.yaml`,
`deploy/k8s/executor.yaml`). The executor is configured here, so run config cannot change it.
The cluster packages are imported only when chosen (they are an optional extra).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from actlake.errors import ConfigError

EXECUTORS = ("multiprocess", "celery", "k8s")
#: the executor config used when $ACTLAKE_EXECUTOR=celery and no $ACTLAKE_EXECUTOR_CONFIG is given
#: (env sources: resolved at run time, and the URLs, which may hold passwords, stay out of run records)
CELERY_ENV_CONFIG = {"broker": {"env": "ACTLAKE_CELERY_BROKER"}, "backend": {"env": "ACTLAKE_CELERY_BACKEND"}}
CLUSTER_EXTRA = "pip install 'actlake[cluster]' (dagster-celery, dagster-postgres, dagster-k8s, redis)"


@dataclass(frozen=True)
class ExecutorChoice:
    """The executor the code location uses: its kind, an optional config file, the machine queue template."""

    kind: str = "multiprocess"
    config_file: str = ""
    machine_queue: str = "machine-{machine}"

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ConfigError(f"ACTLAKE_EXECUTOR must be one of {list(EXECUTORS)}, got {self.kind!r}")
        if "{machine}" not in self.machine_queue:
            raise ConfigError(f"ACTLAKE_CELERY_MACHINE_QUEUE must contain '{{machine}}', got {self.machine_queue!r}")

    @classmethod
    def from_env(cls) -> "ExecutorChoice":
        """$ACTLAKE_EXECUTOR, $ACTLAKE_EXECUTOR_CONFIG and $ACTLAKE_CELERY_MACHINE_QUEUE."""
        return cls(kind=os.environ.get("ACTLAKE_EXECUTOR", "").strip().lower() or "multiprocess",
                   config_file=os.environ.get("ACTLAKE_EXECUTOR_CONFIG", "").strip(),
                   machine_queue=os.environ.get("ACTLAKE_CELERY_MACHINE_QUEUE", "").strip() or "machine-{machine}")


def execution_config(path: str | Path) -> dict[str, Any]:
    """The `execution: config:` block of a YAML file (the shape of run config and of dagster-celery's `-y`)."""
    import yaml

    path = Path(path)
    try:
        parsed = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"ACTLAKE_EXECUTOR_CONFIG: cannot read {path}: {exc}") from None
    config = (parsed.get("execution") or {}).get("config") if isinstance(parsed, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(f"ACTLAKE_EXECUTOR_CONFIG: {path} has no `execution: config:` mapping")
    return config


def celery_env_config() -> dict[str, Any]:
    """Broker and backend from the environment; fails now (not at the first run) when no broker is set."""
    broker = os.environ.get("ACTLAKE_CELERY_BROKER", "").strip()
    if not broker:
        raise ConfigError("ACTLAKE_EXECUTOR=celery needs ACTLAKE_CELERY_BROKER (e.g. redis://host:6379/0) "
                          "or ACTLAKE_EXECUTOR_CONFIG")
    config: dict[str, Any] = dict(CELERY_ENV_CONFIG)
    if not os.environ.get("ACTLAKE_CELERY_BACKEND", "").strip():
        config["backend"] = CELERY_ENV_CONFIG["broker"] if broker.startswith(("redis://", "rediss://")) else "rpc://"
    return config


def build_executor(choice: ExecutorChoice) -> dg.ExecutorDefinition | None:
    """The executor definition for `choice` (None: Dagster's default multiprocess executor)."""
    if choice.kind == "multiprocess":
        if choice.config_file:
            return dg.multiprocess_executor.configured(execution_config(choice.config_file))
        return None
    try:
        if choice.kind == "celery":
            from .celery_executor import machine_queue_celery_executor

            config = execution_config(choice.config_file) if choice.config_file else celery_env_config()
            return machine_queue_celery_executor(choice.machine_queue).configured(config)
        from dagster_k8s import k8s_job_executor
    except ImportError as exc:
        raise ConfigError(f"ACTLAKE_EXECUTOR={choice.kind} needs {exc.name}: {CLUSTER_EXTRA}") from None
    return k8s_job_executor.configured(execution_config(choice.config_file)) if choice.config_file else k8s_job_executor
