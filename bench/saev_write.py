"""saev writer throughput vs `ndarray.tofile` of the same bytes (+ fsync), measured in the same run.

Target: writer >= 0.8x the baseline. Prints a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from actlake.batch import Batch
from actlake.formats.saev import SaevMetadata, SaevWriter, encode_data


def run_writer(root: Path, acts: np.ndarray, batch: int, budget: int) -> float:
    n, n_layers, t, d = acts.shape
    md = SaevMetadata(family="vit", ckpt="bench", layers=tuple(range(n_layers)), patches_per_ex=t, cls_token=False,
                      d_model=d, n_examples=n, patches_per_shard=budget, data=encode_data({"bench": True}))
    lengths = np.full(n, t)
    ids = np.arange(n)
    start = time.perf_counter()
    writer = SaevWriter(root, md, texts=False)
    for s in range(0, n, batch):
        writer.write_batch(Batch(acts[s : s + batch], lengths[s : s + batch], ids[s : s + batch]))
    writer.close()
    return time.perf_counter() - start


def run_tofile(root: Path, acts: np.ndarray, shards: int) -> float:
    """The physical baseline: the same bytes, as many files as the writer makes, tofile + fsync."""
    start = time.perf_counter()
    for k, part in enumerate(np.array_split(acts, shards)):
        path = root / f"raw{k}.bin"
        with open(path, "wb") as f:
            part.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=512, help="bytes to write per trial")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on the working disk)")
    args = ap.parse_args()
    mib = 96 if args.quick else args.mib
    d, t, n_layers = 768, 64, 2
    n = max(1, (mib << 20) // (n_layers * t * d * 4))
    acts = np.random.default_rng(0).standard_normal((n, n_layers, t, d), dtype=np.float32)
    budget = max(t * n_layers, (n // 4) * t * n_layers)  # about 4 shards
    nbytes = acts.nbytes
    base = Path(args.dir or tempfile.mkdtemp(prefix="actlake-bench-", dir="."))
    writer_s, tofile_s = [], []
    for trial in range(args.trials):
        for kind in ("tofile", "writer") if trial % 2 == 0 else ("writer", "tofile"):
            root = base / f"{kind}{trial}"
            root.mkdir(parents=True)
            if kind == "writer":
                writer_s.append(run_writer(root, acts, batch=32, budget=budget))
            else:
                tofile_s.append(run_tofile(root, acts, shards=4))
            shutil.rmtree(root, ignore_errors=True)
            os.system(f"chmod -R u+w {base} 2>/dev/null")
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    w, b = statistics.median(writer_s), statistics.median(tofile_s)
    result = {
        "bench": "saev_write", "bytes": nbytes, "trials": args.trials,
        "writer_gbps": nbytes / w / 1e9, "tofile_fsync_gbps": nbytes / b / 1e9,
        "ratio_writer_vs_tofile": b / w, "target": 0.8,
    }
    print(f"writer  {result['writer_gbps']:.2f} GB/s   tofile+fsync {result['tofile_fsync_gbps']:.2f} GB/s   "
          f"ratio {result['ratio_writer_vs_tofile']:.2f}x (target >= 0.8x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
