"""`actlake demo`: the whole asset graph, through Dagster, on the embedded default (MiniLM over built-in texts)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

NAME = "demo"
HELP = ("materialize actlake's whole Dagster asset graph on the embedded default (MiniLM, built-in texts, "
        "2 machine slices, layers 1,3,5, CPU) into a persistent instance, then print one run's lineage")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="show Dagster's own event log on the console")


def _cli(name: str) -> str:
    """How to call an entry point of this environment, as the user can type it from here."""
    exe = Path(sys.executable).parent / name
    if not exe.exists():
        return name
    rel = os.path.relpath(exe)
    return shlex.quote(rel if not rel.startswith("..") else str(exe))


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError

    try:
        import warnings

        warnings.filterwarnings("ignore", module="dagster")
        warnings.filterwarnings("ignore", message=".*is currently in beta.*")
        from actlake_dagster.definitions import build_defs
        from actlake_dagster.demo import materialize_graph
        from actlake_dagster.instance import ensure_home, open_instance
        from actlake_dagster.lineage import instance_lineage, run_path_of
        from actlake_dagster.settings import GraphSettings
    except ImportError as exc:
        raise ConfigError(f"the demo runs through Dagster, which is not importable here ({exc})") from exc
    from ..lineage import lineage_from_files
    from .lineage import render

    settings = GraphSettings.from_env()
    home = ensure_home(gpus=settings.gpus)
    instance = open_instance(home)
    defs = build_defs(settings)
    print(f"demo: {settings.model} over {settings.data} (first {settings.limit} texts, {settings.max_seq_len} tokens), "
          f"{settings.num_machines} machine slices, layers {','.join(map(str, settings.layers))}, "
          f"val fraction {settings.val_fraction}")
    print(f"      Dagster instance {home}")
    result = materialize_graph(defs, settings, instance, verbose=args.verbose)
    wrote = sum(1 for _, _, run_id, by in result.runs if by == run_id)
    print(f"demo: {len(result.runs)} Dagster runs in {result.seconds:.1f} s; {wrote} wrote new data"
          + ("" if wrote else " (everything was already published: content hashes unchanged, nothing rewritten)"))
    layer = settings.layers[-1]
    ckpt = result.checkpoints[-1]
    from actlake_dagster.partitions import layer_key
    from actlake_dagster.records import latest

    from actlake_dagster.assets.keys import SAE_RUN

    run_md = latest(instance, SAE_RUN, layer_key(ckpt, layer))
    run_id = str(run_md.get("run_id")) if run_md else ""
    path = run_path_of(instance, run_id)
    if path:
        lineage = lineage_from_files(path)
        lineage["dagster"] = instance_lineage(instance, run_id)
        print("\nlineage of one run:")
        print(render(lineage))
    print(f"\nthe same lineage any time: {_cli('actlake')} lineage {run_id}")
    print(f"open the UI on this instance: {_cli('actlake')} ui   (http://127.0.0.1:3000; sensors and automation "
          "start RUNNING there: ACTLAKE_AUTOMATION=off keeps them stopped)")
    return 0
