"""Hostile stores of every format, run through the real command line in a child process under a 2 GiB
address-space limit: each must end in a typed error or a verify problem that names the file, with no
traceback, bounded memory and bounded time (the child is killed after HANG_S)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import pytest

from actlake.atomic import make_writable

ADDRESS_SPACE = 2 * 2**30
HANG_S = 60  # a guard against hangs, not a timing assertion: a bounded case ends in about a second
TEXTS = ["one two three", "four five", "six seven eight nine ten", "eleven", "twelve thirteen"]
LMPROBE_INDEX = "index/train-00000-of-00001.parquet"


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """`actlake ARGV` in a child process under the address-space limit."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "actlake.cli", *argv], capture_output=True, text=True,
                          timeout=HANG_S, preexec_fn=_limit, env=env)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small store per format, written by `actlake extract` (tiny random BERT)."""
    return extract_stores(tmp_path_factory.mktemp("stores"))


def extract_stores(root: Path) -> dict[str, Path]:
    """One small store per format under `root`, written by `actlake extract` (tiny random BERT); store paths."""
    from actlake.cli import main

    data = root / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out: dict[str, Path] = {}
    for fmt in ("saev", "zarr", "lmprobe", "pickle"):
        assert main(["extract", "--model", "tiny-random:bert", "--data", str(data), "--layers", "0", "--format", fmt,
                     "--out", str(root / fmt), "--max-seq-len", "8", "--no-progress"]) == 0
        [store] = [p for p in (root / fmt).iterdir() if not p.name.startswith(".")]
        if fmt == "zarr":
            store = store / "activations.zarr"
        elif fmt == "pickle":
            store = store / "machine_0000"
        out[fmt] = store
    return out


def _copy(store: Path, parent: Path) -> Path:
    """A writable copy under `parent`, keeping the store's (content-addressed) name."""
    dst = parent / store.name
    shutil.copytree(store, dst, symlinks=True)
    make_writable(dst)
    return dst


def _refused(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """A clean refusal: exit 1 (verify found problems) or 2 (the command failed), a message naming the file."""
    text = result.stdout + result.stderr
    assert result.returncode in (1, 2), text
    assert "Traceback" not in text and "MemoryError" not in text, text
    for needle in needles:
        assert needle in text, text


def _set_lmprobe_tensors(store: Path, mutate: Callable[[dict], None]) -> None:
    table = pq.read_table(store / LMPROBE_INDEX)
    meta = dict(table.schema.metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    mutate(tensors)
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(table.replace_schema_metadata(meta), store / LMPROBE_INDEX)


@pytest.mark.parametrize("pattern", ["tensors/{layer:0>1500000000}_{shard}.safetensors",
                                     "tensors/" + "x" * 300 + "{layer}_{shard}.safetensors",
                                     "tensors/{layer.__class__}_{shard}", "tensors/{layer!r}_{shard}"])
def test_lmprobe_file_pattern_is_parsed_before_formatting(stores: dict[str, Path], tmp_path: Path, pattern: str) -> None:
    store = _copy(stores["lmprobe"], tmp_path / "s")
    _set_lmprobe_tensors(store, lambda t: t["hidden_layers"].__setitem__("file_pattern", pattern))
    for command in ("verify", "info"):
        _refused(cli(command, str(store)), "file_pattern")


@pytest.mark.parametrize("fmt,name", [("saev", "metadata.json"), ("zarr", ".zattrs"), ("pickle", "metadata.json")])
def test_deeply_nested_json_is_a_metadata_error(stores: dict[str, Path], tmp_path: Path, fmt: str, name: str) -> None:
    store = _copy(stores[fmt], tmp_path / "s")
    (store / name).write_text("[" * 100_000)
    for command in ("verify", "info"):
        _refused(cli(command, str(store)))


def test_deeply_nested_lmprobe_schema_metadata(stores: dict[str, Path], tmp_path: Path) -> None:
    store = _copy(stores["lmprobe"], tmp_path / "s")
    table = pq.read_table(store / LMPROBE_INDEX)
    meta = {**table.schema.metadata, b"lmprobe:tensors": b"[" * 100_000}
    pq.write_table(table.replace_schema_metadata(meta), store / LMPROBE_INDEX)
    for command in ("verify", "info"):
        _refused(cli(command, str(store)), "lmprobe:tensors")


@pytest.mark.parametrize("fmt,name", [("saev", "metadata.json"), ("saev", "provenance.json"),
                                      ("saev", "samples.jsonl"), ("pickle", "metadata.json"), ("zarr", ".zattrs"),
                                      ("zarr", ".zmetadata"), ("zarr", "text/prompts.jsonl")])
def test_huge_sparse_metadata_is_refused_unread(stores: dict[str, Path], tmp_path: Path, fmt: str, name: str) -> None:
    """zarr's .zattrs is read whole by zarr-python itself: its size is checked before zarr opens the store."""
    store = _copy(stores[fmt], tmp_path / "s")
    with open(store / name, "r+b") as f:
        f.truncate(3 * 2**30)  # 3 GiB of holes: no disk used, but a reader that slurps it needs 3 GiB+
    for command in ("verify", "info"):
        _refused(cli(command, str(store)), name, "more than a")


@pytest.mark.parametrize("fmt,name", [("saev", "samples.jsonl"), ("zarr", "text/prompts.jsonl")])
def test_non_utf8_text_lines(stores: dict[str, Path], tmp_path: Path, fmt: str, name: str) -> None:
    store = _copy(stores[fmt], tmp_path / "s")
    lines = (store / name).read_bytes().splitlines(keepends=True)
    (store / name).write_bytes(b"".join([lines[0].replace(b"one", b"\xff\xfe"), *lines[1:]]))
    _refused(cli("verify", str(store)), name, "line 1 is not valid UTF-8")
    _refused(cli("info", str(store)), name, "line 1 is not valid UTF-8")
