#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install actlake into it.
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test,interop
# torch is installed first, pinned, so the project's "torch>=2.2" never pulls another build:
# on this project's CPU machines pip takes the local CPU wheel; on a GPU machine it takes the
# CUDA build from the package index. Set ACTLAKE_TORCH to choose another torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${ACTLAKE_TORCH:-torch==2.13.0}"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install --quiet -e ".[${extras}]"
else
  .venv/bin/python -m pip install --quiet -e .
fi
echo "actlake installed in $(pwd)/.venv"
