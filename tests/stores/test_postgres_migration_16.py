"""Migration 16: the runs are vacuumed by their churn, indexes included.

Every status change of a run is a non-HOT update, so each version enters the
live-status partial indexes (pending, due, orphans) at their right end and
leaves a dead entry; only VACUUM's index pass frees a leaf page of them, and
until then every poll from the left end reads it. In a table of many finished
runs a plain VACUUM skipped that pass (under 2% of the heap pages held dead
rows), so the first test queues runs in a table of 100,000 finished ones,
finishes them, vacuums as autovacuum would, and counts the pages the pending
poll reads. The second upgrades a populated schema-15 database: the settings
are there, and schema 15's statements (an engine of the previous version
beside the new one) answer the same after the upgrade.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg
import pytest

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


async def _until_removable(conn: Any, xid: str) -> None:
    """Wait until no other transaction of the database could still see the
    rows transaction ``xid`` made dead (the tests of other processes share
    the server), so that VACUUM may remove them."""
    while await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL "
        "AND age(backend_xmin) >= age($1::text::xid8::text::xid)",
        xid,
    ):
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


SEED = _runs(1, 2_000, "completed") + "; " + _runs(2_001, 2_100, "pending")


async def _old_answers(conn: Any) -> dict[str, list[str]]:
    pending = [r["id"] for r in await conn.fetch(POLL, 1_000, None)]
    listing = await conn.fetch(
        "SELECT id FROM durably_runs WHERE workflow = $1 ORDER BY created_at DESC, id DESC "
        "LIMIT $2",
        "wf-1",
        10_000,
    )
    return {"pending": pending, "wf-1": [r["id"] for r in listing]}


@pytest.fixture
async def at_15(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> AsyncIterator[tuple[str, dict[str, list[str]]]]:
    """A store URL whose schema is at version 15 with 2,100 runs (100 queued),
    and schema 15's answers to its poll and listing statements."""
    async with isolated_postgres() as url:
        yield url, await seeded_at(url, 15, SEED, _old_answers)


async def test_an_upgraded_database_vacuums_the_runs_by_their_churn(
    at_15: tuple[str, dict[str, list[str]]],
) -> None:
    url, before = at_15
    assert len(MIGRATIONS) >= 16
    assert len(before["pending"]) == 100
    store = PostgresStore(url)
    await store.open()
    try:
        assert await store.list_pending(0, 1_000) == before["pending"]
    finally:
        await store.close()

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
