"""Benchmark: last-token load of one layer of an lmprobe 2.0 dataset vs np.fromfile of the same bytes.

Writes N prompts x 1 layer (d=1024, float32) through actlake's lmprobe writer, then times, in
the same run and with a warm page cache:
- baseline: `np.fromfile` of each shard's data region (exactly the bytes holding the vectors);
- actlake: `LmprobeReader.last_token(layer)` (one read per shard);
- upstream lmprobe (if installed): its per-prompt shard loader on a subset, extrapolated.
Prints the ratio (baseline time / actlake time; target >= 0.5) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from actlake.batch import Batch
from actlake.formats import lmprobe as lm
from actlake.spec import StoreSpec


def write_dataset(root: Path, n: int, d: int, shard_bytes: int, seed: int = 0) -> Path:
    """A pooled float32 dataset of n prompts x 1 layer (layer 12), written in batches of 1024."""
    spec = StoreSpec(layers=(12,), d_model=d, max_tokens=1, n_samples=n, model_name="bench/model",
                     options={"shard_bytes": shard_bytes})
    writer = lm.create_writer(root, spec)
    rng = np.random.default_rng(seed)
    for s in range(0, n, 1024):
        b = min(1024, n - s)
        acts = rng.standard_normal((b, 1, 1, d), dtype=np.float32)
        writer.write_batch(Batch(acts_bltd=acts, lengths=np.ones(b, dtype=np.int64), sample_ids=np.arange(s, s + b),
                                 texts=[f"bench prompt {i}" for i in range(s, s + b)], labels=np.arange(s, s + b) % 2))
    return writer.close()


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls after one warm-up call; returns (seconds, last result)."""
    result = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def bench_layout(root: Path, n: int, d: int, shard_bytes: int, repeats: int) -> dict[str, float]:
    out = write_dataset(root, n, d, shard_bytes)
    reader = lm.open_reader(out)
    layer = 12
    regions = []
    for shard in range(reader.hidden.last_token_shards):
        path = out / reader.hidden.file(layer, shard)
        info = lm.read_safetensors_header(path)[reader.hidden.key(layer)]
        regions.append((path, info.start, info.nbytes // 4))

    def baseline() -> list[np.ndarray]:  # no concatenation: just the reads
        return [np.fromfile(p, dtype=np.float32, count=c, offset=o) for p, o, c in regions]

    def ours() -> np.ndarray:
        return reader.last_token(layer)

    t_base, ref = timed(baseline, repeats)
    t_ours, got = timed(ours, repeats)
    assert np.array_equal(np.concatenate(ref).reshape(n, d), got), "reader returned different bytes"
    t_open, _ = timed(lambda: lm.open_reader(out).last_token(layer), max(1, repeats // 2))
    nbytes = n * d * 4
    return {"path": str(out), "shards": len(regions), "bytes": nbytes, "baseline_s": t_base, "actlake_s": t_ours,
            "actlake_open_and_load_s": t_open, "baseline_gbps": nbytes / t_base / 1e9,
            "actlake_gbps": nbytes / t_ours / 1e9, "ratio": t_base / t_ours}


def bench_upstream(out: Path, subset: int, cache_dir: Path) -> dict[str, float] | None:
    """Upstream lmprobe's per-prompt shard loader (load_pooled_batch) on `subset` prompts."""
    os.environ["LMPROBE_CACHE_DIR"] = str(cache_dir)
    try:
        import lmprobe
        from lmprobe.cache import load_pooled_batch
    except ImportError:
        return None
    import warnings

    reader = lm.open_reader(out)
    prompts = reader.texts[:subset]
    repo = "local/lmprobe-bench"
    with lm.local_hub(out, repo), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        lmprobe.pull_dataset(repo, layers=[12], materialize=False)
        t_pull = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = load_pooled_batch("bench/model", prompts, [12], "last_token")
        t_load = time.perf_counter() - t0
    assert np.array_equal(rows.numpy(), reader.last_token(12)[:subset]), "upstream returned different vectors"
    return {"upstream_prompts": subset, "upstream_pull_registry_s": t_pull, "upstream_load_s": t_load,
            "upstream_ms_per_prompt": 1e3 * t_load / subset,
            "upstream_extrapolated_s": t_load / subset * reader.n_samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (2,048 prompts)")
    ap.add_argument("--n", type=int, default=16_384)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--upstream-subset", type=int, default=512)
    ap.add_argument("--root", type=Path, default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args(argv)
    n = 2048 if args.quick else args.n
    repeats = 3 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        tmp_path = Path(tmp)
        results: dict[str, object] = {"n": n, "d": args.d}
        one = bench_layout(tmp_path / "one", n, args.d, lm.DEFAULT_SHARD_BYTES, repeats)
        many = bench_layout(tmp_path / "many", n, args.d, max(1, n * args.d * 4 // 8), repeats)
        for label, r in (("default shard_bytes", one), ("8 shards", many)):
            print(f"[{label}] {r['shards']} shard(s), {r['bytes'] / 2**20:.0f} MiB: np.fromfile {r['baseline_s'] * 1e3:.1f} ms "
                  f"({r['baseline_gbps']:.2f} GB/s), actlake last_token {r['actlake_s'] * 1e3:.1f} ms "
                  f"({r['actlake_gbps']:.2f} GB/s), open+load {r['actlake_open_and_load_s'] * 1e3:.1f} ms, "
                  f"ratio {r['ratio']:.2f}x (target >= 0.5x)")
        results.update({f"one_{k}": v for k, v in one.items() if k != "path"})
        results.update({f"many_{k}": v for k, v in many.items() if k != "path"})
        up = bench_upstream(Path(one["path"]), min(args.upstream_subset, n), tmp_path / "lmprobe-cache")
        if up is not None:
            print(f"[upstream lmprobe] per-prompt loader: {up['upstream_ms_per_prompt']:.3f} ms/prompt on "
                  f"{up['upstream_prompts']} prompts -> ~{up['upstream_extrapolated_s']:.1f} s for {n} "
                  f"(registry build {up['upstream_pull_registry_s']:.2f} s); actlake "
                  f"{one['actlake_s'] * 1e3:.1f} ms for all {n}")
            results.update(up)
        results["ratio"] = one["ratio"]
        results["target_met"] = bool(min(one["ratio"], many["ratio"]) >= 0.5)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
