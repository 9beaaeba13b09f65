"""`actlake infer --run PATH`: dump the SAE's latent activations of every token (patch_acts.npz) and metrics."""

from __future__ import annotations

import argparse
import json

NAME = "infer"
HELP = "write inference/<shard_hash>/{patch_acts.npz, metrics.json, config.json} for a trained run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run directory (a bare name is a run id under the runs root, $SAEV_NFS/saev/runs)")
    p.add_argument("--shards", default=None,
                   help="activation directory to encode (default: links/val-shards, else links/train-shards)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--overwrite", action="store_true", help="replace a dump made from another checkpoint")
    p.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from actlake.runs import open_run, resolve_shards_arg
    from actlake.sae.infer import infer_run

    run = open_run(args.run)
    shards = None if args.shards is None else resolve_shards_arg(args.shards)
    out = infer_run(run, shards, device=args.device, overwrite=args.overwrite, progress=not args.no_progress)
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    print(json.dumps({"inference": str(out), **{k: metrics[k] for k in
                                                 ("n_tokens", "nmse", "explained_variance", "l0", "dead_frac")}}))
    return 0
