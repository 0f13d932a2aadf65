"""Migration 16: completed runs at the right end of their own index; the runs
vacuumed by their churn, indexes included.

Completed runs had the middle of ``durably_runs_finished (status, ...)``
('completed' sorts before 'dead' and 'failed'): once a run had failed, every
run completing descended the tree and split its leaves 50/50. In their own
index, in start order, a run completing enters the rightmost leaf, which
PostgreSQL fills; the first test counts that index's pages against a copy
built afterwards.

Every status change of a run is a non-HOT update, so each version enters the
live-status partial indexes (pending, due, orphans) at their right end and
leaves a dead entry; only VACUUM's index pass frees a leaf page of them, and
until then every poll from the left end reads it. In a table of many finished
runs a plain VACUUM skipped that pass (under 2% of the heap pages held dead
rows), so the second test queues runs in a table of 100,000 finished ones,
finishes them, vacuums as autovacuum would, and counts the pages the pending
poll reads. The last upgrades a populated schema-15 database: the indexes
and settings are there, listings and counts by status answer as before, and
schema 15's statements (an engine of the previous version beside the new one)
answer the same after the upgrade.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg
import pytest

from durably.stores import RunQuery
from durably.stores._postgres_schema import MIGRATIONS
from durably.stores.postgres import PostgresStore

from ._old_schema import read_upgraded, seeded_at

FINISHED = 100_000
QUEUED = 600

# the pending poll as schema 15's store sends it (list_pending)
POLL = (
    "SELECT id FROM durably_runs WHERE (status = 'pending') IS NOT FALSE "
    "AND ($2::text IS NULL OR namespace = $2) "
    "ORDER BY priority DESC, created_at, id LIMIT $1"
)


def _runs(first: int, last: int, status: str) -> str:
    return (
        "INSERT INTO durably_runs (id, workflow, workflow_version, status, namespace, "
        "tags, created_at, updated_at) "
        "SELECT lpad(to_hex(i), 12, '0') || left(md5(i::text), 20), 'wf-' || (i % 3), '1', "
        f"'{status}', 'default', '[]'::jsonb, i, i FROM generate_series({first}, {last}) AS i"
    )


async def _poll_pages(conn: Any) -> int:
    """Shared buffers (hit + read) the pending poll's executed plan touched."""
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    plan = await conn.fetchval(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + POLL.replace("$2", "NULL::text"), 10
    )
    top = json.loads(plan)[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


async def test_runs_completing_in_start_order_fill_the_completed_runs_index(
    postgres_store: PostgresStore,
) -> None:
    """20,000 runs completing one at a time in start order, among runs of
    every finished status, leave the index the completed runs are found
    through no larger than a copy built afterwards over the same rows (leaves
    packed at 90%) plus a tenth. In durably_runs_finished they went to the
    middle of the tree ('dead' and 'failed' sort after 'completed') and every
    split was 50/50 (~1.75 times the built copy)."""
    conn = await asyncpg.connect(postgres_store.url.split("?")[0])
    try:
        await conn.execute(f'SET search_path TO "{postgres_store.schema}"')
        for k, status in enumerate(("cancelled", "dead", "failed")):
            await conn.execute(_runs(300 * k + 1, 300 * k + 300, status))
        for i in range(901, 20_901, 500):
            # one statement per run (each enters the index on its own), 500 per round trip
            await conn.execute("; ".join(_runs(j, j, "completed") for j in range(i, i + 500)))
        live = await conn.fetchval(
            "SELECT i.indexrelid FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relname = 'durably_runs' "
            "AND pg_get_indexdef(i.indexrelid) LIKE '%(status%created_at%' "
            "AND pg_get_indexdef(i.indexrelid) LIKE '%completed%' "
            "UNION ALL SELECT to_regclass('durably_runs_completed')::oid "
            "WHERE to_regclass('durably_runs_completed') IS NOT NULL",
            postgres_store.schema,
        )
        assert live is not None, "no index finds the completed runs"
        definition = await conn.fetchval("SELECT pg_get_indexdef($1::oid)", live)
        await conn.execute(f"CREATE INDEX fresh_copy ON {definition.split(' ON ', 1)[1]}")
        live_pages = await conn.fetchval("SELECT pg_relation_size($1::oid) / 8192", live)
        built_pages = await conn.fetchval("SELECT pg_relation_size('fresh_copy') / 8192")
    finally:
        await conn.close()
    assert live_pages <= 1.1 * built_pages, (definition, live_pages, built_pages)


async def _until_removable(conn: Any, xid: str) -> None:
    """Wait until no other transaction of the database could still see the
    rows transaction ``xid`` made dead (the tests of other processes share
    the server), so that VACUUM may remove them."""
    while True:
        older = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND greatest(age(backend_xmin), age(backend_xid)) "
            ">= age($1::text::xid8::text::xid)",
            xid,
        )
        if not older:
            return
        await asyncio.sleep(0.05)


async def test_a_vacuum_frees_the_pending_polls_dead_entries_in_a_large_table(
    postgres_store: PostgresStore,
) -> None:
    """600 runs queued and finished among 100,000 finished runs leave ~6 leaf
    pages of dead entries at the left end of the pending index. After a
    plain VACUUM (what autovacuum runs) the poll of an empty queue reads the
    index's root leaf only: without vacuum_index_cleanup = on, VACUUM skipped
    the index pass (the dead rows sit on well under 2% of the heap's pages)
    and the poll read every one of those pages."""
    conn = await asyncpg.connect(postgres_store.url.split("?")[0])
    try:
        await conn.execute(f'SET search_path TO "{postgres_store.schema}"')
        await conn.execute(_runs(1, FINISHED, "completed"))
        await conn.execute(_runs(FINISHED + 1, FINISHED + QUEUED, "pending"))
        await conn.execute("ANALYZE durably_runs")
        assert len(await conn.fetch(POLL, QUEUED + 1, None)) == QUEUED
        async with conn.transaction():
            await conn.execute(
                "UPDATE durably_runs SET status = 'completed' "
                "WHERE (status = 'pending') IS NOT FALSE"
            )
            xid = await conn.fetchval("SELECT pg_current_xact_id()::text")
        dirty = await _poll_pages(conn)
        await _until_removable(conn, xid)
        await conn.execute("VACUUM durably_runs")
        clean = await _poll_pages(conn)
        assert await conn.fetch(POLL, 10, None) == []
    finally:
        await conn.close()
    assert dirty >= 5, dirty  # the dead entries the test is about are there
    assert clean <= 2, (dirty, clean)


# 2,000 finished runs (every 7th failed, every 11th cancelled, every 13th dead;
# ties on created_at in pairs), then 100 queued
SEED = (
    _runs(1, 2_000, "completed").replace(", i, i FROM", ", i / 2, i FROM")
    + "; UPDATE durably_runs SET status = CASE WHEN created_at % 7 = 0 THEN 'failed' "
    "WHEN created_at % 11 = 0 THEN 'cancelled' WHEN created_at % 13 = 0 THEN 'dead' "
    "ELSE status END; " + _runs(2_001, 2_100, "pending")
)
FINISHED_STATUSES = ("completed", "failed", "cancelled", "dead")

# Schema 15's statements (the previous version's store) listing by status, as it sent them.
OLD_BY_STATUS = (
    "SELECT id FROM durably_runs WHERE status = '{status}' ORDER BY created_at DESC, id DESC "
    "LIMIT $1"
)
OLD_COUNT = (
    "SELECT count(*) FROM (SELECT 1 FROM durably_runs WHERE status = '{status}' "
    "AND workflow = $2 LIMIT $1) AS hits"
)


async def _old_answers(conn: Any) -> dict[str, Any]:
    answers: dict[str, Any] = {"pending": [r["id"] for r in await conn.fetch(POLL, 1_000, None)]}
    listing = await conn.fetch(
        "SELECT id FROM durably_runs WHERE workflow = $1 ORDER BY created_at DESC, id DESC "
        "LIMIT $2",
        "wf-1",
        10_000,
    )
    answers["wf-1"] = [r["id"] for r in listing]
    for status in FINISHED_STATUSES:
        sql = OLD_BY_STATUS.format(status=status)
        answers[status] = [r["id"] for r in await conn.fetch(sql, 10_000)]
        answers[f"count {status}"] = await conn.fetchval(
            OLD_COUNT.format(status=status), 10_000, "wf-1"
        )
    return answers


@pytest.fixture
async def at_15(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A store URL whose schema is at version 15 with 2,100 runs (100 queued),
    and schema 15's answers to its poll, listing and counting statements."""
    async with isolated_postgres() as url:
        yield url, await seeded_at(url, 15, SEED, _old_answers)


async def test_an_upgraded_database_answers_as_before_and_is_vacuumed_by_churn(
    at_15: tuple[str, dict[str, Any]],
) -> None:
    url, before = at_15
    assert len(MIGRATIONS) >= 16
    assert len(before["pending"]) == 100
    assert all(before[status] for status in FINISHED_STATUSES)
    store = PostgresStore(url)
    await store.open()
    try:
        assert await store.list_pending(0, 1_000) == before["pending"]
        for status in FINISHED_STATUSES:
            seen: list[str] = []
            cursor = None
            while True:
                page = await store.list_runs(RunQuery(status=status, limit=97, cursor=cursor))
                seen += [r.run_id for r in page.runs]
                if page.next_cursor is None:
                    break
                cursor = page.next_cursor
            assert seen == before[status], status
        counts = await store.count_runs(RunQuery(workflow="wf-1"), 10_000)
        assert {st: counts.get(st, 0) for st in FINISHED_STATUSES} == {
            st: before[f"count {st}"] for st in FINISHED_STATUSES
        }
    finally:
        await store.close()

    async def index_names(conn: Any) -> set[str]:
        sql = "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
        return {r["indexname"] for r in await conn.fetch(sql)}

    names = await read_upgraded(url, index_names)
    assert {"durably_runs_completed", "durably_runs_unsuccessful"} <= names
    assert "durably_runs_finished" not in names

    async def options(conn: Any) -> list[str]:
        return list(
            await conn.fetchval(
                "SELECT reloptions FROM pg_class WHERE oid = 'durably_runs'::regclass"
            )
            or []
        )

    assert sorted(await read_upgraded(url, options)) == [
        "autovacuum_vacuum_scale_factor=0.02",
        "vacuum_index_cleanup=on",
    ]
    # The previous version's statements, still running beside this one, answer the same.
    assert await read_upgraded(url, _old_answers) == before
