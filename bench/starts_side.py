"""Starts: N runs started at once (``asyncio.gather``) by a process that only starts them.

    python starts_side.py --side durably --n 10000
    python starts_side.py --side durably --n 10000 --src /path/to/other/checkout/src
    python starts_side.py --side dbos --n 10000

What is timed is the gather of N starts, from the first call until every start has returned,
i.e. until every run is durably recorded; nothing executes the runs.

- durably: ``durably.Engine(url, consumers="never")`` (a producer: it stores runs, another
  process would execute them), ``await engine.start("bench", i)`` N times at once.
- DBOS: ``DBOSClient(system_database_url=url)``, ``await client.enqueue_async(options, i)`` N
  times at once on a queue no worker serves (DBOS's way for a process to create workflows that
  other processes execute).

Both on PostgreSQL (``--db postgres``, the default) or SQLite, on a freshly reset database,
after ``--warmup`` untimed starts. ``--src`` imports durably from another checkout's ``src/``
(before/after comparisons). Prints one JSON line (see common.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from common import Target, emit, error_result, make_target, prepare_workdir, reset_target


async def commits(t: Target) -> int | None:
    """Transactions committed in the target database so far (PostgreSQL's statistics; a
    backend reports its own when it exits, so read this after the side closed its pool)."""
    if t.db != "postgres":
        return None
    import asyncpg

    await asyncio.sleep(0.5)  # the pool's backends report as they exit
    conn = await asyncpg.connect(t.url)
    try:
        value: int = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return value
    finally:
        await conn.close()


async def durably_starts(t: Target, n: int, warmup: int) -> dict[str, Any]:
    import durably

    engine = durably.Engine(t.url, consumers="never")

    @engine.workflow("bench", version="1")
    async def bench(ctx: Any, i: int) -> int:
        return i

    try:
        await asyncio.gather(*(engine.start("bench", i) for i in range(warmup)))
        t0 = time.perf_counter()
        handles = await asyncio.gather(*(engine.start("bench", i) for i in range(n)))
        elapsed = time.perf_counter() - t0
        stored = await engine.store.count_pending()
    finally:
        await engine.close()
    if len({h.run_id for h in handles}) != n or stored != n + warmup:
        raise RuntimeError(f"{stored} runs stored for {n + warmup} starts")
    return {"n": n, "seconds": round(elapsed, 4), "starts_per_s": round(n / elapsed, 1)}


async def dbos_starts(t: Target, n: int, warmup: int) -> dict[str, Any]:
    from dbos import DBOS, DBOSClient, DBOSConfig, EnqueueOptions

    # A launch creates DBOS's system tables (the client does not); then only the client runs.
    config: DBOSConfig = {
        "name": "durably-bench",
        "system_database_url": t.url,
        "log_level": "WARNING",
        "run_migrations": True,
    }
    DBOS(config=config)
    DBOS.launch()
    DBOS.destroy(workflow_completion_timeout_sec=0)
    client = DBOSClient(system_database_url=t.url)
    options: EnqueueOptions = {"queue_name": "bench", "workflow_name": "bench"}
    try:
        await asyncio.gather(*(client.enqueue_async(options, i) for i in range(warmup)))
        t0 = time.perf_counter()
        handles = await asyncio.gather(*(client.enqueue_async(options, i) for i in range(n)))
        elapsed = time.perf_counter() - t0
    finally:
        client.destroy()
    if len({h.get_workflow_id() for h in handles}) != n:
        raise RuntimeError("fewer workflows than starts")
    return {"n": n, "seconds": round(elapsed, 4), "starts_per_s": round(n / elapsed, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--side", choices=["durably", "dbos"], required=True)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="postgres")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--src", default=None, help="import durably from this src/ directory")
    p.add_argument("--name", default=None, help="database / file name")
    p.add_argument("--workdir", default=".work")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    wd = prepare_workdir(args.workdir)
    t = make_target(args.db, args.name or f"bench_{args.side}_starts", wd)
    base: dict[str, Any] = {"side": args.side, "db": args.db, "scenario": "starts"}
    measure = durably_starts if args.side == "durably" else dbos_starts

    async def run() -> dict[str, Any]:
        await reset_target(t)
        before = await commits(t)
        result = await asyncio.wait_for(measure(t, args.n, args.warmup), args.timeout)
        after = await commits(t)
        if before is not None and after is not None:
            # Every commit in the database while the side ran (schema setup and warm-up
            # included, so slightly more than the starts' own), per start.
            result["commits_per_start"] = round((after - before) / (args.n + args.warmup), 3)
        return result

    try:
        emit({**base, **asyncio.run(run())})
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
