"""Migration 15: the workflow and parent listings ascend.

With ``created_at DESC`` a new run's entry went to the left end of its
workflow's (or parent's) range, so every full leaf split in half; ascending,
each new entry is the last of its range, and in the range that sorts last (the
newest parent's children, time-ordered ids; the last workflow name) it goes to
the rightmost leaf, which PostgreSQL fills. The first test counts the index's
pages against a freshly built copy. The
second upgrades a populated schema-14 database: every listing by workflow and
by parent (cursor pages too) answers what schema 14's statements answered, and
those statements (an engine of the previous version beside the new one) answer
the same after the upgrade: an index changes how a row is found, never which.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg
import pytest

from durably.stores import RunQuery
from durably.stores._postgres_schema import MIGRATIONS
from durably.stores.postgres import PostgresStore

from ._old_schema import read_upgraded, seeded_at

RUNS = 3_000

# Run i: one of 3 workflows, every 4th a child of one of 5 parents, created in
# pairs (ties on created_at), one row at a time in start order.
SEED = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, namespace, parent_id,
        tags, created_at, updated_at)
    SELECT 'run-' || lpad(i::text, 5, '0'), 'wf-' || (i % 3), '1', 'completed', 'default',
        CASE WHEN i % 4 = 0 THEN 'parent-' || (i % 5) END, '[]'::jsonb, i / 2, i
    FROM generate_series(1, {RUNS}) AS i
"""

# Schema 14's statements (the previous version's store), as it sent them.
OLD_BY_WORKFLOW = (
    "SELECT id FROM durably_runs WHERE workflow = $1 ORDER BY created_at DESC, id DESC LIMIT $2"
)
OLD_BY_PARENT = (
    "SELECT id FROM durably_runs WHERE parent_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2"
)
WORKFLOWS = ["wf-0", "wf-1", "wf-2"]
PARENTS = [f"parent-{i}" for i in range(5)]


async def _old_answers(conn: Any) -> dict[str, list[str]]:
    answers: dict[str, list[str]] = {}
    for wf in WORKFLOWS:
        answers[wf] = [r["id"] for r in await conn.fetch(OLD_BY_WORKFLOW, wf, 10_000)]
    for parent in PARENTS:
        answers[parent] = [r["id"] for r in await conn.fetch(OLD_BY_PARENT, parent, 10_000)]
    return answers


@pytest.mark.parametrize(
    ("column", "value", "leading"),
    [
        # a fan-out: the children of the newest parent (time-ordered ids sort last)
        ("parent_id", "'ffffffffffff' || repeat('0', 20)", "(parent_id, created_at"),
        # runs of the workflow whose name sorts last
        ("workflow", "'zz-last'", "(workflow, created_at"),
    ],
)
async def test_runs_started_in_order_fill_the_listing_of_the_last_range(
    postgres_store: PostgresStore, column: str, value: str, leading: str
) -> None:
    """20,000 runs inserted one at a time in start order into the range that
    sorts last leave its listing index no larger than a copy built afterwards
    over the same rows (leaves packed at 90%) plus a tenth: each new entry
    goes to the rightmost leaf, which splits leaving the left page full. With
    created_at DESC each went to the left end of the range and every split
    was 50/50 (~1.75 times the built copy)."""
    conn = await asyncpg.connect(postgres_store.url.split("?")[0])
    try:
        await conn.execute(f'SET search_path TO "{postgres_store.schema}"')
        await conn.execute(
            "INSERT INTO durably_runs (id, workflow, workflow_version, status, namespace, "
            "tags, created_at, updated_at) "
            "SELECT lpad(to_hex(i), 12, '0') || left(md5(i::text), 20), 'wf', '1', "
            "'completed', 'default', '[]'::jsonb, i, i FROM generate_series(1, 1000) AS i"
        )
        values = {"workflow": "'wf'", "parent_id": "NULL", column: value}
        await conn.execute(
            "INSERT INTO durably_runs (id, workflow, parent_id, workflow_version, status, "
            "namespace, tags, created_at, updated_at) "
            f"SELECT lpad(to_hex(i), 12, '0') || left(md5(i::text), 20), {values['workflow']}, "
            f"{values['parent_id']}, '1', 'completed', 'default', '[]'::jsonb, i, i "
            "FROM generate_series(1001, 21000) AS i"
        )
        live = await conn.fetchval(
            "SELECT i.indexrelid FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relname = 'durably_runs' "
            "AND pg_get_indexdef(i.indexrelid) LIKE '%' || $2 || '%'",
            postgres_store.schema,
            leading,
        )
        assert live is not None, f"no {leading} listing index"
        definition = await conn.fetchval("SELECT pg_get_indexdef($1::oid)", live)
        await conn.execute(f"CREATE INDEX fresh_copy ON {definition.split(' ON ', 1)[1]}")
        live_pages = await conn.fetchval("SELECT pg_relation_size($1::oid) / 8192", live)
        built_pages = await conn.fetchval("SELECT pg_relation_size('fresh_copy') / 8192")
    finally:
        await conn.close()
    assert live_pages <= 1.1 * built_pages, (definition, live_pages, built_pages)


@pytest.fixture
async def at_14(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> AsyncIterator[tuple[str, dict[str, list[str]]]]:
    """A store URL whose schema is at version 14 with RUNS runs, and schema
    14's answers to its listing statements."""
    async with isolated_postgres() as url:
        yield url, await seeded_at(url, 14, SEED, _old_answers)


async def test_an_upgraded_database_lists_by_workflow_and_parent_as_before(
    at_14: tuple[str, dict[str, list[str]]],
) -> None:
    url, before = at_14
    assert len(MIGRATIONS) >= 15
    store = PostgresStore(url)
    await store.open()
    try:
        for key in [*WORKFLOWS, *PARENTS]:
            field = "workflow" if key in WORKFLOWS else "parent_id"
            seen: list[str] = []
            cursor = None
            while True:
                page = await store.list_runs(RunQuery(**{field: key}, limit=97, cursor=cursor))
                seen += [r.run_id for r in page.runs]
                if page.next_cursor is None:
                    break
                cursor = page.next_cursor
            assert seen == before[key], key
            assert seen
    finally:
        await store.close()

    async def index_names(conn: Any) -> set[str]:
        sql = "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
        rows = await conn.fetch(sql)
        return {r["indexname"] for r in rows}

    names = await read_upgraded(url, index_names)
    assert {"durably_runs_workflow_created", "durably_runs_parent_created"} <= names
    assert not {"durably_runs_workflow", "durably_runs_parent"} & names
    # The previous version's statements, still running beside this one, answer the same.
    assert await read_upgraded(url, _old_answers) == before
