"""The instance on a real Postgres (dagster-postgres): a temporary cluster (`initdb`, `postgres` on a free
loopback port, as an unprivileged user), DAGSTER_HOME holding deploy/postgres/dagster.yaml as documented,
the graph of one layer materialized on it, and `actlake lineage` answered from that instance."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from .services import REPO, Processes, free_port, require, tail, wait_until

PG_YAML = REPO / "deploy" / "postgres" / "dagster.yaml"
PG_USER, PG_DB = "actlake", "actlake_dagster"


def _pg_bindir() -> Path | None:
    """Debian's server binaries (/usr/lib/postgresql/<version>/bin), the newest version; else initdb on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _os_user() -> str | None:
    """Who runs the server: None (this user) unless we are root, which Postgres refuses; then the Debian
    package's `postgres` user, else a system user created here."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "actlake-pg"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "actlake-pg"],
                   check=True, capture_output=True)
    return "actlake-pg"


def _run(procs: Processes, name: str, cmd: list[str], log: Path, cwd: Path, user: str | None,
         timeout_s: float = 120) -> None:
    proc = procs.start(name, cmd, log, env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"}, cwd=cwd, user=user)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    procs.stop(proc)
    assert rc == 0, f"{name} ended {rc}:\n{tail(log)}"


@pytest.mark.slow
def test_postgres_instance_materializes_and_answers_lineage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    bindir = _pg_bindir()
    require("PostgreSQL server (initdb, postgres)", bindir, "apt-get install -y postgresql")
    require("dagster-postgres (Python)", importlib.util.find_spec("dagster_postgres"),
            "pip install 'dagster-postgres==0.29.*'")
    assert bindir is not None
    import psycopg2

    timings: dict[str, float] = {}
    t_start = time.monotonic()
    user = _os_user()
    # not tmp_path: its parents are private to this user, and the server runs as another one
    pgroot = Path(tempfile.mkdtemp(prefix="actlake-pg-"))
    procs = Processes()
    instance = None
    try:
        sock = pgroot / "sock"
        sock.mkdir()
        if user is not None:
            entry = pwd.getpwnam(user)
            for path in (pgroot, sock):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        _run(procs, "initdb", [str(bindir / "initdb"), "-D", str(pgroot / "data"), "-U", PG_USER, "--auth=trust",
                               "-E", "UTF8", "--locale=C", "--no-sync"], tmp_path / "initdb.log", pgroot, user)
        port = free_port()
        server_log = tmp_path / "postgres.log"
        server = procs.start("postgres", [str(bindir / "postgres"), "-D", str(pgroot / "data"), "-k", str(sock),
                                          "-p", str(port), "-h", "127.0.0.1", "-F"],
                             server_log, env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"}, cwd=pgroot, user=user)

        def connect(db: str = "postgres") -> "psycopg2.extensions.connection":
            return psycopg2.connect(host="127.0.0.1", port=port, user=PG_USER, dbname=db, connect_timeout=2)

        def accepts() -> bool:
            try:
                connect().close()
            except psycopg2.OperationalError:
                return False
            return True

        wait_until(accepts, 60, "postgres", server_log, server)
        conn = connect()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {PG_DB}")
        conn.close()
        timings["postgres ready"] = time.monotonic() - t_start

        # the instance: DAGSTER_HOME with the documented dagster.yaml, credentials from the environment
        home = tmp_path / "dagster"
        home.mkdir()
        shutil.copy(PG_YAML, home / "dagster.yaml")
        for var, value in {"DAGSTER_HOME": str(home), "DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(port),
                           "DAGSTER_PG_DB": PG_DB, "DAGSTER_PG_USERNAME": PG_USER, "DAGSTER_PG_PASSWORD": "unused",
                           "ACTLAKE_SCRATCH": str(tmp_path / "scratch"), "ACTLAKE_NFS": str(tmp_path / "nfs")}.items():
            monkeypatch.setenv(var, value)
        for var in ("SAEV_SCRATCH", "SAEV_NFS"):
            monkeypatch.delenv(var, raising=False)
        from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

        from actlake.cli import main
        from actlake_dagster.definitions import build_defs
        from actlake_dagster.demo import materialize_graph
        from actlake_dagster.instance import existing_instance
        from actlake_dagster.resources import (CheckpointsResource, DeviceResource, SAETrainingResource,
                                               StorageRootsResource)
        from actlake_dagster.settings import GraphSettings

        instance = existing_instance()  # what `actlake lineage` opens
        assert instance is not None
        assert isinstance(instance.run_storage, PostgresRunStorage), type(instance.run_storage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage), type(instance.event_log_storage)

        # one checkpoint, two machines, one layer: extraction, merges, then the SAE run (5 Dagster runs)
        t = time.monotonic()
        model = "tiny-random:bert"
        settings = GraphSettings(model=model, data="builtin:stdlib-docs", limit=24, max_seq_len=16, batch_size=8,
                                 num_machines=2, layers=(1,), val_fraction=0.25, device="cpu", automation=False)
        resources = {"checkpoints": CheckpointsResource(model=model), "device": DeviceResource(device="cpu"),
                     "storage": StorageRootsResource(), "sae": SAETrainingResource(k=4, expansion=2, epochs=2,
                                                                                   batch_size=64)}
        graph = materialize_graph(build_defs(settings, resources), settings, instance, say=lambda _: None)
        timings["graph on postgres"] = time.monotonic() - t
        jobs = [job for job, _, _, _ in graph.runs]
        assert jobs == ["extract_slices"] * 2 + ["merge_shards"] * 2 + ["train_saes"], jobs
        run_ids = {run_id for _, _, run_id, _ in graph.runs}

        # the runs and their events are in Postgres, and nothing went to sqlite under DAGSTER_HOME
        with connect(PG_DB) as conn, conn.cursor() as cur:
            cur.execute("SELECT run_id, status FROM runs")
            stored = dict(cur.fetchall())
            cur.execute("SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'")
            [[n_materializations]] = cur.fetchall()
        conn.close()
        assert set(stored) == run_ids and set(stored.values()) == {"SUCCESS"}, stored
        assert n_materializations == 2 + 2 + 3, n_materializations
        assert not list(home.rglob("*.db")), list(home.rglob("*.db"))

        # actlake lineage, by the Dagster run id of the SAE run, answered through $DAGSTER_HOME/dagster.yaml
        train_run = graph.runs[-1][2]
        extract_runs = sorted(run_id for job, _, run_id, _ in graph.runs if job == "extract_slices")
        capsys.readouterr()
        assert main(["lineage", train_run, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        dag = out["dagster"]
        assert dag is not None, "lineage found no instance records"
        assert dag["sae_checkpoint"]["written_by_run"] == train_run and dag["run"]["run_id"] == out["run"]["run_id"]
        for split in ("train", "val"):
            recorded = dag[f"{split}_shards"]
            assert recorded["shard_hash"] == out[f"{split}_shards"]["shard_hash"]
            assert sorted(s["written_by_run"] for s in recorded["machine_slices"]) == extract_runs
        assert main(["lineage", "--shards", out["train_shards"]["shard_hash"], "--json"]) == 0
        reverse = json.loads(capsys.readouterr().out)
        assert [r["run_id"] for r in reverse["runs"]] == [out["run"]["run_id"]]
        assert reverse["dagster"] and {r["dagster_run"] for r in reverse["dagster"]} <= run_ids
        timings["lineage"] = time.monotonic() - t_start - timings["postgres ready"] - timings["graph on postgres"]
    finally:
        if instance is not None:
            instance.dispose()  # close the pooled connections before the server goes
        for name, proc in procs.procs:
            if name == "postgres":
                procs.stop(proc, sig=signal.SIGINT)  # Postgres' fast shutdown
        procs.stop_all()
        shutil.rmtree(pgroot, ignore_errors=True)
    timings["total"] = time.monotonic() - t_start
    print(f"postgres timings (s): { {k: round(v, 1) for k, v in timings.items()} }")
