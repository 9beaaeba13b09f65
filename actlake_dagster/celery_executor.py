"""dagster-celery's executor, with each machine partition's steps on a Celery queue of its own.

Why: dagster-celery picks a step's queue from the op tag `dagster-celery/queue` and nothing else
(`step.tags` are the op's tags; a run tag cannot override them), and one asset's op tags are the
same for every partition. The extraction of machine partition `i` must run on machine `i`'s
workers, so this executor reads the run's machine dimension (the run tag
`dagster/partition/machine`, else the run's partition key) and sends that run's steps to the
queue `machine-<i>` (the template `machine_queue`). Every other step keeps dagster-celery's own
rule: its `dagster-celery/queue` tag (`gpu` for the GPU steps, see `assets.keys.GPU_OP_TAGS`), else
the default queue `dagster`.

Everything else (task submission, the broker, the result backend, priorities, retries, the
worker CLI `dagster-celery worker start`) is dagster-celery's, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import dagster as dg
from dagster._core.definitions.executor_definition import multiple_process_executor_requirements
from dagster._core.execution.retries import RetryMode
from dagster_celery.executor import CELERY_CONFIG, CeleryExecutor
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG

#: the run tag Dagster puts on a run of one partition of a multi-partitioned job, one per dimension
MACHINE_TAG = "dagster/partition/machine"
PARTITION_TAG = "dagster/partition"
MACHINE_DIMENSION = "machine"
#: where a machine partition's steps go; `{machine}` is the partition's machine index
DEFAULT_MACHINE_QUEUE = "machine-{machine}"


def step_queue(step_tags: Mapping[str, str], machine: str | None, default_queue: str,
               machine_queue: str = DEFAULT_MACHINE_QUEUE) -> str:
    """The Celery queue of one step: the machine's queue for a run of a machine partition, else the
    step's `dagster-celery/queue` tag, else `default_queue` (dagster-celery's own rule)."""
    if machine is not None and machine_queue:
        return machine_queue.format(machine=machine)
    return step_tags.get(DAGSTER_CELERY_QUEUE_TAG, default_queue)


def machine_of_run(run_tags: Mapping[str, str], partitions_def: dg.PartitionsDefinition | None) -> str | None:
    """The machine dimension of the run's partition, or None when the run is not of a machine partition.

    Runs launched for a partition (UI, sensors, backfills, `dagster asset materialize --partition`)
    carry one tag per dimension; a run started with only `dagster/partition` is parsed with the
    job's partitions definition.
    """
    if MACHINE_TAG in run_tags:
        return run_tags[MACHINE_TAG]
    key = run_tags.get(PARTITION_TAG)
    if key is None or not isinstance(partitions_def, dg.MultiPartitionsDefinition):
        return None
    if MACHINE_DIMENSION not in partitions_def.partition_dimension_names:
        return None
    return partitions_def.get_partition_key_from_str(key).keys_by_dimension[MACHINE_DIMENSION]


class MachineQueueCeleryExecutor(CeleryExecutor):
    """A `CeleryExecutor` whose step submission routes a machine partition's steps to that machine's queue."""

    def __init__(self, machine_queue: str = DEFAULT_MACHINE_QUEUE, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.machine_queue = machine_queue

    def execute(self, plan_context: Any, execution_plan: Any) -> Iterator[dg.DagsterEvent]:
        from dagster_celery.core_execution_loop import core_celery_execution_loop
        from dagster_celery.executor import _submit_task

        job_def = plan_context.job.get_definition()
        machine = machine_of_run(plan_context.dagster_run.tags, job_def.partitions_def)

        def submit(app: Any, context: Any, step: Any, queue: str, priority: int, known_state: Any) -> Any:
            routed = step_queue(step.tags, machine, queue, self.machine_queue)
            if routed != queue:  # dagster-celery has just logged the op tag's queue: say where it really goes
                context.log.info(f'Step "{step.key}" of machine partition {machine} goes to queue "{routed}" '
                                 f'(instead of "{queue}").')
            return _submit_task(app, context, step, routed, priority, known_state)

        return core_celery_execution_loop(plan_context, execution_plan, step_execution_fn=submit)


def machine_queue_celery_executor(machine_queue: str = DEFAULT_MACHINE_QUEUE) -> dg.ExecutorDefinition:
    """dagster-celery's `celery` executor (same name, same config schema: broker, backend, include,
    config_source, retries), routing machine partitions to `machine_queue.format(machine=i)`."""

    @dg.executor(name="celery", config_schema=CELERY_CONFIG, requirements=multiple_process_executor_requirements())
    def celery_executor(init_context: dg.InitExecutorContext) -> dg.Executor:
        cfg = init_context.executor_config
        return MachineQueueCeleryExecutor(
            machine_queue=machine_queue, broker=cfg.get("broker"), backend=cfg.get("backend"),
            config_source=cfg.get("config_source"), include=cfg.get("include"),
            retries=RetryMode.from_config(cfg["retries"]),  # type: ignore[arg-type]
        )

    return celery_executor
