"""Dagster entry point (`dagster dev -w workspace.yaml`): the code location lives in actlake_dagster."""

from actlake_dagster.definitions import defs

__all__ = ["defs"]
