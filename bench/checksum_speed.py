"""Checksum throughput of the candidate hashes for checksums.json, on one file of 1 GiB (by default).

Each candidate reads the file in 8 MiB blocks (what `actlake.checksums` does) and is timed twice:
from the page cache (the file was just written) and over an in-memory buffer (hash cost alone).
Candidates: hashlib sha256 (SHA-NI where the CPU has it), hashlib blake2b, zlib.crc32, and
xxhash xxh3_128 when that package happens to be installed (it is not a dependency of actlake).
Prints one line per candidate and a final JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable

BLOCK = 8 << 20


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)


def candidates() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "blake2b": hashlib.blake2b, "crc32": _Crc32}
    try:
        import xxhash

        out["xxh3_128 (not a dependency)"] = xxhash.xxh3_128
    except ImportError:
        pass
    return out


def time_file(path: Path, make: Callable[[], Any]) -> float:
    h = make()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return time.perf_counter() - t0


def time_memory(data: bytes, make: Callable[[], Any]) -> float:
    h = make()
    view = memoryview(data)
    t0 = time.perf_counter()
    for off in range(0, len(data), BLOCK):
        h.update(view[off : off + BLOCK])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=1024, help="file size in MiB")
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")
    args = ap.parse_args()
    nbytes = args.mib << 20
    data = os.urandom(nbytes)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "blob.bin"
        path.write_bytes(data)
        time_file(path, candidates()["crc32"])  # warm the page cache
        results = {}
        for name, make in candidates().items():
            t_file = min(time_file(path, make) for _ in range(2))
            t_mem = min(time_memory(data, make) for _ in range(2))
            results[name] = {"file_GBps": round(nbytes / t_file / 1e9, 2), "memory_GBps": round(nbytes / t_mem / 1e9, 2)}
            print(f"{name:28s} file (page cache) {results[name]['file_GBps']:6.2f} GB/s   "
                  f"memory {results[name]['memory_GBps']:6.2f} GB/s")
    print(json.dumps({"bytes": nbytes, "results": results}))


if __name__ == "__main__":
    main()
