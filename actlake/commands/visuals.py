"""`actlake visuals --run PATH`: HTML/PNG views of the top latents of an inference dump, and a summary PNG."""

from __future__ import annotations

import argparse

NAME = "visuals"
HELP = "draw inference/<shard_hash>/visuals/ (latent pages or image grids, summary.png, index.html)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run directory (a bare name is a run id under the runs root, $SAEV_NFS/saev/runs)")
    p.add_argument("--shards-hash", default=None,
                   help="which inference dump (default: the only one, else the val/train shards' one)")
    p.add_argument("--top-latents", type=int, default=32, help="latents to draw, by total activation")
    p.add_argument("--latents", default=None, help="comma-separated latent ids to draw instead of the ranking")
    p.add_argument("--contexts", type=int, default=16, help="examples per latent")
    p.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from actlake.errors import ConfigError
    from actlake.runs import open_run
    from actlake.sae.visuals import VisualsConfig, visuals_run

    latents = None
    if args.latents:
        try:
            latents = tuple(int(x) for x in args.latents.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"--latents must be comma-separated integers, got {args.latents!r}") from None
    cfg = VisualsConfig(top_latents=args.top_latents, contexts=args.contexts, latents=latents)
    out = visuals_run(open_run(args.run), args.shards_hash, cfg, progress=not args.no_progress)
    print(out / "index.html")
    return 0
