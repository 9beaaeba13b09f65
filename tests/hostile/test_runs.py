"""Hostile and faulty run directories (issue: integrity): each case gets a typed error naming the file, exit 2
on the command line and no traceback, and a run directory never reads data other than what it recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from actlake.cli import main
from actlake.errors import DatasetError
from actlake.run_guard import run_lock
from actlake.runs import open_run

from ..test_runs import TRAIN, text_shards, write_shards


@pytest.fixture
def trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """(run dir, train shards, val shards) of a small trained run."""
    for var in ("SAEV_SCRATCH", "SAEV_NFS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ACTLAKE_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("ACTLAKE_NFS", str(tmp_path / "nfs"))
    train = text_shards(tmp_path / "scratch" / "saev" / "shards", 1)
    val = text_shards(tmp_path / "scratch" / "saev" / "shards", 2, n=10)
    run = tmp_path / "nfs" / "saev" / "runs" / "r"
    assert main([*TRAIN, "--run", str(run), "--shards", str(train), "--val-shards", str(val), "--layer", "3"]) == 0
    return run, train, val


def _cli_fails(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_repointed_train_link_is_refused(trained: tuple[Path, Path, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    run, _, _ = trained
    other = text_shards(tmp_path / "elsewhere", 9, n=31)  # another store (another metadata hash)
    link = run / "links" / "train-shards"
    link.unlink()
    os.symlink(other, link)
    _cli_fails(capsys, ["infer", "--run", str(run), "--device", "cpu", "--quiet"], "train-shards", "trained with")
    _cli_fails(capsys, ["visuals", "--run", str(run), "--quiet"], "train-shards")


def test_linked_store_whose_name_no_longer_matches_is_refused(trained: tuple[Path, Path, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run, _, val = trained
    md = val / "metadata.json"
    os.chmod(val, 0o755)
    os.chmod(md, 0o644)
    obj = json.loads(md.read_text())
    obj["ckpt"] = "someone-else"
    md.write_text(json.dumps(obj))
    _cli_fails(capsys, ["infer", "--run", str(run), "--device", "cpu", "--quiet"], "metadata.json")


def test_nan_weights_in_sae_pt_are_refused(trained: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run, _, _ = trained
    blob = torch.load(run / "checkpoint" / "sae.pt", weights_only=True)
    name = next(k for k, v in blob["state_dict"].items() if v.is_floating_point() and v.numel() > 1)
    blob["state_dict"][name][0] = float("nan")
    torch.save(blob, run / "checkpoint" / "sae.pt")
    _cli_fails(capsys, ["infer", "--run", str(run), "--device", "cpu", "--quiet", "--overwrite"], "NaN", "sae.pt")


def test_second_training_of_one_run_at_once_is_refused(trained: tuple[Path, Path, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run, _, _ = trained
    before = (run / "checkpoint" / "sae.pt").read_bytes()
    with run_lock(open_run(run), "training"):  # another process holds the run (same flock semantics)
        pid = os.fork()
        if pid == 0:  # a separate process, as a second `actlake train` would be
            code = main([*TRAIN, "--run", str(run), "--layer", "3", "--overwrite"])
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 2
    assert (run / "checkpoint" / "sae.pt").read_bytes() == before  # the first checkpoint is untouched


def test_nan_store_says_the_input_holds_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    acts = rng.standard_normal((20, 1, 6, 8)).astype(np.float32)
    acts[3, 0, 2, 5] = np.nan
    shards = write_shards(tmp_path / "s", acts, layers=(0,), lengths=np.full(20, 6))
    err = _cli_fails(capsys, [*TRAIN, "--run", str(tmp_path / "run"), "--shards", str(shards), "--layer", "0"], "NaN")
    assert "lower --lr" not in err
    with pytest.raises(DatasetError, match="NaN"):
        from actlake.sae.train import TrainConfig, train_sae

        train_sae(shards, TrainConfig(layer=0, epochs=1, device="cpu", batch_size=32), progress=False)


def test_run_config_with_a_non_integer_layer(trained: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run, _, _ = trained
    cfg = run / "checkpoint" / "config.json"
    obj = json.loads(cfg.read_text())
    obj["layer"] = "zero"
    cfg.write_text(json.dumps(obj))
    _cli_fails(capsys, ["infer", "--run", str(run), "--device", "cpu", "--quiet"], "config.json", "layer")


def test_truncated_dump_is_an_error_and_infer_rewrites_it(trained: tuple[Path, Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run, _, val = trained
    assert main(["infer", "--run", str(run), "--device", "cpu", "--quiet"]) == 0
    dump = run / "inference" / val.name / "patch_acts.npz"
    whole = dump.read_bytes()
    dump.write_bytes(whole[: len(whole) // 2])
    _cli_fails(capsys, ["visuals", "--run", str(run), "--quiet"], "patch_acts.npz")
    capsys.readouterr()
    assert main(["infer", "--run", str(run), "--device", "cpu", "--quiet"]) == 0  # never handed back as done
    assert dump.read_bytes() == whole
    (run / "inference" / val.name / "config.json").write_bytes(b"\xff\xfe garbage {")
    _cli_fails(capsys, ["visuals", "--run", str(run), "--quiet"], "config.json")


def test_killed_infer_leftovers_are_removed_on_rerun(trained: tuple[Path, Path, Path]) -> None:
    run, _, val = trained
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid that no longer runs
    stale = run / "inference" / f".tmp-{val.name}-{dead}"
    stale.mkdir(parents=True)
    (stale / "patch_acts.npz").write_bytes(b"half")
    live = run / "inference" / f".tmp-{val.name}-{os.getppid()}"  # a live process's work is left alone
    live.mkdir()
    assert main(["infer", "--run", str(run), "--device", "cpu", "--quiet"]) == 0
    assert not stale.exists() and live.exists()


def test_full_disk_and_unwritable_output_are_typed(trained: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run, train, _ = trained

    def full_disk(*_a: object, **_k: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    _cli_fails(capsys, [*TRAIN, "--run", str(run), "--layer", "3", "--overwrite"], "sae.pt", "could not write")
    monkeypatch.undo()
    # sysfs refuses new entries even to root (whom permission bits would not stop): a real unwritable output
    _cli_fails(capsys, ["convert", str(train), "--to", "zarr", "--out", "/sys/actlake-cannot-write"], "/sys")
    _cli_fails(capsys, [*TRAIN, "--run", "/sys/actlake-cannot-write/r", "--shards", str(train), "--layer", "3"], "/sys")
