"""The parquet footer's schema metadata: `lmprobe:` keys (model, provenance, tensors) and actlake's own key."""

from __future__ import annotations

import json
import platform
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from typing import Any

import numpy as np

from actlake.formats.lmprobe.layout import (
    ACTLAKE_META_KEY,
    FORMAT_VERSION,
    PROMPT_ORDERING,
    REVISION_KEYS,
)
from actlake.spec import StoreSpec


def to_plain(value: Any) -> Any:
    """JSON-able copy of a value (numpy scalars and arrays become Python numbers and lists)."""
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def model_revision(spec: StoreSpec) -> str | None:
    """The model revision recorded for `spec`: first of REVISION_KEYS in provenance, then data."""
    for source in (spec.provenance, spec.data):
        for key in REVISION_KEYS:
            value = source.get(key)
            if isinstance(value, str) and value:
                return value
    return None


def _package_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def build_provenance(spec: StoreSpec) -> dict[str, Any]:
    """The spec's provenance block (all its keys), overlaid with `spec.provenance`."""
    from actlake import __version__

    out: dict[str, Any] = {
        "lmprobe_version": None,  # lmprobe did not write this dataset; actlake_version says who did
        "extraction_backend": "actlake",
        "nnsight_version": _package_version("nnsight"),
        "torch_version": _package_version("torch"),
        "transformers_version": _package_version("transformers"),
        "python_version": platform.python_version(),
        "created_at": datetime.now(UTC).isoformat(),
        "actlake_version": __version__,
    }
    for key, value in spec.provenance.items():
        out[str(key)] = to_plain(value)
    return out


def schema_metadata(spec: StoreSpec, tensors: dict[str, Any]) -> dict[bytes, bytes]:
    """Every `lmprobe:` key (JSON-encoded) plus actlake's round-trip facts under ACTLAKE_META_KEY."""
    info = {
        "format_version": FORMAT_VERSION,
        "model": {"name": spec.model_name, "revision": model_revision(spec)},
        "num_prompts": spec.n_samples,
        "prompt_ordering": PROMPT_ORDERING,
        "tensors": tensors,
        "provenance": build_provenance(spec),
    }
    meta = {f"lmprobe:{k}".encode(): json.dumps(v).encode() for k, v in info.items()}
    meta[ACTLAKE_META_KEY] = json.dumps({
        "content_hash": spec.content_hash(), "family": spec.family, "dataset": spec.dataset,
        "data": to_plain(spec.data), "max_tokens": spec.max_tokens, "cls_token": spec.cls_token,
        "machine_id": spec.machine_id, "num_machines": spec.num_machines,
    }).encode()
    return meta
