"""The worker's polls on PostgreSQL never start parallel workers: each reads a
page through an index, and under the generic plan the pool uses the planner
cannot tell a page from a third of the table. Seen at 1,000,000 runs
(bench/grow-explain.md): the deadline sweep found no row in its index, yet
launched two parallel workers to read it and took 8 ms a tick instead of 0.1."""

from __future__ import annotations

import json

import asyncpg

from durably.stores.postgres import LIST_EXPIRED, PostgresStore

RUNS = 100_000

# Finished runs with a deadline long past, and a few live ones past theirs.
SEED = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, deadline_at, input,
        output, tags, created_at, updated_at)
    SELECT 'run-' || lpad(i::text, 7, '0'), 'order', '1',
        CASE WHEN i % 10000 = 0 THEN 'running' ELSE 'completed' END, i,
        repeat('x', 100), repeat('y', 100), '[]'::jsonb, i, i
    FROM generate_series(1, {RUNS}) AS i
"""


def _node_types(plan: dict[str, object]) -> list[str]:
    found = [str(plan.get("Node Type"))]
    for child in plan.get("Plans", []):  # type: ignore[attr-defined]
        found.extend(_node_types(child))
    return found


async def test_the_deadline_sweep_starts_no_parallel_workers(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    await store.open()
    admin = await asyncpg.connect(postgres_url.split("?")[0])
    try:
        await admin.execute(f'SET search_path TO "{store.schema}"')
        await admin.execute(SEED)
        await admin.execute("ANALYZE durably_runs")
        # the plan a pooled connection of the store makes (its settings, its generic plan)
        # with parallel work priced as at 1,000,000 runs, where the planner chose it with the
        # server's default costs (seeding a million rows here would take the suite too long)
        async with store._db.connection() as conn:  # pyright: ignore[reportPrivateUsage]
            tx = conn.transaction()
            await tx.start()
            try:
                for setting in (
                    "parallel_setup_cost",
                    "parallel_tuple_cost",
                    "min_parallel_table_scan_size",
                    "min_parallel_index_scan_size",
                ):
                    await conn.execute(f"SET LOCAL {setting} = 0")
                await conn.execute(f"PREPARE expired AS {LIST_EXPIRED}")
                explained = await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) EXECUTE expired("
                    f"{RUNS + 1}, '{{completed,failed,cancelled,dead}}', 100, NULL)"
                )
                await conn.execute("DEALLOCATE expired")
            finally:
                await tx.rollback()
        nodes = _node_types(json.loads(explained)[0]["Plan"])
        assert not any("Gather" in n or "Parallel" in n for n in nodes), nodes
        expired = await store.list_expired(RUNS + 1, 100)
        assert expired == [f"run-{i:07d}" for i in range(10_000, RUNS + 1, 10_000)]
    finally:
        await admin.close()
        await store.close()
