"""Zarr fp16 logger read benchmark (the spec's matrix) vs a numpy memmap of identical bytes, same run.

For R_max in {32, 64, 128} x T_chunk_prompt in {64, 128, 256}: a store is written through the
real writer (every sample full length, so both sides copy the same bytes), the same fp16 bytes
are dumped to (N, L, T, H) memmap files, and we measure
- latency of k random (sample, layer) prompt and response reads (mean / median / p95), actlake's
  chunk-file fast path vs `np.array(memmap[i, l, :p])`, plus zarr-python's own API on a subset;
- batch assembly for the training pattern (b samples x 2 random layers each, prompt + response):
  `reader.gather` vs memmap fancy-index gather. Target: >= 0.5x the memmap.
And, for R_max=64 / T_chunk=128, the same batches through a torch DataLoader with 0, 4, 8 workers.
Ends with one JSON line of results.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from actlake import Batch, StoreSpec
from actlake.atomic import remove_tree
from actlake.formats import zarr_logger as zl


def build(root: Path, n: int, n_layers: int, p_max: int, r_max: int, t_chunk: int, hidden: int,
          rng: np.random.Generator) -> tuple[zl.ZarrReader, np.memmap, np.memmap, float]:
    """Write one store (full-length samples) and memmaps of its exact bytes; return both + write s."""
    spec = StoreSpec(layers=tuple(range(n_layers)), d_model=hidden, max_tokens=p_max, n_samples=n,
                     model_name="bench", options={"p_max": p_max, "r_max": r_max, "t_chunk_prompt": t_chunk})
    start = time.perf_counter()
    writer = zl.create_writer(root, spec)
    step = 8
    for s in range(0, n, step):
        b = min(step, n - s)
        writer.write_batch(Batch(
            acts_bltd=rng.standard_normal((b, n_layers, p_max, hidden), dtype=np.float32),
            lengths=np.full(b, p_max), sample_ids=np.arange(s, s + b),
            response_bltd=rng.standard_normal((b, n_layers, r_max, hidden), dtype=np.float32),
            response_lengths=np.full(b, r_max)))
    run = writer.close()
    write_s = time.perf_counter() - start
    reader = zl.ZarrReader(run / zl.STORE_NAME)
    maps = []
    for name, t in (("prompt", p_max), ("response", r_max)):
        f = root / f"{name}.bin"
        mm = np.memmap(f, dtype=np.float16, mode="w+", shape=(n, n_layers, t, hidden))
        for s in range(0, n, step):
            idx = np.arange(s, min(s + step, n))
            mm[idx] = reader._block(zl.PROMPT if name == "prompt" else zl.RESPONSE, idx, list(range(n_layers)))
        mm.flush()
        del mm
        mm = np.memmap(f, dtype=np.float16, mode="r", shape=(n, n_layers, t, hidden))
        mm._mmap.madvise(__import__("mmap").MADV_RANDOM)
        maps.append(mm)
    return reader, maps[0], maps[1], write_s


def last_token_bench(reader: zl.ZarrReader, api: zl.ZarrReader, mp: np.memmap, repeats: int = 5) -> dict[str, float]:
    """last_token(layer) over every sample: chunk-file gather and zarr-API gather vs memmap fancy index."""
    n_layers = mp.shape[1]
    last = reader.lengths - 1  # every sample is full length in this bench
    samples = np.arange(len(last))

    def best(fn: Any) -> float:
        times = []
        for k in range(repeats):
            t = time.perf_counter()
            fn(k % n_layers)
            times.append(time.perf_counter() - t)
        return min(times) * 1e3

    assert np.array_equal(reader.last_token(reader.layers[1]), mp[samples, 1, last])
    z = best(lambda li: reader.last_token(reader.layers[li]))
    a = best(lambda li: api.last_token(api.layers[li]))
    m = best(lambda li: np.array(mp[samples, li, last]))
    return {"zarr_ms": z, "zarr_api_ms": a, "memmap_ms": m, "ratio_vs_memmap": m / z}


def latencies(fn: Any, pairs: np.ndarray) -> np.ndarray:
    """Seconds per call of fn(i, l) over the pairs."""
    out = np.empty(len(pairs))
    clock = time.perf_counter
    for k, (i, li) in enumerate(pairs.tolist()):
        t = clock()
        fn(i, li)
        out[k] = clock() - t
    return out


def stats(lat_s: np.ndarray) -> dict[str, float]:
    us = lat_s * 1e6
    return {"mean_us": float(us.mean()), "median_us": float(np.median(us)), "p95_us": float(np.percentile(us, 95))}


def batch_assembly(reader: zl.ZarrReader, mp: np.memmap, mr: np.memmap, b: int, n_batches: int,
                   rng: np.random.Generator) -> dict[str, float]:
    """b samples x 2 random layers each, prompt + response, as (2b, T, H) arrays; best of 3 passes."""
    n, n_layers = mp.shape[:2]
    plans = []
    for _ in range(n_batches):
        samples = np.repeat(rng.choice(n, size=b, replace=False), 2)
        layers = np.concatenate([rng.choice(n_layers, size=2, replace=False) for _ in range(b)])
        plans.append((samples, layers))
    ours, base = [], []
    for _ in range(3):
        t = time.perf_counter()
        for samples, layers in plans:
            reader.gather(samples, layers, "prompt")
            reader.gather(samples, layers, "response")
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        for samples, layers in plans:
            mp[samples, layers]
            mr[samples, layers]
        base.append(time.perf_counter() - t)
    pairs = 2 * b * n_batches
    o, m = min(ours), min(base)
    return {"zarr_ms_per_batch": 1e3 * o / n_batches, "memmap_ms_per_batch": 1e3 * m / n_batches,
            "zarr_pairs_per_s": pairs / o, "memmap_pairs_per_s": pairs / m, "ratio_vs_memmap": m / o}


class PairBatches:
    """Map-style dataset whose item k is one assembled batch (b samples x 2 layers), per-process handles."""

    def __init__(self, kind: str, path: Path, shapes: tuple, plans: list, prompt_bin: Path, response_bin: Path) -> None:
        self.kind, self.path, self.shapes, self.plans = kind, path, shapes, plans
        self.bins = (prompt_bin, response_bin)
        self._h: Any = None
        self._pid = -1

    def _handles(self) -> Any:
        if self._h is None or self._pid != os.getpid():
            if self.kind == "zarr":
                self._h = zl.ZarrReader(self.path)
            else:
                self._h = [np.memmap(f, dtype=np.float16, mode="r", shape=s) for f, s in zip(self.bins, self.shapes)]
            self._pid = os.getpid()
        return self._h

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, k: int) -> Any:
        import torch

        samples, layers = self.plans[k]
        h = self._handles()
        if self.kind == "zarr":
            p, r = h.gather(samples, layers, "prompt"), h.gather(samples, layers, "response")
        else:
            p, r = h[0][samples, layers], h[1][samples, layers]
        return torch.from_numpy(p), torch.from_numpy(r)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_h": None, "_pid": -1}


def dataloader_bench(reader: zl.ZarrReader, root: Path, mp: np.memmap, mr: np.memmap, b: int, n_batches: int,
                     workers: list[int], rng: np.random.Generator) -> list[dict[str, Any]]:
    import torch

    warnings.filterwarnings("ignore", message=".*worker processes in total.*")  # 8 workers on small CI boxes
    n, n_layers = mp.shape[:2]
    plans = [(np.repeat(rng.choice(n, size=b, replace=False), 2),
              np.concatenate([rng.choice(n_layers, size=2, replace=False) for _ in range(b)])) for _ in range(n_batches)]
    out = []
    for w in workers:
        row: dict[str, Any] = {"workers": w}
        for kind in ("zarr", "memmap"):
            ds = PairBatches(kind, reader.path, (mp.shape, mr.shape), plans, root / "prompt.bin", root / "response.bin")
            loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=w,
                                                 prefetch_factor=2 if w else None)
            it = iter(loader)
            next(it)  # workers started, handles opened
            t = time.perf_counter()
            count = 1
            for _ in it:
                count += 1
            dt = time.perf_counter() - t
            row[f"{kind}_pairs_per_s"] = 2 * b * (count - 1) / dt
        row["ratio_vs_memmap"] = row["zarr_pairs_per_s"] / row["memmap_pairs_per_s"]
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (seconds): fewer samples and queries")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--p-max", type=int, default=256)
    ap.add_argument("--queries", type=int, default=10_000)
    ap.add_argument("--api-queries", type=int, default=300, help="queries through zarr-python's own API")
    ap.add_argument("--batch", type=int, default=16, help="b samples per training batch (x 2 layers each)")
    ap.add_argument("--workers", default="0,4,8")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.hidden, args.queries, args.api_queries = 24, 512, 1000, 60
    workers = [int(x) for x in args.workers.split(",")]
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"bench": "zarr_read", "samples": args.samples, "layers": args.layers,
                               "hidden": args.hidden, "P_max": args.p_max, "queries": args.queries,
                               "batch": args.batch, "matrix": [], "target_batch_ratio": 0.5}
    print(f"N={args.samples} L={args.layers} H={args.hidden} P_max={args.p_max} queries={args.queries} "
          f"(latencies in us: mean/median/p95; ratio = memmap time / zarr time, >1 = zarr faster)")
    for r_max in (32, 64, 128):
        for t_chunk in (64, 128, 256):
            t_chunk = min(t_chunk, args.p_max)
            root = Path(tempfile.mkdtemp(prefix="actlake-zarr-bench-"))
            try:
                reader, mp, mr, write_s = build(root, args.samples, args.layers, args.p_max, r_max, t_chunk,
                                                args.hidden, rng)
                assert np.array_equal(reader.get(3, 1), mp[3, 1]) and np.array_equal(reader.get_response(2, 0), mr[2, 0])
                pairs = np.stack([rng.integers(0, args.samples, args.queries),
                                  rng.integers(0, args.layers, args.queries)], axis=1)
                row: dict[str, Any] = {"R_max": r_max, "T_chunk_prompt": t_chunk,
                                       "prompt_chunk_kib": t_chunk * args.hidden * 2 / 1024, "write_s": write_s}
                for part, get, mm in (("prompt", reader.get, mp), ("response", reader.get_response, mr)):
                    z = stats(latencies(get, pairs))
                    m = stats(latencies(lambda i, li, mm=mm: np.array(mm[i, li]), pairs))
                    row[part] = {"zarr": z, "memmap": m, "ratio_mean": m["mean_us"] / z["mean_us"]}
                api = zl.ZarrReader(reader.path, fast=False)
                sub = pairs[: args.api_queries]
                row["prompt"]["zarr_api"] = stats(latencies(api.get, sub))
                row["response"]["zarr_api"] = stats(latencies(api.get_response, sub))
                row["batch_assembly"] = batch_assembly(reader, mp, mr, min(args.batch, args.samples), 20, rng)
                row["last_token"] = last_token_bench(reader, api, mp)
                if r_max == 64 and t_chunk == min(128, args.p_max):
                    row["dataloader"] = dataloader_bench(reader, root, mp, mr, min(args.batch, args.samples), 40,
                                                         workers, rng)
                results["matrix"].append(row)
                p, r, b = row["prompt"], row["response"], row["batch_assembly"]
                print(f"R_max={r_max:3d} T_chunk={t_chunk:3d} ({row['prompt_chunk_kib']:.0f} KiB chunks)  "
                      f"prompt zarr {p['zarr']['mean_us']:.0f}/{p['zarr']['median_us']:.0f}/{p['zarr']['p95_us']:.0f} "
                      f"memmap {p['memmap']['mean_us']:.0f}/{p['memmap']['median_us']:.0f}/{p['memmap']['p95_us']:.0f} "
                      f"zarr-api {p['zarr_api']['mean_us']:.0f}  | response zarr {r['zarr']['mean_us']:.0f}/"
                      f"{r['zarr']['median_us']:.0f}/{r['zarr']['p95_us']:.0f} memmap {r['memmap']['mean_us']:.0f}/"
                      f"{r['memmap']['median_us']:.0f}/{r['memmap']['p95_us']:.0f} zarr-api {r['zarr_api']['mean_us']:.0f}"
                      f"  | batch {b['zarr_ms_per_batch']:.2f} ms vs memmap {b['memmap_ms_per_batch']:.2f} ms "
                      f"= {b['ratio_vs_memmap']:.2f}x")
                lt = row["last_token"]
                print(f"    last_token (N={args.samples}, one layer): zarr {lt['zarr_ms']:.2f} ms, zarr-api "
                      f"{lt['zarr_api_ms']:.2f} ms, memmap {lt['memmap_ms']:.2f} ms = {lt['ratio_vs_memmap']:.2f}x")
                for d in row.get("dataloader", []):
                    print(f"    DataLoader workers={d['workers']}: zarr {d['zarr_pairs_per_s']:,.0f} pairs/s, memmap "
                          f"{d['memmap_pairs_per_s']:,.0f} pairs/s = {d['ratio_vs_memmap']:.2f}x")
                del reader, mp, mr, api
            finally:
                remove_tree(root)
    ratios = [row["batch_assembly"]["ratio_vs_memmap"] for row in results["matrix"]]
    results["min_batch_ratio"] = min(ratios)
    results["meets_target"] = min(ratios) >= 0.5
    print(f"batch assembly vs memmap: min {min(ratios):.2f}x, max {max(ratios):.2f}x (target >= 0.5x)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
