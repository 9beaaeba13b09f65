"""Real services for tests (Redis, Postgres, Celery workers): free loopback ports, programs found or
the test skipped loudly (failed under CI), every process the leader of its own session and stopped by
its process group id whatever happens."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def in_ci() -> bool:
    """True when $CI says so: a missing service then fails the test instead of skipping it."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(what: str, found: object, install: str) -> None:
    """Skip (loudly) when `found` is falsy; under CI, fail instead."""
    if found:
        return
    message = f"{what} is missing: {install}"
    if in_ci():
        pytest.fail(f"CI: {message} (scripts/system-packages.sh installs it)")
    pytest.skip(f"!!! {message}; this test did NOT run !!!")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return "<no log>"


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, log: Path | None = None,
               proc: subprocess.Popen[bytes] | None = None) -> float:
    """Poll `ready` until it is true; seconds waited. Fails early when `proc` exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}:\n{tail(log) if log else ''}")
        try:
            if ready():
                return time.monotonic() - t0
        except (OSError, ConnectionError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what}: not ready after {timeout_s:.0f} s:\n{tail(log) if log else ''}")


class Processes:
    """Every process a test starts, each the leader of its own session; stopped by process group id."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.stopped: set[int] = set()

    def start(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path = REPO, user: str | None = None) -> subprocess.Popen[bytes]:
        """Start `cmd` (as `user` through runuser when given) with stdout and stderr into `log`."""
        if user is not None:
            cmd = ["runuser", "-u", user, "--", *cmd]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        """`sig` to the group (the leader and what it started), wait, then SIGKILL whatever is left."""
        if proc.pid in self.stopped:  # a stopped group's id may since belong to someone else
            return
        pgid = proc.pid  # start_new_session: the leader's pid is the group's id
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.stopped.add(proc.pid)

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            self.stop(proc)


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without the project's and Dagster's variables, plus `extra` and offline model hubs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACTLAKE_", "SAEV_", "DAGSTER_", "PYTEST_")) and k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    env.update(extra)
    return env
