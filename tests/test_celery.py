"""The extraction on Celery for real: a Redis broker on loopback, two dagster-celery workers each on the
queue of one machine (`machine-0`, `machine-1`), two machine partitions launched with
`dagster asset materialize` on the code location with ACTLAKE_EXECUTOR=celery. Each partition must run
on its own machine's worker, and the merged shard directories must have the same names (content
hashes) and bytes as a single-process run of the same partitions."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .services import BIN, REPO, Processes, clean_env, free_port, require, tail, wait_until

MODEL, CHECKPOINT = "tiny-random:bert", "tiny-random-bert"
#: the graph the code location loads in every process (launchers and workers): kept tiny
GRAPH_ENV = {"ACTLAKE_MODEL": MODEL, "ACTLAKE_DATA": "builtin:stdlib-docs", "ACTLAKE_LIMIT": "24",
             "ACTLAKE_MAX_SEQ_LEN": "16", "ACTLAKE_BATCH_SIZE": "8", "ACTLAKE_NUM_MACHINES": "2",
             "ACTLAKE_LAYERS": "0,1", "ACTLAKE_VAL_FRACTION": "0.25", "ACTLAKE_DEVICE": "cpu",
             "ACTLAKE_AUTOMATION": "off"}
CELERY_YAML = REPO / "deploy" / "celery" / "celery.yaml"
RUN_TIMEOUT_S = 240.0
PROVENANCE = "provenance.json"


def _redis_pong(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


def _start_redis(procs: Processes, tmp: Path) -> int:
    """redis-server on a free loopback port, no persistence; the port once it answers PING."""
    redis = shutil.which("redis-server") or "/usr/bin/redis-server"
    for attempt in range(3):  # a free port can be taken between probing and binding
        port, log = free_port(), tmp / f"redis-{attempt}.log"
        proc = procs.start("redis", [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--daemonize", "no"], log, cwd=tmp)
        try:
            wait_until(lambda: _redis_pong(port), 20, "redis-server", log, proc)
            return port
        except AssertionError:
            procs.stop(proc)
            if "already in use" not in tail(log).lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under a merged directory, by relative path; provenance.json (outside the content
    hash: where and when it was written) is compared without its roots and its creation time."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name == "checksums.json":  # lists provenance.json too: compared without it
            files = [e for e in json.loads(p.read_text())["files"] if e[0] != PROVENANCE]
            out[str(p.relative_to(root))] = hashlib.sha256(json.dumps(files).encode()).hexdigest()
        elif p.is_file() and p.name != PROVENANCE:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _provenance(merged: Path, scratch: Path) -> dict[str, object]:
    prov = json.loads((merged / PROVENANCE).read_text(encoding="utf-8").replace(str(scratch.resolve()), "<scratch>"))
    prov.pop("created_at")
    return prov


def _merge_in_process(instance: object, scratch: Path, nfs: Path, extract: bool) -> dict[str, Path]:
    """Merge both splits of the checkpoint on `instance` (extracting both machines first when `extract`),
    in this process; the merged directory of each split."""
    import dagster as dg

    from actlake_dagster.definitions import build_defs
    from actlake_dagster.partitions import SPLITS, slice_key, split_key
    from actlake_dagster.resources import CheckpointsResource, DeviceResource, SAETrainingResource, StorageRootsResource
    from actlake_dagster.settings import GraphSettings

    settings = GraphSettings(model=MODEL, data="builtin:stdlib-docs", limit=24, max_seq_len=16, batch_size=8,
                             num_machines=2, layers=(0, 1), val_fraction=0.25, device="cpu", automation=False)
    resources = {"checkpoints": CheckpointsResource(model=MODEL), "device": DeviceResource(device="cpu"),
                 "storage": StorageRootsResource(scratch=str(scratch), nfs=str(nfs)), "sae": SAETrainingResource()}
    defs = build_defs(settings, resources)
    assert isinstance(instance, dg.DagsterInstance)
    if extract:
        for m in range(settings.num_machines):
            defs.resolve_job_def("extract_slices").execute_in_process(partition_key=slice_key(CHECKPOINT, m),
                                                                      instance=instance)
    out = {}
    for split in SPLITS:
        result = defs.resolve_job_def("merge_shards").execute_in_process(partition_key=split_key(CHECKPOINT, split),
                                                                         instance=instance)
        [mat] = result.get_asset_materialization_events()
        out[split] = Path(str(mat.materialization.metadata["path"].value))
    return out


@pytest.mark.slow
def test_celery_runs_each_machine_partition_on_its_own_worker(tmp_path: Path) -> None:
    import dagster as dg
    from dagster._core.events import DagsterEventType

    from actlake_dagster.partitions import CHECKPOINTS

    require("redis-server", shutil.which("redis-server") or Path("/usr/bin/redis-server").exists(),
            "apt-get install -y redis-server")
    require("dagster-celery and redis (Python)",
            importlib.util.find_spec("dagster_celery") and importlib.util.find_spec("redis"),
            "pip install 'dagster-celery==0.29.*' 'redis>=6.4'")
    timings: dict[str, float] = {}
    t_start = time.monotonic()
    home, scratch, nfs = tmp_path / "dagster", tmp_path / "scratch", tmp_path / "nfs"
    for d in (home, scratch, nfs):
        d.mkdir()
    # the instance launchers and workers share (sqlite under a temp DAGSTER_HOME); two gpu pool slots so both
    # machines' steps may run at once (on a cluster: the number of GPUs)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nnux:\n  enabled: false\n"
                                       "concurrency:\n  pools:\n    default_limit: 2\n", encoding="utf-8")
    instance = dg.DagsterInstance.from_config(str(home))
    instance.add_dynamic_partitions(CHECKPOINTS, [CHECKPOINT])  # what the checkpoint sensor would do

    procs = Processes()
    runs: dict[str, str] = {}
    try:
        port = _start_redis(procs, tmp_path)
        timings["redis"] = time.monotonic() - t_start
        env = clean_env({**GRAPH_ENV, "DAGSTER_HOME": str(home), "ACTLAKE_SCRATCH": str(scratch),
                         "ACTLAKE_NFS": str(nfs), "ACTLAKE_EXECUTOR": "celery",
                         "ACTLAKE_CELERY_BROKER": f"redis://127.0.0.1:{port}/0",
                         "ACTLAKE_CELERY_BACKEND": f"redis://127.0.0.1:{port}/1"})

        # two workers, one queue each, started the documented way (the executor block of deploy/celery/celery.yaml)
        t = time.monotonic()
        workers = {}
        for m in ("0", "1"):
            log = tmp_path / f"worker-{m}.log"
            proc = procs.start(f"worker-{m}", [str(BIN / "dagster-celery"), "worker", "start", "-A", "dagster_celery.app",
                                               "-y", str(CELERY_YAML), "-q", f"machine-{m}", "-n", f"machine-{m}",
                                               "--", "--pool=solo"], log, env=env)
            workers[m] = (proc, log)
        for m, (proc, log) in workers.items():
            wait_until(lambda log=log, m=m: f"machine-{m}@" in tail(log) and " ready." in tail(log),
                       90, f"celery worker machine-{m}", log, proc)
        timings["workers ready"] = time.monotonic() - t

        # both machine partitions at once, each its own run launched from the code location's module
        t = time.monotonic()
        launches = {}
        for m in ("0", "1"):
            log = tmp_path / f"launch-{m}.log"
            launches[m] = (procs.start(f"launch-{m}", [str(BIN / "dagster"), "asset", "materialize", "-m",
                                                       "actlake_dagster.definitions", "--select", "machine_slices",
                                                       "--partition", f"{CHECKPOINT}|{m}"], log, env=env), log)
        for m, (proc, log) in launches.items():
            try:
                rc = proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - t)))
            except subprocess.TimeoutExpired:
                rc = None
            assert rc == 0, (f"launch of machine {m} ended {rc}:\n{tail(log)}\n--- worker {m}:\n"
                             f"{tail(workers[m][1])}")
        timings["both partitions on celery"] = time.monotonic() - t

        # which worker ran which partition: the step events the workers wrote into the instance
        for record in instance.get_run_records():
            run = record.dagster_run
            machine = run.tags.get("dagster/partition/machine")
            assert run.status == dg.DagsterRunStatus.SUCCESS and machine in ("0", "1"), (run.run_id, run.status, run.tags)
            events = [e.dagster_event for e in instance.all_logs(run.run_id, of_type=DagsterEventType.ENGINE_EVENT)]
            ran_on = [str(e.engine_event_data.metadata["Celery worker"].value) for e in events
                      if e is not None and "Celery worker" in e.engine_event_data.metadata]
            assert len(ran_on) == 1 and ran_on[0].startswith(f"machine-{machine}@"), (machine, ran_on)
            logs = {e.message for e in instance.all_logs(run.run_id)}
            assert f'Step "machine_slices" of machine partition {machine} goes to queue "machine-{machine}" ' \
                   f'(instead of "gpu").' in logs
            runs[machine] = f"{ran_on[0]} (run {run.run_id[:8]})"
        assert sorted(runs) == ["0", "1"], runs
        for m, (_, log) in workers.items():  # and from the workers' side: one task each, of its own run
            text = tail(log, 10**7)
            assert len(re.findall(r"Task execute_plan\[[^]]+\] succeeded in ", text)) == 1, tail(log)
            assert runs[m].split("run ")[1][:8] in text
    finally:
        procs.stop_all()
    timings["services stopped"] = time.monotonic() - t_start

    # merge what the workers wrote, here; the same partitions extracted and merged in one process elsewhere
    t = time.monotonic()
    merged = _merge_in_process(instance, scratch, nfs, extract=False)
    instance.dispose()
    single = dg.DagsterInstance.ephemeral()
    single.add_dynamic_partitions(CHECKPOINTS, [CHECKPOINT])
    reference = _merge_in_process(single, tmp_path / "ref" / "scratch",
                                  tmp_path / "ref" / "nfs", extract=True)
    timings["merge + single-process reference"] = time.monotonic() - t
    for split in ("train", "val"):
        assert merged[split].is_relative_to(scratch) and reference[split].is_relative_to(tmp_path / "ref")
        assert merged[split].name == reference[split].name, (split, merged[split], reference[split])
        assert _tree_digest(merged[split]) == _tree_digest(reference[split]), split
        assert _provenance(merged[split], scratch) == _provenance(reference[split], tmp_path / "ref" / "scratch")
    timings["total"] = time.monotonic() - t_start
    print(f"celery: machine partition -> worker {runs}; timings (s) { {k: round(v, 1) for k, v in timings.items()} }")
