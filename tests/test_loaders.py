"""PyTorch loaders: exactly-once shuffled tokens, seeding, DataLoader workers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import actlake
from actlake.errors import LayerNotStoredError
from actlake.torch import SequenceDataset, ShuffledTokenLoader, TokenDataset

from .conftest import write_saev


@pytest.fixture
def text_store(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray, np.ndarray]:
    acts = rng.standard_normal((23, 2, 7, 6)).astype(np.float32)
    lengths = rng.integers(1, 8, size=23)
    out = write_saev(tmp_path, acts, layers=(1, 4), lengths=lengths, patches_per_shard=7 * 2 * 5)
    return out, acts, lengths


def _all_tokens(acts: np.ndarray, lengths: np.ndarray, layer_pos: int) -> set[tuple[int, int]]:
    return {(s, t) for s in range(len(lengths)) for t in range(lengths[s])}


def test_shuffled_loader_yields_every_token_once(text_store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    out, acts, lengths = text_store
    loader = ShuffledTokenLoader(out, 4, batch_size=16, block_tokens=4, window_blocks=3, return_index=True, seed=7)
    seen: list[tuple[int, int]] = []
    sizes = []
    for x, samples, tokens in loader:
        sizes.append(len(x))
        assert x.dtype == torch.float32
        assert np.array_equal(x.numpy(), acts[samples.numpy(), 1, tokens.numpy()])
        seen += list(zip(samples.tolist(), tokens.tolist()))
    assert len(seen) == len(set(seen)) == int(lengths.sum())
    assert set(seen) == _all_tokens(acts, lengths, 1)
    assert all(s == 16 for s in sizes[:-1]) and len(sizes) == len(loader)


def test_shuffled_loader_is_seeded_and_epochs_differ(text_store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    out, _, _ = text_store
    a = ShuffledTokenLoader(out, 1, batch_size=8, seed=3, block_tokens=2, window_blocks=4)
    b = ShuffledTokenLoader(out, 1, batch_size=8, seed=3, block_tokens=2, window_blocks=4)
    first_a = [x.clone() for x in a]
    first_b = [x.clone() for x in b]
    assert all(torch.equal(x, y) for x, y in zip(first_a, first_b))
    second_a = [x.clone() for x in a]  # epoch 1
    assert not all(torch.equal(x, y) for x, y in zip(first_a, second_a))
    c = ShuffledTokenLoader(out, 1, batch_size=8, seed=4, block_tokens=2, window_blocks=4)
    assert not all(torch.equal(x, y) for x, y in zip(first_a, c))


@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 5), st.booleans(), st.integers(0, 3))
@settings(max_examples=40, deadline=None)
def test_plans_partition_the_tokens(batch_size: int, block: int, window: int, drop_last: bool, seed: int) -> None:
    """Index math only: the plans of an epoch cover every token exactly once (minus a dropped tail)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 6, size=17)
    rows = np.zeros((int(lens.sum()) + 1, 1), np.float32)
    base = np.concatenate([[0], np.cumsum(lens)[:-1]])
    seg = actlake.TokenSegment(rows, base, lens, 0)

    class FakeReader(actlake.Reader):
        format = "fake"
        path = Path("fake")
        layers = (0,)
        d_model = 1
        n_samples = len(lens)
        dtype = np.dtype(np.float32)
        max_tokens = 6

        @property
        def lengths(self) -> np.ndarray:
            return lens

        def get(self, sample: int, layer: int) -> np.ndarray:
            return rows[:0]

        def token_segments(self, layer: int) -> list[actlake.TokenSegment]:
            return [seg, actlake.TokenSegment(rows, base, lens, len(lens))]

    loader = ShuffledTokenLoader(FakeReader(), 0, batch_size=batch_size, block_tokens=block, window_blocks=window,
                                 drop_last=drop_last, seed=seed)
    got = [int(p) for plan in loader.plans() for p in plan.positions]
    assert all(0 <= p < 2 * int(lens.sum()) for p in got)
    total = 2 * int(lens.sum())
    assert len(got) == len(set(got))
    expected = total - (total % batch_size if drop_last else 0)
    assert len(got) == expected
    assert len(loader) == (total // batch_size if drop_last else -(-total // batch_size))


def test_token_dataset_with_workers(text_store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    out, acts, lengths = text_store
    ds = TokenDataset(out, 1)
    assert len(ds) == int(lengths.sum())
    expected = np.concatenate([acts[s, 0, : lengths[s]] for s in range(len(lengths))])
    got = torch.cat(list(DataLoader(ds, batch_size=10, num_workers=2)))
    assert np.array_equal(got.numpy(), expected)


def test_sequence_dataset_with_workers(text_store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    out, acts, lengths = text_store
    ds = SequenceDataset(out, [4, 1])
    items = list(DataLoader(ds, batch_size=5, num_workers=2))
    acts_all = torch.cat([b["acts"] for b in items]).numpy()
    lens = torch.cat([b["length"] for b in items]).numpy()
    samples = torch.cat([b["sample"] for b in items]).numpy()
    layers = torch.cat([b["layer"] for b in items]).numpy()
    for k in range(len(ds)):
        li = {1: 0, 4: 1}[int(layers[k])]
        assert lens[k] == lengths[samples[k]]
        assert np.array_equal(acts_all[k, : lens[k]], acts[samples[k], li, : lens[k]])
        assert not acts_all[k, lens[k]:].any()


def test_loader_rejects_unknown_layer(text_store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    with pytest.raises(LayerNotStoredError):
        ShuffledTokenLoader(text_store[0], 2)


def test_shuffled_loader_with_empty_samples(tmp_path: Path, rng: np.random.Generator) -> None:
    acts = rng.standard_normal((9, 1, 4, 3)).astype(np.float32)
    lengths = np.array([0, 3, 0, 0, 4, 1, 0, 2, 0])
    out = write_saev(tmp_path, acts, layers=(0,), lengths=lengths, patches_per_shard=4 * 4)
    loader = ShuffledTokenLoader(out, 0, batch_size=3, block_tokens=2, window_blocks=2, return_index=True)
    seen = []
    for x, samples, tokens in loader:
        assert np.array_equal(x.numpy(), acts[samples.numpy(), 0, tokens.numpy()])
        seen += list(zip(samples.tolist(), tokens.tolist()))
    assert sorted(seen) == [(s, t) for s in range(9) for t in range(lengths[s])]


def test_pickled_reader_maps_its_own_files(text_store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    import pickle

    out, acts, lengths = text_store
    reader = actlake.open(out)
    reader.get(0, 1)
    assert reader._maps  # a memmap is open in this process
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._maps == {}  # a worker process maps the files itself
    assert np.array_equal(clone.get(3, 4), acts[3, 1, : lengths[3]])
    reader.close()
    assert reader._maps == {}
