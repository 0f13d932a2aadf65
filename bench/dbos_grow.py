"""DBOS's side of "cost as work grows": its system tables seeded with N finished workflows.

    python dbos_grow.py --name bench_dbos_grown seed --runs 1000000 --k 5

As ``grow.py seed`` does for durably: DBOS runs one real throughput workflow (``dbos_side.py``'s
``bench_wf``, K trivial steps) as a template, then every row it left in a table keyed by
``workflow_uuid`` (``workflow_status``, ``operation_outputs`` — one per step —,
``workflow_input``, ``workflow_output``, whatever DBOS 3.x writes there) is copied N times with
``INSERT … SELECT … generate_series`` under new workflow ids, in DBOS's own database. The
columns are read from ``information_schema``, so the copy follows the installed DBOS's schema;
timestamps (epoch milliseconds) are spread back over ~23 days and every 20th workflow is
``ERROR``, as in durably's seed. Then ``VACUUM ANALYZE`` and ``CHECKPOINT``.

``dbos_side.py --name bench_dbos_grown --keep throughput|latency`` then measures on it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from importlib.metadata import version
from typing import Any

from common import emit, error_result, make_target, prepare_workdir, reset_target

SCHEMA = "dbos"
# epoch-millisecond columns moved back by the seeded workflow's age (g * STEP_MS)
TIME_COLUMNS = {
    "created_at",
    "updated_at",
    "completed_at",
    "started_at_epoch_ms",
    "completed_at_epoch_ms",
    "retention_timestamp",
}
STEP_MS = 2  # 1,000,000 workflows x 2 ms: ~23 days


def run_template(url: str, k: int) -> str:
    """Run one K-step workflow on a fresh DBOS database and return its workflow id."""
    import dbos_side
    from dbos import DBOS, DBOSConfig

    config: DBOSConfig = {
        "name": "durably-bench",
        "system_database_url": url,
        "log_level": "WARNING",
        "run_migrations": True,
    }
    DBOS(config=config)
    DBOS.launch()
    try:

        async def one() -> str:
            h = await DBOS.start_workflow_async(dbos_side.bench_wf, k)
            if await h.get_result() != k:
                raise RuntimeError("template workflow returned a wrong result")
            return h.get_workflow_id()

        return asyncio.run(one())
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=0)


async def copy_rows(url: str, template: str, runs: int) -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(url)
    copied: dict[str, int] = {}
    try:
        tables = [
            r["table_name"]
            for r in await conn.fetch(
                "SELECT table_name FROM information_schema.columns "
                "WHERE table_schema = $1 AND column_name = 'workflow_uuid' ORDER BY table_name",
                SCHEMA,
            )
        ]
        # workflow_status first: the others reference it
        tables.sort(key=lambda name: name != "workflow_status")
        for table in tables:
            cols = [
                r["column_name"]
                for r in await conn.fetch(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = $1 AND table_name = $2 AND is_generated = 'NEVER' "
                    "ORDER BY ordinal_position",
                    SCHEMA,
                    table,
                )
            ]
            n_template = await conn.fetchval(
                f'SELECT count(*) FROM {SCHEMA}."{table}" WHERE workflow_uuid = $1', template
            )
            if not n_template:
                continue
            exprs = []
            for c in cols:
                if c == "workflow_uuid":
                    exprs.append("'seed-' || lpad(g::text, 7, '0')")
                elif c in TIME_COLUMNS:
                    exprs.append(f'"{c}" - g::bigint * {STEP_MS}')
                elif table == "workflow_status" and c == "status":
                    exprs.append("CASE WHEN g % 20 = 0 THEN 'ERROR' ELSE status END")
                elif table in ("workflow_status", "workflow_output") and c == "error":
                    exprs.append("CASE WHEN g % 20 = 0 THEN 'seeded failure' ELSE error END")
                else:
                    exprs.append(f'"{c}"')
            col_list = ", ".join(f'"{c}"' for c in cols)
            for lo in range(1, runs + 1, 250_000):  # batches: bounded WAL per statement
                hi = min(runs, lo + 249_999)
                await conn.execute(
                    f'INSERT INTO {SCHEMA}."{table}" ({col_list}) '
                    f'SELECT {", ".join(exprs)} FROM {SCHEMA}."{table}" t, '
                    f"generate_series({lo}, {hi}) g WHERE t.workflow_uuid = $1",
                    template,
                )
            copied[table] = n_template * runs
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
        sizes = {
            r["relname"]: round(r["bytes"] / 2**20, 1)
            for r in await conn.fetch(
                "SELECT c.relname, pg_total_relation_size(c.oid) AS bytes FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = $1 AND c.relkind = 'r'",
                SCHEMA,
            )
            if r["relname"] in copied
        }
    finally:
        await conn.close()
    return {"rows": copied, "mib": sizes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--name", default="bench_dbos_grown")
    p.add_argument("--workdir", default=".work")
    p.add_argument("what", choices=["seed"])
    p.add_argument("--runs", type=int, default=1_000_000)
    p.add_argument("--k", type=int, default=5)
    args = p.parse_args()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    prepare_workdir(args.workdir)
    t = make_target("postgres", args.name, prepare_workdir(args.workdir))
    base: dict[str, Any] = {"side": "dbos", "version": version("dbos"), "scenario": "grow-seed"}
    try:
        t0 = time.perf_counter()
        asyncio.run(reset_target(t))
        template = run_template(t.url, args.k)
        res = asyncio.run(copy_rows(t.url, template, args.runs))
        emit({**base, "runs": args.runs, "seconds": round(time.perf_counter() - t0, 1), **res})
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
