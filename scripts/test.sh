#!/usr/bin/env bash
# Install everything the test suite needs and run it: lint, types, tests.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

# --- services: PostgreSQL and Redis normally run on this machine; start them if down.
if command -v pg_isready >/dev/null 2>&1 && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
fi
if command -v psql >/dev/null 2>&1 && pg_isready -h 127.0.0.1 -p 5432 -q; then
  # The fleet and chaos tests run several engines (each a pool of up to 10 connections) plus
  # subprocesses at once; Debian's default of 100 connections refuses some of them on a busy
  # run. Raised only when we are the machine's root and PostgreSQL is local.
  conns="$(psql -h 127.0.0.1 -U postgres -tAc 'SHOW max_connections' 2>/dev/null || echo 0)"
  if [ "${conns:-0}" -lt 400 ] && [ "$(id -u)" = 0 ] && command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "raising PostgreSQL max_connections ${conns} -> 400"
    psql -h 127.0.0.1 -U postgres -qc "ALTER SYSTEM SET max_connections = 400" >/dev/null \
      && pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main restart \
      || true
    for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
  fi
  if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1; then
    psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >/dev/null
  fi
fi
if command -v redis-cli >/dev/null 2>&1 && ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi

# --- the dashboard's browser tests drive Debian's chromium through Playwright
# (which cannot download a browser of its own here).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium"
  apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } || true
fi

# --- the project and its test dependencies, in a virtualenv of its own.
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
# With the redis extra, as a user installs it: bullmq pins croniter==2.0.7 (and exact
# msgpack/semver), so the whole suite runs on the oldest croniter durably allows.
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,redis]'

# --- the schedule window tests (and the memory engine's DST firing) again on the newest
# croniter, what users without the redis extra get: a small second virtualenv, kept
# between runs (~15 s; ~25 s the first time).
if [ ! -x .venv-croniter/bin/python ]; then
  "$PYTHON" -m venv .venv-croniter
fi
.venv-croniter/bin/python -m pip install -q --disable-pip-version-check --upgrade \
  -e . croniter pytest pytest-asyncio pytest-timeout

echo "== ruff"
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
echo "== mypy --strict"
.venv/bin/mypy
echo "== schedules on croniter $(.venv-croniter/bin/python -c 'import importlib.metadata as m; print(m.version("croniter"))')"
.venv-croniter/bin/pytest -q -p no:cacheprovider tests/engine/test_schedules.py \
  -k "not sqlite and not postgresql and (not memory or dst)"
echo "== replay paths with the sticky-run cache off (the main run has it on)"
DURABLY_TEST_STICKY_RUNS=0 .venv/bin/pytest -q -p no:cacheprovider tests/engine/test_replay.py \
  tests/engine/test_interleavings.py tests/engine/test_dispatched.py tests/engine/test_composition.py
echo "== dispatched steps with turns never held across them (the main run holds them)"
DURABLY_TEST_STEP_HOLD=0 .venv/bin/pytest -q -p no:cacheprovider tests/engine/test_dispatched.py \
  tests/engine/test_late_results.py tests/engine/test_saga_dispatched.py
echo "== pytest (croniter $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("croniter"))'))"
# The slowest tests are listed at the end: the CI budget is 20 minutes.
exec .venv/bin/pytest -q -p no:cacheprovider --durations=25 "$@"
