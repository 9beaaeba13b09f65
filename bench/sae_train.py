"""SAE training tokens/s vs the shuffled loader alone vs the SAE step alone (in-RAM batch), same run.

Shows whether training is bound by reading (train ~ loader) or by compute (train ~ step alone).
TopK SAE, expansion 8, k 32, batch 4096, d=384 and d=768, CPU unless --device says otherwise.
Prints a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from actlake.batch import Batch
from actlake.formats.saev import SaevMetadata, SaevWriter, encode_data
from actlake.sae.model import SparseAutoencoder
from actlake.sae.train import TrainConfig, make_optimizer, resolve_device, train_sae
from actlake.torch import ShuffledTokenLoader


def build_store(root: Path, n: int, t: int, d: int, rng: np.random.Generator) -> Path:
    """A 2-layer text-like saev store (lengths t/2..t, padded to t)."""
    lengths = rng.integers(t // 2, t + 1, size=n)
    md = SaevMetadata(family="bert", ckpt=f"bench-{d}", layers=(0, 1), patches_per_ex=t, cls_token=False,
                      d_model=d, n_examples=n, patches_per_shard=max(2 * t, (n // 3) * 2 * t), data=encode_data({}))
    writer = SaevWriter(root, md, texts=False)
    for s in range(0, n, 64):
        acts = rng.standard_normal((min(64, n - s), 2, t, d), dtype=np.float32)
        writer.write_batch(Batch(acts, lengths[s : s + 64], np.arange(s, s + len(acts))))
    return writer.close()


def loader_alone(path: Path, batch: int, threads: int) -> float:
    """Tokens/s of one epoch of the shuffled loader, touching every batch (no training)."""
    loader = ShuffledTokenLoader(path, 1, batch_size=batch, n_threads=threads, seed=0)
    start = time.perf_counter()
    total = 0.0
    for x in loader:
        total += float(x[0, 0])
    return loader.n_tokens / (time.perf_counter() - start)


def step_alone(cfg: TrainConfig, d: int, n_tokens: int, device: torch.device) -> float:
    """Tokens/s of the SAE step (loss, backward, Adam, decoder renorm) on an in-RAM batch, no reading."""
    sae = SparseAutoencoder(cfg.sae_config(d), generator=torch.Generator().manual_seed(0)).to(device)
    opt = make_optimizer(sae, cfg.lr)
    x = torch.randn(cfg.batch_size, d, generator=torch.Generator().manual_seed(1)).to(device)
    steps = max(2, n_tokens // cfg.batch_size)
    start = time.perf_counter()
    for _ in range(steps):
        out = sae.loss(x)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        sae.project_decoder_grad()
        opt.step()
        sae.normalise_decoder()
        float(out["loss"].detach())
    return steps * cfg.batch_size / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=120_000, help="approximate real tokens per store")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dims", default="384,768")
    ap.add_argument("--quick", action="store_true", help="~25K tokens per width")
    args = ap.parse_args()
    tokens = 25_000 if args.quick else args.tokens
    device = resolve_device(args.device)
    t = 128
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="actlake-bench-", dir="."))
    results = []
    try:
        for d in (int(x) for x in args.dims.split(",")):
            path = build_store(tmp, max(4, int(tokens / (0.75 * t))), t, d, rng)
            cfg = TrainConfig(layer=1, expansion=8, k=32, epochs=1, batch_size=args.batch, device=str(device),
                              n_threads=args.threads, warmup_steps=1, min_steps_per_epoch=0)
            loader_alone(path, args.batch, args.threads)  # warm the page cache
            load_tps = loader_alone(path, args.batch, args.threads)
            res = train_sae(path, cfg, progress=False)
            train_tps = res.tokens_seen / res.seconds
            step_tps = step_alone(cfg, d, res.n_tokens, device)
            bound = "reading" if train_tps > 0.8 * load_tps and load_tps < step_tps else "compute"
            row = {"d_model": d, "n_latents": 8 * d, "k": 32, "n_tokens": res.n_tokens,
                   "loader_tokens_per_s": round(load_tps), "train_tokens_per_s": round(train_tps),
                   "step_alone_tokens_per_s": round(step_tps), "ratio_train_vs_loader": train_tps / load_tps,
                   "ratio_train_vs_step_alone": train_tps / step_tps, "bound_by": bound}
            results.append(row)
            print(f"d={d}: loader {load_tps:,.0f} tok/s   train {train_tps:,.0f} tok/s   step alone "
                  f"{step_tps:,.0f} tok/s   train/loader {train_tps / load_tps:.3f}x   "
                  f"train/step {train_tps / step_tps:.2f}x   -> bound by {bound}")
        print(json.dumps({"bench": "sae_train", "device": str(device), "batch": args.batch,
                          "threads": args.threads, "torch_threads": torch.get_num_threads(), "results": results}))
    finally:
        os.system(f"chmod -R u+w {tmp} 2>/dev/null")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
