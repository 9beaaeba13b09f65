"""Zarr fp16 activation logger: written stores checked against the spec with plain zarr / json / numpy."""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import actlake
from actlake import Batch, StoreSpec
from actlake.atomic import make_writable
from actlake.checksums import write_checksums
from actlake.cli import main as cli_main
from actlake.errors import (
    ConfigError,
    FormatError,
    MetadataError,
    MissingFileError,
    TruncatedFileError,
    UnsafePathError,
)
from actlake.formats import zarr_logger as zl

N, L, T, H, TR = 11, 3, 20, 16, 12
LAYERS = (0, 2, 5)
P_MAX, R_MAX, T_CHUNK = 12, 8, 5
FP16_RTOL = 2.0**-10


def make_data(seed: int = 0, n: int = N) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "acts": rng.standard_normal((n, L, T, H)).astype(np.float32),
        "resp": rng.standard_normal((n, L, TR, H)).astype(np.float32),
        "lens": np.concatenate([[T, 0, P_MAX, P_MAX + 1], rng.integers(0, T + 1, n - 4)])[:n],
        "rlens": np.concatenate([[TR, 0, R_MAX], rng.integers(0, TR + 1, n - 3)])[:n],
        "ids": np.arange(n, dtype=np.int64) * 10 + 3,
    }


def spec_for(n: int = N, **kw) -> StoreSpec:
    options = {"p_max": P_MAX, "r_max": R_MAX, "t_chunk_prompt": T_CHUNK}
    options.update(kw.pop("options", {}))
    return StoreSpec(layers=LAYERS, d_model=H, max_tokens=T, n_samples=n, model_name="tiny-model",
                     dataset="synthetic-qa", options=options, provenance={"git_commit": "abc123"}, **kw)


def batches(d: dict, lo: int = 0, hi: int | None = None, size: int = 4, response: bool = True):
    hi = len(d["ids"]) if hi is None else hi
    for s in range(lo, hi, size):
        sl = slice(s, min(s + size, hi))
        k = len(range(*sl.indices(hi)))
        ids = d["ids"][sl]
        yield Batch(
            acts_bltd=d["acts"][sl], lengths=d["lens"][sl], sample_ids=ids, texts=[f"prompt {i}" for i in ids],
            labels=ids % 3,
            response_bltd=d["resp"][sl] if response else None, response_lengths=d["rlens"][sl] if response else None,
            response_texts=[f"answer {i}" for i in ids] if response else None,
            extra={"hallu_label": [int(i % 2) for i in ids], "split": ["train", "val", "test", 0][:k],
                   "source": [f"src{i}" for i in ids]},
        )


def write_store(root: Path, d: dict, spec: StoreSpec | None = None, response: bool = True) -> Path:
    writer = zl.create_writer(root, spec or spec_for(len(d["ids"])))
    for b in batches(d, response=response):
        writer.write_batch(b)
    return writer.close()


@pytest.fixture(scope="module")
def data() -> dict:
    return make_data()


@pytest.fixture(scope="module")
def store(tmp_path_factory, data) -> Path:
    run = write_store(tmp_path_factory.mktemp("zarr"), data)
    return run / zl.STORE_NAME


def writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    make_writable(dst)
    return dst


def expected_prompt(d: dict, i: int, j: int, cap: int = P_MAX) -> np.ndarray:
    return d["acts"][i, j, : min(int(d["lens"][i]), cap)].astype(np.float16)


# ---- the written store against the spec --------------------------------------------------------


def test_activation_arrays_follow_the_spec(store: Path, data: dict) -> None:
    for name, t, tc in (("prompt_activations", P_MAX, T_CHUNK), ("response_activations", R_MAX, R_MAX)):
        meta = json.loads((store / "arrays" / name / ".zarray").read_text())
        assert meta["zarr_format"] == 2
        assert meta["shape"] == [N, L, t, H]
        assert meta["chunks"] == [1, 1, tc, H]
        assert meta["dtype"] == "<f2"
        assert meta["compressor"] is None and meta["filters"] is None
        assert meta["fill_value"] == 0 and meta["order"] == "C"
    root = zarr.open_group(str(store), mode="r")
    prompt = root["arrays/prompt_activations"]
    assert prompt.dtype == np.float16 and prompt.shape == (N, L, P_MAX, H)
    full = prompt[:]
    for i in range(N):
        p = min(int(data["lens"][i]), P_MAX)
        for j in range(L):
            src = data["acts"][i, j, :p]
            assert np.allclose(full[i, j, :p].astype(np.float32), src, rtol=FP16_RTOL, atol=1e-6)
            assert np.array_equal(full[i, j, :p], src.astype(np.float16))  # one cast, round to nearest
            assert not full[i, j, p:].any()  # padding is the fill value 0
    resp = root["arrays/response_activations"][:]
    for i in range(N):
        r = min(int(data["rlens"][i]), R_MAX)
        assert np.array_equal(resp[i, :, :r], data["resp"][i, :, :r].astype(np.float16))
        assert not resp[i, :, r:].any()


def test_raw_chunk_files_are_uncompressed_c_order_fp16(store: Path, data: dict) -> None:
    i, j = 0, 1  # sample 0 has T real tokens: every prompt chunk is written
    for c in range(-(-P_MAX // T_CHUNK)):
        raw = np.fromfile(store / "arrays" / "prompt_activations" / f"{i}.{j}.{c}.0", dtype="<f2")
        assert raw.size == T_CHUNK * H  # edge chunks are stored full size
        rows = raw.reshape(T_CHUNK, H)
        k = min(T_CHUNK, P_MAX - c * T_CHUNK)
        want = data["acts"][i, j, c * T_CHUNK : c * T_CHUNK + k].astype(np.float16)
        assert np.array_equal(rows[:k], want)
    raw = np.fromfile(store / "arrays" / "response_activations" / f"{i}.{j}.0.0", dtype="<f2").reshape(R_MAX, H)
    assert np.array_equal(raw, data["resp"][i, j, :R_MAX].astype(np.float16))
    # an all-padding chunk is never written: sample 1 has no prompt tokens
    assert not list((store / "arrays" / "prompt_activations").glob("1.*"))


def test_per_sample_arrays_texts_and_attrs(store: Path, data: dict) -> None:
    root = zarr.open_group(str(store), mode="r")
    arrays = root["arrays"]
    assert arrays["prompt_len"].dtype == np.int32 and arrays["response_len"].dtype == np.int32
    assert np.array_equal(arrays["prompt_len"][:], np.minimum(data["lens"], P_MAX))
    assert np.array_equal(arrays["response_len"][:], np.minimum(data["rlens"], R_MAX))
    assert arrays["sample_id"].dtype == np.int64 and np.array_equal(arrays["sample_id"][:], data["ids"])
    assert arrays["label"].dtype == np.int64 and np.array_equal(arrays["label"][:], data["ids"] % 3)
    assert arrays["hallu_label"].dtype == np.int8 and np.array_equal(arrays["hallu_label"][:], data["ids"] % 2)
    assert arrays["split"].dtype == np.int8 and list(arrays["split"][:4]) == [0, 1, 2, 0]
    keys = arrays["sample_key"][:]
    assert keys.dtype == np.dtype("S64")
    import hashlib

    want0 = hashlib.sha256(json.dumps([3, "prompt 3", "answer 3"], separators=(",", ":")).encode()).hexdigest()
    assert keys[0].decode() == want0
    prompts = [json.loads(x) for x in (store / "text" / "prompts.jsonl").read_text().splitlines()]
    responses = [json.loads(x) for x in (store / "text" / "responses.jsonl").read_text().splitlines()]
    assert len(prompts) == len(responses) == N
    assert prompts[4] == {"i": 4, "sample_key": keys[4].decode(), "prompt": f"prompt {data['ids'][4]}"}
    assert responses[4] == {"i": 4, "sample_key": keys[4].decode(), "response": f"answer {data['ids'][4]}"}
    extra = [json.loads(x) for x in (store / "text" / "extra_metadata.jsonl").read_text().splitlines()]
    assert extra[2]["source"] == f"src{data['ids'][2]}"
    attrs = dict(root.attrs)
    for key in zl.REQUIRED_ATTRS:
        assert key in attrs, key
    assert attrs["schema_version"] == "1.0" and attrs["model_id"] == "tiny-model"
    assert attrs["num_layers"] == L and attrs["layers"] == list(LAYERS) and attrs["hidden_size"] == H
    assert attrs["T_max"] == T and attrs["P_max"] == P_MAX and attrs["R_max"] == R_MAX and attrs["dtype"] == "float16"
    assert attrs["t_chunk_prompt"] == T_CHUNK and attrs["t_chunk_response"] == R_MAX
    assert attrs["dataset_name"] == "synthetic-qa" and attrs["git_commit"] == "abc123"
    pc, rc = int((data["lens"] > P_MAX).sum()), int((data["rlens"] > R_MAX).sum())
    assert pc > 0 and rc > 0
    assert attrs["prompt_truncated_count"] == pc and attrs["response_truncated_count"] == rc
    assert attrs["prompt_truncated_fraction"] == pytest.approx(pc / N)
    assert attrs["response_truncated_fraction"] == pytest.approx(rc / N)


def test_consolidated_metadata_and_read_only(store: Path) -> None:
    zmeta = json.loads((store / ".zmetadata").read_text())
    assert zmeta["zarr_consolidated_format"] == 1
    assert "arrays/prompt_activations/.zarray" in zmeta["metadata"]
    group = zarr.open_consolidated(str(store), mode="r")
    assert group["arrays/response_len"].shape == (N,)
    assert not os.access(store / ".zattrs", os.W_OK) or os.geteuid() == 0
    assert actlake.verify(store) == []
    assert actlake.verify(store.parent) == []


# ---- reader ----------------------------------------------------------------------------------


def test_reader_returns_the_logged_slices(store: Path, data: dict) -> None:
    with actlake.open(store.parent) as r:
        assert isinstance(r, zl.ZarrReader) and r.fast
        assert r.format == "zarr" and r.dtype == np.float16 and r.layers == LAYERS
        assert (r.n_samples, r.d_model, r.max_tokens, r.r_max) == (N, H, P_MAX, R_MAX)
        for i in range(N):
            for j, layer in enumerate(LAYERS):
                x, y = r.get_pair(i, layer)
                assert x.dtype == np.float16 and x.shape == (min(data["lens"][i], P_MAX), H)
                assert np.array_equal(x, expected_prompt(data, i, j))
                assert np.array_equal(y, data["resp"][i, j, : min(data["rlens"][i], R_MAX)].astype(np.float16))
        assert np.array_equal(r.sample_ids, data["ids"])
        assert r.texts[3] == f"prompt {data['ids'][3]}" and r.response_texts[3] == f"answer {data['ids'][3]}"
        assert np.array_equal(r.labels, data["ids"] % 3)
        with pytest.raises(actlake.errors.LayerNotStoredError):
            r.get(0, 1)
        with pytest.raises(actlake.errors.SampleIndexError):
            r.get(N, 0)


def test_fast_path_equals_zarr_api(store: Path) -> None:
    fast, api = zl.ZarrReader(store), zl.ZarrReader(store, fast=False)
    assert fast.fast and not api.fast
    group = zarr.open_consolidated(str(store), mode="r")
    for i in range(N):
        for j, layer in enumerate(LAYERS):
            p = int(fast.lengths[i])
            assert np.array_equal(fast.get(i, layer), group["arrays/prompt_activations"][i, j, :p])
            assert np.array_equal(fast.get(i, layer), api.get(i, layer))
            assert np.array_equal(fast.get_response(i, layer), api.get_response(i, layer))
    for layer in LAYERS:
        assert np.array_equal(fast.last_token(layer), api.last_token(layer))
    b1, b2 = fast.batch([3, 0, 7], [5, 0]), api.batch([3, 0, 7], [5, 0])
    assert np.array_equal(b1.acts_bltd, b2.acts_bltd) and np.array_equal(b1.response_bltd, b2.response_bltd)
    assert np.array_equal(b1.acts_bltd, group["arrays/prompt_activations"][[3, 0, 7]][:, [2, 0]])
    samples, layers = np.array([1, 4, 4, 9]), np.array([2, 0, 5, 2])
    g = fast.gather(samples, layers, part="response")
    want = group["arrays/response_activations"][:][samples, [1, 0, 2, 1]]
    assert np.array_equal(g, want)


def test_batch_carries_every_per_sample_field(store: Path, data: dict) -> None:
    r = actlake.open(store)
    b = r.batch([2, 5])
    assert b.acts_bltd.shape == (2, L, P_MAX, H) and b.response_bltd.shape == (2, L, R_MAX, H)
    assert list(b.lengths) == list(np.minimum(data["lens"][[2, 5]], P_MAX))
    assert list(b.response_lengths) == list(np.minimum(data["rlens"][[2, 5]], R_MAX))
    assert b.extra["hallu_label"] == [int(data["ids"][2] % 2), int(data["ids"][5] % 2)]
    assert b.extra["split"][0] == 2 and b.extra["source"] == [f"src{data['ids'][2]}", f"src{data['ids'][5]}"]
    assert len(b.extra["sample_key"][0]) == 64
    last = r.last_token(2)
    for i in range(N):
        p = int(r.lengths[i])
        want = data["acts"][i, 1, p - 1].astype(np.float16) if p else np.zeros(H, np.float16)
        assert np.array_equal(last[i], want)
    (seg,) = r.token_segments(5)
    for i in (0, 3, 7):
        rows = seg.rows_2d[seg.base_rows[i] : seg.base_rows[i] + seg.lengths[i]]
        assert np.array_equal(rows, expected_prompt(data, i, 2))


def test_reading_one_sample_layer_touches_only_its_chunks(store: Path, monkeypatch) -> None:
    import zarr.storage._local as local

    opened: list[str] = []
    real_open, real_get = os.open, local._get

    def spy_open(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    def spy_get(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_get(path, *args, **kwargs)

    fast, api = zl.ZarrReader(store), zl.ZarrReader(store, fast=False)
    api.root  # metadata opened before counting
    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(local, "_get", spy_get)
    for reader in (fast, api):
        for i, layer, li in ((0, 2, 1), (6, 5, 2)):
            opened.clear()
            reader.get(i, layer)
            reader.get_response(i, layer)
            names = {(Path(p).parent.name, Path(p).name) for p in opened}
            n_prompt = -(-int(reader.lengths[i]) // T_CHUNK)
            want = {("prompt_activations", f"{i}.{li}.{c}.0") for c in range(n_prompt)}
            if reader.response_lengths[i]:
                want.add(("response_activations", f"{i}.{li}.0.0"))
            assert names == want, (type(reader), names)


@functools.lru_cache(maxsize=2)
def _opened(store: Path) -> tuple[zl.ZarrReader, object]:
    return zl.ZarrReader(store), zarr.open_consolidated(str(store), mode="r")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, N - 1), st.integers(0, L - 1), st.integers(0, P_MAX), st.integers(0, P_MAX))
def test_chunk_file_reads_match_zarr_for_any_token_range(store: Path, sample: int, li: int, a: int, b: int) -> None:
    reader, group = _opened(store)
    n = int(reader.lengths[sample])  # reads ask for real tokens only (chunks entirely in padding may be absent)
    t0, t1 = min(a, b, n), min(max(a, b), n)
    out = np.full((t1 - t0, H), 7, dtype=np.float16)
    reader._read(zl.PROMPT, sample, li, t0, t1, out)
    assert np.array_equal(out, group["arrays/prompt_activations"][sample, li, t0:t1])


def test_threaded_gather_equals_serial_reads(store: Path) -> None:
    rng = np.random.default_rng(5)
    samples, layers = rng.integers(0, N, 40), rng.choice(LAYERS, 40)
    threaded, serial = zl.ZarrReader(store, read_threads=3), zl.ZarrReader(store, fast=False, read_threads=1)
    for part in ("prompt", "response"):
        assert np.array_equal(threaded.gather(samples, layers, part), serial.gather(samples, layers, part))
    assert np.array_equal(threaded.batch(range(N)).acts_bltd, serial.batch(range(N)).acts_bltd)
    with pytest.raises(ConfigError):
        zl.ZarrReader(store, read_threads=0)


def test_slash_dimension_separator_is_read_directly(tmp_path: Path, store: Path) -> None:
    copy = writable_copy(store, tmp_path / "s.zarr")
    src = zarr.open_consolidated(str(store), mode="r")["arrays/prompt_activations"][:]
    root = zarr.open_group(str(copy), mode="r+", zarr_format=2)
    arr = root["arrays"].create_array("prompt_activations", shape=src.shape, chunks=(1, 1, T_CHUNK, H),
                                      dtype="float16", fill_value=0, compressors=None, filters=None,
                                      chunk_key_encoding={"name": "v2", "separator": "/"}, overwrite=True)
    arr[:] = src
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(copy), zarr_format=2)
    assert json.loads((copy / "arrays/prompt_activations/.zarray").read_text())["dimension_separator"] == "/"
    assert (copy / "arrays/prompt_activations/0/1/0/0").is_file()
    write_checksums(copy)  # the rewritten store, sealed again
    fast, api = zl.ZarrReader(copy), zl.ZarrReader(copy, fast=False)
    assert fast.fast
    for i in range(N):
        for layer in LAYERS:
            assert np.array_equal(fast.get(i, layer), api.get(i, layer))
    assert actlake.verify(copy) == []


def test_pickling_drops_handles_and_reopens(store: Path) -> None:
    r = zl.ZarrReader(store, fast=False)
    r.get(0, 0)
    assert r._root is not None
    clone = pickle.loads(pickle.dumps(r))
    assert clone._root is None
    assert np.array_equal(clone.get(3, 2), r.get(3, 2))
    assert clone._root is not None


def test_dataloader_workers_each_open_their_own_handle(store: Path) -> None:
    import torch

    from actlake.torch import SequenceDataset

    ds = SequenceDataset(store, [0, 5])
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    got = torch.cat([b["acts"] for b in loader])
    r = actlake.open(store)
    assert got.shape == (N * 2, P_MAX, H)
    assert np.array_equal(got[3, : r.lengths[1]].numpy(), r.get(1, 5).astype(np.float32))


# ---- writer options --------------------------------------------------------------------------


def test_quantile_caps_and_default_chunking(tmp_path: Path, data: dict) -> None:
    spec = spec_for(options={"p_max": None, "r_max": None, "t_chunk_prompt": None, "p_quantile": 0.5,
                             "prompt_lengths": data["lens"].tolist(), "r_quantile": 0.9,
                             "response_lengths": data["rlens"].tolist()})
    lay = zl.layout_from_spec(spec)
    assert lay.p_max == int(np.quantile(data["lens"], 0.5, method="higher"))
    assert lay.r_max == int(np.quantile(data["rlens"], 0.9, method="higher"))
    assert lay.t_chunk_prompt == lay.p_max  # H=16: 1 MiB holds far more than P_max tokens
    run = write_store(tmp_path, data, spec)
    attrs = json.loads((run / zl.STORE_NAME / ".zattrs").read_text())
    assert attrs["p_max_policy"] == "quantile" and attrs["p_quantile"] == 0.5 and attrs["P_max"] == lay.p_max
    assert attrs["prompt_truncated_count"] == int((data["lens"] > lay.p_max).sum())
    assert zl.default_t_chunk(4096, 4096) == 128 and zl.default_t_chunk(4096, 1024) == 512
    assert zl.default_t_chunk(64, 256) == 64
    with pytest.raises(ConfigError, match="prompt_lengths"):
        zl.layout_from_spec(spec_for(options={"p_max": None, "p_quantile": 0.9}))
    with pytest.raises(ConfigError, match="not both"):
        zl.layout_from_spec(spec_for(options={"p_quantile": 0.9, "prompt_lengths": [1, 2]}))
    with pytest.raises(ConfigError, match="unknown zarr option"):
        zl.layout_from_spec(spec_for(options={"pmax": 3}))
    with pytest.raises(ConfigError):
        zl.layout_from_spec(spec_for(options={"t_chunk_prompt": P_MAX + 1}))


def test_prompt_only_batches_store_zero_response(tmp_path: Path, data: dict) -> None:
    run = write_store(tmp_path, data, response=False)
    store = run / zl.STORE_NAME
    root = zarr.open_group(str(store), mode="r")
    assert root["arrays/response_activations"].shape == (N, L, R_MAX, H)
    assert not root["arrays/response_len"][:].any()
    assert [p.name for p in (store / "arrays" / "response_activations").iterdir() if not p.name.startswith(".")] == []
    r = actlake.open(run)
    assert r.get_response(0, 0).shape == (0, H) and r.response_texts is None
    assert json.loads((store / ".zattrs").read_text())["has_response"] is False
    assert actlake.verify(run) == []


def test_resume_after_interruption_and_published_noop(tmp_path: Path, data: dict) -> None:
    spec = spec_for()
    w = zl.create_writer(tmp_path, spec)
    it = batches(data)
    w.write_batch(next(it))
    w.write_batch(next(it))
    w.write_batch(next(it))
    w.abort()
    # a crash after batch 3's chunks but before its part file: only batches 1-2 count
    parts = w.store_tmp / zl.PARTS_DIR
    (parts / "part-000000000008-000000000011.json").unlink()
    folder = w.store_tmp / "arrays" / "prompt_activations"
    assert (folder / "8.0.0.0").exists()
    w2 = zl.create_writer(tmp_path, spec)
    assert w2.resume_from == 8
    assert not list(folder.glob("8.*")) and not list(folder.glob("10.*")) and list(folder.glob("3.*"))
    for b in batches(data, lo=8):
        w2.write_batch(b)
    run = w2.close()
    ref = write_store(tmp_path / "ref", data)
    a, b = actlake.open(run), actlake.open(ref)
    for layer in LAYERS:
        assert np.array_equal(a.batch(range(N), [layer]).acts_bltd, b.batch(range(N), [layer]).acts_bltd)
    assert a.texts == b.texts and np.array_equal(a.sample_ids, b.sample_ids)
    w3 = zl.create_writer(tmp_path, spec)
    assert w3.resume_from == N and w3.close() == run


def test_writer_rejects_bad_batches(tmp_path: Path, data: dict) -> None:
    w = zl.create_writer(tmp_path, spec_for(n=2))
    with pytest.raises(ConfigError):
        w.write_batch(Batch(np.zeros((1, L, 4, H + 1), np.float32), np.array([1]), np.array([0])))
    with pytest.raises(ConfigError, match="more samples"):
        w.write_batch(Batch(np.zeros((3, L, 4, H), np.float32), np.array([1, 1, 1]), np.arange(3)))
    with pytest.raises(ConfigError, match="split"):
        w.write_batch(Batch(np.zeros((1, L, 4, H), np.float32), np.array([1]), np.array([0]), extra={"split": ["x"]}))
    with pytest.raises(ConfigError, match="wrote 0"):
        w.close()


# ---- sharded runs, manifest, merge -----------------------------------------------------------


def write_sharded(root: Path, d: dict, machines: int = 2) -> Path:
    n = len(d["ids"])
    shards = []
    for m in range(machines):
        mine = np.arange(m, n, machines)  # interleaved: machine m gets samples m, m+M, ...
        part = {k: v[mine] for k, v in d.items()}
        w = zl.create_writer(root, spec_for(n=len(mine), machine_id=m, num_machines=machines))
        for b in batches(part, size=3):
            w.write_batch(b)
        shards.append(w.close())
        if m < machines - 1:
            assert not (shards[0].parent.parent / zl.MANIFEST_NAME).exists()
            with pytest.raises(MissingFileError):
                actlake.open(shards[0].parent.parent)
    return shards[0].parent.parent


def test_sharded_writers_manifest_and_multi_shard_reader(tmp_path: Path, data: dict) -> None:
    run = write_sharded(tmp_path, data)
    assert sorted(p.name for p in (run / "shards").iterdir()) == ["shard-0000.zarr", "shard-0001.zarr"]
    manifest = json.loads((run / zl.MANIFEST_NAME).read_text())
    assert manifest["format"] == zl.MANIFEST_FORMAT and manifest["n_samples"] == N
    assert manifest["index"][:3] == [[0, 0], [1, 0], [0, 1]]  # global order = sample id order
    for shard in manifest["shards"]:
        zarr.open_consolidated(str(run / shard["path"]), mode="r")  # each shard is a self-contained store
    r = actlake.open(run)
    assert isinstance(r, zl.ZarrManifestReader) and r.n_samples == N
    assert np.array_equal(r.sample_ids, data["ids"])
    for i in range(N):
        for j, layer in enumerate(LAYERS):
            assert np.array_equal(r.get(i, layer), expected_prompt(data, i, j))
    assert r.texts == [f"prompt {i}" for i in data["ids"]]
    b = r.batch([4, 1])
    assert np.array_equal(b.acts_bltd[0, 0, : min(data["lens"][4], P_MAX)], expected_prompt(data, 4, 0))
    assert actlake.verify(run) == []
    assert r.locate(3) == (1, 1)


def test_merge_builds_one_consolidated_store(tmp_path: Path, data: dict) -> None:
    run = write_sharded(tmp_path / "runs", data)
    out = tmp_path / "merged"
    assert cli_main(["merge", str(run), "--out", str(out)]) == 0
    store = out / zl.STORE_NAME
    assert actlake.verify(store) == []
    group = zarr.open_consolidated(str(store), mode="r")
    assert np.array_equal(group["arrays/sample_id"][:], data["ids"])
    prompt = group["arrays/prompt_activations"]
    assert prompt.chunks == (1, 1, T_CHUNK, H)
    for i in range(N):
        for j in range(L):
            p = min(int(data["lens"][i]), P_MAX)
            assert np.array_equal(prompt[i, j, :p], expected_prompt(data, i, j))
    attrs = dict(group.attrs)
    assert attrs["n_samples"] == N and attrs["prompt_truncated_count"] == int((data["lens"] > P_MAX).sum())
    lines = (store / "text" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(x)["i"] for x in lines] == list(range(N))
    with pytest.raises(ConfigError, match="already exists"):
        zl.merge([run], out)
    with pytest.raises(MetadataError, match="more than one input"):
        zl.merge([run, store], tmp_path / "dup")


def test_merge_command_refuses_mixed_formats(tmp_path: Path, store: Path) -> None:
    from actlake.commands.merge import merge_paths
    from tests.conftest import write_saev

    saev_dir = write_saev(tmp_path / "saev", np.zeros((2, 1, 4, 8), np.float32), layers=(0,))
    with pytest.raises(ConfigError, match="different formats"):
        merge_paths([store, saev_dir], tmp_path / "out")


# ---- hostile input ---------------------------------------------------------------------------


def test_missing_zarray_is_a_typed_error(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    (bad / "arrays" / "prompt_activations" / ".zarray").unlink()
    with pytest.raises(MissingFileError) as exc:
        actlake.open(bad)
    assert exc.value.path.name == ".zarray"
    assert any(".zarray" in p for p in actlake.verify(bad))


def _patch_zarray(store: Path, name: str, **fields) -> None:
    f = store / "arrays" / name / ".zarray"
    meta = json.loads(f.read_text())
    meta.update(fields)
    f.write_text(json.dumps(meta))
    zmeta = json.loads((store / ".zmetadata").read_text())
    zmeta["metadata"][f"arrays/{name}/.zarray"] = meta
    (store / ".zmetadata").write_text(json.dumps(zmeta))


def test_wrong_dtype_is_a_typed_error(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    _patch_zarray(bad, "prompt_activations", dtype="<f4")
    with pytest.raises(MetadataError, match="float16") as exc:
        zl.ZarrReader(bad)
    assert exc.value.path == bad / "arrays" / "prompt_activations" / ".zarray"
    assert any("float16" in p and "prompt_activations" in p for p in actlake.verify(bad))


def test_garbage_dtype_is_a_typed_error(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    _patch_zarray(bad, "response_len", dtype="not-a-dtype")
    with pytest.raises(MetadataError, match="not a numpy dtype"):
        zl.ZarrReader(bad)


def test_truncated_chunk_file_is_a_typed_error(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    chunk = bad / "arrays" / "prompt_activations" / "0.1.0.0"
    with open(chunk, "r+b") as f:
        f.truncate(30)
    for fast in (True, False):
        r = zl.ZarrReader(bad, fast=fast)
        with pytest.raises(TruncatedFileError):
            r.get(0, 2)
        assert r.get(0, 0).shape[0] == P_MAX  # other chunks still read
    assert any("0.1.0.0" in p and "bytes" in p for p in actlake.verify(bad))


def test_missing_chunk_file_holding_real_tokens_is_an_error(tmp_path: Path, store: Path, data: dict) -> None:
    """A chunk holding real tokens is always written, so a missing one was deleted: MissingFileError naming it on
    every read path, and a verify problem even once checksums.json is written again without it."""
    bad = writable_copy(store, tmp_path / "s.zarr")
    chunk = bad / "arrays" / "prompt_activations" / "0.1.1.0"
    chunk.unlink()
    write_checksums(bad)
    for reader in (zl.ZarrReader(bad), zl.ZarrReader(bad, fast=False)):
        with pytest.raises(MissingFileError) as exc:
            reader.get(0, 2)
        assert Path(exc.value.path) == chunk
        with pytest.raises(MissingFileError):
            reader.batch([1, 0])
        assert np.array_equal(reader.get(0, 0), expected_prompt(data, 0, 0))  # other chunks still read
    problems = actlake.verify(bad)
    assert len(problems) == 1 and str(chunk) in problems[0] and "real tokens" in problems[0]


def test_real_chunks_of_zeros_are_written_padding_chunks_are_not(tmp_path: Path) -> None:
    """zarr-python skips chunks equal to the fill value; the writer and merge still write every chunk holding
    real tokens (all zeros here), and leave chunks entirely in padding absent."""
    spec = StoreSpec(layers=(0, 1), d_model=4, max_tokens=6, n_samples=2, model_name="m",
                     options={"t_chunk_prompt": 2, "r_max": 2})
    w = zl.create_writer(tmp_path / "w", spec)
    acts = np.zeros((2, 2, 6, 4), np.float32)
    acts[1] = 1
    w.write_batch(Batch(acts_bltd=acts, lengths=np.array([5, 3]), sample_ids=np.arange(2)))
    run = w.close()
    merged = zl.merge([run], tmp_path / "m")
    for store in (run / "activations.zarr", merged):
        names = set(os.listdir(store / "arrays" / "prompt_activations"))
        want = {f"{s}.{li}.{c}.0" for s, n in ((0, 5), (1, 3)) for li in (0, 1) for c in range(-(-n // 2))}
        assert want <= names and "1.0.2.0" not in names and "0.0.2.0" in names  # 5 tokens: 3 chunks of 2
        z = zarr.open_consolidated(str(store), mode="r")["arrays/prompt_activations"]
        assert not z[0].any() and z[1, :, :3].all()
        assert actlake.verify(store) == []


def test_compressed_store_falls_back_to_zarr_and_fails_verify(tmp_path: Path, store: Path) -> None:
    import numcodecs

    bad = writable_copy(store, tmp_path / "s.zarr")
    src = zarr.open_consolidated(str(store), mode="r")["arrays/response_activations"][:]
    root = zarr.open_group(str(bad), mode="r+", zarr_format=2)
    arr = root["arrays"].create_array("response_activations", shape=src.shape, chunks=(1, 1, R_MAX, H),
                                      dtype="float16", fill_value=0, compressors=numcodecs.Zlib(level=1),
                                      overwrite=True)
    arr[:] = src
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr notes that text/ is not a Zarr node
        zarr.consolidate_metadata(str(bad), zarr_format=2)
    r = zl.ZarrReader(bad)
    assert r._direct[zl.RESPONSE] is None and r._direct[zl.PROMPT] is not None
    assert np.array_equal(r.get_response(4, 5), src[4, 2, : r.response_lengths[4]])
    assert any("compressor" in p and "response_activations" in p for p in actlake.verify(bad))


def test_bad_consolidated_metadata_is_a_typed_error(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    (bad / ".zmetadata").write_text("{not json")
    with pytest.raises(MetadataError) as exc:
        zl.ZarrReader(bad)
    assert exc.value.path.name == ".zmetadata"
    (bad / ".zmetadata").unlink()
    with pytest.raises(MissingFileError):
        zl.ZarrReader(bad)
    assert actlake.verify(bad)


def test_stale_consolidated_metadata_and_bad_jsonl_fail_verify(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    _patch_zarray(bad, "prompt_len", fill_value=0)
    f = bad / "arrays" / "response_len" / ".zarray"
    f.write_text(f.read_text().replace('"order": "C"', '"order": "F"'))
    lines = (bad / "text" / "responses.jsonl").read_text().splitlines()
    (bad / "text" / "responses.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    problems = actlake.verify(bad)
    assert any("response_len" in p and ".zmetadata" in p for p in problems)
    assert any("responses.jsonl" in p and "lines" in p for p in problems)


def test_lengths_beyond_caps_are_refused(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    arr = zarr.open_group(str(bad), mode="r+", zarr_format=2)["arrays/prompt_len"]
    arr[0] = P_MAX + 1
    with pytest.raises(FormatError, match="outside"):
        zl.ZarrReader(bad)


@pytest.mark.parametrize("path", ["../../outside.zarr", "/etc", "shards/../../x.zarr"])
def test_manifest_path_outside_the_run_is_refused(tmp_path: Path, data: dict, path: str) -> None:
    run = writable_copy(write_sharded(tmp_path / "runs", data), tmp_path / "run")
    manifest = json.loads((run / zl.MANIFEST_NAME).read_text())
    manifest["shards"][1]["path"] = path
    (run / zl.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(UnsafePathError) as exc:
        actlake.open(run)
    assert exc.value.path == run / zl.MANIFEST_NAME
    assert any("escapes" in p or "absolute" in p for p in actlake.verify(run))


def test_inconsistent_manifest_index_is_refused(tmp_path: Path, data: dict) -> None:
    run = writable_copy(write_sharded(tmp_path / "runs", data), tmp_path / "run")
    manifest = json.loads((run / zl.MANIFEST_NAME).read_text())
    manifest["index"][1] = manifest["index"][0]
    (run / zl.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(MetadataError, match="two global positions"):
        actlake.open(run)
    manifest["index"][1] = [1, 99]
    (run / zl.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(MetadataError, match="outside a shard"):
        actlake.open(run)


def test_absurd_shape_is_refused_before_allocating(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    _patch_zarray(bad, "prompt_activations", shape=[1 << 40, L, P_MAX, H])
    with pytest.raises(MetadataError, match="N=") as exc:
        zl.ZarrReader(bad)
    assert exc.value.path == bad / "arrays" / "prompt_activations" / ".zarray"


def test_fd_cache_is_bounded_per_process_and_closed(store: Path) -> None:
    r = zl.ZarrReader(store, fd_cache=zl.FdCache(3))
    for i in range(N):
        for layer in LAYERS:
            r.get(i, layer)
    fds = r._fds
    assert len(fds) == 3
    open_fds = [e[0] for e in fds._entries.values() if e[0] >= 0]
    assert open_fds and all(os.fstat(fd) for fd in open_fds)
    clone = pickle.loads(pickle.dumps(r))
    assert len(clone._fds) == 0 and clone._fds.capacity == 3  # descriptors never travel
    assert np.array_equal(clone.get(0, 2), r.get(0, 2))
    r.close()
    assert len(fds) == 0
    for fd in open_fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert np.array_equal(r.get(0, 2), clone.get(0, 2))  # reopens lazily after close
    with pytest.raises(ConfigError):
        zl.FdCache(0)


def test_fd_cache_reuses_descriptors(store: Path, monkeypatch) -> None:
    r = zl.ZarrReader(store)
    calls: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (calls.append(os.fspath(p)), real_open(p, *a, **k))[1])
    first = r.get(0, 2)
    n = len(calls)
    assert n == -(-P_MAX // T_CHUNK)
    assert np.array_equal(r.get(0, 2), first) and len(calls) == n  # second read: no open


# ---- package split review: vectorised reads, hardened metadata, verify / merge / writer fixes ------


def test_last_token_opens_one_chunk_per_sample(store: Path, data: dict, monkeypatch) -> None:
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(os.fspath(p)), real_open(p, *a, **k))[1])
    r = zl.ZarrReader(store, read_threads=1)
    last = r.last_token(2)
    lens = np.minimum(data["lens"], P_MAX)
    want_files = {f"{i}.1.{(int(p) - 1) // T_CHUNK}.0" for i, p in enumerate(lens) if p}
    assert sorted(Path(p).name for p in opened) == sorted(want_files)
    for i, p in enumerate(lens):
        assert np.array_equal(last[i], data["acts"][i, 1, p - 1].astype(np.float16) if p else np.zeros(H, np.float16))


def test_last_token_and_token_segments_agree_on_every_read_path(tmp_path: Path, store: Path, data: dict) -> None:
    run = write_sharded(tmp_path / "runs", data)
    readers = [zl.ZarrReader(store, read_threads=3), zl.ZarrReader(store, fast=False), zl.open_reader(run),
               zl.ZarrManifestReader(run, fast=False, read_threads=2)]
    for layer, j in ((0, 0), (5, 2)):
        want_last = np.stack([data["acts"][i, j, min(p, P_MAX) - 1] if p else np.zeros(H)
                              for i, p in enumerate(data["lens"])]).astype(np.float16)
        want_rows = np.concatenate([expected_prompt(data, i, j) for i in range(N)])
        for r in readers:
            assert np.array_equal(r.last_token(layer), want_last), type(r)
            (seg,) = r.token_segments(layer)
            assert np.array_equal(seg.rows_2d, want_rows), type(r)
            assert np.array_equal(seg.lengths, np.minimum(data["lens"], P_MAX))
    api = readers[1]
    assert np.array_equal(api.batch(range(N)).acts_bltd, readers[0].batch(range(N)).acts_bltd)


def test_oversized_sample_key_dtype_and_slice_are_refused(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    _patch_zarray(bad, "sample_key", dtype=f"|S{zl.MAX_SAMPLE_KEY_BYTES + 1}")
    with pytest.raises(MetadataError, match="sample keys longer") as exc:
        zl.ZarrReader(bad)
    assert exc.value.path == bad / "arrays" / "sample_key" / ".zarray"
    bad2 = writable_copy(store, tmp_path / "s2.zarr")
    t = zl.MAX_DIMS["T"]
    _patch_zarray(bad2, "response_activations", shape=[N, L, t, 1 << 16], chunks=[1, 1, t, 1 << 16])
    _patch_zarray(bad2, "prompt_activations", shape=[N, L, P_MAX, 1 << 16], chunks=[1, 1, T_CHUNK, 1 << 16])
    with pytest.raises(MetadataError, match="bytes per") as exc:
        zl.ZarrReader(bad2)
    assert exc.value.path.name == ".zarray"


def test_verify_reports_odd_chunk_names_and_jsonl_without_sample_key(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    (bad / "arrays" / "prompt_activations" / "0.0.\u00b2.0").write_bytes(b"\0" * (T_CHUNK * H * 2))
    f = bad / "text" / "prompts.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines()]
    del rows[2]["sample_key"]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = actlake.verify(bad)
    assert any("0.0.\u00b2.0" in p and "chunk grid" in p for p in problems)
    assert any("prompts.jsonl" in p and "line 3" in p and "sample_key" in p for p in problems)


def test_merge_refuses_bad_truncation_attr_and_long_keys(tmp_path: Path, store: Path, data: dict) -> None:
    bad = writable_copy(store, tmp_path / "s.zarr")
    root = zarr.open_group(str(bad), mode="r+", zarr_format=2)
    root.attrs["prompt_truncated_count"] = "many"
    root.attrs["t_chunk_prompt"] = "garbage"  # ignored: merge keeps the array's own chunking
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(bad), zarr_format=2)
    with pytest.raises(MetadataError, match="prompt_truncated_count") as exc:
        zl.merge([bad], tmp_path / "out")
    assert exc.value.path == bad / ".zattrs"
    assert not (tmp_path / "out" / zl.STORE_NAME).exists()
    d = make_data(seed=3, n=4)
    spec = spec_for(n=4, options={"p_max": P_MAX, "r_max": R_MAX, "t_chunk_prompt": T_CHUNK})
    w = zl.create_writer(tmp_path / "w", spec)
    for b in batches(d, size=4):
        w.write_batch(b)
    src = writable_copy(w.close() / zl.STORE_NAME, tmp_path / "long.zarr")
    root = zarr.open_group(str(src), mode="r+", zarr_format=2)
    keys = root["arrays"].create_array("sample_key", shape=(4,), chunks=(4,), dtype="|S80", fill_value=b"",
                                       compressors=None, filters=None, overwrite=True)
    keys[:] = np.array([b"k" * 80] * 4, dtype="|S80")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(src), zarr_format=2)
    assert zl.ZarrReader(src).sample_keys[0] == "k" * 80  # readable ...
    with pytest.raises(MetadataError, match="does not fit"):  # ... but never silently cut to |S64
        zl.merge([src], tmp_path / "out2")


def test_crash_while_closing_resumes_at_n_samples(tmp_path: Path, data: dict, monkeypatch) -> None:
    from actlake import writer as base_writer_mod
    from actlake.formats.zarr_logger import writer as writer_mod

    spec = spec_for()
    w = zl.create_writer(tmp_path, spec)
    for b in batches(data):
        w.write_batch(b)

    def boom(*args, **kwargs):
        raise OSError("disk gone")

    for module, stage in ((writer_mod, "finish_store"), (base_writer_mod, "publish_dir")):  # before / after finishing
        monkeypatch.setattr(module, stage, boom)
        with pytest.raises(OSError):
            w.close()
        w.abort()  # what a caller does on error (and what a crash does to the writer's lock)
        monkeypatch.undo()
        assert not (tmp_path / f"zarr-{spec.content_hash()[:16]}").exists()
        w = zl.create_writer(tmp_path, spec)
        assert w.resume_from == N, stage  # nothing written is lost
    run = w.close()
    assert actlake.verify(run) == []
    assert np.array_equal(actlake.open(run).sample_ids, data["ids"])


def test_option_edge_cases_and_unreadable_published_attrs(tmp_path: Path, data: dict) -> None:
    lay = zl.layout_from_spec(spec_for(options={"p_max": None, "r_max": None, "t_chunk_prompt": None}))
    assert (lay.p_max, lay.r_max) == (T, zl.DEFAULT_R_MAX)
    with pytest.raises(ConfigError, match="t_chunk_prompt"):
        zl.layout_from_spec(spec_for(options={"t_chunk_prompt": 0}))
    run = write_store(tmp_path, data)
    attrs = run / zl.STORE_NAME / ".zattrs"
    make_writable(run)
    attrs.write_text("[1, 2]")
    with pytest.raises(MetadataError, match="not a JSON object") as exc:
        zl.create_writer(tmp_path, spec_for())
    assert exc.value.path == attrs
