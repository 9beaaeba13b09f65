"""`actlake verify` throughput (checksums.json plus the NaN / Inf pass) vs plain reads of the same files, same run.

Builds a saev store of about `--mib` MiB (all tokens real, so every byte is data), then times, from the page
cache (each pass follows one warm-up read): a plain read of every file in 8 MiB blocks on one thread (the
physical baseline: no hashing), hashlib sha256 over those blocks on one thread (the hash alone),
`actlake.checksums.check_store` (the byte check of `verify` and `open(verify=True)`), and the whole
`actlake.verify` (spec structure, checksums and the NaN / Inf scan in one streaming pass). Prints GB/s, ratios to
the plain read and to sha256 on one thread (the hash bounds verify from the page cache; a disk is slower than
both), and a final JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

import actlake
from actlake.batch import Batch
from actlake.checksums import check_store
from actlake.formats.saev import SaevMetadata, SaevWriter, encode_data

BLOCK = 8 << 20


def build_store(root: Path, mib: int, rng: np.random.Generator) -> Path:
    """A saev store of about `mib` MiB of float32 activations, every token real."""
    t, d, layers = 64, 768, (0, 1)
    n = max(8, mib * 2**20 // (len(layers) * t * d * 4)) // 4 * 4  # four full shards: no holes
    md = SaevMetadata(family="bert", ckpt="bench", layers=layers, patches_per_ex=t, cls_token=False, d_model=d,
                      n_examples=n, patches_per_shard=max(2 * t, (n // 4) * 2 * t), data=encode_data({}))
    writer = SaevWriter(root, md, texts=False)
    for s in range(0, n, 64):
        acts = rng.standard_normal((min(64, n - s), len(layers), t, d), dtype=np.float32)
        writer.write_batch(Batch(acts, np.full(len(acts), t), np.arange(s, s + len(acts))))
    return writer.close()


def files_of(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.is_file())


def plain_read(store: Path, digest: bool) -> None:
    """Every file in BLOCK-sized reads on one thread, hashed with sha256 when `digest`."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    for f in files_of(store):
        h = hashlib.sha256() if digest else None
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                if h is not None:
                    h.update(view[:n])


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    fn()  # warm-up: the page cache holds the store afterwards
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=1024, help="store size in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temporary directory)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="actlake-bench-verify-", dir=args.dir))
    try:
        store = build_store(tmp / "shards", args.mib, np.random.default_rng(0))
        size = sum(f.stat().st_size for f in files_of(store))
        assert actlake.verify(store) == [], "the bench store must verify clean"
        timings = {
            "plain read (1 thread)": best_of(args.repeat, lambda: plain_read(store, False)),
            "sha256 read (1 thread)": best_of(args.repeat, lambda: plain_read(store, True)),
            "check_store (checksums)": best_of(args.repeat, lambda: check_store(store)),
            "actlake.verify (all)": best_of(args.repeat, lambda: actlake.verify(store)),
        }
        base, hashing = timings["plain read (1 thread)"], timings["sha256 read (1 thread)"]
        print(f"store: {size / 1e9:.2f} GB, {len(files_of(store))} files; {os.cpu_count()} CPUs; page cache")
        results = {}
        for name, secs in timings.items():
            gbps = size / secs / 1e9
            results[name] = {"seconds": round(secs, 3), "GBps": round(gbps, 2), "vs_plain_read": round(base / secs, 2),
                             "vs_sha256_1_thread": round(hashing / secs, 2)}
            print(f"{name:26s} {secs:7.3f} s  {gbps:6.2f} GB/s  {base / secs:5.2f}x plain read  "
                  f"{hashing / secs:5.2f}x sha256 on 1 thread")
        print(json.dumps({"bytes": size, "results": results}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
