"""What the one-step run's two statements cost the server, per index set.

Runs a few one-step workflows through the engine on a fresh schema and records the two
statements a run sends (the leased insert, the final result + settle) with their arguments;
then replays them, with fresh run ids, on two fresh schemas: ``before`` (migrations 1-11) and
``after`` (every migration), interleaved run by run on one connection each. Prints per
statement: client time (round trip + commit, median), and from ``EXPLAIN (ANALYZE, BUFFERS,
WAL)``: server execution time, WAL records and WAL bytes (one heap tuple plus one record per
index entry written).

    .venv/bin/python bench/writes.py [--count 2000] [--explain 200] [--floor] [--waiters]

``--floor`` also times floor.py's one-commit insert on the same connections (the floor under
the same load); ``--waiters`` also replays the final statement that clears the waiter tables
(``_FINAL``) on runs of their own, beside the one a first turn that waited on nothing sends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(
    0, os.environ.get("DURABLY_SRC") or str(Path(__file__).resolve().parents[1] / "src")
)

import asyncpg
import asyncpg.connection

import durably
from durably.stores import _pg_batch, _postgres_schema, postgres

BASE = "postgresql://postgres@127.0.0.1:5432/test"
CAPTURED: dict[str, list[Any]] = {}
BARE = """
DO $$ DECLARE i text; BEGIN
  FOR i IN SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()
    AND tablename = 'durably_runs' AND indexname <> 'durably_runs_pkey' LOOP
    EXECUTE format('DROP INDEX %I', i);
  END LOOP;
END $$;
"""

# floor.py's statement: one 2-column row inserted, one commit
FLOOR_TABLE = "CREATE TABLE floor_t (id BIGSERIAL PRIMARY KEY, run_id TEXT, v TEXT)"
FLOOR_INSERT = "INSERT INTO floor_t (run_id, v) VALUES ($1, $2)"
FLOOR_PAYLOAD = json.dumps({"output": 42, "name": "s0", "status": "completed", "pad": "x" * 64})


def capture() -> None:
    real = asyncpg.connection.Connection.fetchval
    wanted = {postgres._INSERT_RUN: "insert", _pg_batch._FINAL: "final"}
    # A first turn that waited on nothing sends the variant without the waiter tables.
    no_waiters = getattr(_pg_batch, "_FINAL_NO_WAITERS", None)
    if no_waiters is not None:
        wanted[no_waiters] = "final"

    async def fetchval(self: Any, query: str, *args: Any, **kw: Any) -> Any:
        if query in wanted:
            CAPTURED[wanted[query]] = [query, list(args)]
        return await real(self, query, *args, **kw)

    asyncpg.connection.Connection.fetchval = fetchval  # type: ignore[method-assign]


async def record() -> None:
    schema = f"durably_writes_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(BASE)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        engine = durably.Engine(store=f"{BASE}?schema={schema}")

        async def trivial(x: int) -> int:
            return x

        @engine.workflow("one_step", version="1")
        async def one_step(ctx: Any, x: int) -> int:
            out: int = await ctx.local_step("s0", trivial, x)
            return out

        async with engine:
            for i in range(5):
                run = await engine.start("one_step", i)
                await engine.wait_for_run(run.run_id, terminal=True, timeout=10)
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.close()


def with_id(args: list[Any], old: str, new: str) -> list[Any]:
    return [new if a == old else a for a in args]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--explain", type=int, default=200)
    p.add_argument("--bare", action="store_true", help="also a schema without secondary indexes")
    p.add_argument("--extra", default="", help="SQL of a candidate, run after the migrations")
    p.add_argument("--plan", action="store_true", help="print one plan of each statement")
    p.add_argument(
        "--waiters",
        action="store_true",
        help="also time the final statement that clears waiter tables (_FINAL), on other runs",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time floor.py's statement (a 2-column row, one commit) on the same connections",
    )
    a = p.parse_args()
    capture()
    await record()
    ins_q, ins_args = CAPTURED["insert"]
    fin_q, fin_args = CAPTURED["final"]
    old = ins_args[0]
    # Each run replays one of these statement lists (a fresh id each).
    runs = [[("insert", ins_q, ins_args), ("final", fin_q, fin_args)]]
    if a.waiters:
        runs.append([("insert", ins_q, ins_args), ("final_waiters", _pg_batch._FINAL, fin_args)])
    variants = {"before": _postgres_schema.MIGRATIONS[:11], "after": _postgres_schema.MIGRATIONS}
    if a.bare:  # the bound of the index lever: durably_runs with its primary key alone
        variants["bare"] = [*_postgres_schema.MIGRATIONS, BARE]
    if a.extra:  # a candidate index change on top of every migration
        variants["extra"] = [*_postgres_schema.MIGRATIONS, a.extra]
    conns: dict[str, asyncpg.Connection] = {}
    schemas = {v: f"durably_writes_{v}_{uuid.uuid4().hex[:8]}" for v in variants}
    admin = await asyncpg.connect(BASE)
    try:
        for v, migs in variants.items():
            await admin.execute(f'CREATE SCHEMA "{schemas[v]}"')
            c = await asyncpg.connect(BASE, server_settings={"search_path": f'"{schemas[v]}"'})
            for m in migs:
                await c.execute(m)
            if a.floor:
                await c.execute(FLOOR_TABLE)
            conns[v] = c
        times: dict[tuple[str, str], list[float]] = {}
        for i in range(a.count):
            for v in variants if i % 2 else reversed(list(variants)):
                for statements in runs if i % 2 else reversed(runs):
                    rid = f"{v}-{i}-{uuid.uuid4().hex[:8]}"
                    for name, q, args in statements:
                        t0 = time.perf_counter()
                        await conns[v].fetchval(q, *with_id(args, old, rid))
                        times.setdefault((v, name), []).append(time.perf_counter() - t0)
                if a.floor:
                    t0 = time.perf_counter()
                    await conns[v].execute(FLOOR_INSERT, rid, FLOOR_PAYLOAD)
                    times.setdefault((v, "floor"), []).append(time.perf_counter() - t0)
        plans: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for i in range(a.explain):
            for v in variants:
                for statements in runs:
                    rid = f"x{v}-{i}-{uuid.uuid4().hex[:8]}"
                    for name, q, args in statements:
                        raw = await conns[v].fetchval(
                            "EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + q,
                            *with_id(args, old, rid),
                        )
                        plans.setdefault((v, name), []).append(json.loads(raw)[0])
        if a.plan:
            for key, ps in plans.items():
                print(key, json.dumps(ps[-1], indent=1))
        indexes = {
            v: await conns[v].fetch(
                "SELECT indexname FROM pg_indexes "
                "WHERE schemaname = $1 AND tablename = 'durably_runs'",
                schemas[v],
            )
            for v in variants
        }
        for v in variants:
            print(f"{v}: {len(indexes[v])} indexes on durably_runs")
            if a.floor:
                ts = times[(v, "floor")]
                print(
                    f"  floor  client p50 {statistics.median(ts) * 1e3:.3f} ms"
                    f" (mean {statistics.fmean(ts) * 1e3:.3f}); floor.py's one-commit insert"
                )
            for name in ("insert", "final", "final_waiters"):
                if (v, name) not in times:
                    continue
                ts = times[(v, name)]
                ps = plans[(v, name)]
                wal_rec = statistics.median(pl["Plan"].get("WAL Records", 0) for pl in ps)
                wal_b = statistics.median(pl["Plan"].get("WAL Bytes", 0) for pl in ps)
                ex = statistics.median(pl["Execution Time"] for pl in ps)
                print(
                    f"  {name:6s} client p50 {statistics.median(ts) * 1e3:.3f} ms"
                    f" (mean {statistics.fmean(ts) * 1e3:.3f}); server exec p50 {ex:.3f} ms;"
                    f" WAL {wal_rec:.0f} records, {wal_b:.0f} bytes"
                )
    finally:
        for v, c in conns.items():
            await c.close()
            await admin.execute(f'DROP SCHEMA IF EXISTS "{schemas[v]}" CASCADE')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
