"""Commits per one-step workflow on PostgreSQL, durably and DBOS, counted by the server.

Each side's latency scenario (``durably_side.py`` / ``dbos_side.py latency``: one one-step
workflow at a time) runs twice on its own fresh database, with ``--count 10 + N`` and with
``--count 10`` (the same start-up, warm-up and shutdown); ``pg_stat_database.xact_commit`` is
read after each process has exited (a backend reports its counts when it ends), and the
difference over N is the commits one workflow costs. Every transaction counts, on every
connection of that database: a NOTIFY that wakes a listening backend costs that backend a
transaction too. The floor of a durable one-step run is two: the run exists before the step's
effect, and the step's result and the run's outcome are written together.

    .venv/bin/python commits.py [--count 200] [--sides durably,dbos]

durably is imported from this checkout's ``src/`` (``BENCH_DURABLY_SRC`` names another).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import pg_base_url

HERE = Path(__file__).resolve().parent
SRC = Path(os.environ.get("BENCH_DURABLY_SRC") or HERE.parent / "src").resolve()
_BASE = 10  # the shorter run's timed workflows (a side reports nothing for none)


def run_side(side: str, name: str, count: int) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), str(HERE)) if p)
    argv = [sys.executable, str(HERE / f"{side}_side.py"), "--db", "postgres", "--name", name]
    argv += ["latency", "--count", str(count)]
    done = subprocess.run(argv, env=env, cwd=HERE, capture_output=True, text=True, timeout=600)
    last = (done.stdout.strip().splitlines() or ["{}"])[-1]
    if done.returncode != 0 or "error" in json.loads(last):
        raise SystemExit(f"{side} failed: {last} {done.stderr[-2000:]}")


async def commits(name: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(f"{pg_base_url()}/postgres")
    try:
        value: int = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = $1", name
        )
        return value
    finally:
        await conn.close()


def per_workflow(side: str, count: int) -> float:
    name = f"bench_commits_{side}"
    counted: list[int] = []
    for n in (_BASE, _BASE + count):
        run_side(side, name, n)
        time.sleep(1.0)  # the exited backends' counts reach the statistics
        # the side's database carries BENCH_DB_SUFFIX (common.make_target)
        counted.append(asyncio.run(commits(name + os.environ.get("BENCH_DB_SUFFIX", ""))))
    return (counted[1] - counted[0]) / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--sides", default="durably,dbos")
    args = p.parse_args()
    for side in args.sides.split(","):
        print(f"{side}: {per_workflow(side, args.count):.2f} commits per one-step workflow")


if __name__ == "__main__":
    main()
