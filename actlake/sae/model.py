"""Sparse autoencoder: TopK (or ReLU + L1) with unit-norm decoder rows and an AuxK dead-latent loss."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

ACTIVATIONS = ("topk", "relu")


@dataclass(frozen=True)
class SAEConfig:
    """Architecture and loss of one SAE (JSON-serialisable; stored in sae.pt and config.json).

    d_model: input width. n_latents: dictionary size. activation: "topk" (keep the k largest
    pre-activations, ReLU'd) or "relu" (ReLU + L1 penalty `l1_coeff`). aux_k / aux_coeff: the
    AuxK loss, which reconstructs the residual from the top `aux_k` pre-activations of dead
    latents so they receive gradient again (aux_coeff 0 turns it off).
    """

    d_model: int
    n_latents: int
    activation: str = "topk"
    k: int = 32
    l1_coeff: float = 5e-3
    aux_k: int = 256
    aux_coeff: float = 1.0 / 32.0

    def __post_init__(self) -> None:
        if not 0 < self.d_model <= 1 << 20:
            raise ConfigError(f"d_model must be in 1..{1 << 20}, got {self.d_model}")
        if not 0 < self.n_latents <= 1 << 24:
            raise ConfigError(f"n_latents must be in 1..{1 << 24}, got {self.n_latents}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.activation == "topk" and not 0 < self.k <= self.n_latents:
            raise ConfigError(f"k must be in 1..n_latents={self.n_latents}, got {self.k}")
        if self.l1_coeff < 0 or self.aux_coeff < 0:
            raise ConfigError("l1_coeff and aux_coeff must be >= 0")
        if self.aux_k < 1:
            raise ConfigError(f"aux_k must be >= 1, got {self.aux_k}")

    def to_json(self) -> dict[str, Any]:
        """Plain dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> "SAEConfig":
        """Rebuild from `to_json()` output; unknown keys are an error (a config from elsewhere)."""
        if not isinstance(obj, dict):
            raise ConfigError(f"SAE config must be a JSON object, got {type(obj).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ConfigError(f"unknown SAE config keys {unknown}")
        try:
            return cls(**obj)
        except TypeError as exc:
            raise ConfigError(f"bad SAE config: {exc}") from exc


class _SelectedPreActs(torch.autograd.Function):
    """Pre-activations at chosen latents, with a sparse backward.

    Forward gathers `pre_bn[b, idx_bk[b, j]]` from pre-activations computed without autograd.
    Backward touches only the B*k chosen entries: dW_enc = x^T G by a sparse matmul and
    d(x - b_dec) = G W_enc^T by an embedding bag, instead of two dense (B, d, n) matmuls.
    """

    @staticmethod
    def forward(ctx: Any, xc_bd: torch.Tensor, w_enc_dn: torch.Tensor, b_enc_n: torch.Tensor,
                idx_bk: torch.Tensor, pre_bn: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(xc_bd, w_enc_dn, idx_bk)
        return pre_bn.gather(1, idx_bk)

    @staticmethod
    def backward(ctx: Any, g_bk: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xc_bd, w_enc_dn, idx_bk = ctx.saved_tensors
        b, k = idx_bk.shape
        n = w_enc_dn.shape[1]
        g_bk = g_bk.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = F.embedding_bag(idx_bk, w_enc_dn.t().contiguous(), per_sample_weights=g_bk, mode="sum")
        if ctx.needs_input_grad[1]:
            rows = torch.arange(b, device=idx_bk.device).repeat_interleave(k)
            g_nb = torch.sparse_coo_tensor(torch.stack([idx_bk.reshape(-1), rows]), g_bk.reshape(-1), (n, b),
                                           check_invariants=False)
            grad_w = torch.sparse.mm(g_nb, xc_bd).t()
        if ctx.needs_input_grad[2]:
            grad_b = torch.zeros(n, dtype=g_bk.dtype, device=g_bk.device).index_add_(0, idx_bk.reshape(-1),
                                                                                      g_bk.reshape(-1))
        return grad_x, grad_w, grad_b, None, None


class _SparseDecode(torch.autograd.Function):
    """sum_j vals[b, j] * W_dec[idx[b, j]] with a backward that never sorts or builds dense (B, n) tensors.

    dW_dec = G^T grad by a sparse matmul; dvals[b, j] = <grad[b], W_dec[idx[b, j]]> gathered from
    one dense (B, d) x (d, n) matmul (a gather of B*k decoder rows is slower on CPU).
    """

    @staticmethod
    def forward(ctx: Any, vals_bk: torch.Tensor, idx_bk: torch.Tensor, w_dec_nd: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(vals_bk, idx_bk, w_dec_nd)
        return F.embedding_bag(idx_bk, w_dec_nd, per_sample_weights=vals_bk, mode="sum")

    @staticmethod
    def backward(ctx: Any, grad_bd: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        vals_bk, idx_bk, w_dec_nd = ctx.saved_tensors
        b, k = idx_bk.shape
        grad_bd = grad_bd.contiguous()
        grad_vals = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_vals = (grad_bd @ w_dec_nd.t()).gather(1, idx_bk)
        if ctx.needs_input_grad[2]:
            rows = torch.arange(b, device=idx_bk.device).repeat_interleave(k)
            g_nb = torch.sparse_coo_tensor(torch.stack([idx_bk.reshape(-1), rows]), vals_bk.reshape(-1),
                                           (w_dec_nd.shape[0], b), check_invariants=False)
            grad_w = torch.sparse.mm(g_nb, grad_bd)
        return grad_vals, None, grad_w


class SparseAutoencoder(nn.Module):
    """x -> z = act(W_enc^T (x - b_dec) + b_enc) -> x_hat = z W_dec + b_dec, rows of W_dec unit-norm.

    Works on *normalised* inputs: callers multiply raw activations by `input_scale` (a buffer
    saved with the weights, chosen by the trainer so the mean squared norm is d_model).
    """

    def __init__(self, config: SAEConfig, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        d, n = config.d_model, config.n_latents
        w_dec_nd = torch.randn(n, d, generator=generator)
        w_dec_nd /= w_dec_nd.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(w_dec_nd)
        self.W_enc = nn.Parameter(w_dec_nd.t().clone())  # tied init (Gao et al. 2024)
        self.b_enc = nn.Parameter(torch.zeros(n))
        self.b_dec = nn.Parameter(torch.zeros(d))
        self.register_buffer("input_scale", torch.ones(()))

    # ---- forward pieces ----------------------------------------------------------------
    def pre_acts(self, x_bd: torch.Tensor) -> torch.Tensor:
        """(B, n_latents) encoder pre-activations."""
        return (x_bd - self.b_dec) @ self.W_enc + self.b_enc

    def activate(self, pre_bn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(dense z, topk values, topk indices); values/indices are None for ReLU."""
        if self.config.activation == "topk":
            vals_bk, idx_bk = pre_bn.topk(self.config.k, dim=-1, sorted=False)
            vals_bk = F.relu(vals_bk)
            z_bn = torch.zeros_like(pre_bn).scatter(-1, idx_bk, vals_bk)
            return z_bn, vals_bk, idx_bk
        return F.relu(pre_bn), None, None

    def encode(self, x_bd: torch.Tensor) -> torch.Tensor:
        """(B, n_latents) latent activations of normalised inputs."""
        return self.activate(self.pre_acts(x_bd))[0]

    def decode(self, z_bn: torch.Tensor) -> torch.Tensor:
        """(B, d_model) reconstruction from latents."""
        return z_bn @ self.W_dec + self.b_dec

    def _decode_sparse(self, vals_bk: torch.Tensor, idx_bk: torch.Tensor) -> torch.Tensor:
        """Reconstruction from top-k (values, indices) without a dense (B, n) matmul."""
        return _SparseDecode.apply(vals_bk, idx_bk, self.W_dec) + self.b_dec

    def forward(self, x_bd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(reconstruction, latents)."""
        z_bn = self.encode(x_bd)
        return self.decode(z_bn), z_bn

    # ---- training ----------------------------------------------------------------------
    def loss(self, x_bd: torch.Tensor, dead_n: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Training loss terms for a batch of normalised inputs.

        mse: mean over the batch of the squared error summed over dims, divided by d_model.
        l1: (ReLU only) mean over the batch of the latent L1 norm. aux: AuxK normalised MSE of
        the residual reconstructed by the top `aux_k` dead latents (0 when none are dead).
        TopK never builds a dense (B, n_latents) gradient: see `_SelectedPreActs`.
        """
        cfg = self.config
        zero = torch.zeros((), device=x_bd.device)
        xc_bd = x_bd - self.b_dec
        if cfg.activation == "topk":
            with torch.no_grad():
                pre_bn = xc_bd @ self.W_enc + self.b_enc
                idx_bk = pre_bn.topk(cfg.k, dim=-1, sorted=False).indices
            vals_bk = F.relu(_SelectedPreActs.apply(xc_bd, self.W_enc, self.b_enc, idx_bk, pre_bn))
            x_hat_bd = self._decode_sparse(vals_bk, idx_bk)
            l1 = zero
            with torch.no_grad():
                on_bk = vals_bk > 0
                fired_n = torch.zeros(cfg.n_latents, dtype=torch.bool, device=x_bd.device)
                fired_n[idx_bk[on_bk]] = True
                l0 = on_bk.sum(-1).float().mean()
        else:
            pre_bn = xc_bd @ self.W_enc + self.b_enc
            z_bn = F.relu(pre_bn)
            x_hat_bd = self.decode(z_bn)
            l1 = z_bn.abs().sum(-1).mean()
            with torch.no_grad():
                fired_n = (z_bn > 0).any(0)
                l0 = (z_bn > 0).sum(-1).float().mean()
                pre_bn = pre_bn.detach()
        err_bd = x_bd - x_hat_bd
        mse = err_bd.pow(2).sum(-1).mean() / cfg.d_model
        aux = zero
        if cfg.aux_coeff > 0 and dead_n is not None and bool(dead_n.any()):
            k_aux = min(cfg.aux_k, int(dead_n.sum()))
            with torch.no_grad():
                a_idx = pre_bn.masked_fill(~dead_n, float("-inf")).topk(k_aux, dim=-1, sorted=False).indices
            a_vals = F.relu(_SelectedPreActs.apply(xc_bd, self.W_enc, self.b_enc, a_idx, pre_bn))
            e_hat_bd = _SparseDecode.apply(a_vals, a_idx, self.W_dec)
            resid_bd = err_bd.detach()
            denom = (resid_bd - resid_bd.mean(0)).pow(2).sum().clamp_min(1e-12)
            aux = (e_hat_bd - resid_bd).pow(2).sum() / denom
        total = mse + cfg.l1_coeff * l1 + cfg.aux_coeff * aux
        return {"loss": total, "mse": mse, "l1": l1, "aux": aux, "l0": l0, "fired": fired_n}

    @torch.no_grad()
    def normalise_decoder(self) -> None:
        """Rescale decoder rows to unit norm (called after every optimiser step)."""
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-8)

    @torch.no_grad()
    def project_decoder_grad(self) -> None:
        """Drop the gradient component parallel to each decoder row (it would only change the norm)."""
        if self.W_dec.grad is None:
            return
        parallel_n = (self.W_dec.grad * self.W_dec).sum(1, keepdim=True)
        self.W_dec.grad -= parallel_n * self.W_dec

    # ---- persistence -------------------------------------------------------------------
    @classmethod
    def from_state(cls, config: SAEConfig, state_dict: dict[str, torch.Tensor]) -> "SparseAutoencoder":
        """An SAE with the given weights (shapes checked by load_state_dict)."""
        sae = cls(config)
        try:
            sae.load_state_dict(state_dict)
        except RuntimeError as exc:
            raise ConfigError(f"state dict does not fit the SAE config: {exc}") from exc
        return sae


#: version of the sae.pt dict layout (docs/formats/runs.md)
CHECKPOINT_FORMAT = "actlake-sae/1"


def save_sae(path: Any, sae: SparseAutoencoder, **extra: Any) -> None:
    """Write sae.pt atomically: a plain dict torch.load(weights_only=True) accepts.

    Layout: {"format": CHECKPOINT_FORMAT, "config": SAEConfig dict, "state_dict": {name:
    tensor}, **extra}; every extra value must be JSON-like (str/int/float/bool/list/dict/None).
    """
    from ..atomic import atomic_file

    state = {k: v.detach().cpu().contiguous() for k, v in sae.state_dict().items()}
    blob = {"format": CHECKPOINT_FORMAT, "config": sae.config.to_json(), "state_dict": state, **extra}
    from ..errors import WriteError

    try:
        with atomic_file(path) as f:
            torch.save(blob, f)
    except RuntimeError as exc:  # torch's inline_container reports ENOSPC and friends as RuntimeError
        raise WriteError(f"could not write the checkpoint ({str(exc)[:200]})", path) from exc


def load_sae(path: Any, *, device: str | torch.device = "cpu") -> tuple[SparseAutoencoder, dict[str, Any]]:
    """(SAE, whole checkpoint dict) from sae.pt, loaded with weights_only=True (no code runs)."""
    import pickle
    from pathlib import Path

    from ..errors import FormatError, MissingFileError

    path = Path(path)
    if not path.is_file():
        raise MissingFileError("SAE checkpoint is missing", path)
    try:
        blob = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise FormatError(f"not a loadable sae.pt ({type(exc).__name__}: {str(exc)[:200]})", path) from exc
    if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
        raise FormatError(f"not an {CHECKPOINT_FORMAT} checkpoint dict", path)
    if not isinstance(blob.get("state_dict"), dict):
        raise FormatError("checkpoint has no state_dict", path)
    for name, value in blob["state_dict"].items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise FormatError(f"weights {name!r} hold NaN or Inf values: refusing a broken SAE", path)
    try:
        config = SAEConfig.from_json(blob.get("config"))
        sae = SparseAutoencoder.from_state(config, blob["state_dict"])
    except ConfigError as exc:
        raise FormatError(exc.problem, path) from exc
    return sae.to(device), blob
