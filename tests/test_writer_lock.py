"""Every format's writer refuses a second concurrent writer of the same store, and frees it on abort."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import actlake
from actlake.batch import Batch
from actlake.errors import FormatError
from actlake.formats import FORMAT_MODULES, create_writer
from actlake.spec import StoreSpec


@pytest.mark.parametrize("fmt", sorted(FORMAT_MODULES))
def test_second_writer_is_refused_until_the_first_lets_go(tmp_path: Path, fmt: str) -> None:
    dtype = "float16" if fmt == "zarr" else "float32"
    spec = StoreSpec(layers=(0, 1), d_model=4, max_tokens=3, n_samples=2, model_name="m", family="text",
                     dtype=dtype, dataset="/tmp/data")
    first = create_writer(fmt, tmp_path, spec)
    with pytest.raises(FormatError, match="another process is writing"):
        create_writer(fmt, tmp_path, spec)
    first.abort()
    second = create_writer(fmt, tmp_path, spec)
    acts = np.arange(2 * 2 * 3 * 4, dtype=np.float32).reshape(2, 2, 3, 4)
    second.write_batch(Batch(acts, np.array([3, 2]), np.array([0, 1]), texts=["a", "b"]))
    out = second.close()
    assert actlake.verify(out) == []
    assert not list(tmp_path.glob("**/*.lock"))


@pytest.mark.parametrize("fmt", sorted(FORMAT_MODULES))
def test_writing_to_an_already_published_store_is_a_no_op(tmp_path: Path, fmt: str) -> None:
    dtype = "float16" if fmt == "zarr" else "float32"
    spec = StoreSpec(layers=(0,), d_model=2, max_tokens=2, n_samples=1, model_name="m", family="text", dtype=dtype,
                     dataset="/tmp/data")
    batch = Batch(np.ones((1, 1, 2, 2), np.float32), np.array([2]), np.array([0]), texts=["a"])
    first = create_writer(fmt, tmp_path, spec)
    first.write_batch(batch)
    out = first.close()
    again = create_writer(fmt, tmp_path, spec)
    assert again.resume_from == 1
    again.write_batch(batch)  # ignored: the store is published and immutable
    assert again.close() == out
