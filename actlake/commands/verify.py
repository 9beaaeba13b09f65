"""`actlake verify PATH`: check every invariant of the store's spec; exit 1 on any problem."""

from __future__ import annotations

import argparse

NAME = "verify"
HELP = ("check a store against its spec and report every problem (exit 1 if any; exit 2 if the check itself "
        "failed) and every warning (what could not be checked)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="store directory or file")
    p.add_argument("--format", default=None, help="skip detection and check as this format")


def run(args: argparse.Namespace) -> int:
    import actlake

    report = actlake.verify_report(args.path, args.format)
    for problem in report.problems:
        print(f"problem: {problem}")
    for warned in report.warnings:
        print(f"warning: {warned}")
    note = f" ({len(report.warnings)} warning(s): not checked, not failed)" if report.warnings else ""
    print(f"{args.path}: {'OK' if report.ok else f'{len(report.problems)} problem(s)'}{note}")
    return 0 if report.ok else 1
