"""`actlake` command line: argument parsing only; each subcommand lives in actlake/commands/<name>.py.

A command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import __version__, commands
from .errors import ActlakeError

DESCRIPTION = (
    "Transformer activations on disk: extract them once (saev, zarr, lmprobe or pickle layouts), read them "
    "back, train sparse autoencoders on them, and trace every SAE to its shards, checkpoint and dataset. "
    "`actlake demo` runs the whole Dagster asset graph on the embedded MiniLM; `actlake ui` opens it.")
EPILOG = "Exit codes: 0 success; 1 `verify` found problems; 2 the command failed (the message names the file)."


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default where it has one and its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == []
                or default is argparse.SUPPRESS or action.option_strings == []):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actlake", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"actlake {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP, formatter_class=_HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ActlakeError as exc:
        print(f"actlake {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except OSError as exc:  # a read-only filesystem, a full disk, no permission: say where, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"actlake {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"actlake {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
