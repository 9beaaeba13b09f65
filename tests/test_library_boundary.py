"""The library stands alone: importing and using actlake never imports dagster."""

from __future__ import annotations

import subprocess
import sys


def test_actlake_does_not_import_dagster() -> None:
    code = (
        "import sys, actlake, actlake.torch, actlake.formats, actlake.extract, actlake.sae, actlake.runs, actlake.cli\n"
        "from actlake.formats import available_formats, format_module\n"
        "[format_module(f) for f in available_formats()]\n"
        "actlake.cli.build_parser()\n"
        "assert 'dagster' not in sys.modules, 'dagster was imported'\n"
        "assert sorted(available_formats()) == ['lmprobe', 'pickle', 'saev', 'zarr'], available_formats()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
