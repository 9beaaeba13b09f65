"""gzip-pickle shards v1.0: files checked with plain gzip + pickle + json, reader, verify, merge, hostile input."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import actlake
from actlake.batch import Batch
from actlake.checksums import write_checksums
from actlake.errors import (
    ConfigError,
    DuplicateSampleError,
    FormatError,
    HashMismatchError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
    TruncatedFileError,
    UnsafePathError,
    UnsafePickleError,
)
from actlake.formats import create_writer, detect_format
from actlake.formats import pickle_shards as ps
from actlake.spec import StoreSpec

LAYERS = (5, 2)
N, T, D = 9, 6, 4


def make_data(rng: np.random.Generator, n: int = N) -> dict:
    acts = rng.standard_normal((n, len(LAYERS), T, D)).astype(np.float32)
    lengths = rng.integers(0, T + 1, n)
    lengths[0] = T
    texts = [("long text " * 40) if i == 1 else f"sample {i}" for i in range(n)]
    return {"acts": acts, "lengths": lengths, "texts": texts, "labels": np.arange(n) % 3,
            "sample_ids": np.arange(n, dtype=np.int64) * 7 + 1000}


def write_store(root: Path, data: dict, *, batch_size: int = 4, machine_id: int = 0, num_machines: int = 1,
                labels: bool = True, texts: bool = True, **options) -> Path:
    n = data["acts"].shape[0]
    spec = StoreSpec(layers=LAYERS, d_model=D, max_tokens=T, n_samples=n, model_name="tiny/model", family="gpt2",
                     dataset="/data/x", data={"name": "synthetic", "split": "train"},
                     provenance={"model_params": {"num_hidden_layers": 6, "vocab_size": 50}},
                     machine_id=machine_id, num_machines=num_machines, options=options)
    writer = create_writer("pickle", root, spec)
    for s in range(0, n, batch_size):
        sl = slice(s, min(s + batch_size, n))
        writer.write_batch(Batch(
            acts_bltd=data["acts"][sl], lengths=data["lengths"][sl], sample_ids=data["sample_ids"][sl],
            texts=data["texts"][sl] if texts else None, labels=data["labels"][sl] if labels else None,
        ))
    return writer.close()


def writable_copy(src: Path, dst: Path) -> Path:
    """A writable copy of a published (read-only) store, for corrupting it."""
    shutil.copytree(src, dst)
    for p in [dst, *dst.iterdir()]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


def plain_metadata(path: Path) -> dict:
    return json.loads((path / "metadata.json").read_text())


def plain_shard(path: Path, info: dict) -> dict:
    opener = gzip.open if info["compressed"] else open
    with opener(path / info["filename"], "rb") as f:
        return pickle.load(f)


def save_metadata(path: Path, md: dict) -> None:
    (path / "metadata.json").write_text(json.dumps(md))


@pytest.fixture
def data(rng: np.random.Generator) -> dict:
    return make_data(rng)


@pytest.fixture
def store(tmp_path: Path, data: dict) -> Path:
    return write_store(tmp_path / "out", data, shard_bytes=3 * T * D * 4 * len(LAYERS))


# ---- the files, read with plain json / gzip / pickle ----------------------------------------


def test_metadata_json_has_every_spec_field(store: Path, data: dict) -> None:
    md = plain_metadata(store)
    assert re.fullmatch(r"pickle-[0-9a-f]{16}", store.parent.name) and store.name == "machine_0000"
    assert md["version"] == "1.0"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", md["created_at"])
    cfg = md["extraction_config"]
    assert cfg["model_name"] == "tiny/model" and cfg["model_architecture"] == "gpt2"
    assert cfg["model_params"] == {"hidden_size": D, "num_hidden_layers": 6, "vocab_size": 50}
    assert (cfg["dataset_name"], cfg["dataset_config"], cfg["dataset_split"]) == ("synthetic", None, "train")
    assert cfg["layers_extracted"] == list(LAYERS) and cfg["max_seq_length"] == T and cfg["batch_size"] == 4
    assert md["distributed_config"] == {"machine_id": 0, "total_machines": 1, "multihost": False,
                                        "num_hosts": 1, "mesh_type": "1d"}
    shards = md["shards"]
    assert [s["shard_id"] for s in shards] == list(range(1, len(shards) + 1)) and len(shards) > 1
    first = 0
    for s in shards:
        f = store / s["filename"]
        assert s["filename"] == f"shard_{s['shard_id']:04d}.pkl.gz" and s["compressed"] is True
        assert s["size_bytes"] == f.stat().st_size
        assert s["checksum"] == "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
        assert s["layers"] == list(LAYERS)
        ids = data["sample_ids"][first : first + s["num_samples"]]
        assert s["sample_id_range"] == [int(ids.min()), int(ids.max())]
        first += s["num_samples"]
    assert first == N
    stats = md["statistics"]
    assert stats["total_shards"] == len(shards) and stats["total_samples"] == N
    assert stats["total_size_bytes"] == sum(s["size_bytes"] for s in shards)
    assert stats["layers_extracted"] == list(LAYERS) and stats["extraction_duration_seconds"] >= 0
    ext = md["actlake"]
    assert ext["sample_ids"] == data["sample_ids"].tolist() and ext["lengths"] == data["lengths"].tolist()
    assert ext["labels"] == data["labels"].tolist()


def test_shards_hold_exactly_the_spec_dict(store: Path, data: dict) -> None:
    md = plain_metadata(store)
    pos = 0
    for info in md["shards"]:
        shard = plain_shard(store, info)
        assert list(shard) == [f"layer_{x}" for x in LAYERS]
        for j, layer in enumerate(LAYERS):
            items = shard[f"layer_{layer}"]
            assert len(items) == info["num_samples"]
            for k, item in enumerate(items):
                i = pos + k
                n = int(data["lengths"][i])
                assert set(item) == {"sample_idx", "activation", "shape", "text_preview", "metadata"}
                assert item["sample_idx"] == data["sample_ids"][i]
                # the spec's shape: (max_seq_length, hidden) with token_count real rows, zero padding
                assert item["activation"].dtype == np.float32 and item["activation"].shape == (T, D)
                assert md["extraction_config"]["max_seq_length"] == T
                np.testing.assert_array_equal(item["activation"][:n], data["acts"][i, j, :n])
                assert not item["activation"][n:].any()
                assert item["shape"] == (T, D) and isinstance(item["shape"], tuple)
                assert item["text_preview"] == data["texts"][i][:200]
                meta = item["metadata"]
                assert meta["token_count"] == n and meta["machine_id"] == 0
                assert meta["dataset_idx"] == data["sample_ids"][i] and meta["label"] == data["labels"][i]
                assert meta.get("text", item["text_preview"]) == data["texts"][i]
                assert ("text" in meta) == (len(data["texts"][i]) > 200)
        pos += info["num_samples"]


def test_published_store_is_read_only_and_rerun_is_a_noop(tmp_path: Path, store: Path, data: dict) -> None:
    assert not os.access(store, os.W_OK) or os.geteuid() == 0
    assert not (store.stat().st_mode & stat.S_IWUSR)
    assert all(not (f.stat().st_mode & stat.S_IWUSR) for f in store.iterdir())
    assert not list(store.glob(".*")) and not list(store.parent.glob(".tmp-*"))
    again = write_store(tmp_path / "out", data, shard_bytes=3 * T * D * 4 * len(LAYERS))
    assert again == store


def test_uncompressed_option_writes_plain_pickles(tmp_path: Path, data: dict) -> None:
    out = write_store(tmp_path, data, compressed=False, pickle_protocol=4)
    md = plain_metadata(out)
    for info in md["shards"]:
        assert info["filename"].endswith(".pkl") and info["compressed"] is False
        with open(out / info["filename"], "rb") as f:
            assert f.read(2) != b"\x1f\x8b"
    shard = plain_shard(out, md["shards"][0])
    np.testing.assert_array_equal(shard["layer_2"][0]["activation"], data["acts"][0, 1])
    assert actlake.verify(out) == []


@pytest.mark.parametrize("padded", [True, False])
def test_shards_are_sized_by_the_byte_budget(tmp_path: Path, data: dict, padded: bool) -> None:
    """The budget counts the float32 bytes stored: max_seq_length rows per sample padded, token_count rows not."""
    budget = 2 * T * D * 4 * len(LAYERS)
    out = write_store(tmp_path, data, shard_bytes=budget, batch_size=5, padded=padded)
    raw = (np.full(N, T) if padded else data["lengths"]) * len(LAYERS) * D * 4
    expected, acc, count = [], 0, 0  # greedy: close a shard before a sample that would overflow it
    for r in raw:
        if count and acc + r > budget:
            expected.append(count)
            acc, count = 0, 0
        acc, count = acc + r, count + 1
        if acc >= budget:
            expected.append(count)
            acc, count = 0, 0
    if count:
        expected.append(count)
    assert [s["num_samples"] for s in plain_metadata(out)["shards"]] == expected


def test_default_budget_puts_small_data_in_one_shard(tmp_path: Path, data: dict) -> None:
    out = write_store(tmp_path, data)
    assert [s["filename"] for s in plain_metadata(out)["shards"]] == ["shard_0001.pkl.gz"]


# ---- the spec's own loader, copied verbatim ---------------------------------------------------

# --- begin verbatim copy of the code printed in pickle-shards-v1.md ("Loading API" and
# "Compatibility"; its usage lines, which read ./activations, are run by the tests below) ---
import json
import pickle
import gzip
from pathlib import Path
import numpy as np

def load_metadata(output_dir):
    """Load extraction metadata"""
    with open(Path(output_dir) / "metadata.json") as f:
        return json.load(f)

def load_shard(shard_path, compressed=True):
    """Load a single shard"""
    if compressed:
        with gzip.open(shard_path, 'rb') as f:
            return pickle.load(f)
    else:
        with open(shard_path, 'rb') as f:
            return pickle.load(f)

def iter_activations(output_dir, layer_idx):
    """Iterate over all activations for a specific layer"""
    metadata = load_metadata(output_dir)
    layer_key = f"layer_{layer_idx}"

    for shard_info in metadata['shards']:
        if layer_idx not in shard_info['layers']:
            continue

        shard_path = Path(output_dir) / shard_info['filename']
        shard_data = load_shard(shard_path, compressed=shard_info['compressed'])

        if layer_key in shard_data:
            for item in shard_data[layer_key]:
                yield item

from torch.utils.data import Dataset, DataLoader

class ActivationDataset(Dataset):
    def __init__(self, output_dir, layer_idx):
        self.output_dir = Path(output_dir)
        self.layer_idx = layer_idx
        self.layer_key = f"layer_{layer_idx}"

        # Load metadata and build index
        with open(self.output_dir / "metadata.json") as f:
            self.metadata = json.load(f)

        # Build index: [(shard_id, item_idx), ...]
        self.index = []
        for shard_info in self.metadata['shards']:
            if layer_idx in shard_info['layers']:
                shard_path = self.output_dir / shard_info['filename']
                shard_data = load_shard(shard_path, compressed=shard_info['compressed'])
                num_items = len(shard_data[self.layer_key])
                for i in range(num_items):
                    self.index.append((shard_info['shard_id'], i))

        # Cache current shard
        self.current_shard_id = None
        self.current_shard = None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        shard_id, item_idx = self.index[idx]

        # Load shard if not cached
        if shard_id != self.current_shard_id:
            shard_info = next(s for s in self.metadata['shards'] if s['shard_id'] == shard_id)
            shard_path = self.output_dir / shard_info['filename']
            self.current_shard = load_shard(shard_path, compressed=shard_info['compressed'])
            self.current_shard_id = shard_id

        item = self.current_shard[self.layer_key][item_idx]
        return {
            'activation': item['activation'],
            'sample_idx': item['sample_idx'],
            'text': item['text_preview']
        }
# --- end verbatim copy ---


@pytest.mark.parametrize("compressed", [True, False])
def test_spec_loader_reads_our_shards(tmp_path: Path, data: dict, compressed: bool) -> None:
    out = write_store(tmp_path, data, shard_bytes=3 * T * D * 4, compressed=compressed)
    reader = actlake.open(out)
    for layer in LAYERS:
        items = list(iter_activations(out, layer_idx=layer))
        assert [it["sample_idx"] for it in items] == data["sample_ids"].tolist()
        for i, item in enumerate(items):
            n = item["metadata"]["token_count"]
            np.testing.assert_array_equal(item["activation"][:n], reader.get(i, layer))
            assert item["activation"].shape == (T, D) and not item["activation"][n:].any()
        dataset = ActivationDataset(out, layer_idx=layer)
        assert len(dataset) == N
        for i in (0, N - 1, 3, 1):
            got = dataset[i]
            np.testing.assert_array_equal(got["activation"], reader.batch([i], [layer]).acts_bltd[0, 0])
            assert got["sample_idx"] == reader.sample_ids[i] and got["text"] == reader.texts[i][:200]


def test_spec_usage_example_runs_as_printed(tmp_path: Path, rng: np.random.Generator,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's DataLoader usage, verbatim, over a store of variable-length samples written with default
    options: every batch stacks ([batch_size, seq_len, hidden_size]); with padded=false it cannot."""
    n, layers = 40, (15, 16)
    acts = rng.standard_normal((n, len(layers), T, D)).astype(np.float32)
    lengths = rng.integers(1, T + 1, n)
    lengths[:2] = (1, T)
    spec = StoreSpec(layers=layers, d_model=D, max_tokens=T, n_samples=n, model_name="tiny/model", family="gpt2")
    stores = {}
    for padded in (True, False):
        writer = create_writer("pickle", tmp_path / str(padded), dataclasses.replace(spec, options={} if padded else
                                                                                       {"padded": False}))
        writer.write_batch(Batch(acts_bltd=acts, lengths=lengths, sample_ids=np.arange(n), texts=["x"] * n))
        stores[padded] = writer.close()
    monkeypatch.chdir(tmp_path)
    os.symlink(stores[True], tmp_path / "activations")

    seen = []
    # --- the spec's usage, as printed ---
    dataset = ActivationDataset("./activations", layer_idx=15)
    loader = DataLoader(dataset, batch_size=32, shuffle=True)

    for batch in loader:
        activations = batch['activation']  # [batch_size, seq_len, hidden_size]
        # Train SAE...
        # --- end of the spec's usage ---
        seen.append((activations.numpy(), batch["sample_idx"].numpy()))
    assert [a.shape for a, _ in seen] == [(32, T, D), (8, T, D)]
    got = np.concatenate([a for a, _ in seen])[np.argsort(np.concatenate([i for _, i in seen]))]
    want = acts[:, 0] * (np.arange(T)[None, :, None] < lengths[:, None, None])
    np.testing.assert_array_equal(got, want)

    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        next(iter(DataLoader(ActivationDataset(stores[False], layer_idx=15), batch_size=32, shuffle=True)))


def test_spec_dataloader_batches_equal_length_samples(tmp_path: Path, data: dict) -> None:
    data = dict(data, lengths=np.full(N, T))
    out = write_store(tmp_path, data, shard_bytes=4 * T * D * 4)
    loader = DataLoader(ActivationDataset(out, layer_idx=2), batch_size=4, shuffle=False)
    got = np.concatenate([b["activation"].numpy() for b in loader])
    np.testing.assert_array_equal(got, data["acts"][:, 1])


# ---- reader ---------------------------------------------------------------------------------


def test_reader_protocol(store: Path, data: dict) -> None:
    assert detect_format(store) == "pickle"
    r = actlake.open(store)
    assert (r.format, r.layers, r.d_model, r.n_samples, r.max_tokens) == ("pickle", LAYERS, D, N, T)
    np.testing.assert_array_equal(r.sample_ids, data["sample_ids"])
    np.testing.assert_array_equal(r.lengths, data["lengths"])
    np.testing.assert_array_equal(r.labels, data["labels"])
    assert r.texts == data["texts"]
    for i in range(N):
        for j, layer in enumerate(LAYERS):
            np.testing.assert_array_equal(r.get(i, layer), data["acts"][i, j, : data["lengths"][i]])
    idx = [8, 0, 4, 4, -1]
    b = r.batch(idx, [2])
    for k, i in enumerate(idx):
        n = data["lengths"][i]
        np.testing.assert_array_equal(b.acts_bltd[k, 0, :n], data["acts"][i, 1, :n])
        assert not b.acts_bltd[k, 0, n:].any()
    assert b.texts == [data["texts"][i] for i in idx]
    np.testing.assert_array_equal(b.labels, data["labels"][idx])
    for j, layer in enumerate(LAYERS):
        last = r.last_token(layer)
        for i in range(N):
            n = data["lengths"][i]
            np.testing.assert_array_equal(last[i], data["acts"][i, j, n - 1] if n else np.zeros(D))
    with pytest.raises(actlake.errors.LayerNotStoredError):
        r.get(0, 3)
    with pytest.raises(actlake.errors.SampleIndexError):
        r.get(N, 2)
    assert r.summary()["provenance"]["model_name"] == "tiny/model"


def test_reader_returns_read_only_arrays(store: Path) -> None:
    x = actlake.open(store).get(0, 5)
    with pytest.raises(ValueError):
        x[0, 0] = 1.0


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=8), data=st.data())
def test_locate_maps_positions_to_shard_items(counts: list[int], data: st.DataObject) -> None:
    total = sum(counts)
    if total == 0:
        return
    reader = ps.PickleReader.__new__(ps.PickleReader)
    reader.path = Path("x")
    reader.n_samples = total
    reader.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pairs = [(k, j) for k, c in enumerate(counts) for j in range(c)]
    s = data.draw(st.integers(-total, total - 1))
    assert reader.locate(s) == pairs[s]


def test_verify_checksums_on_load(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    md = plain_metadata(bad)
    md["shards"][1]["checksum"] = "sha256:" + "0" * 64
    save_metadata(bad, md)
    write_checksums(bad)  # re-sealed: the shard checksum in metadata.json is what is checked
    second = md["shards"][0]["num_samples"]
    ps.open_reader(bad, verify_checksums=False).get(second, 5)  # a caller that checked the files itself
    reader = actlake.open(bad)  # checked by default, before the shard is decompressed
    reader.get(0, 5)
    with pytest.raises(HashMismatchError) as exc:
        reader.get(second, 5)
    assert exc.value.path.name == "shard_0002.pkl.gz" and "not decompressed" in str(exc.value)
    problems = actlake.verify(bad)
    assert len(problems) == 1 and "shard_0002.pkl.gz" in problems[0] and "checksum" in problems[0]


# ---- verify and hostile input ---------------------------------------------------------------


def test_verify_passes_on_written_store(store: Path) -> None:
    assert actlake.verify(store) == []
    assert ps.verify(store) == []


def test_verify_reports_statistics_and_unlisted_shards(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    md = plain_metadata(bad)
    md["statistics"]["total_samples"] = 1
    save_metadata(bad, md)
    shutil.copy(bad / "shard_0001.pkl.gz", bad / "shard_0099.pkl.gz")
    problems = ps.verify(bad)
    assert any("total_samples" in p for p in problems)
    assert any("shard_0099.pkl.gz" in p and "not listed" in p for p in problems)


def test_truncated_gzip_shard(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    f = bad / "shard_0001.pkl.gz"
    f.write_bytes(f.read_bytes()[:-40])
    with pytest.raises(TruncatedFileError) as exc:  # size no longer matches metadata.json
        actlake.open(bad)
    assert exc.value.path == f.resolve()
    md = plain_metadata(bad)
    md["shards"][0]["size_bytes"] = f.stat().st_size  # hide the size change: the gzip stream itself ends early
    md["shards"][0]["checksum"] = ps.file_sha256(f)  # (and the checksum, which would refuse it first)
    save_metadata(bad, md)
    with pytest.raises(TruncatedFileError) as exc:
        actlake.open(bad).get(0, 5)
    assert exc.value.path.name == "shard_0001.pkl.gz"
    problems = actlake.verify(bad)
    assert any("shard_0001.pkl.gz" in p for p in problems)


def test_garbage_shard_is_a_format_error(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    f = bad / "shard_0001.pkl.gz"
    size = f.stat().st_size
    f.write_bytes(b"not gzip at all".ljust(size, b"!"))
    with pytest.raises(FormatError) as exc:
        actlake.open(bad).get(0, 5)
    assert exc.value.path.name == "shard_0001.pkl.gz"


def test_missing_shard(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    (bad / "shard_0002.pkl.gz").unlink()
    with pytest.raises(MissingFileError) as exc:
        actlake.open(bad)
    assert exc.value.path.name == "shard_0002.pkl.gz"
    assert any("shard_0002.pkl.gz" in p and "missing" in p for p in actlake.verify(bad))


@pytest.mark.parametrize("content, error", [
    ("{not json", MetadataError),
    (json.dumps({"version": "1.0", "shards": []}), MetadataError),
    (json.dumps({"version": "2.0", "created_at": "x", "extraction_config": {"layers_extracted": [1]},
                 "shards": [], "statistics": {}}), ProtocolVersionError),
    (json.dumps({"version": "1.0", "created_at": "x", "extraction_config": {"layers_extracted": [1]},
                 "shards": [{"shard_id": 1, "filename": "a.pkl.gz"}], "statistics": {}}), MetadataError),
    (json.dumps([1, 2]), MetadataError),
])
def test_bad_metadata_json(tmp_path: Path, store: Path, content: str, error: type) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    (bad / "metadata.json").write_text(content)
    write_checksums(bad)  # re-sealed: the metadata checks on their own
    assert detect_format(bad) == "pickle"
    with pytest.raises(error) as exc:
        actlake.open(bad)
    assert exc.value.path.name == "metadata.json"
    problems = actlake.verify(bad)
    assert len(problems) == 1 and "metadata.json" in problems[0]


@pytest.mark.parametrize("name", ["../escape.pkl.gz", "/etc/passwd", "sub/../../x.pkl.gz"])
def test_shard_filename_escaping_the_store(tmp_path: Path, store: Path, name: str) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    shutil.copy(bad / "shard_0001.pkl.gz", tmp_path / "escape.pkl.gz")
    md = plain_metadata(bad)
    md["shards"][0]["filename"] = name
    save_metadata(bad, md)
    with pytest.raises(UnsafePathError):
        actlake.open(bad)
    assert any("escape" in p or "absolute" in p or "not allowed" in p for p in actlake.verify(bad))


class _Evil:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def _craft(func, arg: str) -> dict:
    return {"layer_5": [{"sample_idx": 0, "activation": _Evil(func, arg), "shape": (1, D),
                         "text_preview": "", "metadata": {}}], "layer_2": []}


@pytest.mark.parametrize("kind", ["os.system", "subprocess.call", "eval"])
def test_malicious_shard_executes_nothing(tmp_path: Path, store: Path, kind: str) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    marker = tmp_path / f"pwned-{kind}"
    func, arg = {
        "os.system": (os.system, f"touch {marker}"),
        "subprocess.call": (subprocess.call, ["touch", str(marker)]),
        "eval": (eval, f"open({str(marker)!r}, 'w').close()"),
    }[kind]
    f = bad / "shard_0001.pkl.gz"
    with gzip.open(f, "wb") as g:
        pickle.dump(_craft(func, arg), g)
    md = plain_metadata(bad)
    md["shards"][0].update(size_bytes=f.stat().st_size, checksum="sha256:" + hashlib.sha256(f.read_bytes()).hexdigest())
    save_metadata(bad, md)
    with pytest.raises(UnsafePickleError) as exc:
        actlake.open(bad).get(0, 5)
    assert exc.value.path.name == "shard_0001.pkl.gz"
    problems = actlake.verify(bad)
    assert any("shard_0001.pkl.gz" in p and "not allowed" in p for p in problems)
    assert not marker.exists()


def test_foreign_store_in_the_spec_example_shape(tmp_path: Path, rng: np.random.Generator) -> None:
    """A store written by another tool (no actlake key, padded activations as in the spec example)."""
    root = tmp_path / "foreign"
    root.mkdir()
    acts = rng.standard_normal((4, 8, 3)).astype(np.float32)
    counts = [8, 5, 2, 7]
    shards = []
    for sid, samples in ((1, [0, 1]), (2, [2, 3])):
        shard = {f"layer_{layer}": [{"sample_idx": 10 + i, "activation": acts[i] * (layer + 1), "shape": (8, 3),
                                     "text_preview": f"t{i}", "metadata": {"token_count": counts[i],
                                                                           "dataset_idx": i, "machine_id": 0}}
                                    for i in samples] for layer in (0, 1)}
        name = f"shard_{sid:04d}.pkl.gz"
        with gzip.open(root / name, "wb") as g:
            pickle.dump(shard, g)
        blob = (root / name).read_bytes()
        shards.append({"shard_id": sid, "filename": name, "size_bytes": len(blob), "num_samples": 2,
                       "layers": [0, 1], "sample_id_range": [10 + samples[0], 10 + samples[1]], "compressed": True,
                       "checksum": "sha256:" + hashlib.sha256(blob).hexdigest()})
    md = {"version": "1.0", "created_at": "2025-01-09T12:00:00Z",
          "extraction_config": {"model_name": "m", "model_architecture": "qwen2", "model_params": {"hidden_size": 3},
                                "dataset_name": "d", "dataset_config": None, "dataset_split": "train",
                                "layers_extracted": [0, 1], "max_seq_length": 8, "batch_size": 2},
          "shards": shards,
          "statistics": {"total_shards": 2, "total_samples": 4, "total_size_bytes": sum(s["size_bytes"] for s in shards),
                         "layers_extracted": [0, 1], "extraction_duration_seconds": 1.5}}
    save_metadata(root, md)
    assert actlake.verify(root) == []
    r = actlake.open(root)
    assert (r.n_samples, r.d_model, r.max_tokens) == (4, 3, 8)
    np.testing.assert_array_equal(r.lengths, counts)
    np.testing.assert_array_equal(r.sample_ids, [10, 11, 12, 13])
    assert r.texts == ["t0", "t1", "t2", "t3"] and r.labels is None
    np.testing.assert_array_equal(r.get(1, 1), acts[1, :5] * 2)
    np.testing.assert_array_equal(r.last_token(0)[2], acts[2, 1])


# ---- writer: resume, errors -----------------------------------------------------------------


def test_resume_after_interruption(tmp_path: Path, data: dict) -> None:
    budget = 2 * T * D * 4 * len(LAYERS)
    spec = StoreSpec(layers=LAYERS, d_model=D, max_tokens=T, n_samples=N, options={"shard_bytes": budget})

    def batch(sl: slice) -> Batch:
        return Batch(acts_bltd=data["acts"][sl], lengths=data["lengths"][sl], sample_ids=data["sample_ids"][sl],
                     texts=data["texts"][sl], labels=data["labels"][sl])

    w = create_writer("pickle", tmp_path, spec)
    assert w.resume_from == 0
    w.write_batch(batch(slice(0, 6)))
    w.abort()  # interrupted: committed shards stay under the temporary name
    w2 = create_writer("pickle", tmp_path, spec)
    assert 0 < w2.resume_from <= 6
    assert w2.resume_from == sum(json.loads(p.read_text())["info"]["num_samples"]
                                 for p in w2.tmp_path.glob(".shard_*.json"))
    w2.write_batch(batch(slice(w2.resume_from, N)))
    out = w2.close()
    assert ps.verify(out) == []
    r = actlake.open(out)
    np.testing.assert_array_equal(r.sample_ids, data["sample_ids"])
    for i in range(N):
        np.testing.assert_array_equal(r.get(i, 2), data["acts"][i, 1, : data["lengths"][i]])
    assert create_writer("pickle", tmp_path, spec).resume_from == N


def test_writer_refuses_bad_input(tmp_path: Path, data: dict) -> None:
    spec = StoreSpec(layers=LAYERS, d_model=D, max_tokens=T, n_samples=3)
    w = create_writer("pickle", tmp_path, spec)
    with pytest.raises(ConfigError):
        w.write_batch(Batch(acts_bltd=np.zeros((1, 1, T, D), np.float32), lengths=[1], sample_ids=[0]))
    w.write_batch(Batch(acts_bltd=data["acts"][:1], lengths=data["lengths"][:1], sample_ids=[7]))
    with pytest.raises(ConfigError, match="already written"):
        w.write_batch(Batch(acts_bltd=data["acts"][:1], lengths=data["lengths"][:1], sample_ids=[7]))
    with pytest.raises(ConfigError, match="n_samples"):
        w.close()
    bad_level = StoreSpec(layers=LAYERS, d_model=D, max_tokens=T, n_samples=1, options={"compresslevel": 11})
    with pytest.raises(ConfigError, match="compresslevel"):
        create_writer("pickle", tmp_path / "x", bad_level)


def test_other_spec_at_a_published_path_is_refused(tmp_path: Path, data: dict) -> None:
    out = write_store(tmp_path, data)
    md = json.loads((out / "metadata.json").read_text())
    assert md["actlake"]["spec_hash"]
    smaller = {k: v[:5] for k, v in data.items()}
    with pytest.raises(ConfigError, match="different pickle store"):
        write_store(tmp_path, smaller)  # same job hash (n_samples is not part of it), other content


# ---- per-machine stores and merge -----------------------------------------------------------


def _two_machines(tmp_path: Path, data: dict, ids_b: np.ndarray | None = None) -> tuple[Path, Path]:
    a = {k: v[:5] for k, v in data.items()}
    b = {k: v[5:] for k, v in data.items()}
    if ids_b is not None:
        b["sample_ids"] = ids_b
    budget = 2 * T * D * 4 * len(LAYERS)
    pa = write_store(tmp_path / "job", a, machine_id=0, num_machines=2, shard_bytes=budget)
    pb = write_store(tmp_path / "job", b, machine_id=1, num_machines=2, shard_bytes=budget)
    return pa, pb


def test_machines_write_separate_dirs_and_merge_joins_them(tmp_path: Path, data: dict) -> None:
    pa, pb = _two_machines(tmp_path, data)
    assert pa.parent == pb.parent and (pa.name, pb.name) == ("machine_0000", "machine_0001")
    assert plain_metadata(pb)["distributed_config"]["machine_id"] == 1
    item = plain_shard(pb, plain_metadata(pb)["shards"][0])["layer_5"][0]
    assert item["metadata"]["machine_id"] == 1
    out = ps.merge([pa, pb], tmp_path / "merged")
    md = plain_metadata(out)
    n_shards = len(plain_metadata(pa)["shards"]) + len(plain_metadata(pb)["shards"])
    assert [s["shard_id"] for s in md["shards"]] == list(range(1, n_shards + 1))
    for s in md["shards"]:
        f = out / s["filename"]
        assert s["filename"] == f"shard_{s['shard_id']:04d}.pkl{'.gz' if s['compressed'] else ''}"
        assert s["checksum"] == "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    assert md["statistics"]["total_samples"] == N and md["statistics"]["total_shards"] == n_shards
    assert md["distributed_config"]["merged_machine_ids"] == [0, 1]
    assert md["distributed_config"]["total_machines"] == 2
    assert actlake.verify(out) == []
    r = actlake.open(out)
    np.testing.assert_array_equal(r.sample_ids, data["sample_ids"])
    assert r.texts == data["texts"]
    for i in range(N):
        np.testing.assert_array_equal(r.get(i, 5), data["acts"][i, 0, : data["lengths"][i]])
    assert ps.merge([pa, pb], tmp_path / "merged") == out  # rerun: same inputs, nothing to do
    with pytest.raises(ConfigError):
        ps.merge([pb, pa], tmp_path / "merged")
    assert actlake.verify(pa) == [] and os.access(pa / "metadata.json", os.R_OK)


def test_merge_refuses_duplicate_sample_ids(tmp_path: Path, data: dict) -> None:
    pa, pb = _two_machines(tmp_path, data, ids_b=data["sample_ids"][1:5])
    with pytest.raises(DuplicateSampleError) as exc:
        ps.merge([pa, pb], tmp_path / "merged")
    assert exc.value.path == pb / "metadata.json"
    assert not (tmp_path / "merged").exists()


def test_merge_refuses_incompatible_stores(tmp_path: Path, data: dict) -> None:
    pa = write_store(tmp_path / "a", data)
    spec = StoreSpec(layers=(5,), d_model=D, max_tokens=T, n_samples=1)
    w = create_writer("pickle", tmp_path / "b", spec)
    w.write_batch(Batch(acts_bltd=data["acts"][:1, :1], lengths=[2], sample_ids=[-5]))
    pb = w.close()
    with pytest.raises(MetadataError, match="layers_extracted"):
        ps.merge([pa, pb], tmp_path / "merged")


def test_actlake_merge_command_calls_pickle_merge(tmp_path: Path, data: dict, capsys: pytest.CaptureFixture) -> None:
    from actlake.cli import main as cli_main

    pa, pb = _two_machines(tmp_path, data)
    assert cli_main(["merge", str(pa), str(pb), "--out", str(tmp_path / "merged")]) == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain_metadata(out)["statistics"]["total_samples"] == N and actlake.verify(out) == []
    dup_a, dup_b = _two_machines(tmp_path / "dup", data, ids_b=data["sample_ids"][:4])
    assert cli_main(["merge", str(dup_a), str(dup_b), "--out", str(tmp_path / "m2")]) == 2
    assert "sample id" in capsys.readouterr().err


# ---- review fixes: sizes before allocation, index vs items, locks, verify details ----------------


def _edit_metadata(bad: Path, **ext_changes) -> None:
    md = plain_metadata(bad)
    md["actlake"].update(ext_changes)
    save_metadata(bad, md)


@pytest.mark.parametrize("changes", [{"d_model": 1 << 40}, {"max_tokens": 1 << 40}, {"d_model": 0}])
def test_absurd_declared_sizes_are_refused_at_open(tmp_path: Path, store: Path, changes: dict) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    _edit_metadata(bad, **changes)
    with pytest.raises(MetadataError) as exc:
        actlake.open(bad)
    assert exc.value.path.name == "metadata.json"


def test_declared_width_is_checked_against_items_before_batch_allocates(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    _edit_metadata(bad, d_model=D * 1000)
    r = actlake.open(bad)
    for call in (lambda: r.batch([0]), lambda: r.last_token(5), lambda: r.get(0, 5)):
        with pytest.raises(FormatError, match="width") as exc:
            call()
        assert exc.value.path.name == "shard_0001.pkl.gz"
    assert any("d_model" in p for p in actlake.verify(bad))


def test_index_lengths_beyond_the_items_are_a_typed_error(tmp_path: Path, data: dict) -> None:
    real = write_store(tmp_path / "real", data, padded=False)  # items of token_count rows
    bad = writable_copy(real, tmp_path / "bad")
    short = int(np.flatnonzero(data["lengths"] < T)[0])
    lengths = data["lengths"].tolist()
    lengths[short] = T  # the item holds fewer rows than the index now claims
    _edit_metadata(bad, lengths=lengths)
    r = actlake.open(bad)
    for call in (lambda: r.last_token(2), lambda: r.get(short, 2), lambda: r.batch([short])):
        with pytest.raises(FormatError, match="activation rows"):
            call()
    assert any("lengths" in p for p in actlake.verify(bad))


def test_index_sample_ids_must_match_the_items(tmp_path: Path, store: Path, data: dict) -> None:
    bad = writable_copy(store, tmp_path / "bad")
    _edit_metadata(bad, sample_ids=(data["sample_ids"] + 1).tolist())
    with pytest.raises(FormatError, match="sample_idx") as exc:
        actlake.open(bad).get(0, 5)
    assert exc.value.path.name == "shard_0001.pkl.gz"
    assert any("sample_ids" in p for p in actlake.verify(bad))


def _rewrite_shard(bad: Path, info_index: int, edit) -> None:
    """Load shard `info_index` with plain gzip + pickle, apply `edit`, write it back and fix size + checksum."""
    md = plain_metadata(bad)
    info = md["shards"][info_index]
    shard = plain_shard(bad, info)
    edit(shard)
    f = bad / info["filename"]
    with gzip.open(f, "wb") as g:
        pickle.dump(shard, g)
    info.update(size_bytes=f.stat().st_size, checksum="sha256:" + hashlib.sha256(f.read_bytes()).hexdigest())
    md["statistics"]["total_size_bytes"] = sum(s["size_bytes"] for s in md["shards"])
    save_metadata(bad, md)


def test_layers_of_one_sample_must_hold_the_same_rows(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")

    def drop_a_row(shard: dict) -> None:
        item = shard["layer_2"][0]
        item["activation"] = item["activation"][:-1]
        item["shape"] = item["activation"].shape

    _rewrite_shard(bad, 0, drop_a_row)
    with pytest.raises(FormatError, match="same tokens") as exc:
        actlake.open(bad).get(0, 5)
    assert exc.value.path.name == "shard_0001.pkl.gz"
    assert any("same tokens" in p for p in actlake.verify(bad))


def test_verify_reports_item_details(tmp_path: Path, store: Path) -> None:
    bad = writable_copy(store, tmp_path / "bad")

    def spoil(shard: dict) -> None:
        long_item = shard["layer_5"][1]  # sample 1 has a text longer than the preview
        long_item["text_preview"] = "something else"
        shard["layer_5"][0]["metadata"]["token_count"] = "many"

    _rewrite_shard(bad, 0, spoil)
    md = plain_metadata(bad)
    del md["shards"][1]["sample_id_range"]
    save_metadata(bad, md)
    problems = ps.verify(bad)
    assert any("layer_5[1].text_preview is not the first 200" in p for p in problems)
    assert any("token_count 'many'" in p for p in problems)
    assert any("shards[1] lacks ['sample_id_range']" in p for p in problems)


def test_verify_token_count_beyond_rows_only_for_a_truncation(tmp_path: Path, rng: np.random.Generator) -> None:
    """A foreign store may pad/truncate to max_seq_length; a token_count beyond other row counts is a problem."""
    data = make_data(rng)
    out = write_store(tmp_path / "s", data)
    for rows, expect_problem in ((T, False), (T - 1, True)):
        bad = writable_copy(out, tmp_path / f"bad{rows}")

        def edit(shard: dict, rows: int = rows) -> None:
            for layer in LAYERS:
                item = shard[f"layer_{layer}"][0]  # sample 0 has T real tokens
                item["activation"] = np.ascontiguousarray(item["activation"][:rows])
                item["shape"] = item["activation"].shape
                item["metadata"]["token_count"] = T + 3

        _rewrite_shard(bad, 0, edit)
        md = plain_metadata(bad)
        del md["actlake"]  # read as a foreign store: lengths come from the items
        save_metadata(bad, md)
        problems = ps.verify(bad)
        assert any("not a truncation" in p for p in problems) == expect_problem, problems


def test_second_writer_of_the_same_store_is_refused(tmp_path: Path, data: dict) -> None:
    spec = StoreSpec(layers=LAYERS, d_model=D, max_tokens=T, n_samples=N)
    first = create_writer("pickle", tmp_path, spec)
    with pytest.raises(FormatError, match="another process") as exc:
        create_writer("pickle", tmp_path, spec)
    assert exc.value.path == first.tmp_path
    first.abort()
    second = create_writer("pickle", tmp_path, spec)  # the lock is released on abort
    second.write_batch(Batch(acts_bltd=data["acts"], lengths=data["lengths"], sample_ids=data["sample_ids"]))
    out = second.close()
    assert actlake.verify(out) == [] and not list(out.parent.glob(".tmp-*"))


@pytest.mark.parametrize("options", [{"shard_bytes": "lots"}, {"compresslevel": 2.5}, {"compressed": "maybe"},
                                     {"shard_bytes": 0}])
def test_unusable_options_are_config_errors(tmp_path: Path, options: dict) -> None:
    spec = StoreSpec(layers=LAYERS, d_model=D, max_tokens=T, n_samples=1, options=options)
    with pytest.raises(ConfigError):
        create_writer("pickle", tmp_path, spec)
    ok = StoreSpec(layers=LAYERS, d_model=D, max_tokens=T, n_samples=1, options={"shard_bytes": 5e7})
    assert create_writer("pickle", tmp_path, ok).options.shard_bytes == 50_000_000


def test_failed_merge_leaves_no_temporary_directory(tmp_path: Path, data: dict) -> None:
    pa, pb = _two_machines(tmp_path, data)
    bad = writable_copy(pb, tmp_path / "bad-b")
    md = plain_metadata(bad)
    md["shards"][-1]["checksum"] = "sha256:" + "0" * 64
    save_metadata(bad, md)
    with pytest.raises(HashMismatchError):
        ps.merge([pa, bad], tmp_path / "merged", verify_checksums=True)
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".tmp-merged*"))
