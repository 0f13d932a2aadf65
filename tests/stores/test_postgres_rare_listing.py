"""Listing the runs of a rare workflow or namespace reads those runs, not the table.

Under the generic plan (what a long-lived pool keeps) ``workflow = $1`` is
estimated at the table's average share per workflow: with one workflow
holding nearly every run, a page of a workflow with a handful of runs was
planned as a backward walk of the creation-order index with a filter, which
read every newer run of the other workflow first (all 1,000,000 of them in
``bench/grow-explain.md``, where the statistics had not seen the rare
workflow yet). Counted, not timed: 20,000 runs of ``bulk``, analyzed, then 20
older runs of ``rare`` the statistics have not seen; each listing must look
at no more rows than its page holds (plus a few).
"""

from __future__ import annotations

import pytest

from durably.stores import RunQuery
from durably.stores.postgres import PostgresStore

from ._explained import GENERIC, Call, calls_astray, capture_plans, seed_unseen

BULK = 20_000
RARE = 20

# Newer than every rare run: a walk of the creation order meets them all first.
SEED = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, namespace, status, tags,
        created_at, updated_at)
    SELECT 'bulk-' || lpad(i::text, 6, '0'), 'bulk', '1', 'main', 'completed', '[]'::jsonb,
        1000 + i, 1000 + i
    FROM generate_series(1, {BULK}) AS i
"""
# Unseen by the statistics (a workflow deployed since the last ANALYZE): the
# generic plan then takes ``workflow = $1`` for every run.
RARE_SQL = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, namespace, status, tags,
        created_at, updated_at)
    SELECT 'rare-' || lpad(i::text, 4, '0'), 'rare', '1', 'side', 'completed', '[]'::jsonb,
        i, i
    FROM generate_series(1, {RARE}) AS i
"""


async def test_a_rare_workflow_or_namespace_is_listed_from_its_own_index(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = capture_plans(monkeypatch)
    await seed_unseen(postgres_url, SEED, RARE_SQL)

    store = PostgresStore(postgres_url, server_settings=GENERIC)
    await store.open()
    calls: list[Call] = [
        (
            "list_runs of a rare workflow",
            lambda: store.list_runs(RunQuery(workflow="rare", limit=50)),
            RARE,
        ),
        (
            "list_runs of a rare namespace",
            lambda: store.list_runs(RunQuery(namespace="side", limit=50)),
            RARE,
        ),
        (
            "list_runs of the common workflow, a page",
            lambda: store.list_runs(RunQuery(workflow="bulk", limit=50)),
            51,
        ),
    ]
    try:
        # Five calls each: a prepared statement's plan turns generic after five.
        for _ in range(5):
            for _, call, _ in calls:
                await call()
        astray, answers = await calls_astray(plans, calls)
    finally:
        await store.close()
    assert not astray, "\n".join(astray)
    rare = answers["list_runs of a rare workflow"]
    assert [r.run_id for r in rare.runs] == [f"rare-{i:04d}" for i in range(RARE, 0, -1)]  # type: ignore[attr-defined]
