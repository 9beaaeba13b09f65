"""Device names: "auto" picks CUDA when torch sees a GPU; asking for CUDA without one is a clear error."""

from __future__ import annotations

from .errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str) -> str:
    """Validate a device name ("auto", "cpu", "cuda" or "cuda:N") without touching torch."""
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ConfigError(f"device must be one of {DEVICES} (or cuda:N), got {device!r}")
    return device


def resolve_device(device: str) -> str:
    """The concrete torch device name for `device` ("auto" -> "cuda" or "cpu")."""
    import torch

    check_device(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but torch sees no CUDA device")
    return device
