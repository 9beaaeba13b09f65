"""`actlake ui`: the Dagster UI (webserver + daemon) on the instance the demo wrote ($DAGSTER_HOME or ./actlake-data/dagster)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

NAME = "ui"
HELP = "open the Dagster UI on actlake's asset graph and the demo's instance (dagster dev)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=3000, help="port (default 3000)")
    p.add_argument("--print-only", action="store_true", help="print the command instead of running it")


def command(host: str, port: int) -> list[str]:
    """The `dagster dev` command line that serves the actlake code location."""
    exe = Path(sys.executable).parent / "dagster"
    dagster = str(exe) if exe.exists() else (shutil.which("dagster") or "dagster")
    return [dagster, "dev", "-m", "actlake_dagster.definitions", "-h", host, "-p", str(port)]


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError

    try:
        from actlake_dagster.instance import ensure_home
        from actlake_dagster.settings import GraphSettings
    except ImportError as exc:
        raise ConfigError(f"the UI needs dagster installed ({exc})") from exc
    home = ensure_home(gpus=GraphSettings.from_env().gpus)
    cmd = command(args.host, args.port)
    print(f"DAGSTER_HOME={home} {' '.join(cmd)}")
    if args.print_only:
        return 0
    print(f"UI at http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    os.environ["DAGSTER_HOME"] = str(home)
    os.execv(cmd[0], cmd)
    return 0  # not reached
