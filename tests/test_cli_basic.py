"""`actlake info` and `actlake verify` on saev directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actlake.cli import main

from .conftest import write_saev


def test_info_json(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    out = write_saev(tmp_path, rng.standard_normal((4, 2, 3, 5)).astype(np.float32), layers=(0, 2),
                     lengths=np.array([3, 1, 2, 3]))
    assert main(["info", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "saev" and summary["n_samples"] == 4 and summary["n_tokens"] == 9
    assert summary["layers"] == [0, 2] and summary["d_model"] == 5
    assert main(["info", str(out)]) == 0
    assert "n_samples" in capsys.readouterr().out


def test_verify_exit_codes(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    out = write_saev(tmp_path / "a", rng.standard_normal((4, 1, 3, 5)).astype(np.float32), layers=(0,))
    assert main(["verify", str(out)]) == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in out.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "acts000000.bin").write_bytes(b"\0" * 12)
    assert main(["verify", str(bad)]) == 1
    text = capsys.readouterr().out
    assert "not the metadata hash" in text and "acts000000.bin" in text


def test_unknown_path_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err
