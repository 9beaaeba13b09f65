"""Blocks and layers: find each architecture's block list, number layers, capture outputs with hooks.

Layer `l` is the output of block `l` (the residual stream after it), which is
`hidden_states[l + 1]` of `output_hidden_states=True`; negative indices count from the end.
Capture stops the forward pass right after the deepest requested block by raising a private
`StopForward` from that block's hook, so layer 1 of 12 pays for 2 blocks, not 12.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..errors import ConfigError

#: dotted attribute paths of the block list, tried in order before the generic search
BLOCK_PATHS = (
    "model.layers",  # Llama, Qwen2, Mistral (ForCausalLM)
    "layers",  # LlamaModel, Qwen2Model, ViTModel (transformers 5)
    "transformer.h",  # GPT2LMHeadModel
    "h",  # GPT2Model
    "encoder.layer",  # BERT, Dinov2, ViT (transformers 4)
    "encoder.layers",  # CLIP / SigLIP vision models
    "vision_model.encoder.layers",  # CLIPVisionModel / SiglipVisionModel (transformers 4)
    "bert.encoder.layer",
    "model.decoder.layers",
)


class StopForward(Exception):
    """Raised from the hook of the deepest requested block to end the forward pass early."""


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _n_layers_of(config: Any) -> int | None:
    cfg = config if hasattr(config, "num_hidden_layers") else getattr(config, "vision_config", config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


def find_blocks(model: Any) -> tuple[str, Any]:
    """(dotted path, ModuleList) of the model's transformer blocks, in execution order."""
    import torch

    want = _n_layers_of(model.config)
    for path in BLOCK_PATHS:
        blocks = _get_path(model, path)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0 and (want is None or len(blocks) == want):
            return path, blocks
    candidates = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and (want is None or len(m) == want)]
    if len(candidates) == 1:
        return candidates[0]
    raise ConfigError(
        f"cannot find the block list of {type(model).__name__} ({len(candidates)} ModuleLists of length {want})"
    )


def parse_layers(text: str | Sequence[int]) -> list[int] | str:
    """Parse `--layers`: 'all', or comma-separated integers (negative allowed) and ranges like '0-3'."""
    if not isinstance(text, str):
        return [int(x) for x in text]
    text = text.strip()
    if text == "all":
        return "all"
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-") if not part.startswith("-") else (part, "", "")
        try:
            if sep:
                out.extend(range(int(lo), int(hi) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(f"--layers must be 'all' or integers like '0,3,-1' or '0-5', got {text!r}") from None
    if not out:
        raise ConfigError(f"no layers in {text!r}")
    return out


def normalize_layers(layers: Iterable[int] | str, n_blocks: int) -> tuple[int, ...]:
    """Resolve negative indices against `n_blocks`, check range, and return them sorted ascending, unique."""
    if isinstance(layers, str):
        parsed = parse_layers(layers)
        if parsed == "all":
            return tuple(range(n_blocks))
        layers = parsed
    out = set()
    for layer in layers:
        layer = int(layer)
        resolved = layer + n_blocks if layer < 0 else layer
        if not 0 <= resolved < n_blocks:
            raise ConfigError(f"layer {layer} out of range for a model with {n_blocks} blocks "
                              f"(valid: {-n_blocks}..{n_blocks - 1})")
        out.add(resolved)
    if not out:
        raise ConfigError("at least one layer is required")
    return tuple(sorted(out))


@dataclass
class LayerCapture:
    """Forward hooks that keep the output of each requested block; optionally stop after the deepest.

    Use as a context manager around `run(forward)`; `outputs` holds one tensor [B, T, D] per
    requested layer, in `layers` order.
    """

    blocks: Any
    layers: tuple[int, ...]
    early_exit: bool = True
    outputs: dict[int, Any] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)

    def __enter__(self) -> "LayerCapture":
        deepest = max(self.layers)
        for layer in self.layers:
            self._handles.append(self.blocks[layer].register_forward_hook(self._hook(layer, layer == deepest)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int, last: bool) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.outputs[layer] = output[0] if isinstance(output, (tuple, list)) else output
            if last and self.early_exit:
                raise StopForward

        return hook

    def run(self, forward: Any) -> tuple[Any, list[Any]]:
        """Call `forward()`; return (its result or None if stopped early, [outputs in layer order])."""
        self.outputs = {}
        result = None
        try:
            result = forward()
        except StopForward:
            pass
        missing = [layer for layer in self.layers if layer not in self.outputs]
        if missing:
            raise ConfigError(f"blocks {missing} did not run during the forward pass")
        return result, [self.outputs[layer] for layer in self.layers]
