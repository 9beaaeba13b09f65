"""The restricted unpickler: numpy arrays and containers load; code execution and memory bombs do not."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from pathlib import Path

import numpy as np
import pytest

from actlake.errors import UnsafePickleError
from actlake.safe_pickle import safe_loads


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_numpy_arrays_and_containers_round_trip(protocol: int) -> None:
    obj = {"a": [np.arange(6, dtype=np.float32).reshape(2, 3), (1, 2.5, "x")], "b": {1, 2}, "c": bytearray(b"zz"),
           "d": np.float32(3.0), "e": np.zeros((0, 4), np.float16), "f": b"raw"}
    back = safe_loads(pickle.dumps(obj, protocol=protocol))
    assert np.array_equal(back["a"][0], obj["a"][0]) and back["a"][0].dtype == np.float32
    assert back["a"][1] == (1, 2.5, "x") and back["b"] == {1, 2} and back["c"] == bytearray(b"zz")
    assert back["d"] == np.float32(3.0) and back["e"].shape == (0, 4) and back["f"] == b"raw"


def test_code_execution_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    with pytest.raises(UnsafePickleError, match="not allowed"):
        safe_loads(pickle.dumps(Evil()))
    assert not marker.exists()


def _call(module: str, name: str, arg: int) -> bytes:
    """A protocol-2 pickle of `module.name(arg)` built by hand (no such object needs to exist)."""
    return (b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"J" + arg.to_bytes(4, "little", signed=True)
            + b"\x85R.")


@pytest.mark.parametrize("name", ["bytes", "bytearray", "range"])
def test_memory_bombs_are_refused(name: str) -> None:
    blob = _call("builtins", name, 2_000_000_000)
    pickletools.dis(io.BytesIO(blob), out=io.StringIO())  # a well-formed pickle
    with pytest.raises(UnsafePickleError):
        safe_loads(blob)


def test_numpy_preallocation_bomb_is_refused() -> None:
    blob = (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
            b"J\x00\x00\x00\x7f\x85U\x01b\x87R.")
    with pytest.raises(UnsafePickleError):
        safe_loads(blob)
