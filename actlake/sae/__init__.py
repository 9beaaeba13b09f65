"""Sparse autoencoders on stored activations: model, training, inference dumps and visuals."""

from __future__ import annotations

from .model import CHECKPOINT_FORMAT, SAEConfig, SparseAutoencoder, load_sae, save_sae
from .train import TrainConfig, TrainResult, train_run, train_sae

__all__ = [
    "CHECKPOINT_FORMAT", "SAEConfig", "SparseAutoencoder", "TrainConfig", "TrainResult", "load_sae", "save_sae",
    "train_run", "train_sae",
]
