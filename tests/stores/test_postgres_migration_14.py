"""Migration 14 on a populated database, and a rolling deploy across it.

A database at schema 13 holding runs in every status, several workflows and
namespaces, and ties on ``created_at`` is opened by this version (migration
14: the indexes change, no row does). Every listing, count and sweep answers
what the same statements of schema 13's store answered before the upgrade,
and those older statements (an engine of the previous version still running
beside the new one) keep answering the same after it: an index changes how a
row is found, never which rows match.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from durably.model import RunStatus
from durably.stores import RunQuery
from durably.stores._postgres_schema import MIGRATIONS
from durably.stores.postgres import PostgresStore

from ._old_schema import read_upgraded, seeded_at

RUNS = 3_000
STATUSES = [s.value for s in RunStatus]

# Run i: status by i, one of 3 workflows and 2 namespaces, created in pairs (ties).
SEED = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, namespace, wake_at,
        locked_by, locked_until, priority, tags, created_at, updated_at)
    SELECT 'run-' || lpad(i::text, 5, '0'), 'wf-' || (i % 3), '1',
        (ARRAY{STATUSES})[1 + (i * 7) % {len(STATUSES)}],
        CASE WHEN i % 2 = 0 THEN 'default' ELSE 'other' END,
        i, CASE WHEN i % 5 = 0 THEN 'w' END, i, i % 3, '[]'::jsonb, i / 2, 10 * i
    FROM generate_series(1, {RUNS}) AS i
"""

# Schema 13's statements (the previous version's store), as it sent them.
OLD_LIST_BY_STATUS = (
    "SELECT id FROM durably_runs WHERE status = $1 ORDER BY created_at DESC, id DESC LIMIT $2"
)
OLD_COUNT = "SELECT count(*) FROM (SELECT 1 FROM durably_runs WHERE status = $1 LIMIT $2) AS h"
OLD_RETENTION = (
    "SELECT id FROM durably_runs WHERE status = ANY($1::text[]) AND updated_at < $2 "
    "AND ($4::text IS NULL OR namespace = $4) ORDER BY updated_at, id LIMIT $3"
)
OLD_LIVE_OF_WORKFLOW = (
    "SELECT id FROM durably_runs WHERE workflow = $1 AND status = ANY($2::text[]) "
    "ORDER BY created_at DESC, id DESC LIMIT $3"
)
TERMINAL = ["cancelled", "completed", "dead", "failed"]
LIVE = ["pending", "running", "suspended"]


async def _old_answers(conn: Any) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    for status in STATUSES:
        rows = await conn.fetch(OLD_LIST_BY_STATUS, status, 10_000)
        answers[f"list {status}"] = [r["id"] for r in rows]
        answers[f"count {status}"] = await conn.fetchval(OLD_COUNT, status, 10_000)
    for ns in (None, "other"):
        rows = await conn.fetch(OLD_RETENTION, TERMINAL, 10 * 2_000, 10_000, ns)
        answers[f"retention {ns}"] = [r["id"] for r in rows]
    rows = await conn.fetch(OLD_LIVE_OF_WORKFLOW, "wf-1", LIVE, 10_000)
    answers["live of wf-1"] = [r["id"] for r in rows]
    return answers


@pytest.fixture
async def at_13(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A store URL whose schema is at version 13 with RUNS runs, and schema
    13's answers to its statements."""
    async with isolated_postgres() as url:
        yield url, await seeded_at(url, 13, SEED, _old_answers)


async def test_an_upgraded_database_answers_as_before(at_13: tuple[str, dict[str, Any]]) -> None:
    url, before = at_13
    assert len(MIGRATIONS) >= 14
    store = PostgresStore(url)
    await store.open()
    try:
        for status in RunStatus:
            page = await store.list_runs(RunQuery(status=status, limit=1000))
            assert [r.run_id for r in page.runs] == before[f"list {status.value}"][:1000]
        # paging through one status with the cursor gives the same order
        seen: list[str] = []
        cursor = None
        while True:
            page = await store.list_runs(
                RunQuery(status=RunStatus.COMPLETED, limit=100, cursor=cursor)
            )
            seen += [r.run_id for r in page.runs]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == before["list completed"]
        counts = await store.count_runs(RunQuery(), 10_000)
        assert counts == {s: before[f"count {s}"] for s in STATUSES if before[f"count {s}"]}
        for ns in (None, "other"):
            found = await store.list_finished_before(10 * 2_000, 10_000, namespace=ns)
            assert found == before[f"retention {ns}"]
        live = tuple(RunStatus(s) for s in LIVE)
        page = await store.list_runs(RunQuery(statuses=live, workflow="wf-1", limit=1000))
        assert [r.run_id for r in page.runs] == before["live of wf-1"]
    finally:
        await store.close()

    # The previous version's statements, still running beside this one, answer the same.
    assert await read_upgraded(url, _old_answers) == before
