"""Extraction benchmark on the embedded MiniLM (6 blocks, 384-d) over builtin:stdlib-docs.

Ratios measured in the same run, against the physical baselines:
  (a) `actlake extract` engine (tokenise, forward, hooks, copy, write saev) vs a bare forward of the
      same model on the same batches with no hooks and no writes            target <= 1.10x
  (b) only layer 1 of MiniLM's 6 vs all 6 (early exit)                       target <= 0.45x
  (c) peak RSS with 10x the samples vs 1x (each in a fresh subprocess)       target <= 1.2x
Prints one JSON line of results last. `--quick` for a small run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATA = "builtin:stdlib-docs"


def engine_seconds(loaded: Any, n: int, layers: str, max_len: int, batch: int, out: Path) -> tuple[float, float]:
    """Wall time of one extraction into a fresh saev directory: tokenise, plan, forward, hooks, copy, write,
    publish (model loaded and dataset opened beforehand, as for the bare forward)."""
    from actlake.extract import ExtractConfig, extract, open_dataset

    shutil.rmtree(out, ignore_errors=True)
    cfg = ExtractConfig(model="minilm", data=DATA, out=out, layers=layers, limit=n, max_seq_len=max_len,
                        batch_size=batch, device="cpu")
    dataset = open_dataset(DATA, limit=n)
    c0, t0 = time.process_time(), time.perf_counter()
    extract(cfg, model=loaded, dataset=dataset)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    shutil.rmtree(out, ignore_errors=True)
    return seconds, cpu


def bare_seconds(loaded: Any, n: int, max_len: int, batch: int) -> tuple[float, float]:
    """The same batches (same plan, same padding), forward only: no hooks, no copies, no writes."""
    import torch

    from actlake.extract import open_dataset, plan_windows
    from actlake.extract.batching import pad_batch, tokenize_texts

    texts = open_dataset(DATA, limit=n).texts
    tok = tokenize_texts(loaded.tokenizer, texts, max_len)
    batches = []
    for window in plan_windows(tok.lengths, batch, 4):
        for positions in window.batches:
            pb = pad_batch([tok.ids(int(p)) for p in positions], loaded.tokenizer.pad_token_id)
            batches.append({k: torch.from_numpy(v) for k, v in
                            (("input_ids", pb.input_ids), ("attention_mask", pb.attention_mask),
                             ("position_ids", pb.position_ids))})
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        for inputs in batches:
            loaded.model(**inputs)
    return time.perf_counter() - t0, time.process_time() - c0


def rss_child(n: int, max_len: int, batch: int, out: str) -> None:
    """Subprocess body: load, then one extraction of n samples; print peak RSS (KiB) after each."""
    from actlake.extract import ExtractConfig, extract, load_model

    loaded = load_model("minilm", device="cpu")
    after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    extract(ExtractConfig(model="minilm", data=DATA, out=out, layers="all", limit=n, max_seq_len=max_len,
                          batch_size=batch, device="cpu"), model=loaded)
    print(json.dumps({"n": n, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "after_load_kib": after_load}))


def peak_rss(n: int, max_len: int, batch: int, tmp: Path) -> tuple[int, int]:
    out = tmp / f"rss-{n}"
    proc = subprocess.run([sys.executable, __file__, "--rss-child", str(n), "--max-len", str(max_len),
                           "--batch", str(batch), "--out", str(out)], capture_output=True, text=True, check=True)
    shutil.rmtree(out, ignore_errors=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return int(got["maxrss_kib"]), int(got["maxrss_kib"]) - int(got["after_load_kib"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (fewer texts, one repeat)")
    ap.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child is not None:
        rss_child(args.rss_child, args.max_len, args.batch, args.out)
        return

    import torch

    from actlake.extract import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    n = 64 if args.quick else 256
    repeats = 3 if args.quick else 4
    rss_n = 24 if args.quick else 48
    loaded = load_model("minilm", device="cpu")
    tmp = Path(tempfile.mkdtemp(prefix="actlake-bench-extract-"))
    print(f"MiniLM (6 blocks, d=384), {n} stdlib docstrings, max_seq_len {args.max_len}, batch {args.batch}, "
          f"torch threads {torch.get_num_threads()}")
    try:
        bare_seconds(loaded, min(n, 32), args.max_len, args.batch)  # warm-up
        engine, bare, one, every = [], [], [], []
        for _ in range(repeats):  # interleaved so machine noise hits both sides alike
            bare.append(bare_seconds(loaded, n, args.max_len, args.batch))
            engine.append(engine_seconds(loaded, n, "all", args.max_len, args.batch, tmp / "all"))
            one.append(engine_seconds(loaded, n, "1", args.max_len, args.batch, tmp / "one"))
            every.append(engine_seconds(loaded, n, "all", args.max_len, args.batch, tmp / "all"))
        wall = lambda xs: min(x[0] for x in xs)  # noqa: E731 - best of the repeats (noise only adds)
        cpu = lambda xs: min(x[1] for x in xs)  # noqa: E731
        ratio_a, ratio_a_cpu = wall(engine) / wall(bare), cpu(engine) / cpu(bare)
        ratio_b = wall(one) / wall(every)
        print("wall s per repeat: bare", [round(x[0], 2) for x in bare], "engine", [round(x[0], 2) for x in engine])
        print(f"(a) engine all 6 layers {wall(engine):.2f}s vs bare forward {wall(bare):.2f}s: {ratio_a:.3f}x wall, "
              f"{ratio_a_cpu:.3f}x CPU time (target <= 1.10x; median wall ratio "
              f"{statistics.median(x[0] for x in engine) / statistics.median(x[0] for x in bare):.3f}x)")
        print(f"(b) layer 1 only {wall(one):.2f}s vs all 6 layers {wall(every):.2f}s: {ratio_b:.3f}x (target <= 0.45x)")
        rss_1, grow_1 = peak_rss(rss_n, 64, args.batch, tmp)
        rss_10, grow_10 = peak_rss(rss_n * 10, 64, args.batch, tmp)
        ratio_c = rss_10 / rss_1
        print(f"(c) peak RSS {rss_n * 10} samples {rss_10 / 1024:.0f} MiB vs {rss_n} samples {rss_1 / 1024:.0f} MiB: "
              f"{ratio_c:.3f}x (target <= 1.2x); growth of the peak during extraction, after model load: "
              f"{grow_10 / 1024:.0f} MiB vs {grow_1 / 1024:.0f} MiB")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({
        "bench": "extract", "quick": args.quick, "n_texts": n, "max_seq_len": args.max_len, "batch_size": args.batch,
        "torch_threads": torch.get_num_threads(),
        "engine_s": round(wall(engine), 3), "bare_forward_s": round(wall(bare), 3), "ratio_engine_vs_bare": round(ratio_a, 3),
        "ratio_engine_vs_bare_cpu_time": round(ratio_a_cpu, 3),
        "layer1_s": round(wall(one), 3), "all_layers_s": round(wall(every), 3), "ratio_layer1_vs_all": round(ratio_b, 3),
        "rss_1x_mib": round(rss_1 / 1024, 1), "rss_10x_mib": round(rss_10 / 1024, 1), "ratio_rss_10x_vs_1x": round(ratio_c, 3),
        "rss_growth_during_extract_mib": [round(grow_1 / 1024, 1), round(grow_10 / 1024, 1)],
        "rss_samples": [rss_n, rss_n * 10],
    }))


if __name__ == "__main__":
    main()
