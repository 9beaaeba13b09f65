"""Integrity corpus (tracker issue 10): stores damaged after publication, run through the real command line in a
child process under the 2 GiB address-space limit of test_formats. Each case names the outcome it must get: a
verify problem naming the file (exit 1) or a typed error naming it (exit 2), never a traceback; the store a
failing command would have made is not published."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ..conftest import flip_bit
from .test_formats import LMPROBE_INDEX, _copy, _refused, cli, extract_stores

#: a data file of each store `extract_stores` writes (one layer, five samples)
DATA_FILE = {"saev": "acts000000.bin", "zarr": "arrays/prompt_activations/0.0.0.0",
             "lmprobe": "tensors/hidden_layer000_shard000.safetensors", "pickle": "shard_0001.pkl.gz"}
FORMATS = list(DATA_FILE)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return extract_stores(tmp_path_factory.mktemp("integrity"))


def _ok(result) -> str:
    text = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in text, text
    return text


# ---- 1. a flipped byte in a data file ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_byte_in_a_data_file(stores: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    """verify: a problem naming the file (checksums.json); `info --verify` (open(verify=True)): a typed error."""
    store = _copy(stores[fmt], tmp_path / "s")
    victim = store / DATA_FILE[fmt]
    flip_bit(victim, min(100, os.path.getsize(victim) - 1))
    _refused(cli("verify", str(store)), str(victim), "does not match checksums.json")
    _refused(cli("info", "--verify", str(store)), str(victim), "does not match checksums.json")


def test_store_without_checksums_verifies_with_a_warning(stores: dict[str, Path], tmp_path: Path) -> None:
    """A store published before checksums existed: verify passes, and a warning says its bytes were not checked."""
    store = _copy(stores["saev"], tmp_path / "s")
    (store / "checksums.json").unlink()
    text = _ok(cli("verify", str(store)))
    assert "warning:" in text and "checksums.json" in text and "not checked" in text


# ---- 3. metadata edited after publication -----------------------------------------------------------------------


def _edit_zarr_model(store: Path) -> Path:
    """model_id changed in .zattrs and in its consolidated copy, so the two still agree."""
    attrs = json.loads((store / ".zattrs").read_text())
    attrs["model_id"] = "someone/else"
    (store / ".zattrs").write_text(json.dumps(attrs, indent=4))
    zmeta = json.loads((store / ".zmetadata").read_text())
    zmeta["metadata"][".zattrs"] = attrs
    (store / ".zmetadata").write_text(json.dumps(zmeta, indent=4))
    return store / ".zattrs"


def _edit_lmprobe_model(store: Path) -> Path:
    table = pq.read_table(store / LMPROBE_INDEX)
    meta = dict(table.schema.metadata)
    model = json.loads(meta[b"lmprobe:model"])
    model["name"] = "someone/else"
    meta[b"lmprobe:model"] = json.dumps(model).encode()
    pq.write_table(table.replace_schema_metadata(meta), store / LMPROBE_INDEX)
    return store / LMPROBE_INDEX


def _edit_pickle_model(store: Path) -> Path:
    md = json.loads((store / "metadata.json").read_text())
    md["extraction_config"]["model_name"] = "someone/else"
    (store / "metadata.json").write_text(json.dumps(md, indent=2))
    return store / "metadata.json"


def _edit_saev_provenance(store: Path) -> Path:
    prov = json.loads((store / "provenance.json").read_text())
    prov["model_name"] = "someone/else"
    (store / "provenance.json").write_text(json.dumps(prov))
    return store / "provenance.json"


@pytest.mark.parametrize("fmt, edit", [("zarr", _edit_zarr_model), ("lmprobe", _edit_lmprobe_model),
                                       ("pickle", _edit_pickle_model), ("saev", _edit_saev_provenance)])
def test_metadata_edited_after_publication(stores: dict[str, Path], tmp_path: Path, fmt: str, edit) -> None:
    """The metadata files are in checksums.json like the data: verify names the edited file."""
    store = _copy(stores[fmt], tmp_path / "s")
    edited = edit(store)
    _refused(cli("verify", str(store)), str(edited), "checksums.json")
    _refused(cli("info", "--verify", str(store)), str(edited))


# ---- 2. a corrupted pickle shard ----------------------------------------------------------------------------------


def _reseal(store: Path) -> None:
    """checksums.json written again over the damaged store: the per-shard defences are tested on their own."""
    from actlake.checksums import write_checksums

    write_checksums(store)


def _published(out: Path) -> list[Path]:
    """What a command published under `out` (temporary names and lock files excluded)."""
    return [p for p in out.rglob("*") if not any(part.startswith(".") for part in p.relative_to(out).parts)] \
        if out.exists() else []


def test_corrupted_pickle_shard_is_refused_before_unpickling(stores: dict[str, Path], tmp_path: Path) -> None:
    """The shard's sha256 (metadata.json) is checked over the compressed bytes first: convert stops with a typed
    error naming the shard and publishes nothing; verify reports it."""
    store = _copy(stores["pickle"], tmp_path / "s")
    shard = store / "shard_0001.pkl.gz"
    flip_bit(shard, os.path.getsize(shard) // 2)
    _reseal(store)
    out = tmp_path / "out"
    _refused(cli("convert", str(store), "--to", "saev", "--out", str(out)), str(shard), "does not match metadata.json",
             "not decompressed")
    assert _published(out) == []
    _refused(cli("verify", str(store)), str(shard), "does not match metadata.json")


# ---- 8. a gzip bomb in a pickle shard -----------------------------------------------------------------------------

BOMB_BYTES = 5 * 2**29  # 2.5 GiB inflated: more than the child's whole address space


def _gzip_member(data: bytes) -> bytes:
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def _bomb(many: bool) -> bytes:
    """A gzip stream (concatenated members, which gzip reads as one) of a pickle holding BOMB_BYTES of zeros:
    `many` 64 KiB bytearrays in a list, or one bytearray declared BOMB_BYTES long (as numpy pickles a big array)."""
    import struct

    zeros = _gzip_member(bytes(1 << 20))
    if many:
        item = b"\x96" + struct.pack("<Q", 1 << 16) + bytes(1 << 16)  # BYTEARRAY8
        body = _gzip_member(item * 16)  # 16 items: 1 MiB and a little more
        return _gzip_member(b"\x80\x05](") + body * (BOMB_BYTES >> 20) + _gzip_member(b"e.")
    return (_gzip_member(b"\x80\x05\x96" + struct.pack("<Q", BOMB_BYTES)) + zeros * (BOMB_BYTES >> 20)
            + _gzip_member(b"."))


@pytest.mark.parametrize("many", [True, False], ids=["many-items", "one-declared-array"])
def test_gzip_bomb_is_capped(stores: dict[str, Path], tmp_path: Path, many: bool) -> None:
    """A ~3 MB shard inflating to 2.5 GiB, with its size and sha256 updated in metadata.json (so only the cap
    stands in the way): verify and convert refuse it in bounded memory, naming the shard."""
    import hashlib

    store = _copy(stores["pickle"], tmp_path / "s")
    shard = store / "shard_0001.pkl.gz"
    shard.write_bytes(_bomb(many))
    md = json.loads((store / "metadata.json").read_text())
    md["shards"][0].update(size_bytes=shard.stat().st_size,
                           checksum="sha256:" + hashlib.sha256(shard.read_bytes()).hexdigest())
    md["statistics"]["total_size_bytes"] = shard.stat().st_size
    (store / "metadata.json").write_text(json.dumps(md))
    _reseal(store)
    why = "decompresses to more than" if many else "larger than this process may allocate"
    _refused(cli("verify", str(store)), str(shard), why)
    out = tmp_path / "out"
    _refused(cli("convert", str(store), "--to", "saev", "--out", str(out)), str(shard), why)
    assert _published(out) == []


# ---- 4. a deleted zarr chunk --------------------------------------------------------------------------------------


@pytest.mark.parametrize("resealed", [False, True], ids=["as-published", "checksums-rewritten"])
def test_deleted_zarr_chunk(stores: dict[str, Path], tmp_path: Path, resealed: bool) -> None:
    """Every chunk holding real tokens is written (all-zero ones too), so a missing one was deleted: verify names
    it even when checksums.json is rewritten without it; a read is a MissingFileError naming it, so convert
    carries no zeros on and publishes nothing."""
    store = _copy(stores["zarr"], tmp_path / "s")
    chunk = store / DATA_FILE["zarr"]
    chunk.unlink()
    if resealed:
        _reseal(store)
    _refused(cli("verify", str(store)), str(chunk), "holds real tokens")
    out = tmp_path / "out"
    _refused(cli("convert", str(store), "--to", "saev", "--out", str(out)), str(chunk), "chunk file is missing")
    assert _published(out) == []


# ---- 5. NaN / Inf in zarr and lmprobe ----------------------------------------------------------------------------

#: little-endian bit patterns of NaN and +Inf per safetensors / numpy dtype
NON_FINITE = {"F16": {"nan": b"\x00\x7e", "inf": b"\x00\x7c"}, "BF16": {"nan": b"\xc0\x7f", "inf": b"\x80\x7f"},
              "F32": {"nan": b"\x00\x00\xc0\x7f", "inf": b"\x00\x00\x80\x7f"}}


def _poison_lmprobe(store: Path, what: str) -> Path:
    """One value of the hidden-state tensor replaced, located with plain struct + json (the safetensors layout)."""
    import struct

    f = store / DATA_FILE["lmprobe"]
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    entry = next(v for k, v in header.items() if k != "__metadata__")
    value = NON_FINITE[entry["dtype"]][what]
    at = 8 + n + entry["data_offsets"][0] + 3 * len(value)
    f.write_bytes(raw[:at] + value + raw[at + len(value) :])
    return f


def _poison_zarr(store: Path, what: str) -> Path:
    f = store / DATA_FILE["zarr"]
    raw = f.read_bytes()
    f.write_bytes(NON_FINITE["F16"][what] + raw[2:])
    return f


@pytest.mark.parametrize("what", ["nan", "inf"])
@pytest.mark.parametrize("fmt, poison", [("zarr", _poison_zarr), ("lmprobe", _poison_lmprobe)])
def test_non_finite_values(stores: dict[str, Path], tmp_path: Path, fmt: str, poison, what: str) -> None:
    """verify reads every value once (the checksums pass, in blocks) and names the file holding a NaN or Inf,
    even with checksums.json rewritten over it."""
    store = _copy(stores[fmt], tmp_path / "s")
    victim = poison(store, what)
    _reseal(store)
    _refused(cli("verify", str(store)), str(victim), "non-finite value (NaN or Inf)")


# ---- 6. a data file replaced by a link to a right-sized file outside the store ----------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_data_file_replaced_by_a_link(stores: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    """The link is never followed: verify reports it, info and convert stop with a typed error naming it (saev
    and zarr refuse any link in the store; lmprobe and pickle refuse a path leaving the root), nothing published."""
    store = _copy(stores[fmt], tmp_path / "s")
    victim = store / DATA_FILE[fmt]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(outside)
    expect = "is a symbolic link" if fmt in ("saev", "zarr") else "escapes the dataset root"
    _refused(cli("verify", str(store)), str(victim.relative_to(store)), expect)
    _refused(cli("info", str(store)), str(store), expect)
    out = tmp_path / "out"
    _refused(cli("convert", str(store), "--to", "zarr" if fmt == "saev" else "saev", "--out", str(out)), expect)
    assert _published(out) == []


@pytest.mark.parametrize("fmt", ["saev", "zarr"])
def test_link_swapped_in_after_open_is_refused_on_read(stores: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    """Data files are opened without following links (O_NOFOLLOW), so a link swapped in after the reader listed
    the store is refused too, as an UnsafePathError naming it."""
    import actlake
    from actlake.errors import UnsafePathError

    store = _copy(stores[fmt], tmp_path / "s")
    reader = actlake.open(store)
    victim = store / DATA_FILE[fmt]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(outside)
    with pytest.raises(UnsafePathError, match="symbolic link") as info:
        reader.get(0, reader.layers[0])
    assert str(victim) in str(info.value)


# ---- 7/8. saev provenance.json that is not a JSON object -------------------------------------------------------


@pytest.mark.parametrize("content", ["{broken", "[" * 100_000, "[1, 2]", "\udcff"], ids=["broken", "deep", "list", "not-utf8"])
def test_broken_saev_provenance(stores: dict[str, Path], tmp_path: Path, content: str) -> None:
    """verify parses provenance.json (info reads it), so a broken one is a problem naming it even with
    checksums.json rewritten over it; info stops with a typed error."""
    store = _copy(stores["saev"], tmp_path / "s")
    (store / "provenance.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    _reseal(store)
    _refused(cli("verify", str(store)), str(store / "provenance.json"))
    _refused(cli("info", str(store)), str(store / "provenance.json"))


# ---- 12. a zarr chunk its declared codec cannot decode ---------------------------------------------------------


def test_undecodable_blosc_chunk_is_typed(stores: dict[str, Path], tmp_path: Path) -> None:
    """A store declaring blosc (read through the zarr API) whose chunk is garbage: info reads no chunk, convert
    stops with a TruncatedFileError naming the array (not numcodecs' RuntimeError) and publishes nothing."""
    store = _copy(stores["zarr"], tmp_path / "s")
    array = store / "arrays" / "prompt_activations"
    meta = json.loads((array / ".zarray").read_text())
    meta["compressor"] = {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0}
    (array / ".zarray").write_text(json.dumps(meta))
    consolidated = json.loads((store / ".zmetadata").read_text())
    consolidated["metadata"]["arrays/prompt_activations/.zarray"] = meta
    (store / ".zmetadata").write_text(json.dumps(consolidated))
    (array / "0.0.0.0").write_bytes(b"not blosc" * 8)
    out = tmp_path / "out"
    _refused(cli("convert", str(store), "--to", "saev", "--out", str(out)), str(array), "is unreadable",
             "blosc decompression")
    assert _published(out) == []
    _refused(cli("verify", str(store)), str(array / "0.0.0.0"))


# ---- 13. what a killed zarr merge left --------------------------------------------------------------------------


def test_killed_zarr_merge_leftovers_are_removed_on_rerun(stores: dict[str, Path], tmp_path: Path) -> None:
    """`.tmp-activations.zarr-<pid>` of a merge whose process is gone is removed by the next merge into the same
    folder; a live process's temporary store is left alone."""
    from actlake.formats.zarr_logger.merge import merge

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid that no longer runs
    out = tmp_path / "merged"
    stale = out / f".tmp-activations.zarr-{dead}"
    (stale / "arrays").mkdir(parents=True)
    live = out / f".tmp-activations.zarr-{os.getppid()}"
    live.mkdir()
    store = merge([stores["zarr"]], out)
    assert not stale.exists() and live.exists()
    assert store == out / "activations.zarr" and store.is_dir()
