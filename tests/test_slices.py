"""Machine slices of one extraction run meet: `actlake extract --num-machines 3` writes every slice under one
run directory per format, the manifest appears when the last slice lands, `actlake.open` reads the run as
one store, and `actlake merge` publishes exactly the store a 1-machine extraction publishes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import actlake
from actlake.cli import main

TEXTS = ["one two three", "four five", "six seven eight nine ten eleven", "twelve", "thirteen fourteen",
         "fifteen sixteen seventeen", "eighteen", "nineteen twenty twenty-one twenty-two"]
FORMATS = ("saev", "zarr", "lmprobe", "pickle")


def _extract(out: Path, data: Path, fmt: str, *extra: str) -> None:
    args = ["extract", "--model", "tiny-random:bert", "--data", str(data), "--layers", "0,1", "--format", fmt,
            "--out", str(out), "--max-seq-len", "12", "--batch-size", "3", "--no-progress", *extra]
    if fmt == "lmprobe":
        args += ["--option", "storage=full_sequence"]
    assert main(args) == 0


def _only_child(root: Path) -> Path:
    [child] = [p for p in root.iterdir() if not p.name.startswith(".")]
    return child


@pytest.mark.parametrize("fmt", FORMATS)
def test_three_machine_slices_meet_in_one_run(tmp_path: Path, fmt: str) -> None:
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    for m in range(3):
        _extract(tmp_path / "sliced", data, fmt, "--num-machines", "3", "--machine-id", str(m))
        run = _only_child(tmp_path / "sliced")  # every machine writes under the one run directory
        assert (run / "manifest.json").is_file() == (m == 2), "the manifest is written when the last slice lands"
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    counts = [s["n_samples"] for s in manifest.get("slices", manifest.get("shards", []))]
    assert len(counts) == 3 and sum(counts) == len(TEXTS)
    if fmt == "zarr":  # fixed shapes come from the whole dataset, so every shard has the same P_max
        attrs = [json.loads((run / s["path"] / ".zattrs").read_text()) for s in manifest["shards"]]
        assert len({a["P_max"] for a in attrs}) == 1

    _extract(tmp_path / "single", data, fmt)
    single = _only_child(tmp_path / "single")
    assert main(["merge", str(run), "--out", str(tmp_path / "merged"), "--no-progress"]) == 0
    merged = _only_child(tmp_path / "merged")
    assert merged.name == single.name  # the same content-addressed name a 1-machine run publishes
    assert actlake.verify(merged) == []

    with actlake.open(run) as whole, actlake.open(single) as one, actlake.open(merged) as joined:
        assert whole.n_samples == one.n_samples == joined.n_samples == len(TEXTS)
        for reader in (whole, joined):
            assert np.array_equal(np.asarray(reader.sample_ids), np.asarray(one.sample_ids))
        for i in range(len(TEXTS)):
            for layer in (0, 1):
                # merging is lossless; a 1-machine run batches texts differently (float rounding only)
                np.testing.assert_array_equal(joined.get(i, layer), whole.get(i, layer))
                np.testing.assert_allclose(joined.get(i, layer), one.get(i, layer), rtol=0, atol=1e-5)
