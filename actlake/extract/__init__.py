"""Extraction: activations of transformers models, one forward pass per batch, into any format's writer.

`extract(ExtractConfig(...))` is the entry point; see docs/formats/extraction.md for layer
numbering, padding, families, provenance, machine slicing and resume.
"""

from __future__ import annotations

from .batching import machine_slice, plan_windows
from .datasets import Dataset, DatasetFields, open_dataset
from .engine import ExtractConfig, ExtractResult, extract
from .layers import find_blocks, normalize_layers, parse_layers
from .models import MINILM, TINY_ARCHS, LoadedModel, ModelSource, load_model, minilm_dir, resolve_model

__all__ = [
    "Dataset", "DatasetFields", "ExtractConfig", "ExtractResult", "LoadedModel", "MINILM", "ModelSource",
    "TINY_ARCHS", "extract", "find_blocks", "load_model", "machine_slice", "minilm_dir", "normalize_layers",
    "open_dataset", "parse_layers", "plan_windows", "resolve_model",
]
