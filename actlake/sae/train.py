"""Train an SAE on one layer of a stored activation directory through the shuffled token loader."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import devices
from ..errors import ConfigError, DatasetError
from ..reader import Reader
from ..torch import ShuffledTokenLoader
from .model import SAEConfig, SparseAutoencoder

if TYPE_CHECKING:
    from ..runs import Run

SCALE_SAMPLE_TOKENS = 65_536


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when available else CPU; 'cuda' without a GPU is a ConfigError."""
    return torch.device(devices.resolve_device(device))


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (stored in checkpoint/config.json).

    expansion: n_latents = expansion * d_model. dead_after_tokens: a latent that has not fired
    for this many training tokens counts as dead for the AuxK loss (None: min(10M, half an
    epoch), so small datasets still see the loss act). warmup_steps / decay_frac: linear LR
    warm-up, then constant, then linear decay to 0 over the last `decay_frac` of the steps.
    min_steps_per_epoch: small stores get a smaller batch (a power of two, at least 256) so an
    epoch still has this many optimiser steps (0: always `batch_size`).
    """

    layer: int
    expansion: int = 8
    k: int = 32
    activation: str = "topk"
    l1_coeff: float = 5e-3
    aux_k: int = 256
    aux_coeff: float = 1.0 / 32.0
    epochs: int = 8
    batch_size: int = 4096
    min_steps_per_epoch: int = 16
    lr: float = 1e-3
    seed: int = 0
    device: str = "auto"
    normalise: bool = True
    dead_after_tokens: int | None = None
    warmup_steps: int = 20
    decay_frac: float = 0.2
    grad_clip: float = 1.0
    n_threads: int = 2

    def __post_init__(self) -> None:
        if self.expansion < 1 or self.epochs < 1 or self.batch_size < 1 or self.n_threads < 1:
            raise ConfigError("expansion, epochs, batch_size and n_threads must be >= 1")
        if self.min_steps_per_epoch < 0:
            raise ConfigError(f"min_steps_per_epoch must be >= 0, got {self.min_steps_per_epoch}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr}")
        if not 0 <= self.decay_frac <= 1 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("decay_frac must be in [0, 1]; warmup_steps and grad_clip >= 0")
        if self.dead_after_tokens is not None and self.dead_after_tokens < 1:
            raise ConfigError(f"dead_after_tokens must be >= 1, got {self.dead_after_tokens}")
        devices.check_device(self.device)
        self.sae_config(1)  # validates activation / coefficients early

    def sae_config(self, d_model: int) -> SAEConfig:
        """The SAE architecture this run trains for inputs of width `d_model`."""
        n = self.expansion * d_model
        return SAEConfig(d_model=d_model, n_latents=n, activation=self.activation, k=min(self.k, n),
                         l1_coeff=self.l1_coeff, aux_k=self.aux_k, aux_coeff=self.aux_coeff)

    def effective_batch_size(self, n_tokens: int) -> int:
        """`batch_size`, lowered for small stores so an epoch has `min_steps_per_epoch` steps."""
        if not self.min_steps_per_epoch or n_tokens >= self.batch_size * self.min_steps_per_epoch:
            return self.batch_size
        fit = max(1, n_tokens // self.min_steps_per_epoch)
        return min(self.batch_size, max(256, 1 << (fit.bit_length() - 1)))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainResult:
    """A trained SAE and what happened while training it."""

    sae: SparseAutoencoder
    loss_curve: list[dict[str, float]]
    input_scale: float
    n_tokens: int
    tokens_seen: int
    seconds: float
    device: str
    extra: dict[str, Any] = field(default_factory=dict)


def sample_rows(reader: Reader, layer: int, n: int, seed: int) -> np.ndarray:
    """(m, D) float32: up to `n` real token vectors of `layer` drawn without replacement (seeded)."""
    segments = reader.token_segments(layer)
    row_index = [seg.row_index() for seg in segments]
    sizes = np.array([len(r) for r in row_index], dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        raise DatasetError(f"layer {layer} has no real tokens", reader.path)
    rng = np.random.default_rng([seed, 7919])
    pos = np.sort(rng.choice(total, size=min(n, total), replace=False))
    ends = np.cumsum(sizes)
    seg_of = np.searchsorted(ends, pos, side="right")
    out = np.empty((len(pos), reader.d_model), dtype=np.float32)
    for k in np.unique(seg_of):
        m = seg_of == k
        local = pos[m] - (ends[k] - sizes[k])
        out[m] = np.take(segments[int(k)].rows_2d, row_index[int(k)][local], axis=0)
    return out


def input_scale(rows_nd: np.ndarray) -> float:
    """Scale s with mean ||s x||^2 = d (so losses and lr mean the same thing at every width/layer)."""
    mean_sq = float(np.mean(np.sum(rows_nd.astype(np.float64) ** 2, axis=1)))
    if not math.isfinite(mean_sq) or mean_sq <= 0:
        return 1.0
    return math.sqrt(rows_nd.shape[1] / mean_sq)


def _lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    decay_steps = cfg.decay_frac * total
    decay = min(1.0, (total - step) / decay_steps) if decay_steps >= 1 else 1.0
    return warm * decay


def make_optimizer(sae: SparseAutoencoder, lr: float) -> torch.optim.Adam:
    """Adam (fused kernel where this torch build has one for the device: several times faster on CPU)."""
    try:
        return torch.optim.Adam(sae.parameters(), lr=lr, betas=(0.9, 0.999), eps=6.25e-10, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(sae.parameters(), lr=lr, betas=(0.9, 0.999), eps=6.25e-10)


def train_sae(source: str | Path | Reader, cfg: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Train an SAE on layer `cfg.layer` of `source` (a path any actlake format opens, or a Reader).

    Deterministic for a given seed on CPU: weights come from a seeded generator, batches from
    the loader's (seed, epoch) permutation, and nothing else is random.
    """
    from tqdm.auto import tqdm

    import actlake

    device = resolve_device(cfg.device)
    reader = source if isinstance(source, Reader) else actlake.open(source)
    reader.layer_index(cfg.layer)
    sae_cfg = cfg.sae_config(reader.d_model)
    gen = torch.Generator().manual_seed(cfg.seed)
    sae = SparseAutoencoder(sae_cfg, generator=gen)

    sample_nd = sample_rows(reader, cfg.layer, SCALE_SAMPLE_TOKENS, cfg.seed)
    if not np.isfinite(sample_nd).all():
        raise DatasetError(f"the input holds NaN or Inf values (layer {cfg.layer}, found in a sample of "
                           f"{len(sample_nd)} tokens): check the activation store with `actlake verify`")
    scale = input_scale(sample_nd) if cfg.normalise else 1.0
    with torch.no_grad():
        sae.input_scale.fill_(scale)
        sae.b_dec.copy_(torch.from_numpy(sample_nd.mean(0) * scale))
    sae.to(device)

    n_real = int(reader.lengths.sum())
    batch_size = cfg.effective_batch_size(n_real)
    loader = ShuffledTokenLoader(reader, cfg.layer, batch_size=batch_size, seed=cfg.seed,
                                 n_threads=cfg.n_threads, device=device)
    n_tokens = loader.n_tokens
    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * cfg.epochs
    dead_after = cfg.dead_after_tokens or max(1, min(10_000_000, n_tokens // 2))
    opt = make_optimizer(sae, cfg.lr)
    since_fired_n = torch.zeros(sae_cfg.n_latents, dtype=torch.long, device=device)
    curve: list[dict[str, float]] = []
    step = 0
    seen = 0
    t0 = time.perf_counter()
    bar = tqdm(total=n_tokens * cfg.epochs, unit="tok", unit_scale=True, desc="train",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        for epoch in range(cfg.epochs):
            loader.set_epoch(epoch)
            for x_bd in loader:
                x_bd = x_bd.to(device, non_blocking=True)
                if scale != 1.0:
                    x_bd = x_bd * scale
                for group in opt.param_groups:
                    group["lr"] = cfg.lr * _lr_factor(step, total_steps, cfg)
                dead_n = since_fired_n >= dead_after
                out = sae.loss(x_bd, dead_n)
                opt.zero_grad(set_to_none=True)
                out["loss"].backward()
                sae.project_decoder_grad()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(sae.parameters(), cfg.grad_clip)
                opt.step()
                sae.normalise_decoder()
                b = x_bd.shape[0]
                since_fired_n += b
                since_fired_n[out["fired"]] = 0
                seen += b
                stats = {name: float(out[name].detach()) for name in ("loss", "mse", "aux", "l0")}
                loss = stats["loss"]
                if not math.isfinite(loss):
                    if not bool(torch.isfinite(x_bd).all()):
                        raise DatasetError(f"the input holds NaN or Inf values (layer {cfg.layer}): "
                                           "check the activation store with `actlake verify`")
                    raise ConfigError(f"training diverged at step {step} (loss {loss}); lower --lr")
                curve.append({"step": step, "epoch": epoch, "tokens": seen, **stats,
                              "dead_frac": float(dead_n.float().mean())})
                step += 1
                bar.update(b)
                bar.set_postfix(loss=f"{loss:.4f}", l0=f"{curve[-1]['l0']:.1f}", refresh=False)
    finally:
        bar.close()
    sae.eval()
    return TrainResult(sae=sae, loss_curve=curve, input_scale=scale, n_tokens=n_tokens, tokens_seen=seen,
                       seconds=time.perf_counter() - t0, device=str(device),
                       extra={"dead_after_tokens": dead_after, "steps": step, "batch_size_used": batch_size})


def thin_curve(curve: list[dict[str, float]], max_points: int = 2000) -> list[dict[str, float]]:
    """At most `max_points` evenly spaced entries of a loss curve (first and last kept)."""
    if len(curve) <= max_points:
        return list(curve)
    idx = np.unique(np.linspace(0, len(curve) - 1, max_points).round().astype(int))
    return [curve[int(i)] for i in idx]


def train_run(run: "Run", cfg: TrainConfig, *, overwrite: bool = False, progress: bool = True) -> TrainResult:
    """Train on the run's links/train-shards and write checkpoint/{config.json, sae.pt}.

    An existing checkpoint is refused (RunError) unless `overwrite`; sae.pt is written last, so
    its presence means the checkpoint is complete. The run directory is locked while it trains, so a
    second `train` of the same run fails at once instead of overwriting the first one's checkpoint.
    """
    from ..run_guard import run_lock

    with run_lock(run, "training"):
        return _train_locked(run, cfg, overwrite=overwrite, progress=progress)


def _train_locked(run: "Run", cfg: TrainConfig, *, overwrite: bool, progress: bool) -> TrainResult:
    import datetime

    import actlake

    from ..atomic import write_json_atomic
    from ..errors import RunError
    from ..runs import RUN_CONFIG_FORMAT, shard_hash_of
    from .model import save_sae

    if run.has_checkpoint and not overwrite:
        raise RunError("checkpoint already exists (use --overwrite to train again)", run.sae_path)
    train_shards = run.train_shards
    val_shards = run.val_shards
    with actlake.open(train_shards) as reader:
        md = getattr(reader, "metadata", None)
        prov = reader.provenance
        model = getattr(md, "ckpt", None) or prov.get("ckpt") or prov.get("model_name")
        family = getattr(md, "family", None) or prov.get("family")
        dataset = str(getattr(md, "dataset", "") or prov.get("dataset", "") or "")
        result = train_sae(reader, cfg, progress=progress)
    run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if run.sae_path.exists():
        run.sae_path.unlink()  # overwrite: the old checkpoint stops being "complete" first
    last = result.loss_curve[-1] if result.loss_curve else {}
    config = {
        "format": RUN_CONFIG_FORMAT,
        "run_id": run.run_id,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "actlake_version": actlake.__version__,
        "layer": cfg.layer,
        "sae": result.sae.config.to_json(),
        "train": cfg.to_json(),
        "input_scale": result.input_scale,
        "train_shards": {"link": "links/train-shards", "path": str(train_shards),
                         "shard_hash": shard_hash_of(train_shards)},
        "val_shards": None if val_shards is None else {
            "link": "links/val-shards", "path": str(val_shards), "shard_hash": shard_hash_of(val_shards)},
        "model": model,
        "family": family,
        "dataset": dataset,
        "device": result.device,
        "n_tokens": result.n_tokens,
        "tokens_seen": result.tokens_seen,
        "seconds": round(result.seconds, 3),
        "tokens_per_s": round(result.tokens_seen / max(result.seconds, 1e-9), 1),
        **result.extra,
        "final": {k: last.get(k) for k in ("loss", "mse", "aux", "l0", "dead_frac")},
        "loss_curve": thin_curve(result.loss_curve),
    }
    write_json_atomic(run.config_path, config)
    save_sae(run.sae_path, result.sae, input_scale=result.input_scale, layer=cfg.layer, run_id=run.run_id,
             train_shards_hash=shard_hash_of(train_shards), train=cfg.to_json())
    return result
