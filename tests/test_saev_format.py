"""saev protocol 2.1: written directories checked against the spec with plain numpy and json."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import pickle
import stat
import typing
from pathlib import Path

import numpy as np
import pytest

import actlake
from actlake.batch import Batch
from actlake.checksums import write_checksums
from actlake.errors import (
    ConfigError,
    HashMismatchError,
    LayerNotStoredError,
    MetadataError,
    MissingFileError,
    ProtocolVersionError,
    SampleIndexError,
    TruncatedFileError,
    UnsafePickleError,
)
from actlake.formats.saev import SaevMetadata, SaevReader, SaevWriter, encode_data, verify

from .conftest import write_saev

SPEC_FIELDS = {"family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model", "n_examples",
               "patches_per_shard", "data", "dataset", "dtype", "protocol"}


def _acts(rng: np.random.Generator, n: int, n_layers: int, t: int, d: int) -> np.ndarray:
    return rng.standard_normal((n, n_layers, t, d)).astype(np.float32)


def test_directory_matches_spec(tmp_path: Path, rng: np.random.Generator) -> None:
    acts = _acts(rng, 11, 2, 5, 8)
    lengths = rng.integers(1, 6, size=11)
    out = write_saev(tmp_path, acts, layers=(4, 1), lengths=lengths, patches_per_shard=5 * 2 * 4 + 3,
                     texts=[f"text {i}" for i in range(11)])
    md = json.loads((out / "metadata.json").read_text())
    assert set(md) == SPEC_FIELDS
    assert md["protocol"] == "2.1" and md["dtype"] == "float32"
    assert md["layers"] == [4, 1]  # the caller's order is the stored order
    # HASH = full sha256 of the canonical JSON
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":")).encode("utf-8")
    assert out.name == hashlib.sha256(canonical).hexdigest()
    # data is base64 of a pickle of a plain dict
    assert pickle.loads(base64.b64decode(md["data"])) == {"name": "synthetic"}
    # section 3 sizing: floor(budget / (tokens_per_ex * L)) = floor(43 / 10) = 4
    shards = json.loads((out / "shards.json").read_text())
    assert shards == [{"name": "acts000000.bin", "n_examples": 4}, {"name": "acts000001.bin", "n_examples": 4},
                      {"name": "acts000002.bin", "n_examples": 3}]
    # every shard full size, the last one too (upstream memmaps (examples_per_shard, L, T, D)); its tail reads zero
    for s in shards:
        assert os.stat(out / s["name"]).st_size == 4 * 2 * 5 * 8 * 4
    # section 4: logical tensor (N, L, T, D) split along examples, C order, float32
    pieces = [np.fromfile(out / s["name"], dtype="<f4").reshape(4, 2, 5, 8) for s in shards]
    assert not pieces[-1][3:].any()
    whole = np.concatenate([p[: s["n_examples"]] for p, s in zip(pieces, shards)])
    assert np.array_equal(whole, acts * (np.arange(5)[None, None, :, None] < lengths[:, None, None, None]))
    # offset formula of section 4.2 for one coordinate
    ex, layer_idx, tok = 9, 0, 2
    offset = ((ex % 4) * 2 * 5 + layer_idx * 5 + tok) * 8 * 4
    raw = (out / f"acts{ex // 4:06d}.bin").read_bytes()[offset : offset + 32]
    assert np.array_equal(np.frombuffer(raw, "<f4"), whole[ex, layer_idx, tok])
    # documented additions
    assert np.array_equal(np.fromfile(out / "lengths.bin", "<i4"), lengths)
    assert np.array_equal(np.fromfile(out / "sample_ids.bin", "<i8"), np.arange(11))
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [x["text"] for x in lines] == [f"text {i}" for i in range(11)]
    assert not list(tmp_path.glob(".tmp-*"))


def test_published_directory_is_read_only(tmp_path: Path, rng: np.random.Generator) -> None:
    out = write_saev(tmp_path, _acts(rng, 3, 1, 2, 4), layers=(0,))
    assert not os.stat(out).st_mode & stat.S_IWUSR
    assert not os.stat(out / "acts000000.bin").st_mode & stat.S_IWUSR


def test_same_config_is_noop_and_divergent_never_collides(tmp_path: Path, rng: np.random.Generator) -> None:
    acts = _acts(rng, 4, 1, 3, 4)
    first = write_saev(tmp_path, acts, layers=(2,))
    mtime = (first / "acts000000.bin").stat().st_mtime_ns
    md = SaevReader(first).metadata
    again = SaevWriter(tmp_path, md)
    assert again.resume_from == 4
    again.write_batch(Batch(acts, np.full(4, 3), np.arange(4)))  # ignored
    assert again.close() == first
    assert (first / "acts000000.bin").stat().st_mtime_ns == mtime
    other = write_saev(tmp_path, acts, layers=(3,))
    assert other != first and other.exists() and first.exists()


def test_labels_bin_layout(tmp_path: Path, rng: np.random.Generator) -> None:
    acts = _acts(rng, 5, 1, 4, 2)  # CLS + 3 patches
    token_labels = rng.integers(0, 7, size=(5, 4)).astype(np.uint8)
    out = write_saev(tmp_path, acts, layers=(0,), cls_token=True, family="vit", token_labels=token_labels)
    raw = np.fromfile(out / "labels.bin", dtype=np.uint8)
    assert raw.shape == (5 * 3,)  # [n_examples, patches_per_ex]: the CLS token has no label
    assert np.array_equal(raw.reshape(5, 3), token_labels[:, 1:])
    reader = actlake.open(out)
    assert np.array_equal(reader.token_labels[:, 1:], token_labels[:, 1:])


def test_text_extraction_has_all_ignore_labels_bin(tmp_path: Path, rng: np.random.Generator) -> None:
    """The storage spec says every shard directory has labels.bin: text gets 255 (ignore) for every patch."""
    out = write_saev(tmp_path, _acts(rng, 6, 2, 5, 3), layers=(0, 1))
    raw = np.fromfile(out / "labels.bin", dtype=np.uint8)
    assert raw.shape == (6 * 5,) and (raw == 255).all()
    assert actlake.open(out).token_labels is None  # no labels to carry into other formats
    assert actlake.verify(out) == []


def test_last_shard_is_full_size(tmp_path: Path, rng: np.random.Generator) -> None:
    """The last shard has the full shape of spec section 3, so upstream's full-shape memmap opens it."""
    n, n_layers, t, d = 7, 2, 3, 4
    budget = 3 * n_layers * 3 + 1  # floor(19 / (T * L)) = 3 examples per shard: shards of 3, 3, 1
    out = write_saev(tmp_path, _acts(rng, n, n_layers, t, d), layers=(0, 1), patches_per_shard=budget)
    md = json.loads((out / "metadata.json").read_text())
    tokens_per_ex = md["patches_per_ex"] + (1 if md["cls_token"] else 0)
    examples_per_shard = md["patches_per_shard"] // (tokens_per_ex * len(md["layers"]))
    shape_per_shard = (examples_per_shard, len(md["layers"]), tokens_per_ex, md["d_model"])
    assert examples_per_shard == 3
    shards = json.loads((out / "shards.json").read_text())
    assert [s["n_examples"] for s in shards] == [3, 3, 1]  # the real count of the last shard
    last = out / shards[-1]["name"]
    assert os.stat(last).st_size == int(np.prod(shape_per_shard)) * 4
    mm = np.memmap(last, dtype=np.float32, mode="r", shape=shape_per_shard)  # upstream's open
    assert not mm[1:].any()  # the padding examples read as zeros
    assert actlake.verify(out) == []


def test_truncated_last_shard_is_read(tmp_path: Path, rng: np.random.Generator) -> None:
    """A last shard truncated to its real count (older actlake) reads the same as the full-size one."""
    acts = _acts(rng, 5, 1, 2, 3)
    out = write_saev(tmp_path / "root", acts, layers=(0,), patches_per_shard=3 * 2)
    truncated = tmp_path / "copy" / out.name
    truncated.mkdir(parents=True)
    for f in out.iterdir():
        (truncated / f.name).write_bytes(f.read_bytes())
    last = truncated / "acts000001.bin"
    assert last.stat().st_size == 3 * 2 * 3 * 4
    last.write_bytes(last.read_bytes()[: 2 * 2 * 3 * 4])
    (truncated / "checksums.json").unlink()  # older actlake recorded no checksums
    assert np.array_equal(actlake.open(truncated).batch(range(5)).acts_bltd, acts)
    assert actlake.verify(truncated) == []
    last.write_bytes(last.read_bytes()[:-4])  # neither size
    with pytest.raises(TruncatedFileError, match=r"expected 72 .* or 48 \(truncated to its 2 examples\)"):
        SaevReader(truncated)
    assert any("acts000001.bin: size 44 bytes" in p for p in actlake.verify(truncated))


def test_reader_get_batch_last_token(tmp_path: Path, rng: np.random.Generator) -> None:
    acts = _acts(rng, 9, 3, 6, 5)
    lengths = np.array([6, 1, 3, 6, 2, 5, 4, 6, 1])
    out = write_saev(tmp_path, acts, layers=(7, 2, 5), lengths=lengths, patches_per_shard=6 * 3 * 2)
    reader = actlake.open(out)
    assert reader.format == "saev" and reader.layers == (7, 2, 5) and reader.n_samples == 9
    for s in range(9):
        for j, layer in enumerate((7, 2, 5)):
            assert np.array_equal(reader.get(s, layer), acts[s, j, : lengths[s]])
    assert np.array_equal(reader.last_token(5), acts[np.arange(9), 2, lengths - 1])
    batch = reader.batch([8, 0, 4], [5, 7])
    assert np.array_equal(batch.acts_bltd[1, 0], acts[0, 2]) and np.array_equal(batch.acts_bltd[0, 1, :1], acts[8, 0, :1])
    assert list(batch.lengths) == [1, 6, 2]
    with pytest.raises(LayerNotStoredError, match="layer 3 is not stored"):
        reader.get(0, 3)
    with pytest.raises(SampleIndexError):
        reader.get(9, 7)
    with pytest.raises(SampleIndexError):
        reader.batch([0, 12])


def test_newer_upstream_field_names(tmp_path: Path, rng: np.random.Generator) -> None:
    acts = _acts(rng, 3, 1, 2, 4)
    out = write_saev(tmp_path, acts, layers=(0,))
    copy = tmp_path / "upstream"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    md = json.loads((copy / "metadata.json").read_text())
    md["content_tokens_per_example"] = md.pop("patches_per_ex")
    md["max_tokens_per_shard"] = md.pop("patches_per_shard")
    md["pixel_agg"] = "majority"
    (copy / "metadata.json").write_text(json.dumps(md))
    (copy / "checksums.json").unlink()  # as upstream writes it: no checksums
    reader = actlake.open(copy)
    assert reader.max_tokens == 2 and np.array_equal(reader.get(2, 0), acts[2, 0])
    # named by the hash of its metadata.json as written (upstream names included), it verifies clean
    named = tmp_path / hashlib.sha256(json.dumps(md, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    copy.rename(named)
    assert actlake.verify(named) == []


# ---- hostile input -------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path, rng: np.random.Generator) -> Path:
    out = write_saev(tmp_path / "root", _acts(rng, 6, 2, 3, 4), layers=(0, 1), patches_per_shard=3 * 2 * 4)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def _edit_metadata(store: Path, **changes: object) -> None:
    md = json.loads((store / "metadata.json").read_text())
    for k, v in changes.items():
        if v is None:
            md.pop(k)
        else:
            md[k] = v
    (store / "metadata.json").write_text(json.dumps(md))


def test_truncated_shard(store: Path) -> None:
    f = store / "acts000001.bin"
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(TruncatedFileError) as info:
        SaevReader(store)
    assert info.value.path == f


def test_missing_shards_json(store: Path) -> None:
    (store / "shards.json").unlink()
    with pytest.raises(MissingFileError, match="shards.json"):
        actlake.open(store)


def test_metadata_not_json(store: Path) -> None:
    (store / "metadata.json").write_text("{not json")
    with pytest.raises(MetadataError, match="metadata.json"):
        SaevReader(store)


def test_metadata_missing_field(store: Path) -> None:
    _edit_metadata(store, d_model=None)
    with pytest.raises(MetadataError, match="missing field 'd_model'"):
        SaevReader(store)


def test_metadata_wrong_type(store: Path) -> None:
    _edit_metadata(store, d_model="4")
    with pytest.raises(MetadataError, match="'d_model'"):
        SaevReader(store)


def test_protocol_3_refused_and_minor_warns(store: Path) -> None:
    _edit_metadata(store, protocol="3.0")
    with pytest.raises(ProtocolVersionError):
        SaevReader(store)
    _edit_metadata(store, protocol="2.7")
    with pytest.warns(UserWarning, match="2.7"):
        SaevReader(store)


def test_absurd_sizes_refused_before_allocating(store: Path) -> None:
    _edit_metadata(store, d_model=1 << 40)
    with pytest.raises(MetadataError, match="d_model"):
        SaevReader(store)
    _edit_metadata(store, d_model=4, n_examples=10**15)
    with pytest.raises(MetadataError, match="n_examples"):
        SaevReader(store)


def test_labels_wrong_size(store: Path) -> None:
    (store / "labels.bin").write_bytes(bytes(5))
    with pytest.raises(TruncatedFileError, match="labels.bin"):
        SaevReader(store)


def test_verify_reports_hash_mismatch(store: Path) -> None:
    problems = verify(store)
    assert any("not the metadata hash" in p for p in problems)
    assert isinstance(HashMismatchError("x"), actlake.errors.FormatError)


def test_verify_clean_and_dirty(tmp_path: Path, rng: np.random.Generator) -> None:
    out = write_saev(tmp_path / "root", _acts(rng, 4, 1, 2, 3), layers=(0,), patches_per_shard=2 * 2)
    assert actlake.verify(out) == []
    assert verify(out.parent / "missing")

    def corrupted(name: str, damage: object) -> list[str]:
        copy = tmp_path / name / out.name  # same (valid) directory name: only the damage is reported
        copy.mkdir(parents=True)
        for f in out.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        damage(copy)  # type: ignore[operator]
        write_checksums(copy)  # re-sealed: each check on its own (checksums.json has tests of its own)
        return verify(copy)

    def nan(d: Path) -> None:
        x = np.fromfile(d / "acts000001.bin", "<f4")
        x[3] = np.nan
        x.tofile(d / "acts000001.bin")

    problems = corrupted("nan", nan)
    assert len(problems) == 1 and "non-finite" in problems[0] and "acts000001.bin" in problems[0]
    problems = corrupted("extra", lambda d: (d / "acts000009.bin").write_bytes(b""))
    assert len(problems) == 1 and "not listed in shards.json" in problems[0]
    problems = corrupted("dup", lambda d: np.zeros(4, "<i8").tofile(d / "sample_ids.bin"))
    assert len(problems) == 1 and "not unique" in problems[0]
    problems = corrupted("jsonl", lambda d: (d / "samples.jsonl").write_text("{}\n"))
    assert len(problems) == 1 and "samples.jsonl" in problems[0]


def test_data_field_never_unpickled_unless_asked(tmp_path: Path, store: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    _edit_metadata(store, data=base64.b64encode(pickle.dumps(Evil())).decode())
    reader = SaevReader(store)  # opening never unpickles `data`
    assert reader.n_samples == 6
    with pytest.raises(UnsafePickleError):
        reader.data_description()
    assert not marker.exists()


def test_writer_rejects_bad_batches(tmp_path: Path) -> None:
    md = SaevMetadata(family="gpt2", ckpt="m", layers=(0,), patches_per_ex=3, cls_token=False, d_model=2,
                      n_examples=2, data=encode_data({}))
    writer = SaevWriter(tmp_path, md)
    with pytest.raises(ConfigError):
        writer.write_batch(Batch(np.zeros((1, 1, 4, 2), np.float32), np.array([4]), np.array([0])))
    with pytest.raises(ConfigError, match="n_examples"):
        writer.write_batch(Batch(np.zeros((3, 1, 3, 2), np.float32), np.full(3, 3), np.arange(3)))
    with pytest.raises(ConfigError, match="smaller than one example"):
        SaevMetadata(family="gpt2", ckpt="m", layers=(0, 1), patches_per_ex=3, cls_token=False, d_model=2,
                     n_examples=2, patches_per_shard=5)


def test_resume_after_interruption_is_byte_identical(tmp_path: Path, rng: np.random.Generator) -> None:
    acts = _acts(rng, 10, 2, 3, 4)
    lengths = rng.integers(1, 4, size=10)
    md = SaevMetadata(family="gpt2", ckpt="m", layers=(0, 1), patches_per_ex=3, cls_token=False, d_model=4,
                      n_examples=10, patches_per_shard=3 * 2 * 3, data=encode_data({}))

    def batches(start: int) -> list[Batch]:
        return [Batch(acts[s : s + 2], lengths[s : s + 2], np.arange(s, min(s + 2, 10)), texts=["x"] * len(range(s, min(s + 2, 10))))
                for s in range(start, 10, 2)]

    clean = tmp_path / "clean"
    w = SaevWriter(clean, md)
    for b in batches(0):
        w.write_batch(b)
    clean_out = w.close()

    dirty = tmp_path / "dirty"
    w = SaevWriter(dirty, md)
    for b in batches(0)[:3]:  # 6 examples: shards 0 and 1 complete, nothing of shard 2
        w.write_batch(b)
    w.abort()
    assert not (dirty / md.hash).exists()
    w = SaevWriter(dirty, md)
    assert w.resume_from == 6
    for b in batches(6):
        w.write_batch(b)
    dirty_out = w.close()
    for f in sorted(clean_out.iterdir()):
        assert (dirty_out / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in clean_out.iterdir()) == sorted(p.name for p in dirty_out.iterdir())


def test_second_concurrent_writer_is_refused(tmp_path: Path) -> None:
    md = SaevMetadata(family="gpt2", ckpt="m", layers=(0,), patches_per_ex=2, cls_token=False, d_model=2,
                      n_examples=2, data=encode_data({}))
    first = SaevWriter(tmp_path, md)
    with pytest.raises(actlake.errors.FormatError, match="another process is writing"):
        SaevWriter(tmp_path, md)
    first.abort()
    second = SaevWriter(tmp_path, md)  # the lock is released on abort
    second.write_batch(Batch(np.zeros((2, 1, 2, 2), np.float32), np.full(2, 2), np.arange(2)))
    assert second.close().is_dir()
    assert not list(tmp_path.glob(".tmp-*"))


# ---- upstream flavour ----------------------------------------------------------------------

UPSTREAM_FIELDS = ["family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
                   "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"]


def test_convert_to_upstream_flavor(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture) -> None:
    """`convert --to saev --option flavor=upstream` writes what upstream saev's current loader takes, no shim:
    its field names and order, a family of its own, full-size shards, under `saev/shards/<hash of metadata>`."""
    from actlake.cli import main

    acts = _acts(rng, 5, 2, 4, 3)  # CLS + 3 patches
    src = write_saev(tmp_path / "src", acts, layers=(2, 5), cls_token=True, family="clip", patches_per_shard=4 * 2 * 2)
    root = tmp_path / "saev" / "shards"
    assert main(["convert", str(src), "--to", "saev", "--out", str(root), "--option", "flavor=upstream",
                 "--option", "patches_per_shard=16"]) == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert out.parent == root and out.parts[-3:-1] == ("saev", "shards")  # upstream's is_shards_dir

    md = json.loads((out / "metadata.json").read_text())
    assert list(md) == UPSTREAM_FIELDS  # exactly upstream's fields: its loader calls Metadata(**json)
    assert md["family"] in ("clip", "siglip", "dinov2", "dinov3", "fake-clip")  # its Literal
    assert md["content_tokens_per_example"] == 3 and md["cls_token"] is True and md["layers"] == [2, 5]
    assert md["max_tokens_per_shard"] == 16 and md["pixel_agg"] is None and md["protocol"] == "2.1"
    assert md["dtype"] == "float32" and isinstance(md["data"], str) and md["d_model"] == 3 and md["n_examples"] == 5
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":")).encode("utf-8")
    assert out.name == hashlib.sha256(canonical).hexdigest()  # the hash of the metadata as written

    shards = json.loads((out / "shards.json").read_text())
    assert shards == [{"name": "acts000000.bin", "n_examples": 2}, {"name": "acts000001.bin", "n_examples": 2},
                      {"name": "acts000002.bin", "n_examples": 1}]
    tokens_per_example = md["content_tokens_per_example"] + int(md["cls_token"])
    examples_per_shard = md["max_tokens_per_shard"] // (tokens_per_example * len(md["layers"]))
    shape = (examples_per_shard, len(md["layers"]), tokens_per_example, md["d_model"])
    got = np.concatenate([np.memmap(out / s["name"], dtype=np.float32, mode="r", shape=shape)[: s["n_examples"]]
                          for s in shards])  # upstream's full-shape memmap of every shard
    assert np.array_equal(got, acts)
    assert np.fromfile(out / "labels.bin", np.uint8).shape == (5 * 3,)
    assert actlake.verify(out) == []
    reader = actlake.open(out)  # reading takes both flavours
    assert reader.metadata.flavor == "upstream" and reader.metadata.cls_token and reader.max_tokens == 4
    assert np.array_equal(reader.batch(range(5)).acts_bltd, acts)

    # a family upstream does not know is refused, naming the way out; family= declares one
    text = write_saev(tmp_path / "text", _acts(rng, 2, 1, 3, 2), layers=(0,), family="gpt2")
    assert main(["convert", str(text), "--to", "saev", "--out", str(root), "--option", "flavor=upstream"]) == 2
    assert "family=NAME" in capsys.readouterr().err
    assert main(["convert", str(text), "--to", "saev", "--out", str(root), "--option", "flavor=upstream",
                 "--option", "family=fake-clip"]) == 0
    declared = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((declared / "metadata.json").read_text())["family"] == "fake-clip"
    assert main(["convert", str(src), "--to", "saev", "--out", str(root), "--option", "flavor=newest"]) == 2
    assert "flavor" in capsys.readouterr().err


# ---- verify on directories upstream saev wrote ---------------------------------------------


@dataclasses.dataclass
class UpstreamImageFolder:
    """Stands for upstream saev's dataset config class, which its writer pickles into `data`."""

    root: str
    split: str = "train"
    unpickled: typing.ClassVar[list[str]] = []

    def __setstate__(self, state: dict) -> None:  # runs if anything ever unpickles `data`
        UpstreamImageFolder.unpickled.append(state["root"])
        self.__dict__.update(state)


def upstream_dir(shards_root: Path, acts: np.ndarray, data: str, **changes: object) -> Path:
    """A directory as upstream saev's own writer lays it out: its field names and order, `data` a pickle of its
    dataset class, full-size zero-padded shards, named by 8 hex digits of sha256 of the field-ordered JSON."""
    n, n_layers, t, d = acts.shape
    md = {"family": "dinov2", "ckpt": "facebook/dinov2-small", "layers": [1, 3], "content_tokens_per_example": t - 1,
          "cls_token": True, "d_model": d, "n_examples": n, "max_tokens_per_shard": 2 * n_layers * t, "data": data,
          "dataset": "/data/images", "pixel_agg": None, "dtype": "float32", "protocol": "2.1", **changes}
    out = shards_root / hashlib.sha256(json.dumps(md).encode("utf-8")).hexdigest()[:8]
    out.mkdir(parents=True)
    (out / "metadata.json").write_text(json.dumps(md, indent=2))
    shards = [{"name": f"acts{i:06d}.bin", "n_examples": min(2, n - 2 * i)} for i in range(-(-n // 2))]
    (out / "shards.json").write_text(json.dumps(shards, indent=2))
    for i, s in enumerate(shards):
        full = np.zeros((2, n_layers, t, d), np.float32)
        full[: s["n_examples"]] = acts[2 * i : 2 * i + s["n_examples"]]
        full.tofile(out / s["name"])
    np.zeros((n, t - 1), np.uint8).tofile(out / "labels.bin")
    return out


def test_verify_upstream_written_directory_warns_not_fails(tmp_path: Path, rng: np.random.Generator) -> None:
    """Upstream's pickled dataset class and 8-hex directory name are warnings naming what was not checked (the
    pickle is never executed); verify passes and the CLI exits 0. Real problems in such a directory stay errors."""
    from actlake.cli import main
    from actlake.verification import VerifyWarning

    acts = _acts(rng, 5, 2, 5, 3)
    data = base64.b64encode(pickle.dumps(UpstreamImageFolder("/data/images"))).decode("utf8")
    root = tmp_path / "saev" / "shards"
    out = upstream_dir(root, acts, data)
    assert len(out.name) == 8

    report = actlake.verify_report(out)
    assert report.ok and report.problems == () and len(report.warnings) == 3
    sums_warning = next(w for w in report.warnings if "checksums.json" in w)  # upstream records none
    assert "missing" in sums_warning and "not checked" in sums_warning
    data_warning = next(w for w in report.warnings if "'data'" in w)
    assert "UpstreamImageFolder" in data_warning and "not checked" in data_warning
    name_warning = next(w for w in report.warnings if "directory name" in w)
    assert out.name in name_warning and "HASH" in name_warning and "not checked" in name_warning
    with pytest.warns(VerifyWarning) as caught:
        assert actlake.verify(out) == []  # warnings are not problems
        assert main(["verify", str(out)]) == 0  # the CLI's exit code ignores them
    assert {str(w.message) for w in caught} == set(report.warnings)
    assert UpstreamImageFolder.unpickled == []  # verify never executed the pickle
    assert np.array_equal(actlake.open(out).batch(range(5)).acts_bltd, acts)

    def problems(shards_root: Path, **kwargs: object) -> list[str]:
        with pytest.warns(VerifyWarning):  # the warnings that still apply
            return actlake.verify(upstream_dir(shards_root, acts, **kwargs))  # type: ignore[arg-type]

    wrong_name = tmp_path / "renamed" / "deadbeef"
    wrong_name.parent.mkdir()
    out.rename(wrong_name)
    with pytest.warns(VerifyWarning):
        found = actlake.verify(wrong_name)
    assert len(found) == 1 and "neither the metadata hash" in found[0]
    broken = problems(tmp_path / "broken", data=data[:-8])  # a pickle cut short
    assert len(broken) == 1 and "'data'" in broken[0] and "not a complete pickle" in broken[0]

    class RunsCode:
        def __reduce__(self) -> tuple:
            return (os.system, ("true",))

    harmful = base64.b64encode(pickle.dumps(RunsCode())).decode("utf8")
    found = problems(tmp_path / "harmful", data=harmful)
    assert len(found) == 1 and "system" in found[0] and "runs code" in found[0]
    nan = upstream_dir(tmp_path / "nan", acts, data)
    x = np.fromfile(nan / "acts000001.bin", "<f4")
    x[5] = np.nan
    x.tofile(nan / "acts000001.bin")
    with pytest.warns(VerifyWarning):
        found = actlake.verify(nan)  # warnings do not stop the value checks
    assert len(found) == 1 and "non-finite" in found[0]
    assert UpstreamImageFolder.unpickled == []
