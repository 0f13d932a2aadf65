"""The floor: what the database itself allows, with the driver durably uses on it.

One row inserted and committed per transaction, nothing else:

* SQLite: the stdlib ``sqlite3`` module, ``journal_mode=WAL``, ``synchronous=NORMAL`` (durably's
  embedded settings), one connection, sequential. ``--sqlite-mode default`` measures SQLite's own
  default instead (rollback journal, ``synchronous=FULL``), which is what DBOS runs on.
* PostgreSQL: ``asyncpg``; sequential on one connection (``concurrency`` 1, the latency floor) and
  ``--concurrency C`` connections inserting at once (what group commit allows, the throughput
  floor).

    python floor.py --db sqlite --count 5000
    python floor.py --db postgres --count 5000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import time
from typing import Any

from common import emit, error_result, latency_summary, make_target, prepare_workdir, reset_target

PAYLOAD = json.dumps({"output": 42, "name": "s0", "status": "completed", "pad": "x" * 64})


def sqlite_floor(path: str, count: int, mode: str) -> dict[str, Any]:
    conn = sqlite3.connect(path, isolation_level=None)  # explicit BEGIN/COMMIT below
    try:
        if mode == "wal":
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, run_id TEXT, v TEXT)")
        samples: list[float] = []
        t0 = time.perf_counter()
        for i in range(count):
            s = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t (run_id, v) VALUES (?, ?)", (f"r{i}", PAYLOAD))
            conn.execute("COMMIT")
            samples.append(time.perf_counter() - s)
        elapsed = time.perf_counter() - t0
        jm = conn.execute("PRAGMA journal_mode").fetchone()[0]
        sync = conn.execute("PRAGMA synchronous").fetchone()[0]
    finally:
        conn.close()
    return {
        "count": count,
        "seconds": round(elapsed, 4),
        "commits_per_s": round(count / elapsed, 1),
        "commit_latency": latency_summary(samples),
        "sqlite_journal_mode": jm,
        "sqlite_synchronous": sync,
        "sqlite_version": sqlite3.sqlite_version,
        "concurrency": 1,
    }


async def pg_floor(url: str, count: int, concurrency: int) -> dict[str, Any]:
    import asyncpg

    conns = [await asyncpg.connect(url) for _ in range(max(1, concurrency))]
    try:
        await conns[0].execute("CREATE TABLE t (id BIGSERIAL PRIMARY KEY, run_id TEXT, v TEXT)")
        samples: list[float] = []
        per = count // len(conns)

        async def worker(w: int, c: Any) -> None:
            for i in range(per):
                s = time.perf_counter()
                # a single statement outside a transaction block: one commit
                await c.execute("INSERT INTO t (run_id, v) VALUES ($1, $2)", f"r{w}:{i}", PAYLOAD)
                samples.append(time.perf_counter() - s)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w, c) for w, c in enumerate(conns)))
        elapsed = time.perf_counter() - t0
        sync = await conns[0].fetchval("SHOW synchronous_commit")
        version = await conns[0].fetchval("SHOW server_version")
    finally:
        for c in conns:
            await c.close()
    done = per * len(conns)
    return {
        "count": done,
        "seconds": round(elapsed, 4),
        "commits_per_s": round(done / elapsed, 1),
        "commit_latency": latency_summary(samples),
        "pg_synchronous_commit": sync,
        "pg_version": version,
        "asyncpg_version": asyncpg.__version__,
        "concurrency": len(conns),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--db", choices=["sqlite", "postgres"], required=True)
    p.add_argument("--count", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=1, help="PostgreSQL connections at once")
    p.add_argument("--sqlite-mode", choices=["wal", "default"], default="wal")
    p.add_argument("--name", default="bench_floor")
    p.add_argument("--workdir", default=".work")
    args = p.parse_args()
    wd = prepare_workdir(args.workdir)
    t = make_target(args.db, args.name, wd)
    base: dict[str, Any] = {"side": "floor", "db": args.db, "scenario": "floor"}
    if args.db == "sqlite":
        base["sqlite_mode"] = args.sqlite_mode
    try:
        asyncio.run(reset_target(t))
        if args.db == "sqlite":
            assert t.sqlite_path is not None
            res = sqlite_floor(str(t.sqlite_path), args.count, args.sqlite_mode)
        else:
            res = asyncio.run(pg_floor(t.url, args.count, args.concurrency))
        emit({**base, **res})
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
