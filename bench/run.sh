#!/usr/bin/env bash
# The benchmark in one command: durably vs DBOS Transact, with the database's own floor.
#
#   bash bench/run.sh            # full run (N=500 and N=2000, 200 latency samples), ~8-10 min
#   bash bench/run.sh --quick    # smoke run, under a minute
#   bash bench/run.sh --db sqlite --repeat 2 --scale     # any compare.py flag passes through
#   bash bench/run.sh dispatch [--repeat 3] [--quick]    # dispatched steps (dispatch_compare.py)
#   bash bench/run.sh starts [--repeat 3] [--baseline REV]  # 10,000 starts (starts_compare.py)
#   bash bench/run.sh grow [--repeat 5] [--quick]        # 1,000,000 finished runs vs empty: wall, CPU, pages (grow_compare.py)
#   bash bench/run.sh big [--quick]                      # 100,000-child fan, 100,000 suspended (big.py)
#   bash bench/run.sh fleet [--quick]                    # 1, 2, 4 engine processes (fleet.py)
#   bash bench/run.sh all [--quick] [--repeat R]         # every scenario, one summary table (all.py)
#
# It keeps its own virtualenv in bench/.venv (git-ignored) with DBOS, asyncpg and durably
# (editable, from this checkout), reinstalling only when bench/requirements.txt or
# pyproject.toml change. PostgreSQL is expected at 127.0.0.1:5432 (trust auth, user postgres;
# override with BENCH_PG_URL); the bench creates and drops its own databases (bench_dbos,
# bench_durably, bench_floor, ...). Without PostgreSQL it measures SQLite only.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VENV="${BENCH_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "bench: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.bench-installed"
want="$(cat "$HERE/requirements.txt" "$ROOT/pyproject.toml" 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "bench: installing DBOS, asyncpg and durably into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q -r "$HERE/requirements.txt" >&2
    # durably's own dependencies; compare.py also puts $ROOT/src first on PYTHONPATH, so the
    # working tree is what gets measured even if this editable install is not possible.
    if ! "$VENV/bin/python" -m pip install -q -e "$ROOT[postgres,redis]" >&2; then
        echo "bench: 'pip install -e .[postgres,redis]' failed; durably is imported from $ROOT/src" >&2
    fi
    echo "$want" >"$stamp"
fi

cd "$HERE"
if [ "${1:-}" = "dispatch" ]; then
    shift
    exec "$VENV/bin/python" "$HERE/dispatch_compare.py" "$@"
fi
if [ "${1:-}" = "starts" ]; then
    shift
    exec "$VENV/bin/python" "$HERE/starts_compare.py" "$@"
fi
case "${1:-}" in
    grow) shift; exec "$VENV/bin/python" "$HERE/grow_compare.py" "$@" ;;
    big) shift; exec "$VENV/bin/python" "$HERE/big.py" "$@" ;;
    fleet) shift; exec "$VENV/bin/python" "$HERE/fleet.py" "$@" ;;
    all) shift; exec "$VENV/bin/python" "$HERE/all.py" "$@" ;;
esac
exec "$VENV/bin/python" "$HERE/compare.py" "$@"
