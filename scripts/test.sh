#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite (2 pytest workers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,interop
set +e
.venv/bin/python -m pytest -q -n "${ACTLAKE_TEST_WORKERS:-2}" "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
