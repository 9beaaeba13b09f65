"""The persistent Dagster instance the demo, `actlake ui` and `actlake lineage` share: $DAGSTER_HOME, else ./actlake-data/dagster."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

DEFAULT_HOME = Path("actlake-data") / "dagster"


def dagster_home() -> Path:
    """$DAGSTER_HOME if set, else ./actlake-data/dagster (absolute)."""
    return Path(os.environ.get("DAGSTER_HOME") or DEFAULT_HOME).expanduser().resolve()


def instance_yaml(gpus: int) -> str:
    """dagster.yaml of an actlake instance: no telemetry or tours, the `gpu` pool limited to the GPUs configured."""
    return (
        "# written by actlake (edit freely; actlake never overwrites it)\n"
        "telemetry:\n  enabled: false\n"
        "nux:\n  enabled: false\n"
        "concurrency:\n  pools:\n"
        f"    # steps in the gpu pool (extraction, SAE training, inference): one per GPU (ACTLAKE_GPUS={gpus})\n"
        f"    default_limit: {gpus}\n"
    )


def ensure_home(home: Path | None = None, gpus: int = 1) -> Path:
    """Create the instance directory and its dagster.yaml (kept if present)."""
    home = (home or dagster_home()).resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(instance_yaml(gpus), encoding="utf-8")
    return home


def open_instance(home: Path | None = None) -> dg.DagsterInstance:
    """The persistent instance at `home` (created if needed)."""
    home = ensure_home(home)
    os.environ["DAGSTER_HOME"] = str(home)
    return dg.DagsterInstance.from_config(str(home))


def existing_instance() -> dg.DagsterInstance | None:
    """The configured instance, if one exists ($DAGSTER_HOME, or the demo's ./actlake-data/dagster); never creates one."""
    home = dagster_home()
    if not (home / "dagster.yaml").is_file():
        return None
    return dg.DagsterInstance.from_config(str(home))
