"""`actlake convert`: A -> B -> A round trips over every format, bounded batches, CLI, verify on every output.

Every format is parametrised (no skips): a format whose module is missing or broken fails here.
Comparisons are within the narrowest dtype involved: float32 exact through saev and pickle,
float16 rounding through zarr, last tokens only through pooled lmprobe (docs/formats/convert.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import actlake
from actlake import convert as convert_mod
from actlake.cli import main as cli_main
from actlake.convert import batch_size_for, convert, spec_for
from actlake.options import parse_options
from actlake.errors import ConfigError, UnknownFormatError
from actlake.formats import available_formats, detect_format

from .conftest import write_saev

FORMATS = ["saev", "zarr", "lmprobe", "pickle"]
LAYERS = (3, 0)
N, T, D = 7, 5, 8


@pytest.fixture
def source(rng: np.random.Generator) -> dict:
    acts = rng.standard_normal((N, len(LAYERS), T, D)).astype(np.float32)
    lengths = rng.integers(1, T + 1, N)
    lengths[2] = T
    return {"acts": acts, "lengths": lengths, "texts": [f"text number {i} " * (i + 1) for i in range(N)],
            "labels": np.array([0, 1, 1, 0, 1, 0, 0]), "sample_ids": np.arange(N, dtype=np.int64) * 3 + 11}


def saev_store(root: Path, src: dict) -> Path:
    return write_saev(root, src["acts"], layers=LAYERS, lengths=src["lengths"], texts=src["texts"],
                      labels=src["labels"], sample_ids=src["sample_ids"], family="gpt2")


def plain_saev(path: Path) -> dict:
    """A saev store read with plain json + numpy (saev-protocol-2.1 layout plus actlake's documented extra files)."""
    md = json.loads((path / "metadata.json").read_text())
    shards = json.loads((path / "shards.json").read_text())
    n_layers, t, d = len(md["layers"]), md["patches_per_ex"] + int(md["cls_token"]), md["d_model"]
    acts = np.concatenate([np.fromfile(path / s["name"], dtype="<f4")[: s["n_examples"] * n_layers * t * d]
                           .reshape(s["n_examples"], n_layers, t, d) for s in shards])
    lines = [json.loads(x) for x in (path / "samples.jsonl").read_text().splitlines()]
    return {"layers": tuple(md["layers"]), "acts": acts, "lengths": np.fromfile(path / "lengths.bin", "<i4"),
            "sample_ids": np.fromfile(path / "sample_ids.bin", "<i8"), "texts": [x.get("text") for x in lines],
            "labels": np.array([x.get("label", -1) for x in lines])}


def check_plain_saev(path: Path, src: dict, via: str, options: dict) -> None:
    """The saev files at `path`, read with plain numpy, hold the source (within `via`'s dtype), zero padded."""
    got = plain_saev(path)
    assert got["layers"] == LAYERS and got["acts"].shape[0] == N
    np.testing.assert_array_equal(got["sample_ids"], src["sample_ids"])
    np.testing.assert_array_equal(got["labels"], src["labels"])
    assert got["texts"] == src["texts"]
    np.testing.assert_array_equal(got["lengths"], np.ones(N) if pooled(via, options) else src["lengths"])
    for i in range(N):
        for j in range(len(LAYERS)):
            want = expected(src, i, j, via, options)
            np.testing.assert_array_equal(got["acts"][i, j, : want.shape[0]], want)
            assert not got["acts"][i, j, want.shape[0] :].any()


def pickle_store(root: Path, src: dict) -> Path:
    """The source written as pickle shards by converting the saev fixture (the path under test elsewhere)."""
    return convert(saev_store(root / "saev-src", src), "pickle", root / "pickle-src", {"shard_bytes": 600})


def narrow(x: np.ndarray, fmt: str) -> np.ndarray:
    """What a float32 array becomes after a trip through `fmt`'s storage dtype."""
    return x.astype(np.float16).astype(np.float32) if fmt == "zarr" else x


def pooled(fmt: str, options: dict) -> bool:
    return fmt == "lmprobe" and options.get("storage", "pooled") == "pooled"


def expected(src: dict, i: int, j: int, via: str, options: dict) -> np.ndarray:
    """The (T_i, D) activations sample i, layer position j should have after a trip through `via`."""
    n = int(src["lengths"][i])
    rows = src["acts"][i, j, n - 1 : n] if pooled(via, options) else src["acts"][i, j, :n]
    return narrow(rows, via)


def check_same(reader: actlake.Reader, src: dict, via: str, options: dict) -> None:
    """The reader holds the source's samples, metadata and activations (within `via`'s dtype).

    A pooled lmprobe store keeps one (last-token) row per sample, so after it every sample has
    length 1 and its one row is the source's last token.
    """
    assert reader.n_samples == N and tuple(reader.layers) == LAYERS and reader.d_model == D
    np.testing.assert_array_equal(reader.sample_ids, src["sample_ids"])
    np.testing.assert_array_equal(reader.labels, src["labels"])
    assert reader.texts == src["texts"]
    np.testing.assert_array_equal(reader.lengths, np.ones(N) if pooled(via, options) else src["lengths"])
    for j, layer in enumerate(LAYERS):
        want_last = narrow(src["acts"][np.arange(N), j, src["lengths"] - 1], via)
        np.testing.assert_array_equal(reader.last_token(layer), want_last)
        for i in range(N):
            np.testing.assert_array_equal(reader.get(i, layer), expected(src, i, j, via, options))


CASES = [(fmt, {}) for fmt in FORMATS] + [("lmprobe", {"storage": "full_sequence"})]
IDS = [fmt if not opts else f"{fmt}-{opts['storage']}" for fmt, opts in CASES]


def test_every_format_is_registered() -> None:
    assert sorted(available_formats()) == sorted(FORMATS)


@pytest.mark.parametrize("via, options", CASES, ids=IDS)
def test_saev_round_trip_through(tmp_path: Path, source: dict, via: str, options: dict) -> None:
    """saev -> via -> saev keeps arrays (narrowest dtype), sample ids, texts, labels and lengths."""
    a = saev_store(tmp_path / "a", source)
    b = convert(a, via, tmp_path / "b", options)
    assert detect_format(b) == via and actlake.verify(b) == []
    check_same(actlake.open(b), source, via, options)
    back = convert(b, "saev", tmp_path / "c")
    assert detect_format(back) == "saev" and actlake.verify(back) == []
    check_same(actlake.open(back), source, via, options)
    check_plain_saev(back, source, via, options)


@pytest.mark.parametrize("via, options", CASES, ids=IDS)
def test_pickle_round_trip_through(tmp_path: Path, source: dict, via: str, options: dict) -> None:
    """pickle -> via -> pickle, checked on the final shards with plain gzip + pickle."""
    import gzip
    import pickle

    a = pickle_store(tmp_path, source)
    b = convert(a, via, tmp_path / "b", options)
    assert actlake.verify(b) == []
    back = convert(b, "pickle", tmp_path / "c")
    assert actlake.verify(back) == []
    check_same(actlake.open(back), source, via, options)
    md = json.loads((back / "metadata.json").read_text())
    pos = 0
    for info in md["shards"]:
        with gzip.open(back / info["filename"], "rb") as f:
            shard = pickle.load(f)
        assert list(shard) == [f"layer_{x}" for x in LAYERS]
        for j, layer in enumerate(LAYERS):
            for k, item in enumerate(shard[f"layer_{layer}"]):
                i = pos + k
                assert item["sample_idx"] == source["sample_ids"][i]
                assert item["metadata"]["label"] == source["labels"][i]
                assert item["metadata"].get("text", item["text_preview"]) == source["texts"][i]
                want = expected(source, i, j, via, options)
                assert item["metadata"]["token_count"] == want.shape[0]
                act = item["activation"]  # padded to max_seq_length (docs/formats/pickle.md)
                assert act.shape == (md["extraction_config"]["max_seq_length"], D)
                np.testing.assert_array_equal(act[: want.shape[0]], want)
                assert not act[want.shape[0] :].any()
        pos += info["num_samples"]
    assert pos == N


def test_saev_pickle_saev_is_exact_and_keeps_provenance(tmp_path: Path, source: dict) -> None:
    a = saev_store(tmp_path / "a", source)
    p = convert(a, "pickle", tmp_path / "p", {"shard_bytes": 500, "compressed": False})
    md = json.loads((p / "metadata.json").read_text())
    assert len(md["shards"]) > 1 and all(s["filename"].endswith(".pkl") for s in md["shards"])
    assert md["extraction_config"]["model_name"] == "test-model"
    assert md["extraction_config"]["model_architecture"] == "gpt2"
    s = convert(p, "saev", tmp_path / "s")
    check_plain_saev(s, source, "pickle", {})  # float32 both ways: bit-exact against the source arrays
    rs = actlake.open(s)
    assert rs.metadata.family == "gpt2" and rs.metadata.ckpt == "test-model"
    assert rs.provenance["converted_from"]["format"] == "pickle"


def test_saev_target_maps_unknown_family_to_text(tmp_path: Path, source: dict) -> None:
    a = saev_store(tmp_path / "a", source)
    p = convert(a, "pickle", tmp_path / "p")
    spec = spec_for(actlake.open(p), "saev")
    assert spec.family == "gpt2" and spec.dtype == "float32"
    reader = actlake.open(p)
    reader.metadata.raw["actlake"]["family"] = "my-own-model"
    assert spec_for(reader, "saev").family == "text"
    assert spec_for(reader, "pickle").family == "my-own-model"
    assert spec_for(reader, "zarr").dtype == "float16"
    assert spec_for(reader, "pickle", {"dtype": "float32", "shard_bytes": 10}).options == {"shard_bytes": 10}
    assert spec_for(reader, "lmprobe", {"dtype": "float16"}).dtype == "float16"
    for fmt, dtype in (("saev", "float16"), ("pickle", "float16"), ("zarr", "float32")):
        with pytest.raises(ConfigError, match="only"):
            spec_for(reader, fmt, {"dtype": dtype})  # the spec fixes the stored dtype: no silent mismatch
    with pytest.raises(ConfigError):
        spec_for(reader, "pickle", {"dtype": "int8"})
    with pytest.raises(UnknownFormatError):
        spec_for(reader, "hdf5")


def test_batches_stay_within_the_byte_budget(tmp_path: Path, source: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    a = saev_store(tmp_path / "a", source)
    per_sample = len(LAYERS) * T * D * 4
    assert batch_size_for(actlake.open(a), 2 * per_sample + 1) == 2
    assert batch_size_for(actlake.open(a), 1) == 1
    assert batch_size_for(actlake.open(a), 1 << 40) == N
    sizes: list[int] = []
    real = convert_mod.create_writer

    def spying_writer(fmt, root, spec):
        writer = real(fmt, root, spec)
        original = writer.write_batch
        writer.write_batch = lambda batch: (sizes.append(batch.size), original(batch))[1]
        return writer

    monkeypatch.setattr(convert_mod, "create_writer", spying_writer)
    out = convert(a, "pickle", tmp_path / "p", batch_bytes=2 * per_sample)
    assert sizes and max(sizes) <= 2 and sum(sizes) == N
    assert actlake.verify(out) == []


def test_rerun_is_a_noop_and_returns_the_same_store(tmp_path: Path, source: dict) -> None:
    a = saev_store(tmp_path / "a", source)
    first = convert(a, "pickle", tmp_path / "p")
    assert convert(a, "pickle", tmp_path / "p") == first


def test_resumes_an_interrupted_conversion(tmp_path: Path, source: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    a = saev_store(tmp_path / "a", source)
    options = {"shard_bytes": 300}
    reader = actlake.open(a)
    writer = convert_mod.create_writer("pickle", tmp_path / "p", spec_for(reader, "pickle", options))
    writer.write_batch(reader.batch(np.arange(5)))
    writer.abort()  # interrupted after some shards were committed
    firsts: list[int] = []
    real = convert_mod.create_writer

    def spying_writer(fmt, root, spec):
        w = real(fmt, root, spec)
        assert 0 < w.resume_from < N
        original = w.write_batch
        w.write_batch = lambda batch: (firsts.append(int(batch.sample_ids[0])), original(batch))[1]
        return w

    monkeypatch.setattr(convert_mod, "create_writer", spying_writer)
    out = convert(a, "pickle", tmp_path / "p", options)
    assert firsts[0] != source["sample_ids"][0]  # started after the committed shards
    check_same(actlake.open(out), source, "pickle", {})


def test_recreated_source_at_the_same_path_is_converted_again(tmp_path: Path, source: dict) -> None:
    """The target's hashed data carries a fingerprint of the source, so a stale conversion is never reused."""
    import shutil

    from actlake.atomic import remove_tree

    src = tmp_path / "src"
    shutil.copytree(pickle_store(tmp_path / "one", source), src)
    first = convert(src, "saev", tmp_path / "out")
    remove_tree(src)
    relabelled = dict(source, labels=1 - source["labels"])
    shutil.copytree(pickle_store(tmp_path / "two", relabelled), src)
    second = convert(src, "saev", tmp_path / "out")
    assert second != first
    np.testing.assert_array_equal(plain_saev(second)["labels"], relabelled["labels"])
    assert convert(src, "saev", tmp_path / "out") == second  # unchanged source: the rerun finds it


def test_parse_options() -> None:
    assert parse_options(["shard_bytes=1000", "compressed=false", "name=abc", "x=[1,2]"]) == {
        "shard_bytes": 1000, "compressed": False, "name": "abc", "x": [1, 2]}
    assert parse_options(["a=None", "b=True", "c=01", "d=2.5", "e=null"]) == {"a": None, "b": True, "c": "01", "d": 2.5,
                                                                             "e": None}
    with pytest.raises(ConfigError):
        parse_options(["novalue"])


def test_cli_convert_then_verify(tmp_path: Path, source: dict, capsys: pytest.CaptureFixture) -> None:
    a = saev_store(tmp_path / "a", source)
    code = cli_main(["convert", str(a), "--to", "pickle", "--out", str(tmp_path / "p"),
                     "--option", "shard_bytes=400", "--batch-mb", "0.001"])
    assert code == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert detect_format(out) == "pickle" and len(json.loads((out / "metadata.json").read_text())["shards"]) > 1
    assert cli_main(["verify", str(out)]) == 0
    assert cli_main(["convert", str(tmp_path / "missing"), "--to", "saev", "--out", str(tmp_path / "x")]) == 2
    assert cli_main(["convert", str(a), "--to", "saev", "--out", str(tmp_path / "x"), "--batch-mb", "0"]) == 2
    assert "--batch-mb" in capsys.readouterr().err


@pytest.mark.parametrize("via, options", [("zarr", {}), ("lmprobe", {"storage": "full_sequence"}), ("pickle", {}),
                                          ("lmprobe", {})], ids=["zarr", "lmprobe-full_sequence", "pickle", "lmprobe"])
def test_cls_token_survives_every_format(tmp_path: Path, rng: np.random.Generator, via: str, options: dict) -> None:
    """image saev (CLS + 16 patches) -> via -> saev keeps `cls_token: true, patches_per_ex: 16` (plain json); the
    intermediate store records the flag in its own files. A pooled lmprobe row is the last token, never CLS."""
    import pyarrow.parquet as pq

    acts = rng.standard_normal((4, 2, 17, 6)).astype(np.float32)
    src = write_saev(tmp_path / "src", acts, layers=(1, 2), cls_token=True, family="vit")
    mid = convert(src, via, tmp_path / "mid", options)
    if via == "zarr":
        recorded = json.loads((mid / "activations.zarr" / ".zattrs").read_text())["cls_token"]
        zmeta = json.loads((mid / "activations.zarr" / ".zmetadata").read_text())
        assert zmeta["metadata"][".zattrs"]["cls_token"] is recorded
    elif via == "pickle":
        recorded = json.loads((mid / "metadata.json").read_text())["actlake"]["cls_token"]
    else:
        footer = pq.read_schema(next((mid / "index").glob("*.parquet"))).metadata
        recorded = json.loads(footer[b"actlake"])["cls_token"]
    assert recorded is True
    back = convert(mid, "saev", tmp_path / "back")
    md = json.loads((back / "metadata.json").read_text())
    if pooled(via, options):
        assert (md["cls_token"], md["patches_per_ex"]) == (False, 1)  # one stored row per sample: its last token
        return
    assert (md["cls_token"], md["patches_per_ex"]) == (True, 16)
    shard = np.fromfile(back / "acts000000.bin", "<f4").reshape(-1, 2, 17, 6)
    np.testing.assert_array_equal(shard[:4, :, 0], narrow(acts[:, :, 0], via))  # token 0 is still the CLS row
