"""`actlake train --run PATH`: train an SAE in a run directory (created from --shards/--layer when new)."""

from __future__ import annotations

import argparse
import json

NAME = "train"
HELP = "train a sparse autoencoder on one layer of an activation directory, into a run directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None,
                   help="run directory (a bare name is a run id under the runs root, $SAEV_NFS/saev/runs); "
                        "default: a new <timestamp>-<hash> run under the runs root")
    p.add_argument("--shards", default=None, help="training activation directory (needed for a new run)")
    p.add_argument("--val-shards", default=None, help="validation activation directory (linked as links/val-shards)")
    p.add_argument("--layer", type=int, default=None, help="stored layer to train on (default: the only one)")
    p.add_argument("--k", type=int, default=32, help="TopK: active latents per token")
    p.add_argument("--expansion", type=int, default=8, help="n_latents = expansion * d_model")
    p.add_argument("--activation", choices=("topk", "relu"), default="topk", help="TopK or ReLU + L1")
    p.add_argument("--l1-coeff", type=float, default=5e-3, help="L1 coefficient (ReLU only)")
    p.add_argument("--aux-coeff", type=float, default=1.0 / 32.0, help="AuxK dead-latent loss coefficient (0: off)")
    p.add_argument("--epochs", type=int, default=8, help="passes over the training tokens")
    p.add_argument("--batch-size", type=int, default=None,
                   help="tokens per step (default 4096, lowered for small stores so an epoch has >= 16 steps)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and shuffling")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--no-normalise", action="store_true", help="train on raw activations (no input scaling)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint / re-point links")
    p.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    import actlake
    from actlake.errors import ConfigError, RunError
    from actlake.runs import Run, create_run, new_run_id, resolve_run_arg, resolve_shards_arg, runs_root
    from actlake.sae.train import TrainConfig, train_run

    shards = None if args.shards is None else resolve_shards_arg(args.shards)
    val = None if args.val_shards is None else resolve_shards_arg(args.val_shards)
    if args.run is not None:
        run_path = resolve_run_arg(args.run)
    else:
        if shards is None:
            raise RunError("a new run needs --shards (and --layer)")
        run_path = runs_root() / new_run_id({"shards": str(shards.resolve()), "layer": args.layer, "k": args.k,
                                             "expansion": args.expansion, "seed": args.seed})
    run = Run(run_path)
    if run.has_checkpoint and not args.overwrite:
        raise RunError("checkpoint already exists (use --overwrite to train again)", run.sae_path)
    if shards is not None:
        run = create_run(run_path, shards, val, overwrite=args.overwrite)
    elif val is not None:
        run = create_run(run_path, run.train_shards, val, overwrite=args.overwrite)
    elif not (run.links_dir / "train-shards").is_symlink():
        raise RunError("a new run needs --shards DIR (and --layer L)", run.path)
    layer = args.layer
    if layer is None and run.config_path.is_file():
        layer = int(run.read_config()["layer"])
    if layer is None:
        with actlake.open(run.train_shards) as reader:
            if len(reader.layers) != 1:
                raise ConfigError(f"--layer is required: the shards store layers {list(reader.layers)}",
                                  run.train_shards)
            layer = reader.layers[0]
    cfg = TrainConfig(layer=layer, expansion=args.expansion, k=args.k, activation=args.activation,
                      l1_coeff=args.l1_coeff, aux_coeff=args.aux_coeff, epochs=args.epochs,
                      batch_size=args.batch_size or 4096, min_steps_per_epoch=0 if args.batch_size else 16,
                      lr=args.lr, seed=args.seed, device=args.device,
                      normalise=not args.no_normalise)
    result = train_run(run, cfg, overwrite=args.overwrite, progress=not args.no_progress)
    last = result.loss_curve[-1] if result.loss_curve else {}
    print(json.dumps({"run": str(run.path), "checkpoint": str(run.sae_path), "layer": layer,
                      "n_latents": result.sae.config.n_latents, "tokens_seen": result.tokens_seen,
                      "seconds": round(result.seconds, 2), "device": result.device,
                      "final_loss": last.get("loss"), "final_l0": last.get("l0")}))
    return 0
