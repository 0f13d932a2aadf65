#!/usr/bin/env bash
# Install durably and run the demo: an order workflow on SQLite that is
# killed with SIGKILL mid-run, restarted, and finishes without redoing work.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/durably demo "$@"
