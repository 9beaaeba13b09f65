#!/usr/bin/env bash
# Set up .venv with the test extras, lint with ruff, and run the whole suite (2 pytest workers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-packages.sh || echo "warning: Chromium could not be installed; the UI test will skip (CI fails)" >&2
bash scripts/setup.sh test,interop,cluster,remote
.venv/bin/ruff check .   # the rule set is stated in pyproject.toml
set +e
.venv/bin/python -m pytest -q -n "${ACTLAKE_TEST_WORKERS:-2}" "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
