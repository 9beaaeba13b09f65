"""`actlake verify PATH`: check every invariant of the store's spec; exit 1 on any problem."""

from __future__ import annotations

import argparse

NAME = "verify"
HELP = "check a store against its spec and report every problem (exit 1 if any)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="store directory or file")
    p.add_argument("--format", default=None, help="skip detection and check as this format")


def run(args: argparse.Namespace) -> int:
    import actlake

    problems = actlake.verify(args.path, args.format)
    for problem in problems:
        print(f"problem: {problem}")
    print(f"{args.path}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0
