"""Interop: the upstream `lmprobe` package (the `interop` extra) loads actlake's output and fits a Probe.

Upstream only fetches through the hub client; `lm.local_hub` serves the local directory in its
place (no network). Its local cache goes to a temporary LMPROBE_CACHE_DIR.
"""

from __future__ import annotations

from pathlib import Path

import lmprobe  # the interop extra is installed in CI: a missing package must fail, not skip
import numpy as np
import pytest
from lmprobe.cache import load_prompt_logits

from actlake.batch import Batch
from actlake.formats import lmprobe as lm
from actlake.spec import StoreSpec


@pytest.fixture(autouse=True)
def _isolated_lmprobe_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream keeps a process-wide registry and an on-disk cache: isolate both per test."""
    from lmprobe import cache

    monkeypatch.setenv("LMPROBE_CACHE_DIR", str(tmp_path / "lmprobe-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(cache, "_backend", None, raising=False)
    for name in ("_shard_manifests", "_shard_indices"):
        if hasattr(cache, name):
            monkeypatch.setattr(cache, name, {})


def _dataset(root: Path, storage: str, dtype: str, n: int = 48) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    acts = rng.standard_normal((n, 2, 5, 16)).astype(np.float32)
    labels = np.arange(n) % 2
    acts[:, :, :, :3] += labels[:, None, None, None] * 2.0  # a linearly separable signal
    lengths = rng.integers(1, 6, n)
    values = rng.standard_normal((n, 4)).astype(np.float32)
    indices = rng.integers(0, 32_000, (n, 4))
    spec = StoreSpec(layers=(3, 5), d_model=16, max_tokens=5, n_samples=n, model_name=f"org/tiny-{storage}",
                     dtype=dtype, options={"storage": storage, "shard_bytes": 16 * 4 * 20})
    writer = lm.create_writer(root, spec)
    for s in range(0, n, 10):
        sl = slice(s, min(s + 10, n))
        writer.write_batch(Batch(acts_bltd=acts[sl], lengths=lengths[sl], sample_ids=np.arange(n)[sl],
                                 texts=[f"prompt {i}" for i in range(sl.start, sl.stop)], labels=labels[sl],
                                 logits_topk_values=values[sl], logits_topk_indices=indices[sl]))
    return writer.close(), acts[np.arange(n), :, lengths - 1], labels, values


@pytest.mark.filterwarnings("ignore:layers parameter is ignored:UserWarning")
@pytest.mark.parametrize("storage,dtype", [("pooled", "float32"), ("full_sequence", "float16")])
def test_upstream_load_activations_and_probe(tmp_path: Path, storage: str, dtype: str) -> None:
    out, last_nld, labels, values = _dataset(tmp_path / "data", storage, dtype)
    repo = f"local/actlake-{storage}"
    with lm.local_hub(out, repo):
        acts, y = lmprobe.load_activations(repo, return_labels=True, show_progress=False)
        logit_values, logit_indices = load_prompt_logits(f"org/tiny-{storage}", "prompt 3", top_k=4)
    assert sorted(acts) == [3, 5]
    ours = lm.open_reader(out)
    for j, layer in enumerate((3, 5)):
        assert acts[layer].shape == (48, 16)
        np.testing.assert_array_equal(acts[layer], last_nld[:, j].astype(dtype).astype(np.float32))
        np.testing.assert_array_equal(acts[layer], ours.last_token(layer).astype(np.float32))
    np.testing.assert_array_equal(y, labels)
    order = np.argsort(-values[3], kind="stable")
    np.testing.assert_array_equal(logit_values.numpy().reshape(-1), values[3][order])
    assert str(logit_indices.dtype) == "torch.int32"
    probe = lmprobe.Probe(model=None, random_state=0)
    probe.fit_from_activations(acts[5], y)
    assert probe.score_from_activations(acts[5], y) > 0.9
    assert probe.predict_from_activations(acts[5]).shape == (48,)


def test_actlake_package_does_not_shadow_upstream() -> None:
    """`actlake.formats.lmprobe` is a package of the same last name: top-level `lmprobe` must stay upstream's."""
    import actlake

    package = Path(actlake.__file__).resolve().parent  # the clone's own folder may be named actlake too
    assert package not in Path(lmprobe.__file__).resolve().parents
    assert hasattr(lmprobe, "load_activations") and hasattr(lmprobe, "Probe")
    assert lm.__name__ == "actlake.formats.lmprobe"


def test_local_hub_serves_only_inside_the_root(tmp_path: Path) -> None:
    import huggingface_hub

    from actlake.errors import MissingFileError, UnsafePathError

    out = _dataset(tmp_path / "data", "pooled", "float32", n=4)[0]
    original = huggingface_hub.hf_hub_download
    with lm.local_hub(out, "local/ds"):
        assert huggingface_hub.hf_hub_download is not original
        got = huggingface_hub.hf_hub_download("local/ds", "index/train-00000-of-00001.parquet", repo_type="dataset")
        assert Path(got) == (out / "index/train-00000-of-00001.parquet").resolve()
        with pytest.raises(UnsafePathError):
            huggingface_hub.hf_hub_download("local/ds", "../../etc/passwd")
        with pytest.raises(MissingFileError):
            huggingface_hub.hf_hub_download("local/ds", "tensors/nothing.safetensors")
    assert huggingface_hub.hf_hub_download is original
