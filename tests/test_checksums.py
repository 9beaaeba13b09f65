"""checksums.json (docs/formats.md, "Checksums"): written by every writer, merge and convert, checked here with
plain json + hashlib against the files on disk; verify and `actlake.open(path, verify=True)` against damage."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

import actlake
from actlake.atomic import make_writable
from actlake.checksums import CHECKSUMS_NAME, file_digest, write_checksums
from actlake.convert import convert
from actlake.errors import HashMismatchError, MissingFileError
from actlake.formats import pickle_shards, zarr_logger
from actlake.verification import VerifyWarning

from .conftest import flip_bit, write_saev

FORMATS = ["saev", "zarr", "lmprobe", "pickle"]
LAYERS = (1, 4)
N, T, D = 6, 5, 8
#: small shards, so that every format writes several data files
OPTIONS = {"saev": {"patches_per_shard": T * len(LAYERS) * 4}, "zarr": {}, "lmprobe": {"storage": "full_sequence"},
           "pickle": {"shard_bytes": 400}}


def plain_digest(path: Path, block: int) -> str:
    """sha256 of the concatenated sha256 digests of the file's consecutive `block`-byte blocks (plain hashlib)."""
    digests = []
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digests.append(hashlib.sha256(chunk).digest())
    return hashlib.sha256(b"".join(digests)).hexdigest()


def check_checksums_file(root: Path) -> None:
    """checksums.json lists exactly the files under `root` (but itself), in component order, with their sizes and
    digests recomputed here with hashlib; it is valid JSON written one entry per line."""
    text = (root / CHECKSUMS_NAME).read_text()
    doc = json.loads(text)
    assert (doc["format"], doc["version"], doc["algorithm"], doc["block_bytes"]) == \
        ("actlake-checksums", 1, "sha256-blocks", 8 << 20)
    lines = text.splitlines()
    assert lines[0].endswith('"files": [') and lines[-1] == "]}" and len(lines) == len(doc["files"]) + 2
    on_disk = sorted(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                     for d, _, files in os.walk(root) for f in files if (d, f) != (str(root), CHECKSUMS_NAME))
    listed = [rel for rel, _, _ in doc["files"]]
    assert sorted(listed) == on_disk
    assert listed == sorted(listed, key=lambda rel: rel.split("/"))
    for rel, size, digest in doc["files"]:
        assert not (root / rel).is_symlink()
        assert os.path.getsize(root / rel) == size
        assert plain_digest(root / rel, doc["block_bytes"]) == digest, rel


@pytest.fixture
def source(tmp_path: Path, rng: np.random.Generator) -> Path:
    acts = rng.standard_normal((N, len(LAYERS), T, D)).astype(np.float32)
    lengths = np.array([5, 1, 3, 5, 2, 4])
    return write_saev(tmp_path / "src", acts, layers=LAYERS, lengths=lengths, texts=[f"text {i}" for i in range(N)],
                      patches_per_shard=T * len(LAYERS) * 4)


def store_root(path: Path, fmt: str) -> Path:
    """The directory that carries checksums.json (zarr: the store inside its run directory)."""
    return path / "activations.zarr" if fmt == "zarr" and (path / "activations.zarr").is_dir() else path


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_written_store_lists_its_files(tmp_path: Path, source: Path, fmt: str) -> None:
    check_checksums_file(source)  # the saev writer
    out = convert(source, fmt, tmp_path / "out", OPTIONS[fmt])  # convert goes through each writer
    root = store_root(out, fmt)
    check_checksums_file(root)
    assert actlake.verify_report(out).warnings == ()
    with actlake.open(out, verify=True) as reader:
        assert reader.n_samples == N


def test_merge_outputs_carry_checksums(tmp_path: Path, source: Path) -> None:
    z = convert(source, "zarr", tmp_path / "z")
    merged = zarr_logger.merge([z], tmp_path / "zm")
    check_checksums_file(merged)
    p = convert(source, "pickle", tmp_path / "p", OPTIONS["pickle"])
    joined = pickle_shards.merge([p], tmp_path / "pm" / "joined")
    check_checksums_file(joined)
    assert actlake.verify(merged) == [] and actlake.verify(joined) == []


def test_sparse_and_dense_files_have_one_digest(tmp_path: Path) -> None:
    """A block inside a hole is not read, yet digests like the zeros it holds (a copy without holes agrees)."""
    sparse, dense = tmp_path / "sparse.bin", tmp_path / "dense.bin"
    size = 3 * (8 << 20) + 123
    with open(sparse, "wb") as f:
        f.write(b"head")
        f.truncate(size)
    dense.write_bytes(sparse.read_bytes())
    assert file_digest(sparse) == file_digest(dense) == plain_digest(dense, 8 << 20)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_digest(empty) == hashlib.sha256(b"").hexdigest()


def _data_file(root: Path, fmt: str) -> Path:
    return {"saev": root / "acts000000.bin", "zarr": root / "arrays" / "prompt_activations" / "0.0.0.0",
            "lmprobe": root / "tensors" / "hidden_layer001_shard000.safetensors",
            "pickle": root / "shard_0001.pkl.gz"}[fmt]


def _writable(path: Path) -> None:
    make_writable(path)



@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_byte_fails_verify_and_open_verify(tmp_path: Path, source: Path, fmt: str) -> None:
    out = convert(source, fmt, tmp_path / "out", OPTIONS[fmt])
    _writable(out)
    root = store_root(out, fmt)
    victim = _data_file(root, fmt)
    flip_bit(victim, os.path.getsize(victim) - 3)
    problems = actlake.verify(out)
    assert any(str(victim) in p and "does not match checksums.json" in p for p in problems), problems
    with pytest.raises(HashMismatchError) as exc:
        actlake.open(out, verify=True)
    assert exc.value.path == victim


def test_store_without_checksums_verifies_with_a_warning(tmp_path: Path, source: Path) -> None:
    out = convert(source, "zarr", tmp_path / "out")
    _writable(out)
    (out / "activations.zarr" / CHECKSUMS_NAME).unlink()
    report = actlake.verify_report(out)
    assert report.ok and len(report.warnings) == 1
    assert "checksums.json" in report.warnings[0] and "not checked" in report.warnings[0]
    with pytest.warns(VerifyWarning, match="checksums.json"):
        actlake.open(out, verify=True).close()


def test_added_and_removed_files_are_problems(tmp_path: Path, source: Path) -> None:
    out = convert(source, "pickle", tmp_path / "out", OPTIONS["pickle"])
    _writable(out)
    (out / "notes.txt").write_text("added later")
    problems = actlake.verify(out)
    assert any("notes.txt" in p and "not listed in checksums.json" in p for p in problems)
    (out / "notes.txt").unlink()
    (out / "shard_0002.pkl.gz").unlink()
    with pytest.raises(MissingFileError) as exc:
        actlake.open(out, verify=True)
    assert exc.value.path == out / "shard_0002.pkl.gz"


def test_any_json_layout_of_the_same_content_is_read(tmp_path: Path, source: Path) -> None:
    """The line layout is streamed; the same document re-indented by another tool is parsed whole."""
    root = source
    _writable(root)
    doc = json.loads((root / CHECKSUMS_NAME).read_text())
    (root / CHECKSUMS_NAME).write_text(json.dumps(doc, indent=2))
    assert actlake.verify_report(root).problems == ()


@pytest.mark.parametrize("damage, needle", [
    (lambda t: t.replace('"sha256-blocks"', '"md5"'), "algorithm"),
    (lambda t: t.replace('"block_bytes": 8388608', '"block_bytes": 3'), "block_bytes"),
    (lambda t: t[: t.rindex("]}")], "closing"),
    (lambda t: t.replace('["labels.bin"', '["../labels.bin"', 1), "not a path inside the store"),
    (lambda t: t.replace('["lengths.bin", ', '["lengths.bin" ', 1), "is not a JSON entry"),
    (lambda t: "\n".join(t.splitlines()[:2] + t.splitlines()[1:]), "out of order or listed twice"),
    (lambda t: t.replace("]}", "x" * 70_000 + "\n]}"), "longer than"),
])
def test_damaged_checksums_file_is_a_problem(tmp_path: Path, source: Path, damage, needle: str) -> None:
    root = source
    _writable(root)
    f = root / CHECKSUMS_NAME
    f.write_text(damage(f.read_text()))
    problems = actlake.verify(root)
    assert any(CHECKSUMS_NAME in p and needle in p for p in problems), problems


def test_rewriting_checksums_is_idempotent(tmp_path: Path, source: Path) -> None:
    _writable(source)
    before = (source / CHECKSUMS_NAME).read_bytes()
    write_checksums(source)
    assert (source / CHECKSUMS_NAME).read_bytes() == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sealed store verifies without warnings
        assert actlake.verify(source) == []
