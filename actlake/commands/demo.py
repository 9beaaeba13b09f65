"""`actlake demo`: every layer of the embedded MiniLM over built-in stdlib docstrings, into saev."""

from __future__ import annotations

import argparse

from .extract import add_common_arguments

NAME = "demo"
HELP = "extract all layers of the embedded MiniLM over built-in texts (offline) and summarise the result"
DEMO_DATA = "builtin:stdlib-docs"
DEMO_MAX_SEQ_LEN = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="output root (default $ACTLAKE_SCRATCH/shards or ./actlake-data/shards)")
    p.add_argument("--n-texts", type=int, default=256, help="number of built-in texts (default 256)")
    add_common_arguments(p)
    p.set_defaults(max_seq_len=DEMO_MAX_SEQ_LEN)


def run(args: argparse.Namespace) -> int:
    import actlake

    from ..extract import MINILM, ExtractConfig, extract
    from ..runs import shards_root

    cfg = ExtractConfig(model=MINILM, data=DEMO_DATA, out=args.out or shards_root(), layers="all", format="saev",
                        max_seq_len=args.max_seq_len, batch_size=args.batch_size, device=args.device,
                        limit=args.n_texts, progress=not args.no_progress)
    result = extract(cfg)
    print(f"demo: {result.n_samples} stdlib docstrings x {len(result.spec.layers)} layers of {MINILM} "
          f"({result.spec.d_model}-d, up to {result.spec.max_tokens} tokens) in {result.seconds:.1f}s")
    with actlake.open(result.path) as reader:
        summary = reader.summary()
    for key, value in summary.items():
        if key != "provenance":
            print(f"{key:>20}: {value}")
    prov = summary.get("provenance", {})
    for key in ("model_name", "weights_sha256", "dataset_spec", "dataset_fingerprint", "python_version",
                "torch_version", "transformers_version", "created_at"):
        if key in prov:
            print(f"{key:>20}: {prov[key]}")
    print(f"read it back with: actlake info {result.path}")
    print(result.path)
    return 0
