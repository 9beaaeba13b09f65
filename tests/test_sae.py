"""SAE model, training, checkpoint, inference dump and visuals, checked with plain torch/scipy/json/PIL."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from actlake.errors import ConfigError, FormatError
from actlake.sae.model import CHECKPOINT_FORMAT, SAEConfig, SparseAutoencoder, load_sae, save_sae
from actlake.sae.train import TrainConfig, input_scale, resolve_device, train_sae

from .conftest import write_saev



def planted_data(seed: int = 0, *, d: int = 32, m: int = 64, k_true: int = 3, n_samples: int = 256,
                 tokens: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(acts [N, 1, T, d], planted unit directions [m, d]): each token is a sum of k_true planted directions."""
    rng = np.random.default_rng(seed)
    dirs = rng.standard_normal((m, d))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    n = n_samples * tokens
    which = np.argsort(rng.random((n, m)), axis=1)[:, :k_true]
    z = np.zeros((n, m))
    np.put_along_axis(z, which, rng.uniform(0.5, 2.0, (n, k_true)), axis=1)
    x = (z @ dirs + 0.01 * rng.standard_normal((n, d))).astype(np.float32)
    return x.reshape(n_samples, 1, tokens, d), dirs


# ---- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"d_model": 0, "n_latents": 8},
    {"d_model": 4, "n_latents": 8, "k": 9},
    {"d_model": 4, "n_latents": 8, "k": 0},
    {"d_model": 4, "n_latents": 8, "activation": "gelu"},
    {"d_model": 4, "n_latents": 8, "l1_coeff": -1.0},
    {"d_model": 4, "n_latents": 8, "aux_k": 0},
])
def test_sae_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        SAEConfig(**kwargs)


def test_train_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError):
        TrainConfig(layer=0, lr=0.0)
    with pytest.raises(ConfigError):
        TrainConfig(layer=0, device="tpu")
    with pytest.raises(ConfigError):
        TrainConfig(layer=0, activation="tanh")
    with pytest.raises(ConfigError):
        SAEConfig.from_json({"d_model": 4, "n_latents": 8, "surprise": 1})


def test_small_stores_get_a_smaller_batch() -> None:
    cfg = TrainConfig(layer=0)
    assert cfg.effective_batch_size(10_000_000) == 4096
    assert cfg.effective_batch_size(10_697) == 512  # the demo: >= 16 steps per epoch
    assert cfg.effective_batch_size(100) == 256  # never below 256 unless asked
    assert TrainConfig(layer=0, batch_size=128).effective_batch_size(100) == 128
    assert TrainConfig(layer=0, min_steps_per_epoch=0).effective_batch_size(10_697) == 4096


def test_device_resolution() -> None:
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            resolve_device("cuda")


# ---- model -------------------------------------------------------------------------------

def _dense_reference_loss(sae: SparseAutoencoder, x: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """The TopK + AuxK loss written with plain dense autograd ops."""
    cfg = sae.config
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    v, i = pre.topk(cfg.k, -1)
    z = torch.zeros_like(pre).scatter(-1, i, F.relu(v))
    err = x - (z @ sae.W_dec + sae.b_dec)
    mse = err.pow(2).sum(-1).mean() / cfg.d_model
    ai = pre.detach().masked_fill(~dead, float("-inf")).topk(min(cfg.aux_k, int(dead.sum())), -1).indices
    za = torch.zeros_like(pre).scatter(-1, ai, F.relu(pre.gather(1, ai)))
    r = err.detach()
    aux = (za @ sae.W_dec - r).pow(2).sum() / (r - r.mean(0)).pow(2).sum()
    return mse + cfg.aux_coeff * aux


def test_sparse_backward_matches_dense_autograd() -> None:
    cfg = SAEConfig(d_model=16, n_latents=64, k=4, aux_k=8)
    sae = SparseAutoencoder(cfg, generator=torch.Generator().manual_seed(0)).double()
    x = torch.randn(50, 16, dtype=torch.double, generator=torch.Generator().manual_seed(1))
    dead = torch.zeros(64, dtype=torch.bool)
    dead[::3] = True
    out = sae.loss(x, dead)
    out["loss"].backward()
    got = {n: p.grad.clone() for n, p in sae.named_parameters()}
    sae.zero_grad()
    ref = _dense_reference_loss(sae, x, dead)
    ref.backward()
    assert float(out["aux"].detach()) > 0
    torch.testing.assert_close(out["loss"].detach(), ref.detach())
    for name, p in sae.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)


def test_aux_loss_gives_dead_latents_gradient() -> None:
    cfg = SAEConfig(d_model=8, n_latents=32, k=2, aux_k=4)
    sae = SparseAutoencoder(cfg, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        pre = sae.pre_acts(x)
    live = set(pre.topk(2, -1).indices.reshape(-1).tolist())
    dead = torch.tensor([j not in live for j in range(32)])
    assert dead.any()
    sae.loss(x, None)["loss"].backward()
    assert float(sae.W_enc.grad[:, dead].abs().sum()) == 0.0  # no aux: dead latents get nothing
    sae.zero_grad()
    sae.loss(x, dead)["loss"].backward()
    assert float(sae.W_enc.grad[:, dead].abs().sum()) > 0.0


def test_decoder_rows_stay_unit_norm_and_grad_is_projected() -> None:
    cfg = SAEConfig(d_model=8, n_latents=16, k=3)
    sae = SparseAutoencoder(cfg, generator=torch.Generator().manual_seed(0))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    sae.loss(x)["loss"].backward()
    sae.project_decoder_grad()
    parallel = (sae.W_dec.grad * sae.W_dec).sum(1)
    assert float(parallel.abs().max()) < 1e-6
    with torch.no_grad():
        sae.W_dec.mul_(3.0)
    sae.normalise_decoder()
    np.testing.assert_allclose(sae.W_dec.norm(dim=1).detach().numpy(), 1.0, rtol=1e-6)


def test_relu_variant_has_l1_and_trains(tmp_path: Path) -> None:
    acts, _ = planted_data(1, n_samples=32, tokens=32, d=16, m=32)
    shards = write_saev(tmp_path, acts, layers=(0,), batch_size=32)
    cfg = TrainConfig(layer=0, activation="relu", expansion=2, epochs=3, batch_size=256, lr=3e-3, device="cpu")
    result = train_sae(shards, cfg, progress=False)
    curve = result.loss_curve
    assert curve[-1]["loss"] < curve[0]["loss"]
    x = torch.from_numpy(acts.reshape(-1, 16)[:100]) * result.input_scale
    out = result.sae.loss(x)
    assert float(out["l1"]) > 0
    assert float(out["loss"]) == pytest.approx(float(out["mse"]) + 5e-3 * float(out["l1"]), rel=1e-5)


# ---- training ----------------------------------------------------------------------------

def test_recovers_planted_sparse_dictionary(tmp_path: Path) -> None:
    acts, dirs = planted_data(0)
    shards = write_saev(tmp_path, acts, layers=(0,), batch_size=64, patches_per_shard=64 * 64)
    assert len(json.loads((shards / "shards.json").read_text())) == 4  # several shards through the loader
    cfg = TrainConfig(layer=0, expansion=4, k=3, epochs=10, batch_size=1024, lr=3e-3, seed=0, device="cpu")
    result = train_sae(shards, cfg, progress=False)
    w_dec = result.sae.W_dec.detach().numpy()
    best = (dirs @ w_dec.T).max(axis=1)
    assert (best > 0.9).mean() >= 0.9, f"recovered {(best > 0.9).mean():.2f}"
    assert result.tokens_seen == 10 * 256 * 64


def test_training_is_deterministic(tmp_path: Path) -> None:
    acts, _ = planted_data(2, n_samples=24, tokens=16, d=8, m=16)
    shards = write_saev(tmp_path, acts, layers=(0,), batch_size=8)
    cfg = TrainConfig(layer=0, expansion=2, k=2, epochs=2, batch_size=64, seed=5, device="cpu")
    a = train_sae(shards, cfg, progress=False)
    b = train_sae(shards, cfg, progress=False)
    c = train_sae(shards, TrainConfig(**{**cfg.to_json(), "seed": 6}), progress=False)
    for name, value in a.sae.state_dict().items():
        assert torch.equal(value, b.sae.state_dict()[name]), name
    assert not torch.equal(a.sae.W_dec, c.sae.W_dec)
    assert [p["loss"] for p in a.loss_curve] == [p["loss"] for p in b.loss_curve]


def test_input_scale_makes_mean_squared_norm_d() -> None:
    rows = np.random.default_rng(0).standard_normal((1000, 12)).astype(np.float32) * 7.0
    s = input_scale(rows)
    assert np.mean(np.sum((rows * s) ** 2, axis=1)) == pytest.approx(12.0, rel=1e-5)


def test_training_on_padded_text_uses_real_tokens_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    acts = rng.standard_normal((10, 2, 8, 6)).astype(np.float32)
    lengths = np.array([1, 8, 3, 5, 2, 8, 7, 4, 6, 1])
    shards = write_saev(tmp_path, acts, layers=(2, 4), lengths=lengths)
    result = train_sae(shards, TrainConfig(layer=4, expansion=1, k=2, epochs=2, batch_size=16, device="cpu"),
                       progress=False)
    assert result.n_tokens == int(lengths.sum())
    assert result.tokens_seen == 2 * int(lengths.sum())


# ---- sae.pt ------------------------------------------------------------------------------

def test_sae_pt_round_trip_with_weights_only(tmp_path: Path) -> None:
    cfg = SAEConfig(d_model=6, n_latents=12, k=3)
    sae = SparseAutoencoder(cfg, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sae.input_scale.fill_(0.25)
        sae.b_enc.uniform_()
    f = tmp_path / "sae.pt"
    save_sae(f, sae, input_scale=0.25, layer=3, train={"lr": 1e-3})
    blob = torch.load(f, weights_only=True)  # plain torch: no pickled classes allowed
    assert blob["format"] == CHECKPOINT_FORMAT
    assert blob["config"] == cfg.to_json()
    json.dumps({k: v for k, v in blob.items() if k != "state_dict"})  # everything but weights is JSON
    assert set(blob["state_dict"]) == {"W_enc", "W_dec", "b_enc", "b_dec", "input_scale"}
    assert blob["state_dict"]["W_enc"].shape == (6, 12) and blob["state_dict"]["W_dec"].shape == (12, 6)
    again, _ = load_sae(f)
    x = torch.randn(5, 6)
    torch.testing.assert_close(again.encode(x), sae.encode(x))
    assert float(again.input_scale) == 0.25
    assert not any(p.name.startswith(".sae.pt.tmp") for p in tmp_path.iterdir())


class _Evil:
    def __reduce__(self):  # pragma: no cover - must never run
        return (print, ("pwned",))


def test_hostile_or_broken_sae_pt_is_a_format_error(tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "config": {}, "state_dict": {}, "x": _Evil()}, evil)
    with pytest.raises(FormatError) as err:
        load_sae(evil)
    assert err.value.path == evil
    good = tmp_path / "good.pt"
    save_sae(good, SparseAutoencoder(SAEConfig(d_model=4, n_latents=8, k=2)))
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(good.read_bytes()[:100])
    with pytest.raises(FormatError):
        load_sae(trunc)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(FormatError):
        load_sae(other)
    wrong = tmp_path / "wrong.pt"
    blob = torch.load(good, weights_only=True)
    blob["config"]["n_latents"] = 9
    torch.save(blob, wrong)
    with pytest.raises(FormatError):
        load_sae(wrong)
    pickled = tmp_path / "plain.pkl"
    pickled.write_bytes(pickle.dumps({"format": CHECKPOINT_FORMAT}))
    with pytest.raises(FormatError):
        load_sae(pickled)


# ---- inference dump ----------------------------------------------------------------------

def test_inference_matrix_layout(tmp_path: Path) -> None:
    from actlake import open as open_store
    from actlake.sae.infer import infer_reader

    rng = np.random.default_rng(0)
    n, t, d = 7, 5, 6
    acts = rng.standard_normal((n, 2, t, d)).astype(np.float32)
    lengths = np.array([5, 1, 3, 5, 2, 4, 5])
    shards = write_saev(tmp_path / "s", acts, layers=(0, 1), lengths=lengths)
    cfg = SAEConfig(d_model=d, n_latents=10, k=3)
    sae = SparseAutoencoder(cfg, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sae.input_scale.fill_(0.5)
    with open_store(shards) as reader:
        res = infer_reader(sae, reader, 1, progress=False, chunk_tokens=7)  # several chunks
    f = tmp_path / "patch_acts.npz"
    sp.save_npz(f, res.acts, compressed=False)
    mat = sp.load_npz(f)
    assert mat.format == "csr" and mat.shape == (n * t, 10)
    row_nnz = np.diff(mat.indptr)
    for s in range(n):
        for tok in range(t):
            r = s * t + tok
            if tok >= lengths[s]:
                assert row_nnz[r] == 0  # padding: empty rows
                continue
            x = torch.from_numpy(acts[s, 1, tok]) * 0.5
            want = sae.encode(x[None])[0].detach().numpy()
            np.testing.assert_allclose(mat[r].toarray()[0], want, rtol=1e-5, atol=1e-6)
            assert row_nnz[r] <= 3
            cols = mat.indices[mat.indptr[r] : mat.indptr[r + 1]]
            assert np.all(np.diff(cols) > 0)  # canonical CSR
    m = res.metrics
    assert m["n_tokens"] == int(lengths.sum()) and m["n_rows"] == n * t
    assert m["l0"] == pytest.approx(mat.nnz / lengths.sum())
    assert 0 <= m["dead_frac"] <= 1
    x_all = np.concatenate([acts[s, 1, : lengths[s]] for s in range(n)]) * 0.5
    x_hat = sae(torch.from_numpy(x_all))[0].detach().numpy()
    sse = float(((x_all - x_hat) ** 2).sum())
    assert m["nmse"] == pytest.approx(sse / float((x_all ** 2).sum()), rel=1e-4)
    assert m["explained_variance"] == pytest.approx(1 - sse / float(((x_all - x_all.mean(0)) ** 2).sum()), rel=1e-4)
