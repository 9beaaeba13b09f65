"""Shuffled token loader throughput vs an in-RAM numpy fancy-index gather of the same rows, same run.

Batch 4096 tokens, d=768, float32. Target: loader >= 0.5x the in-RAM gather. Prints a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from actlake.batch import Batch
from actlake.formats.saev import SaevMetadata, SaevWriter, encode_data
from actlake.torch import ShuffledTokenLoader


def build_store(root: Path, n: int, t: int, d: int, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    lengths = rng.integers(t // 2, t + 1, size=n)  # text-like: variable lengths, padded to t
    md = SaevMetadata(family="bert", ckpt="bench", layers=(0, 1), patches_per_ex=t, cls_token=False, d_model=d,
                      n_examples=n, patches_per_shard=max(2 * t, (n // 3) * 2 * t), data=encode_data({}))
    writer = SaevWriter(root, md, texts=False)
    for s in range(0, n, 64):
        acts = rng.standard_normal((min(64, n - s), 2, t, d), dtype=np.float32)
        writer.write_batch(Batch(acts, lengths[s : s + 64], np.arange(s, s + len(acts))))
    return writer.close(), lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=300_000, help="approximate real tokens in the store")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    tokens = 60_000 if args.quick else args.tokens
    d, t = 768, 128
    n = max(4, int(tokens / (0.75 * t)))
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="actlake-bench-", dir="."))
    try:
        path, lengths = build_store(tmp, n, t, d, rng)
        n_tokens = int(lengths.sum())
        loader = ShuffledTokenLoader(path, 1, batch_size=args.batch, n_threads=args.threads, seed=0)
        # baseline: the same real-token rows of layer 1, already in RAM, gathered by random index
        rows = np.concatenate([loader.gather(p) for p in loader.plans(999)])
        loader_s, base_s = [], []
        for epoch in range(args.epochs):
            start = time.perf_counter()
            for x in loader:
                pass
            loader_s.append(time.perf_counter() - start)
            perm = np.random.default_rng(epoch).permutation(n_tokens)
            start = time.perf_counter()
            for s in range(0, n_tokens, args.batch):
                rows[perm[s : s + args.batch]]
            base_s.append(time.perf_counter() - start)
        loader_tps, base_tps = n_tokens / min(loader_s), n_tokens / min(base_s)
        result = {"bench": "saev_read", "n_tokens": n_tokens, "d_model": d, "batch": args.batch,
                  "threads": args.threads, "loader_tokens_per_s": loader_tps, "ram_gather_tokens_per_s": base_tps,
                  "ratio_loader_vs_ram_gather": loader_tps / base_tps, "target": 0.5}
        print(f"loader {loader_tps:,.0f} tokens/s   in-RAM gather {base_tps:,.0f} tokens/s   "
              f"ratio {loader_tps / base_tps:.2f}x (target >= 0.5x)")
        print(json.dumps(result))
    finally:
        import os

        os.system(f"chmod -R u+w {tmp} 2>/dev/null")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
