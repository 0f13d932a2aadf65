"""The dashboard over 100,000 runs in PostgreSQL: every list and filter page
timed end to end (through the ASGI app, page rendering included) and each
SQL query it sent shown with ``EXPLAIN (ANALYZE, BUFFERS)``.

    .venv/bin/python bench/dashboard.py                 # seeds 100k runs, then measures
    .venv/bin/python bench/dashboard.py --runs 20000 --repeat 10

Runs in its own schema (``bench_dashboard``) of the ``test`` database at
127.0.0.1 (``BENCH_PG_URL`` to change), recreated on each start unless
``--reuse``; the queries it records are those the store sent, captured at the
connection pool, so what is explained is exactly what the dashboard ran.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx

import durably
import durably.dashboard
from durably.model import Run, RunStatus

SCHEMA = "bench_dashboard"
BASE_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
DAY_MS = 86_400_000
STATUS_MIX = [
    (RunStatus.COMPLETED, 70),
    (RunStatus.FAILED, 10),
    (RunStatus.SUSPENDED, 10),
    (RunStatus.PENDING, 5),
    (RunStatus.CANCELLED, 3),
    (RunStatus.DEAD, 2),
]


def _runs(count: int, now: int) -> list[Run]:
    rng = random.Random(42)
    statuses = [s for s, weight in STATUS_MIX for _ in range(weight)]
    runs = []
    for i in range(count):
        created = now - 30 * DAY_MS + (i * 30 * DAY_MS) // count  # id order = time order
        status = rng.choice(statuses)
        runs.append(
            Run(
                run_id=f"order-{i:07d}",
                workflow=f"wf-{rng.randrange(10)}",
                workflow_version="1",
                status=status,
                input={"order": i, "lines": [rng.randrange(100) for _ in range(3)]},
                output={"ok": True} if status is RunStatus.COMPLETED else None,
                error={"message": "boom", "type": "ValueError"}
                if status in (RunStatus.FAILED, RunStatus.DEAD)
                else None,
                tags=[f"tenant:{rng.randrange(50)}"],
                created_at=created,
                updated_at=created + rng.randrange(60_000),
            )
        )
    return runs


class Recorder:
    """Wraps the store's pool: remembers each SQL text, its arguments and how
    long it took (also on connections taken for a transaction)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.queries: list[tuple[str, tuple[Any, ...], float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    async def fetch(self, sql: str, *args: Any) -> Any:
        return await self.timed(self.pool.fetch, sql, args)

    async def timed(self, fetch: Any, sql: str, args: tuple[Any, ...]) -> Any:
        started = time.perf_counter()
        try:
            return await fetch(sql, *args)
        finally:
            self.queries.append((sql, args, (time.perf_counter() - started) * 1000))

    def acquire(self) -> Any:
        recorder, context = self, self.pool.acquire()

        class Connection:
            def __init__(self, conn: Any) -> None:
                self.conn = conn

            def __getattr__(self, name: str) -> Any:
                return getattr(self.conn, name)

            async def fetch(self, sql: str, *args: Any) -> Any:
                return await recorder.timed(self.conn.fetch, sql, args)

        class Acquire:
            async def __aenter__(self) -> Any:
                return Connection(await context.__aenter__())

            async def __aexit__(self, *exc: Any) -> Any:
                return await context.__aexit__(*exc)

            def __await__(self) -> Any:
                # ``await pool.acquire()`` (the store's hot-connection path):
                # the wrapper comes back through ``release`` below
                async def wrapped() -> Any:
                    return Connection(await context)

                return wrapped().__await__()

        return Acquire()

    async def release(self, conn: Any, **kw: Any) -> Any:
        return await self.pool.release(getattr(conn, "conn", conn), **kw)


async def seed(url: str, count: int) -> None:
    conn = await asyncpg.connect(BASE_URL)
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await conn.close()
    store = durably.stores.open_store(url)
    await store.open()
    started = time.perf_counter()
    runs = _runs(count, int(time.time() * 1000))
    for start in range(0, len(runs), 2000):
        await store.create_runs(runs[start : start + 2000])
    await store.close()
    conn = await asyncpg.connect(BASE_URL)
    # What autovacuum does to a table this size soon after a load: statistics,
    # and the visibility map that lets the counts read the index alone.
    await conn.execute(f"VACUUM ANALYZE {SCHEMA}.durably_runs")
    await conn.close()
    print(f"seeded {count:,} runs in {time.perf_counter() - started:.1f} s")


async def measure(url: str, repeat: int, explain: bool) -> None:
    engine = durably.Engine(store=url, drive=False)
    await engine.open()
    store: Any = engine.store
    db = store._db
    recorder = Recorder(db.pool())
    db.pool = lambda: recorder  # type: ignore[method-assign]
    app = durably.dashboard.app(engine)
    now = int(time.time() * 1000)
    day = datetime.fromtimestamp((now - 10 * DAY_MS) / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    day_end = datetime.fromtimestamp((now - 9 * DAY_MS) / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as client:
        deep = (await client.get("/api/runs?limit=200")).json()["next_cursor"]
        for _ in range(20):  # 21 pages in: runs ~4,000 deep
            deep = (await client.get(f"/api/runs?limit=200&cursor={deep}")).json()["next_cursor"]
        pages = {
            "all runs": "/",
            "status=failed": "/?status=failed",
            "workflow=wf-3": "/?workflow=wf-3",
            "tag=tenant:7": "/?tag=tenant:7",
            "status+workflow": "/?status=failed&workflow=wf-3",
            "status+tag": "/?status=dead&tag=tenant:7",
            "id prefix": "/?q=order-00123",
            "one day": f"/?since={day}&until={day_end}",
            "a day + status": f"/?since={day}&until={day_end}&status=suspended",
            "deep cursor": f"/?cursor={deep}",
            "api: status=failed": "/api/runs?status=failed",
        }
        rows = []
        for label, path in pages.items():
            response = await client.get(path)  # warm: plans, pool, templates
            assert response.status_code == 200, (path, response.status_code, response.text[:300])
            samples, sql_ms = [], []
            for _ in range(repeat):
                recorder.queries.clear()
                started = time.perf_counter()
                response = await client.get(path)
                samples.append((time.perf_counter() - started) * 1000)
                # list and counts run concurrently: the slower one is the wait
                sql_ms.append(max(ms for _, _, ms in recorder.queries))
            queries = [(sql, args) for sql, args, _ in recorder.queries]
            rows.append((label, path, samples, sql_ms, queries))
        # the live view's poll: runs changed in the last 2 s
        poll = []
        for _ in range(repeat):
            recorder.queries.clear()
            started = time.perf_counter()
            await store.list_changed(int(time.time() * 1000) - 2000, 200)
            poll.append((time.perf_counter() - started) * 1000)
        queries = [(sql, args) for sql, args, _ in recorder.queries]
        rows.append(("live poll", "store.list_changed(now - 2 s)", poll, poll, queries))

    print(
        "\n| page | page p50 ms | page p95 ms | SQL p50 ms | SQL p95 ms |\n"
        "| --- | --- | --- | --- | --- |"
    )
    for label, path, samples, sql_ms, _ in rows:
        print(
            f"| {label} (`{path[:48]}`) | {statistics.median(samples):.1f} | {_p95(samples):.1f} "
            f"| {statistics.median(sql_ms):.1f} | {_p95(sql_ms):.1f} |"
        )
    if explain:
        conn = await asyncpg.connect(BASE_URL, server_settings={"search_path": SCHEMA})
        # The generic plan: what asyncpg's prepared statements run from their
        # sixth execution on (PostgreSQL then stops planning per value); the
        # listings and counts force a custom plan (list_runs and count_runs
        # set it), so they show that.
        for label, _, _, _, queries in rows:
            for n, (sql, args) in enumerate(queries):
                name = f"q{abs(hash((label, n)))}"
                listing = " UNION ALL " in sql or "ORDER BY created_at DESC, id DESC LIMIT" in sql
                mode = "force_custom_plan" if listing else "force_generic_plan"
                await conn.execute(f"SET plan_cache_mode = {mode}")
                await conn.execute(f"PREPARE {name} AS {sql}")
                values = ", ".join(_literal(a) for a in args)
                plan = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE {name}({values})")
                await conn.execute(f"DEALLOCATE {name}")
                print(f"\n### {label}\n\n```sql\n{_short(sql)}\n```\n```")
                print("\n".join(row[0] for row in plan))
                print("```")
        await conn.close()
    await engine.close()


def _p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "ARRAY[" + ", ".join(_literal(v) for v in value) + "]::text[]"
    return "'" + str(value).replace("'", "''") + "'"


def _short(sql: str) -> str:
    return (
        sql.replace(sql[sql.index("SELECT") + 7 : sql.index(" FROM")], "…")
        if ("SELECT" in sql and " FROM" in sql and "count(*)" not in sql)
        else sql
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--reuse", action="store_true", help="keep the seeded schema")
    parser.add_argument("--no-explain", action="store_true")
    args = parser.parse_args()
    url = f"{BASE_URL}?schema={SCHEMA}"
    if not args.reuse:
        await seed(url, args.runs)
    await measure(url, args.repeat, not args.no_explain)


if __name__ == "__main__":
    asyncio.run(main())
