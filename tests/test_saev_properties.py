"""Property tests of the saev index math (spec sections 3 and 4) over random shapes and budgets."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import actlake
from actlake.formats.saev import SaevMetadata, encode_data

from .conftest import write_saev


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, int, int, int, int, bool]:
    n = draw(st.integers(1, 12))
    n_layers = draw(st.integers(1, 3))
    t = draw(st.integers(1, 4))
    d = draw(st.integers(1, 3))
    cls_token = draw(st.booleans()) if t > 1 else False
    per_ex = t * n_layers
    budget = draw(st.integers(per_ex, per_ex * (n + 2)))
    return n, n_layers, t, d, budget, cls_token


@given(shapes())
@settings(max_examples=60, deadline=None)
def test_sizing_matches_spec_section_3(shape: tuple[int, int, int, int, int, bool]) -> None:
    n, n_layers, t, d, budget, cls_token = shape
    md = SaevMetadata(family="vit", ckpt="m", layers=tuple(range(n_layers)), patches_per_ex=t - int(cls_token),
                      cls_token=cls_token, d_model=d, n_examples=n, patches_per_shard=budget, data=encode_data({}))
    per_shard = budget // (t * n_layers)
    counts = md.shard_counts()
    assert md.examples_per_shard == per_shard
    assert sum(counts) == n and all(c == per_shard for c in counts[:-1]) and 0 < counts[-1] <= per_shard
    assert len(counts) == -(-n // per_shard)


@given(shapes(), st.data())
@settings(max_examples=40, deadline=None)
def test_coordinate_transform_round_trip(shape: tuple[int, int, int, int, int, bool], data: st.DataObject) -> None:
    n, n_layers, t, d, budget, cls_token = shape
    rng = np.random.default_rng(n * 1000 + budget)
    acts = rng.standard_normal((n, n_layers, t, d)).astype(np.float32)
    layers = tuple(data.draw(st.permutations(list(range(0, 2 * n_layers, 2)))))
    with tempfile.TemporaryDirectory() as tmp:
        out = write_saev(Path(tmp), acts, layers=layers, patches_per_shard=budget, cls_token=cls_token,
                         batch_size=data.draw(st.integers(1, n + 1)))
        s = budget // (t * n_layers)
        ex = data.draw(st.integers(0, n - 1))
        li = data.draw(st.integers(0, n_layers - 1))
        tok = data.draw(st.integers(0, t - 1))
        # spec 4.2 by hand: shard file, then byte offset
        raw = (out / f"acts{ex // s:06d}.bin").read_bytes()
        offset = (((ex % s) * n_layers * t) + li * t + tok) * d * 4
        assert np.array_equal(np.frombuffer(raw[offset : offset + d * 4], "<f4"), acts[ex, li, tok])
        reader = actlake.open(out)
        assert np.array_equal(reader.vector(ex, layers[li], tok), acts[ex, li, tok])
        assert np.array_equal(reader.get(ex, layers[li]), acts[ex, li])
        assert np.array_equal(reader.batch(np.arange(n)).acts_bltd, acts)
