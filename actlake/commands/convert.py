"""`actlake convert SRC --to FORMAT --out ROOT`: copy a store into another format, streaming, then verify."""

from __future__ import annotations

import argparse

NAME = "convert"
HELP = "convert an activation store to another format (saev, zarr, lmprobe, pickle) and verify the result"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The source, target format, output root, target options and the batch memory budget."""
    from ..formats import FORMAT_MODULES

    p.add_argument("src", help="source store (any format actlake reads)")
    p.add_argument("--to", required=True, choices=sorted(FORMAT_MODULES), help="target format")
    p.add_argument("--out", required=True, help="output root, a local path or an fsspec URL (s3://, gs://, memory://; docs/remote.md); "
                                        "the store is published under it")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="target-format option (repeatable), e.g. shard_bytes=50000000, compressed=false, dtype=float16")
    p.add_argument("--batch-mb", type=float, default=64.0,
                   help="memory budget of one streamed batch in MiB (default 64)")
    p.add_argument("--no-verify", action="store_true", help="skip `actlake verify` on the output")


def run(args: argparse.Namespace) -> int:
    """Convert, verify (unless --no-verify) and print the published path."""
    from ..convert import convert
    from ..options import parse_options
    from ..errors import ConfigError

    if not args.batch_mb > 0:
        raise ConfigError(f"--batch-mb must be positive, got {args.batch_mb}")
    options = parse_options(args.option)
    if args.to == "lmprobe" and options.get("storage", "pooled") != "full_sequence":
        import sys

        print("actlake convert: note: lmprobe's default storage keeps one pooled (last-token) vector per sample; "
              "pass --option storage=full_sequence for a lossless copy of every token", file=sys.stderr)
    from ..remote.url import is_url, local_path

    def build(out_root: object) -> object:
        return convert(local_path(args.src), args.to, out_root, options,
                       batch_bytes=max(1, int(args.batch_mb * 2**20)), verify=not args.no_verify)

    if is_url(args.out):  # published locally (atomic, verified), then uploaded with checksums.json last
        from ..remote.publish import publish_to

        print(publish_to(args.out, build))
    else:
        print(build(local_path(args.out)))
    return 0
