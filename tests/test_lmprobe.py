"""lmprobe dataset 2.0: written files checked against the spec with plain pyarrow / safetensors."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file

import actlake
from actlake.atomic import make_writable
from actlake.batch import Batch
from actlake.errors import (
    ConfigError,
    FormatError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
    SampleIndexError,
    TruncatedFileError,
    UnsafePathError,
)
from actlake.formats import lmprobe as lm
from actlake.spec import StoreSpec

INDEX = "index/train-00000-of-00001.parquet"


def make_acts(rng: np.random.Generator, n: int, n_layers: int, t: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    acts = rng.standard_normal((n, n_layers, t, d)).astype(np.float32)
    lengths = rng.integers(1, t + 1, n)
    return acts, lengths


def write(root: Path, acts: np.ndarray, lengths: np.ndarray, *, layers: tuple[int, ...] = (2, 7),
          batch_size: int = 4, texts: list[str] | None = None, labels: np.ndarray | None = None,
          dtype: str = "float32", options: dict[str, Any] | None = None, logits_k: int | None = None,
          token_ids: np.ndarray | None = None, extra: dict[str, list[Any]] | None = None,
          provenance: dict[str, Any] | None = None, model_name: str = "org/tiny-lm") -> Path:
    """Write (N, L, T, D) activations through the registry writer in batches; return the published dir."""
    n, _, t, d = acts.shape
    texts = [f"prompt number {i}" for i in range(n)] if texts is None else texts
    rng = np.random.default_rng(99)
    lv = rng.standard_normal((n, logits_k)).astype(np.float32) if logits_k else None
    li = rng.integers(0, 50_000, (n, logits_k)) if logits_k else None
    spec = StoreSpec(layers=layers, d_model=d, max_tokens=t, n_samples=n, model_name=model_name, dtype=dtype,
                     provenance=provenance or {}, options=options or {})
    writer = actlake.formats.create_writer("lmprobe", root, spec)
    for s in range(0, n, batch_size):
        sl = slice(s, min(s + batch_size, n))
        writer.write_batch(Batch(
            acts_bltd=acts[sl], lengths=lengths[sl], sample_ids=np.arange(n)[sl] + 1000, texts=texts[sl],
            labels=None if labels is None else labels[sl], token_ids=None if token_ids is None else token_ids[sl],
            logits_topk_values=None if lv is None else lv[sl], logits_topk_indices=None if li is None else li[sl],
            extra={k: v[sl] for k, v in (extra or {}).items()},
        ))
    return writer.close()


def lmprobe_info(path: Path) -> dict[str, Any]:
    """The spec's own snippet: decode every `lmprobe:` schema key."""
    table = pq.read_table(path / INDEX)
    return {k.decode().removeprefix("lmprobe:"): json.loads(v)
            for k, v in table.schema.metadata.items() if k.decode().startswith("lmprobe:")}


def writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    make_writable(dst)
    return dst


def rewrite_index(path: Path, *, meta: dict[bytes, bytes] | None = None, table: pa.Table | None = None) -> None:
    """Replace the parquet index's table and/or schema metadata (for hostile-input tests)."""
    t = pq.read_table(path / INDEX) if table is None else table
    if meta is not None:
        t = t.replace_schema_metadata(meta)
    pq.write_table(t, path / INDEX)


def with_tensors(path: Path, mutate: Any) -> dict[bytes, bytes]:
    md = dict(pq.read_schema(path / INDEX).metadata)
    tensors = json.loads(md[b"lmprobe:tensors"])
    mutate(tensors)
    md[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    return md


# ------------------------------------------------------------------------------------------------
# spec conformance, read with plain pyarrow + safetensors
# ------------------------------------------------------------------------------------------------


def test_pooled_layout_matches_spec(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 10, 2, 5, 8)
    labels = np.array([0, 1, -1, 1, 0, 1, 0, 1, 0, 1])
    out = write(tmp_path, acts, lengths, labels=labels, options={"shard_bytes": 8 * 4 * 4},
                provenance={"model_revision": "abc123", "torch_version": "9.9"})
    assert out.parent == tmp_path and out.name.startswith("lmprobe-") and len(out.name) == len("lmprobe-") + 16
    table = pq.read_table(out / INDEX)
    s = table.schema
    assert s.field("text").type == pa.string()
    assert s.field("label").type == pa.int32()
    for name in ("num_tokens", "shard_index", "row_offset"):
        assert s.field(name).type == pa.int32(), name
    assert "token_shard_ids" not in s.names and "shard_index_logits" not in s.names
    info = lmprobe_info(out)
    assert set(info) == {"format_version", "model", "num_prompts", "prompt_ordering", "tensors", "provenance"}
    assert info["format_version"] == "2.0"
    assert info["model"] == {"name": "org/tiny-lm", "revision": "abc123"}
    assert info["num_prompts"] == 10 and isinstance(info["prompt_ordering"], str)
    for key in ("lmprobe_version", "extraction_backend", "nnsight_version", "torch_version",
                "transformers_version", "python_version", "created_at"):
        assert key in info["provenance"], key
    assert info["provenance"]["torch_version"] == "9.9"
    hidden = info["tensors"]["hidden_layers"]
    assert hidden["type"] == "hidden" and hidden["layers"] == [2, 7] and hidden["dim"] == 8
    assert hidden["dtype"] == "float32" and hidden["layout"] == "per_layer"
    assert hidden["storage"] == "pooled" and hidden["pooling"] == "last_token"
    assert hidden["row_bytes"] == 8 * 4
    assert hidden["file_pattern"] == "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
    assert hidden["key_pattern"] == "hidden.layer_{layer}"
    assert [x["num_prompts"] for x in hidden["shards"]] == [4, 4, 2]  # 128-byte budget / 32-byte rows
    df = table.to_pydict()
    assert df["label"] == [0, 1, None, 1, 0, 1, 0, 1, 0, 1]
    assert df["num_tokens"] == lengths.tolist()
    # the spec's resolution recipe, verbatim in spirit
    for i in range(10):
        for j, layer in enumerate((2, 7)):
            filename = out / hidden["file_pattern"].format(layer=layer, shard=df["shard_index"][i])
            key = hidden["key_pattern"].format(layer=layer)
            with safe_open(str(filename), framework="np") as f:
                vector = f.get_tensor(key)[df["row_offset"][i]]
            np.testing.assert_array_equal(vector, acts[i, j, lengths[i] - 1])
    for layer in (2, 7):
        for shard, count in enumerate([4, 4, 2]):
            tensors = load_file(str(out / f"tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"))
            assert list(tensors) == [f"hidden.layer_{layer}"]
            assert tensors[f"hidden.layer_{layer}"].shape == (count, 8)
            assert tensors[f"hidden.layer_{layer}"].dtype == np.float32
    assert sorted(p.name for p in (out / "tensors").iterdir()) == sorted(
        f"hidden_layer{layer:03d}_shard{s:03d}.safetensors" for layer in (2, 7) for s in range(3))
    assert actlake.verify(out) == []


def test_fp16_row_bytes_and_shard_sizes_use_two_bytes(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 7, 1, 3, 16)
    out = write(tmp_path, acts, lengths, layers=(0,), dtype="float16", options={"shard_bytes": 16 * 2 * 3})
    hidden = lmprobe_info(out)["tensors"]["hidden_layers"]
    assert hidden["dtype"] == "float16" and hidden["row_bytes"] == 32
    assert [s["num_prompts"] for s in hidden["shards"]] == [3, 3, 1]  # a 4-byte assumption would give 1 per shard
    t = load_file(str(out / "tensors/hidden_layer000_shard000.safetensors"))["hidden.layer_0"]
    assert t.dtype == np.float16
    np.testing.assert_array_equal(t, acts[:3, 0][np.arange(3), lengths[:3] - 1].astype(np.float16))
    with open(out / "tensors/hidden_layer000_shard000.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert header["hidden.layer_0"]["dtype"] == "F16"
    assert lm.verify(out) == []


def test_bfloat16_is_stored_as_bf16_and_read_as_float32(tmp_path: Path, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    acts, lengths = make_acts(rng, 5, 1, 2, 8)
    out = write(tmp_path, acts, lengths, layers=(1,), dtype="bfloat16")
    with safe_open(str(out / "tensors/hidden_layer001_shard000.safetensors"), framework="pt") as f:
        t = f.get_tensor("hidden.layer_1")
    assert t.dtype == torch.bfloat16
    expected = torch.from_numpy(acts[np.arange(5), 0, lengths - 1]).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(t.float().numpy(), expected)
    r = actlake.open(out)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r.last_token(1), expected)
    assert lmprobe_info(out)["tensors"]["hidden_layers"]["row_bytes"] == 16


def test_mean_pooling_is_recorded(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 6, 2, 5, 4)
    lengths[2] = 0  # an empty prompt pools to zeros
    pad_b, pad_t = np.nonzero(np.arange(5)[None, :] >= lengths[:, None])
    acts[pad_b, :, pad_t] = 1e6  # padding must not leak into the mean
    out = write(tmp_path, acts, lengths, options={"pooling": "mean"})
    hidden = lmprobe_info(out)["tensors"]["hidden_layers"]
    assert hidden["storage"] == "pooled" and hidden["pooling"] == "mean"
    t = load_file(str(out / "tensors/hidden_layer007_shard000.safetensors"))["hidden.layer_7"]
    for i in range(6):
        want = acts[i, 1, : lengths[i]].mean(0) if lengths[i] else np.zeros(4)
        np.testing.assert_allclose(t[i], want, rtol=1e-6, atol=1e-6)


def resolve_token(out: Path, hidden: dict[str, Any], layer: int, shard: int, offset: int) -> np.ndarray:
    filename = out / hidden["file_pattern"].format(layer=layer, shard=shard)
    with safe_open(str(filename), framework="np") as f:
        return f.get_tensor(hidden["key_pattern"].format(layer=layer))[offset]


def test_full_sequence_addressing_matches_spec(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 9, 2, 6, 4)
    out = write(tmp_path, acts, lengths, options={"storage": "full_sequence", "shard_bytes": 4 * 4 * 5})
    table = pq.read_table(out / INDEX)
    s = table.schema
    assert s.field("token_offset").type == pa.int64()
    assert s.field("token_shard_ids").type == pa.list_(pa.int64())
    assert s.field("token_shard_offsets").type == pa.list_(pa.int64())
    hidden = lmprobe_info(out)["tensors"]["hidden_layers"]
    assert hidden["storage"] == "full_sequence"
    lts = hidden["last_token_shards"]
    assert [x["num_prompts"] for x in hidden["shards"][:lts]] == [5, 4]
    for x in hidden["shards"][:lts]:
        assert x["num_tokens"] == x["num_prompts"]
    assert sum(x["num_tokens"] for x in hidden["shards"][lts:]) == int((lengths - 1).sum())
    assert sum(x["num_prompts"] for x in hidden["shards"][lts:]) == 9
    for x in hidden["shards"][lts:]:  # sequence shards respect the byte budget (unless one prompt is larger)
        assert x["num_tokens"] * 16 <= 80 or x["num_prompts"] == 1
    df = table.to_pydict()
    assert df["token_offset"] == df["row_offset"]
    for i in range(9):
        ids, offs = df["token_shard_ids"][i], df["token_shard_offsets"][i]
        assert len(ids) == len(offs) == lengths[i]
        assert (ids[-1], offs[-1]) == (df["shard_index"][i], df["row_offset"][i])
        assert all(x >= lts for x in ids[:-1])
        for j, layer in enumerate((2, 7)):
            for tok in range(lengths[i]):
                np.testing.assert_array_equal(resolve_token(out, hidden, layer, ids[tok], offs[tok]), acts[i, j, tok])
    for layer in (2, 7):
        for shard, desc in enumerate(hidden["shards"]):
            t = load_file(str(out / hidden["file_pattern"].format(layer=layer, shard=shard)))
            assert t[f"hidden.layer_{layer}"].shape == (desc["num_tokens"], 4)
    assert lm.verify(out) == []
    r = actlake.open(out)
    for i in range(9):
        np.testing.assert_array_equal(r.get(i, 7), acts[i, 1, : lengths[i]])
        np.testing.assert_array_equal(r.vector(i, 2, 0), acts[i, 0, 0])
    np.testing.assert_array_equal(r.last_token(2), acts[np.arange(9), 0, lengths - 1])
    assert r.max_tokens == 6 and r.lengths.tolist() == lengths.tolist()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    budget_rows=st.integers(1, 9),
    batch_size=st.integers(1, 5),
)
def test_full_sequence_index_math(tmp_path_factory: pytest.TempPathFactory, lengths: list[int],
                                  budget_rows: int, batch_size: int) -> None:
    n, d = len(lengths), 2
    lens = np.array(lengths)
    acts = np.arange(n * 5 * d, dtype=np.float32).reshape(n, 1, 5, d) + 1
    out = write(tmp_path_factory.mktemp("h"), acts, lens, layers=(0,), batch_size=batch_size,
                options={"storage": "full_sequence", "shard_bytes": budget_rows * d * 4})
    hidden = lmprobe_info(out)["tensors"]["hidden_layers"]
    df = pq.read_table(out / INDEX).to_pydict()
    shards = [load_file(str(out / hidden["file_pattern"].format(layer=0, shard=s)))["hidden.layer_0"]
              for s in range(len(hidden["shards"]))]
    for i in range(n):
        got = [shards[s][o] for s, o in zip(df["token_shard_ids"][i], df["token_shard_offsets"][i])]
        np.testing.assert_array_equal(np.array(got).reshape(-1, d), acts[i, 0, : lens[i]])
        last = shards[df["shard_index"][i]][df["row_offset"][i]]
        np.testing.assert_array_equal(last, acts[i, 0, lens[i] - 1] if lens[i] else np.zeros(d))
    assert lm.verify(out) == []
    r = actlake.open(out)
    for i in range(n):
        np.testing.assert_array_equal(r.get(i, 0), acts[i, 0, : lens[i]])


def test_full_sequence_without_extra_tokens_has_no_sequence_shards(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, _ = make_acts(rng, 4, 1, 3, 4)
    out = write(tmp_path, acts, np.ones(4, dtype=np.int64), layers=(0,), options={"storage": "full_sequence"})
    hidden = lmprobe_info(out)["tensors"]["hidden_layers"]
    assert hidden["last_token_shards"] == len(hidden["shards"]) == 1
    assert sorted(p.name for p in (out / "tensors").iterdir()) == ["hidden_layer000_shard000.safetensors"]
    assert lm.verify(out) == []


def test_logits_spec_keys_and_upstream_aliases(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 7, 1, 3, 4)
    out = write(tmp_path, acts, lengths, layers=(0,), logits_k=8, options={"logits_topk": 5, "shard_bytes": 5 * 12 * 3})
    desc = lmprobe_info(out)["tensors"]["logits_topk"]
    assert desc["type"] == "logits_topk" and desc["k"] == 5 and desc["dtype"] == "float32"
    assert desc["row_bytes"] == 5 * (4 + 8) and desc["pooling"] == "last_token"
    assert desc["file_pattern"] == "tensors/logits_topk_{shard:03d}.safetensors"
    assert [s["num_prompts"] for s in desc["shards"]] == [3, 3, 1]
    assert [s["file"] for s in desc["shards"]] == [f"tensors/logits_topk_{i:03d}.safetensors" for i in range(3)]
    table = pq.read_table(out / INDEX)
    assert table.schema.field("shard_index_logits").type == pa.int32()
    assert table.schema.field("row_offset_logits").type == pa.int32()
    df = table.to_pydict()
    src = np.random.default_rng(99)
    lv = src.standard_normal((7, 8)).astype(np.float32)
    li = src.integers(0, 50_000, (7, 8))
    order = np.argsort(-lv, axis=1, kind="stable")[:, :5]
    want_v, want_i = np.take_along_axis(lv, order, 1), np.take_along_axis(li, order, 1)
    for i in range(7):
        filename = out / desc["file_pattern"].format(shard=df["shard_index_logits"][i])
        with safe_open(str(filename), framework="np") as f:
            values = f.get_tensor("topk_values")[df["row_offset_logits"][i]]
            indices = f.get_tensor("topk_indices")[df["row_offset_logits"][i]]
            up_v = f.get_tensor("logits_topk.values")[df["row_offset_logits"][i]]
            up_i = f.get_tensor("logits_topk.indices")[df["row_offset_logits"][i]]
        assert values.dtype == np.float32 and indices.dtype == np.int64 and up_i.dtype == np.int32
        np.testing.assert_array_equal(values, want_v[i])
        np.testing.assert_array_equal(indices, want_i[i])
        np.testing.assert_array_equal(up_v, want_v[i])
        np.testing.assert_array_equal(up_i, want_i[i])
    got_v, got_i = actlake.open(out).logits()
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(got_i, want_i)
    assert lm.verify(out) == []


def test_logits_option_errors(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 2, 1, 2, 4)
    with pytest.raises(ConfigError, match="logits"):
        write(tmp_path / "a", acts, lengths, layers=(0,), options={"logits_topk": 3})
    with pytest.raises(ConfigError, match="top-2"):
        write(tmp_path / "b", acts, lengths, layers=(0,), logits_k=2, options={"logits_topk": 3})
    out = write(tmp_path / "c", acts, lengths, layers=(0,), logits_k=2, options={"logits_topk": 0})
    assert "logits_topk" not in lmprobe_info(out)["tensors"]


def test_token_columns_perplexity_and_user_columns(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 5, 1, 4, 4)
    token_ids = rng.integers(0, 1000, (5, 4))
    ppl = [list(rng.uniform(1, 9, int(n))) for n in lengths]
    strings = [[f"tok{k}" for k in range(int(n))] for n in lengths]
    out = write(tmp_path, acts, lengths, layers=(0,), token_ids=token_ids,
                extra={"token_perplexity": ppl, "token_strings": strings, "source": ["a", "b", "a", "c", "b"],
                       "score": [0.5, 1.5, 2.5, 3.5, 4.5]})
    table = pq.read_table(out / INDEX)
    s = table.schema
    for name in ("perplexity_mean", "perplexity_min", "perplexity_max"):
        assert s.field(name).type == pa.float64()
    assert s.field("token_ids").type == pa.list_(pa.int64())
    assert s.field("token_perplexity").type == pa.list_(pa.float64())
    assert s.field("token_strings").type == pa.list_(pa.string())
    assert s.field("source").type == pa.string() and s.field("score").type == pa.float64()
    df = table.to_pydict()
    for i in range(5):
        assert df["token_ids"][i] == token_ids[i, : lengths[i]].tolist()
        assert df["token_strings"][i] == strings[i]
        np.testing.assert_allclose(df["token_perplexity"][i], ppl[i])
        assert df["perplexity_mean"][i] == pytest.approx(np.mean(ppl[i]))
        assert df["perplexity_min"][i] == pytest.approx(min(ppl[i]))
        assert df["perplexity_max"][i] == pytest.approx(max(ppl[i]))
    assert df["source"] == ["a", "b", "a", "c", "b"]
    r = actlake.open(out)
    assert r.row(3)["source"] == "c" and r.row(3)["sample_id"] == 1003
    b = r.batch([1, 3])
    assert b.extra["source"] == ["b", "c"] and b.extra["score"] == [1.5, 3.5]
    assert b.token_ids is not None and b.token_ids[0, 0] == token_ids[1, 0]
    assert lm.verify(out) == []


def test_string_labels_from_extra(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 3, 1, 2, 4)
    out = write(tmp_path, acts, lengths, layers=(0,), extra={"label": ["yes", None, "no"]})
    table = pq.read_table(out / INDEX)
    assert table.schema.field("label").type == pa.string()
    assert table.column("label").to_pylist() == ["yes", None, "no"]
    r = actlake.open(out)
    assert r.labels is None and r.row(2)["label"] == "no"
    assert lm.verify(out) == []


def test_extra_column_may_not_shadow_index_columns(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 2, 1, 2, 4)
    with pytest.raises(ConfigError, match="shard_index"):
        write(tmp_path, acts, lengths, layers=(0,), extra={"shard_index": [1, 2]})


# ------------------------------------------------------------------------------------------------
# reader round trip
# ------------------------------------------------------------------------------------------------


def test_round_trip_through_reader(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 11, 2, 4, 6)
    labels = rng.integers(0, 3, 11)
    out = write(tmp_path, acts, lengths, labels=labels, options={"shard_bytes": 6 * 4 * 4}, batch_size=3)
    assert lm.detect(out) and actlake.formats.detect_format(out) == "lmprobe"
    r = actlake.open(out)
    assert isinstance(r, lm.LmprobeReader)
    assert r.layers == (2, 7) and r.d_model == 6 and r.n_samples == 11 and r.max_tokens == 1
    assert r.lengths.tolist() == [1] * 11
    assert r.labels.tolist() == labels.tolist()
    assert r.texts == [f"prompt number {i}" for i in range(11)]
    assert r.sample_ids.tolist() == list(range(1000, 1011))
    for j, layer in enumerate((2, 7)):
        want = acts[np.arange(11), j, lengths - 1]
        np.testing.assert_array_equal(r.last_token(layer), want)
        for i in range(11):
            assert r.get(i, layer).shape == (1, 6)
            np.testing.assert_array_equal(r.get(i, layer)[0], want[i])
        segs = r.token_segments(layer)
        rows = np.concatenate([np.asarray(sg.rows_2d)[sg.row_index()] for sg in segs])
        np.testing.assert_array_equal(rows, want)
    b = r.batch([4, 0], [7])
    np.testing.assert_array_equal(b.acts_bltd[:, 0, 0], acts[[4, 0], 1][[0, 1], lengths[[4, 0]] - 1])
    assert r.row(5)["num_tokens"] == lengths[5] and r.row(5)["text"] == "prompt number 5"
    assert r.summary()["storage"] == "pooled"
    with pytest.raises(SampleIndexError):
        r.get(11, 2)
    with pytest.raises(KeyError):
        r.last_token(3)


def test_duplicate_texts_stay_distinct(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 4, 1, 3, 4)
    out = write(tmp_path, acts, lengths, layers=(0,), texts=["same", "same", "same", "other"])
    df = pq.read_table(out / INDEX).to_pydict()
    assert df["text"] == ["same", "same", "same", "other"]
    assert len({(a, b) for a, b in zip(df["shard_index"], df["row_offset"])}) == 4
    r = actlake.open(out)
    lt = r.last_token(0)
    np.testing.assert_array_equal(lt, acts[np.arange(4), 0, lengths - 1])
    assert not np.array_equal(lt[0], lt[1])
    for i in range(3):
        np.testing.assert_array_equal(r.get(i, 0)[0], acts[i, 0, lengths[i] - 1])


def test_rerun_is_a_noop_and_output_is_read_only(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 3, 1, 2, 4)
    out = write(tmp_path, acts, lengths, layers=(0,))
    assert not (out / INDEX).stat().st_mode & 0o222
    spec = StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=3, model_name="org/tiny-lm")
    w = lm.create_writer(tmp_path, spec)
    assert w.resume_from == 3 and w.close() == out
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_custom_patterns_are_honoured(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 5, 2, 3, 4)
    out = write(tmp_path, acts, lengths, options={"file_pattern": "acts/L{layer}/part-{shard}.st",
                                                  "key_pattern": "resid_{layer}", "shard_bytes": 16})
    assert (out / "acts/L7/part-4.st").is_file()
    assert list(load_file(str(out / "acts/L2/part-0.st"))) == ["resid_2"]
    r = actlake.open(out)
    np.testing.assert_array_equal(r.last_token(7), acts[np.arange(5), 1, lengths - 1])
    assert lm.verify(out) == []


def test_writer_checks_counts_and_options(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 3, 1, 2, 4)
    spec = StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=3)
    w = lm.create_writer(tmp_path, spec)
    w.write_batch(Batch(acts_bltd=acts[:2], lengths=lengths[:2], sample_ids=np.arange(2)))
    with pytest.raises(ConfigError, match="n_samples"):
        w.close()
    with pytest.raises(ConfigError, match="more samples"):
        w.write_batch(Batch(acts_bltd=acts, lengths=lengths, sample_ids=np.arange(3)))
    for bad in ({"storage": "zarr"}, {"pooling": "max"}, {"storage": "full_sequence", "pooling": "mean"},
                {"shard_bytes": 0}, {"file_pattern": "../x{layer}{shard}"}, {"file_pattern": "x{layer}.st"},
                {"key_pattern": "k{shard}"}):
        with pytest.raises(ConfigError):
            lm.create_writer(tmp_path, StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=3, options=bad))
    with pytest.raises(ConfigError, match="dtype"):
        lm.create_writer(tmp_path, StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=3, dtype="int8"))


def test_model_revision_from_spec_data() -> None:
    spec = StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=1, data={"weights_sha256": "deadbeef"})
    assert lm.model_revision(spec) == "deadbeef"
    spec = StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=1, provenance={"revision": "r1"},
                     data={"weights_sha256": "deadbeef"})
    assert lm.model_revision(spec) == "r1"
    assert lm.model_revision(StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=1)) is None


# ------------------------------------------------------------------------------------------------
# hostile input
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def dataset(tmp_path: Path, rng: np.random.Generator) -> Path:
    acts, lengths = make_acts(rng, 6, 2, 4, 4)
    out = write(tmp_path / "src", acts, lengths, logits_k=3, options={"storage": "full_sequence", "shard_bytes": 64})
    return writable_copy(out, tmp_path / "copy")


@pytest.mark.parametrize("pattern", ["../../etc/hidden_layer{layer:03d}_shard{shard:03d}.safetensors",
                                     "/etc/hidden_{layer}_{shard}.safetensors",
                                     "tensors/../../x{layer}_{shard}.safetensors"])
def test_path_traversal_in_file_pattern(dataset: Path, pattern: str) -> None:
    rewrite_index(dataset, meta=with_tensors(dataset, lambda t: t["hidden_layers"].update(file_pattern=pattern)))
    with pytest.raises(UnsafePathError) as exc:
        actlake.open(dataset)
    assert exc.value.path == dataset / INDEX
    problems = lm.verify(dataset)
    assert problems and ("escapes" in problems[0] or "absolute" in problems[0])


def test_path_traversal_in_logits_pattern(dataset: Path) -> None:
    rewrite_index(dataset, meta=with_tensors(dataset, lambda t: t["logits_topk"].update(file_pattern="../l{shard}.st")))
    with pytest.raises(UnsafePathError):
        actlake.open(dataset)
    assert any("escapes" in p for p in lm.verify(dataset))


def test_missing_shard(dataset: Path) -> None:
    victim = dataset / "tensors/hidden_layer007_shard001.safetensors"
    victim.unlink()
    with pytest.raises(MissingFileError) as exc:
        actlake.open(dataset)
    assert exc.value.path == victim
    assert any(str(victim) in p for p in lm.verify(dataset))


def test_truncated_safetensors(dataset: Path) -> None:
    victim = dataset / "tensors/hidden_layer002_shard000.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[:-5])
    r = actlake.open(dataset)
    with pytest.raises(TruncatedFileError) as exc:
        r.last_token(2)
    assert exc.value.path == victim
    assert any(str(victim) in p for p in lm.verify(dataset))
    victim.write_bytes(data[:4])
    with pytest.raises(TruncatedFileError):
        actlake.open(dataset).get(0, 2)
    victim.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(TruncatedFileError):
        actlake.open(dataset).get(0, 2)


def test_corrupt_safetensors_header(dataset: Path) -> None:
    victim = dataset / "tensors/hidden_layer002_shard000.safetensors"
    data = bytearray(victim.read_bytes())
    data[8] = ord("[")
    victim.write_bytes(bytes(data))
    with pytest.raises(FormatError) as exc:
        actlake.open(dataset).last_token(2)
    assert exc.value.path == victim


def test_wrong_key_in_shard(dataset: Path) -> None:
    rewrite_index(dataset, meta=with_tensors(dataset, lambda t: t["hidden_layers"].update(key_pattern="resid.{layer}")))
    with pytest.raises(FormatError, match="resid.2"):
        actlake.open(dataset).last_token(2)
    assert any("resid.2" in p for p in lm.verify(dataset))


def test_bad_metadata_json(dataset: Path) -> None:
    md = dict(pq.read_schema(dataset / INDEX).metadata)
    md[b"lmprobe:tensors"] = b"{not json"
    rewrite_index(dataset, meta=md)
    with pytest.raises(MetadataError) as exc:
        actlake.open(dataset)
    assert exc.value.path == dataset / INDEX
    assert lm.verify(dataset)[0].startswith(str(dataset / INDEX))


def test_missing_metadata_key_and_bad_version(dataset: Path) -> None:
    md = dict(pq.read_schema(dataset / INDEX).metadata)
    good = dict(md)
    del md[b"lmprobe:num_prompts"]
    rewrite_index(dataset, meta=md)
    with pytest.raises(MetadataError, match="num_prompts"):
        actlake.open(dataset)
    md = dict(good)
    md[b"lmprobe:format_version"] = b'"3.0"'
    rewrite_index(dataset, meta=md)
    with pytest.raises(ProtocolVersionError):
        actlake.open(dataset)
    md[b"lmprobe:format_version"] = b'"2.0"'
    md[b"lmprobe:num_prompts"] = b"7"
    rewrite_index(dataset, meta=md)
    with pytest.raises(MetadataError, match="num_prompts"):
        actlake.open(dataset)
    assert any("num_prompts" in p for p in lm.verify(dataset))


def test_wrong_column_type(dataset: Path) -> None:
    table = pq.read_table(dataset / INDEX)
    i = table.schema.get_field_index("row_offset")
    table = table.set_column(i, pa.field("row_offset", pa.int64()), table.column("row_offset").cast(pa.int64()))
    rewrite_index(dataset, table=table)
    with pytest.raises(MetadataError, match="row_offset"):
        actlake.open(dataset)
    assert any("row_offset" in p and "int64" in p for p in lm.verify(dataset))


def test_addressing_out_of_range(dataset: Path) -> None:
    table = pq.read_table(dataset / INDEX)
    i = table.schema.get_field_index("row_offset")
    bad = pa.array([99] + table.column("row_offset").to_pylist()[1:], type=pa.int32())
    rewrite_index(dataset, table=table.set_column(i, table.schema.field(i), bad))
    with pytest.raises(MetadataError, match="row_offset"):
        actlake.open(dataset)
    assert any("row_offset" in p for p in lm.verify(dataset))


def test_verify_catches_shape_and_row_bytes(dataset: Path) -> None:
    def mutate(t: dict[str, Any]) -> None:
        t["hidden_layers"]["row_bytes"] = 4 * 4 * 2
        t["hidden_layers"]["shards"][-1]["num_tokens"] += 1
        t["logits_topk"]["row_bytes"] = 3 * 8
    rewrite_index(dataset, meta=with_tensors(dataset, mutate))
    problems = "\n".join(lm.verify(dataset))
    assert "row_bytes 32" in problems
    assert "logits_topk.row_bytes" in problems
    assert "sequence shards hold" in problems
    assert "expected F32" in problems


def test_verify_reports_unlisted_and_non_parquet(dataset: Path) -> None:
    shutil.copy(dataset / "tensors/hidden_layer002_shard000.safetensors", dataset / "tensors/stray.safetensors")
    assert any("stray.safetensors" in p and "not described" in p for p in lm.verify(dataset))
    (dataset / INDEX).write_bytes(b"PAR1 not really")
    with pytest.raises(FormatError) as exc:
        actlake.open(dataset)
    assert exc.value.path == dataset / INDEX
    assert lm.verify(dataset)[0].startswith(str(dataset / INDEX))


def test_absurd_sizes_are_refused_before_allocating(dataset: Path) -> None:
    rewrite_index(dataset, meta=with_tensors(dataset, lambda t: t["hidden_layers"].update(dim=1 << 40)))
    with pytest.raises(TruncatedFileError, match="cannot hold"):
        actlake.open(dataset)


def test_absurd_logits_k_is_refused_before_allocating(dataset: Path) -> None:
    rewrite_index(dataset, meta=with_tensors(dataset, lambda t: t["logits_topk"].update(k=1 << 40)))
    with pytest.raises(FormatError, match="logits tensor"):
        actlake.open(dataset).logits()


def test_safetensors_shape_that_overflows_int64_is_refused(dataset: Path) -> None:
    victim = dataset / "tensors/hidden_layer002_shard000.safetensors"
    data = victim.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [1 << 32, 1 << 32]  # 2**64 elements: wraps to 0 in int64
    header[key]["data_offsets"] = [0, 0]
    text = json.dumps(header).encode()
    victim.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    with pytest.raises(FormatError, match="spans"):
        lm.read_safetensors_header(victim)


def test_absurd_declared_max_tokens_is_refused(dataset: Path) -> None:
    md = dict(pq.read_schema(dataset / INDEX).metadata)
    own = json.loads(md[lm.ACTLAKE_META_KEY])
    own["max_tokens"] = 1 << 40  # batch() would pad every prompt to this
    md[lm.ACTLAKE_META_KEY] = json.dumps(own).encode()
    rewrite_index(dataset, meta=md)
    with pytest.raises(MetadataError, match="max_tokens"):
        actlake.open(dataset)


# ------------------------------------------------------------------------------------------------
# review additions: upstream logits keys, typed errors for hostile values, verify `type` fields
# ------------------------------------------------------------------------------------------------


def test_logits_without_upstream_aliases(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 4, 1, 2, 4)
    out = write(tmp_path, acts, lengths, layers=(0,), logits_k=3, options={"upstream_aliases": False})
    with safe_open(str(out / "tensors/logits_topk_000.safetensors"), framework="np") as f:
        assert sorted(f.keys()) == ["topk_indices", "topk_values"]
    assert actlake.open(out).logits()[0].shape == (4, 3)
    assert lm.verify(out) == []


def test_reader_falls_back_to_upstream_logits_keys(dataset: Path) -> None:
    """A logits shard holding only upstream's key names (as upstream writes them) still reads."""
    from safetensors.numpy import save_file

    want_v, want_i = actlake.open(dataset).logits()
    shard = dataset / "tensors/logits_topk_000.safetensors"
    tensors = load_file(str(shard))
    save_file({"logits_topk.values": tensors["logits_topk.values"],
               "logits_topk.indices": tensors["logits_topk.indices"]}, str(shard))
    got_v, got_i = actlake.open(dataset).logits()
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(got_i, want_i)
    assert got_i.dtype == np.int64
    assert any("'topk_values' is missing" in p for p in lm.verify(dataset))


def test_logits_of_a_non_numeric_dtype_are_refused(dataset: Path) -> None:
    from safetensors.numpy import save_file

    shard = dataset / "tensors/logits_topk_000.safetensors"
    tensors = load_file(str(shard))
    tensors["topk_values"] = tensors["topk_values"].astype(np.uint8)
    save_file(tensors, str(shard))
    with pytest.raises(FormatError, match="dtype U8") as exc:
        actlake.open(dataset).logits()
    assert exc.value.path == shard
    assert any("expected F32" in p for p in lm.verify(dataset))


def test_verify_checks_descriptor_types(dataset: Path) -> None:
    def mutate(t: dict[str, Any]) -> None:
        t["hidden_layers"]["type"] = "hiden"
        del t["logits_topk"]["type"]
    rewrite_index(dataset, meta=with_tensors(dataset, mutate))
    problems = "\n".join(lm.verify(dataset))
    assert "hidden_layers.type is 'hiden'" in problems
    assert "logits_topk.type is None" in problems


def test_token_offsets_list_lengths_must_match(dataset: Path) -> None:
    table = pq.read_table(dataset / INDEX)
    i = table.schema.get_field_index("token_shard_offsets")
    offs = table.column("token_shard_offsets").to_pylist()
    offs[0] = offs[0] + [0]
    table = table.set_column(i, table.schema.field(i), pa.array(offs, type=pa.list_(pa.int64())))
    rewrite_index(dataset, table=table)
    with pytest.raises(MetadataError, match="token_shard_offsets") as exc:
        actlake.open(dataset)
    assert exc.value.path == dataset / INDEX
    assert any("lengths differ" in p for p in lm.verify(dataset))


def test_null_inside_token_lists_is_refused(dataset: Path) -> None:
    table = pq.read_table(dataset / INDEX)
    i = table.schema.get_field_index("token_shard_ids")
    ids = table.column("token_shard_ids").to_pylist()
    ids[1] = [None] * len(ids[1])
    table = table.set_column(i, table.schema.field(i), pa.array(ids, type=pa.list_(pa.int64())))
    rewrite_index(dataset, table=table)
    with pytest.raises(MetadataError, match="nulls inside"):
        actlake.open(dataset)
    assert any("nulls inside" in p for p in lm.verify(dataset))


def test_safetensors_header_with_unhashable_dtype_is_typed(dataset: Path) -> None:
    victim = dataset / "tensors/hidden_layer002_shard000.safetensors"
    data = victim.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["dtype"] = ["F32"]
    text = json.dumps(header).encode()
    victim.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    with pytest.raises(FormatError, match="unsupported dtype") as exc:
        lm.read_safetensors_header(victim)
    assert exc.value.path == victim


def test_non_integer_sample_id_column_falls_back_to_positions(dataset: Path) -> None:
    table = pq.read_table(dataset / INDEX)
    i = table.schema.get_field_index("sample_id")
    table = table.set_column(i, pa.field("sample_id", pa.string()), table.column("sample_id").cast(pa.string()))
    rewrite_index(dataset, table=table)
    assert actlake.open(dataset).sample_ids.tolist() == list(range(6))


def test_unparseable_options_and_oversized_labels_are_config_errors(tmp_path: Path, rng: np.random.Generator) -> None:
    for bad in ({"shard_bytes": "lots"}, {"logits_topk": "many"}):
        with pytest.raises(ConfigError):
            lm.create_writer(tmp_path, StoreSpec(layers=(0,), d_model=4, max_tokens=2, n_samples=3, options=bad))
    acts, lengths = make_acts(rng, 3, 1, 2, 4)
    with pytest.raises(ConfigError, match="int32"):
        write(tmp_path / "a", acts, lengths, layers=(0,), labels=np.array([0, 1, 1 << 40]))
    with pytest.raises(ConfigError, match="int32"):
        write(tmp_path / "b", acts, lengths, layers=(0,), extra={"label": [0, 1, 1 << 40]})


def test_perplexity_of_missing_and_empty_lists_is_null(tmp_path: Path, rng: np.random.Generator) -> None:
    acts, lengths = make_acts(rng, 4, 1, 3, 4)
    ppl = [[2.0, 4.0], None, [], [1.0, 8.0, 3.0]]
    out = write(tmp_path, acts, lengths, layers=(0,), extra={"token_perplexity": ppl})
    df = pq.read_table(out / INDEX).to_pydict()
    assert df["token_perplexity"] == [[2.0, 4.0], None, [], [1.0, 8.0, 3.0]]
    assert df["perplexity_mean"] == [3.0, None, None, 4.0]
    assert df["perplexity_min"] == [2.0, None, None, 1.0]
    assert df["perplexity_max"] == [4.0, None, None, 8.0]
    assert lm.verify(out) == []
