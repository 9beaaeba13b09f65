"""Benchmark: reads of remote stores through moto's S3 server vs the same stores on local disk.

Starts `moto_server` on a free loopback port (stopped by process group at the end), writes one store with random
activations (saev, float32), converts it to zarr (fp16) and lmprobe (full_sequence, float32), uploads the three
with actlake's upload (checksums.json last), then times, in the same run:
- zarr and lmprobe: every real token of one layer (`token_segments`) read remotely (zarr through zarr's
  FsspecStore, lmprobe by byte ranges) vs the local store (warm page cache);
- saev: the first open of the URL (download into the cache, every file checked) and the second open + read of
  every token (the cache: a local read) vs the same read of the local store (target >= 0.9).
Prints the ratios (remote throughput / local throughput) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmprobe_read import timed  # noqa: E402  (median of repeats after a warm-up, as every bench here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    moto = Path(sys.executable).parent / "moto_server"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            if urllib.request.urlopen(url + "/", timeout=1).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"moto_server did not start: {log.read_text()[-2000:]}")


def write_saev(root: Path, n: int, t: int, d: int) -> Path:
    from actlake.batch import Batch
    from actlake.formats import create_writer
    from actlake.spec import StoreSpec

    rng = np.random.default_rng(0)
    lengths = rng.integers(t // 2, t + 1, size=n)
    spec = StoreSpec(layers=(3,), d_model=d, max_tokens=t, n_samples=n, model_name="bench/model", family="synthetic",
                     options={"patches_per_shard": int(lengths.sum())})
    writer = create_writer("saev", root, spec)
    for s in range(0, n, 64):
        b = min(64, n - s)
        acts = rng.standard_normal((b, 1, t, d), dtype=np.float32)
        writer.write_batch(Batch(acts_bltd=acts, lengths=lengths[s : s + b], sample_ids=np.arange(s, s + b),
                                 texts=[f"bench text {i}" for i in range(s, s + b)]))
    return Path(writer.close())


def all_tokens(reader) -> np.ndarray:
    return np.concatenate([np.asarray(seg.rows_2d)[seg.row_index()] for seg in reader.token_segments(3)])


def read_all(target: str | Path) -> np.ndarray:
    import actlake

    with actlake.open(target) as reader:
        return all_tokens(reader)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (128 samples)")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--t", type=int, default=64)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n, repeats = (128, 3) if args.quick else (args.n, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        proc, endpoint = start_moto(tmp_path / "moto.log")
        try:
            os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                              AWS_DEFAULT_REGION="us-east-1", ACTLAKE_CACHE=str(tmp_path / "cache"))
            import s3fs

            from actlake.convert import convert
            from actlake.remote.publish import upload_store

            s3fs.S3FileSystem().mkdir("bench")
            saev = write_saev(tmp_path / "saev", n, args.t, args.d)
            local = {"saev": saev,
                     "zarr": Path(convert(saev, "zarr", tmp_path / "zarr")),
                     "lmprobe": Path(convert(saev, "lmprobe", tmp_path / "lmprobe", {"storage": "full_sequence"}))}
            remote = {fmt: upload_store(path, f"s3://bench/{fmt}/{path.name}") for fmt, path in local.items()}
            results: dict[str, object] = {"n": n, "t": args.t, "d": args.d, "endpoint": "moto_server (loopback)"}
            for fmt in ("zarr", "lmprobe"):
                t_local, ref = timed(lambda: read_all(local[fmt]), repeats)
                t_remote, got = timed(lambda: read_all(remote[fmt]), repeats)
                assert np.array_equal(ref, got), f"{fmt}: remote values differ"
                nbytes = ref.nbytes
                results[fmt] = {"bytes": nbytes, "local_s": t_local, "remote_s": t_remote,
                                "local_mbps": nbytes / t_local / 1e6, "remote_mbps": nbytes / t_remote / 1e6,
                                "ratio": t_local / t_remote}
                print(f"{fmt:>8}: all tokens of one layer ({nbytes / 1e6:.1f} MB, open included): local "
                      f"{t_local * 1e3:.0f} ms, s3 (moto) {t_remote * 1e3:.0f} ms; remote/local throughput "
                      f"{t_local / t_remote:.3f}x")
            t0 = time.perf_counter()
            first = read_all(remote["saev"])  # download into the cache, every file checked
            t_first = time.perf_counter() - t0
            t_local, ref = timed(lambda: read_all(local["saev"]), repeats)
            t_cached, got = timed(lambda: read_all(remote["saev"]), repeats)
            assert np.array_equal(ref, got) and np.array_equal(ref, first), "saev: cached values differ"
            results["saev"] = {"bytes": ref.nbytes, "first_open_s": t_first, "local_s": t_local, "cached_s": t_cached,
                               "ratio": t_local / t_cached}
            print(f"{'saev':>8}: first open of the URL (download + check) {t_first * 1e3:.0f} ms; then all tokens "
                  f"({ref.nbytes / 1e6:.1f} MB, open included): local {t_local * 1e3:.1f} ms, cache "
                  f"{t_cached * 1e3:.1f} ms; cache/local throughput {t_local / t_cached:.3f}x (target >= 0.9)")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
