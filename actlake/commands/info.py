"""`actlake info PATH`: a summary of any stored layout."""

from __future__ import annotations

import argparse
import json

NAME = "info"
HELP = "summarise an activation store (any format)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="store directory or file")
    p.add_argument("--format", default=None, help="skip detection and open as this format")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--verify", action="store_true",
                   help="first check every file against the store's checksums.json (exit 2 naming the first "
                        "file that does not match)")


def run(args: argparse.Namespace) -> int:
    import actlake

    with actlake.open(args.path, args.format, verify=args.verify) as reader:
        summary = reader.summary()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    for key, value in summary.items():
        if key != "provenance":
            print(f"{key:>16}: {value}")
    print("      provenance:")
    for key, value in summary["provenance"].items():
        print(f"    {key}: {value}")
    return 0
