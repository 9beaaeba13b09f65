"""Stores on object storage (issue 11, item 4; docs/remote.md) against moto's S3 server on a loopback port:
every format written to s3:// by `actlake extract --out URL`, read back equal to the local store with plain
numpy, `actlake info` / `actlake verify` on the URL (exit 0), a flipped byte found (exit 1), an incomplete upload
refused, a memory:// round trip, and a run directory whose links/ point at the local cache of remote saev shards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from .services import BIN, Processes, free_port, require, wait_until

FORMATS = ("saev", "zarr", "lmprobe", "pickle")
TEXTS = ["a short text", "the second sample is a little longer than the first", "three",
         "four words are here", "and the fifth one closes the store"]
#: a saev shard is written full size (a file hole locally, every byte on an object store): a small one; lmprobe
#: with every token row, so reads of consecutive rows by byte range are exercised
OPTIONS = {"saev": ["--option", "patches_per_shard=256"], "lmprobe": ["--option", "storage=full_sequence"]}
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server on a free loopback port (stopped by process group whatever happens); the standard AWS_*
    variables point boto3 / s3fs at it; a bucket; its s3:// URL."""
    moto = BIN / "moto_server"
    require("moto_server", moto.exists(), "pip install 'moto[server]' (the test extra)")
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    port = free_port()
    procs = Processes()
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL", "ACTLAKE_CACHE")}
    try:
        proc = procs.start("moto", [str(moto), "-H", "127.0.0.1", "-p", str(port)], log)
        import urllib.request

        wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).status == 200, 30,
                   "moto_server", log, proc)
        os.environ.update(ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("actlake-test")
        yield "s3://actlake-test"
    finally:
        procs.stop_all()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def stores(s3: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each format extracted twice from the same texts: to a local root and to s3:// (--out URL); (local, URL)."""
    from actlake.cli import main

    root = tmp_path_factory.mktemp("remote")
    os.environ["ACTLAKE_CACHE"] = str(root / "cache")
    data = root / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out: dict[str, tuple[Path, str]] = {}
    for fmt in FORMATS:
        args = ["extract", "--model", "tiny-random:bert", "--data", str(data), "--layers", "0", "--format", fmt,
                "--max-seq-len", "8", "--no-progress", *OPTIONS.get(fmt, [])]
        assert main([*args, "--out", str(root / fmt)]) == 0
        assert main([*args, "--out", f"{s3}/{fmt}"]) == 0
        [local] = [p for p in (root / fmt).iterdir() if not p.name.startswith(".")]
        local = local / "machine_0000" if fmt == "pickle" else local
        out[fmt] = (local, f"{s3}/{fmt}/{local.relative_to(root / fmt).as_posix()}")
    assert not any((root / "cache" / "staging").iterdir())  # the staged copies are gone once uploaded
    return out


def _values(reader) -> dict[str, object]:
    """Everything a reader returns, as plain numpy arrays and lists."""
    layer = reader.layers[0]
    segments = reader.token_segments(layer)
    return {"get": [np.asarray(reader.get(s, layer)) for s in range(reader.n_samples)],
            "last": np.asarray(reader.last_token(layer)),
            "batch": np.asarray(reader.batch([4, 0, 2]).acts_bltd),
            "tokens": np.concatenate([np.asarray(s.rows_2d)[s.row_index()] for s in segments]),
            "lengths": np.asarray(reader.lengths), "ids": np.asarray(reader.sample_ids), "texts": reader.texts}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("fmt", FORMATS)
def test_remote_store_reads_equal_and_verifies(stores: dict[str, tuple[Path, str]], fmt: str) -> None:
    import actlake
    from actlake.cli import main

    local, url = stores[fmt]
    with actlake.open(local) as a, actlake.open(url) as b:
        want, got = _values(a), _values(b)
        assert want["lengths"].sum() > len(TEXTS)  # real token rows, not one per sample only
        for key in want:
            assert _equal(want[key], got[key]), (fmt, key)
        if fmt == "saev":  # read from the local cache, named by the content hash
            assert b.path.parent == Path(os.environ["ACTLAKE_CACHE"]) / "saev" / "shards" and b.path.name == local.name
        else:
            assert b.summary()["path"].startswith(url)
    assert main(["verify", url]) == 0
    assert main(["info", "--verify", url]) == 0


def test_cli_in_a_child_process_takes_the_endpoint_from_the_environment(stores: dict[str, tuple[Path, str]]) -> None:
    """`actlake info URL` and `actlake verify URL` as a user runs them: only the standard AWS_* variables."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for cmd in (["info", "--json", stores["zarr"][1]], ["verify", stores["lmprobe"][1]]):
        result = subprocess.run([sys.executable, "-m", "actlake.cli", *cmd], capture_output=True, text=True, env=env,
                                timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
    assert stores["zarr"][1] in result.stdout or "OK" in result.stdout


def _object(url: str) -> tuple[object, str]:
    from actlake.remote.url import filesystem

    return filesystem(url)


def test_flipped_byte_in_a_remote_object_is_found(stores: dict[str, tuple[Path, str]], s3: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    from actlake.cli import main

    from actlake.remote.publish import upload_store

    fs, _ = _object(s3)
    for fmt, data_file in (("zarr", "activations.zarr/arrays/prompt_activations/0.0.0.0"),
                           ("pickle", "shard_0001.pkl.gz")):
        local, url = stores[fmt]
        copy = upload_store(local, f"{s3}/flipped/{fmt}/{local.name}")
        target = f"{copy}/{data_file}".removeprefix("s3://")
        raw = bytearray(fs.cat_file(target))
        raw[min(100, len(raw) - 1)] ^= 0x01
        fs.pipe_file(target, bytes(raw))
        capsys.readouterr()
        assert main(["verify", copy]) == 1
        out = capsys.readouterr().out
        assert f"{copy}/{data_file}" in out and "does not match checksums.json" in out, out
        assert main(["info", "--verify", copy]) == 2


def test_incomplete_upload_is_refused(stores: dict[str, tuple[Path, str]], s3: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """(An empty cache: a saev store whose content hash is cached is read from the cache without a request.)"""
    import actlake
    from actlake.cli import main
    from actlake.errors import IncompleteUploadError

    from actlake.remote.publish import upload_store

    monkeypatch.setenv("ACTLAKE_CACHE", str(tmp_path / "empty-cache"))
    fs, _ = _object(s3)
    for fmt in FORMATS:
        local, _url = stores[fmt]
        partial = upload_store(local, f"{s3}/partial/{fmt}/{local.name}")
        marker = "activations.zarr/checksums.json" if fmt == "zarr" else "checksums.json"
        fs.rm_file(f"{partial}/{marker}".removeprefix("s3://"))  # the upload stopped before its marker
        with pytest.raises(IncompleteUploadError, match="incomplete upload") as info:
            actlake.open(partial)
        assert partial in str(info.value)
        assert main(["verify", partial]) == 1
        assert "incomplete upload" in capsys.readouterr().out


def test_published_remote_store_is_immutable(stores: dict[str, tuple[Path, str]], s3: str,
                                             tmp_path: Path) -> None:
    from actlake.errors import FormatError
    from actlake.remote.publish import upload_store

    local, _ = stores["lmprobe"]
    url = f"{s3}/immutable/{local.name}"
    assert upload_store(local, url) == url
    assert upload_store(local, url) == url  # the same store again: nothing to do
    other = tmp_path / local.name
    shutil.copytree(stores["saev"][0], other)
    with pytest.raises(FormatError, match="immutable"):
        upload_store(other, url)


def test_memory_round_trip(stores: dict[str, tuple[Path, str]], tmp_path: Path) -> None:
    """convert --out memory://...: published locally, uploaded to fsspec's in-memory filesystem, read back equal."""
    import actlake
    from actlake.cli import main
    from actlake.remote.url import is_url, local_path

    local, _ = stores["saev"]
    assert is_url("memory://x") and not is_url("file:///x") and local_path(f"file://{local}") == str(local)
    for fmt in ("zarr", "lmprobe"):
        assert main(["convert", f"file://{local}", "--to", fmt, "--out", f"memory://actlake/{fmt}",
                     "--option", "storage=full_sequence"] if fmt == "lmprobe" else
                    ["convert", str(local), "--to", fmt, "--out", f"memory://actlake/{fmt}"]) == 0
        from fsspec import filesystem

        [name] = filesystem("memory").ls(f"/actlake/{fmt}", detail=False)
        with actlake.open(local) as a, actlake.open(f"memory://{name}") as b:
            layer = a.layers[0]
            for s in range(a.n_samples):
                assert np.array_equal(a.get(s, layer).astype(b.dtype), b.get(s, layer))


def test_run_directory_links_the_cache_of_remote_shards(stores: dict[str, tuple[Path, str]], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    from actlake.cli import main
    from actlake.run_guard import check_links
    from actlake.runs import Run

    local, url = stores["saev"]
    run = tmp_path / "runs" / "r1"
    assert main(["train", "--run", str(run), "--shards", url, "--layer", "0", "--epochs", "1", "--no-progress",
                 "--device", "cpu"]) == 0
    cached = Path(os.environ["ACTLAKE_CACHE"]) / "saev" / "shards" / local.name
    link = run / "links" / "train-shards"
    assert link.is_symlink() and Path(os.readlink(link)) == cached.resolve()
    check_links(Run(run))  # the recorded shard hash is the cache's name, and the name is still its metadata's hash
    assert main(["infer", "--run", str(run), "--device", "cpu"]) == 0
    assert (run / "inference" / local.name / "patch_acts.npz").is_file()


@pytest.mark.parametrize("key", ["../../escape.bin", "a/../../escape.bin", "./x.bin", "a//x.bin"])
def test_object_key_leaving_the_store_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 key: str) -> None:
    """An object key is any string: one a download would write outside its folder is refused on listing, before
    anything is fetched (open, verify and the saev cache all list first)."""
    import actlake
    from actlake.errors import UnsafePathError
    from fsspec import filesystem

    fs = filesystem("memory")
    root = f"/hostile-{abs(hash(key))}"
    fs.pipe(f"{root}/checksums.json", b'{"files": []}')
    fs.pipe(f"{root}/{key}", b"x")
    monkeypatch.setenv("ACTLAKE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UnsafePathError, match="leaves the store"):
        actlake.open(f"memory://{root}")
    with pytest.raises(UnsafePathError, match="leaves the store"):
        actlake.verify(f"memory://{root}")
    assert not (tmp_path / "escape.bin").exists()
