"""Listing, counting and sweeping live runs costs what the live runs cost,
however many runs have finished (migration 14).

Since migration 14 no index over every run leads with ``status``: finished
runs are found through indexes holding finished runs alone, live ones through
their own partial indexes (pending, due, orphans, blocked), and ``list_runs``
and ``count_runs`` write each status in the form its index matches
(``_pg_sql.status_match``). Before it, ``list_runs(statuses=<live>,
workflow=...)`` — how a singleton with ``max_queue`` counts its live runs —
walked the workflow's whole listing index under the generic plan: every
finished run of the workflow looked at (100,000 here) to find 400 live ones.

Counted, not timed: 100,000 finished runs analyzed, then 100 runs in each
live status that the statistics have not seen, older than the finished ones.
Each call runs through the store with ``auto_explain`` under the generic plan
(``count_runs`` asks for custom plans itself), and must look at no more rows
of ``durably_runs`` than the live runs it is about (or its cap) plus a few.
"""

from __future__ import annotations

import asyncpg
import pytest

from durably.model import RunStatus
from durably.stores import RunQuery
from durably.stores.postgres import PostgresStore

from ._explained import GENERIC, Call, calls_astray, capture_plans, seed_unseen

FINISHED = 100_000
EACH = 100
LIVE = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.BLOCKED)
NOW = 10_000_000

# Finished runs created 1_000_001.. (newer than every live run); every 10th failed.
SEED = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, tags, created_at,
        updated_at)
    SELECT 'old-' || lpad(i::text, 6, '0'), 'order', '1',
        CASE WHEN i % 10 = 0 THEN 'failed' ELSE 'completed' END, '[]'::jsonb,
        1000000 + i, 1000000 + i
    FROM generate_series(1, {FINISHED}) AS i
"""
# Live runs, created before every finished run, in each live status.
LIVE_SQL = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, wake_at, locked_by,
        locked_until, tags, created_at, updated_at)
    SELECT 'live-' || lpad(i::text, 4, '0'), 'order', '1', s.status,
        CASE WHEN s.status = 'suspended' THEN {NOW} + i END,
        CASE WHEN s.status = 'running' THEN 'w' END,
        CASE WHEN s.status = 'running' THEN {NOW} + i END, '[]'::jsonb, i, i
    FROM unnest(ARRAY[{", ".join(f"'{s.value}'" for s in LIVE)}]) WITH ORDINALITY AS s(status, k),
        generate_series(s.k * 1000, s.k * 1000 + {EACH} - 1) AS i
"""
CAP = 500


async def test_live_runs_are_listed_and_counted_without_reading_finished_ones(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = capture_plans(monkeypatch)
    await seed_unseen(postgres_url, SEED, LIVE_SQL)

    store = PostgresStore(postgres_url, server_settings=GENERIC)
    await store.open()
    live3 = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED)
    calls: list[Call] = [
        *(
            (
                f"list_runs status={st.value}",
                lambda st=st: store.list_runs(RunQuery(status=st, limit=1000)),
                EACH,
            )
            for st in LIVE
        ),
        (
            "list_runs live statuses of a workflow (count_live)",
            lambda: store.list_runs(RunQuery(statuses=live3, workflow="order", limit=1000)),
            3 * EACH,
        ),
        (
            "list_runs failed, newest page",
            lambda: store.list_runs(RunQuery(status=RunStatus.FAILED, limit=50)),
            51,
        ),
        # One probe per status, each stopping at the cap: a live status reads
        # its partial index; a finished one may read the table from the start
        # until CAP rows match (failed: one run in ten, so 10 * CAP), never all.
        ("count_runs", lambda: store.count_runs(RunQuery(), CAP), 4 * EACH + 12 * CAP),
        (
            "count_runs of a workflow",
            lambda: store.count_runs(RunQuery(workflow="order"), CAP),
            4 * EACH + 12 * CAP,
        ),
        ("list_stalled", lambda: store.list_stalled(NOW, 50), 2 * EACH),
        # oldest change first: the live runs changed before the bound are looked at too
        (
            "list_finished_before",
            lambda: store.list_finished_before(1_000_011, 50),
            10 + 4 * EACH,
        ),
    ]
    try:
        astray, answers = await calls_astray(plans, calls)
    finally:
        await store.close()
    assert not astray, "\n".join(astray)
    counts = answers["count_runs"]
    assert counts == {
        **{st.value: EACH for st in LIVE},
        "completed": CAP,
        "failed": CAP,
    }, counts


async def test_every_index_over_every_run_is_one_a_live_run_needs(
    postgres_store: PostgresStore,
) -> None:
    """Every version of a run enters each index without a predicate (a status
    change is never a HOT update); since migration 14 those are the key, the id
    prefix, the listing orders and the change feed, and none leads with status.
    The status-led indexes hold finished runs only."""
    conn = await asyncpg.connect(postgres_store.url.split("?")[0])
    try:
        rows = await conn.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1 "
            "AND tablename = 'durably_runs'",
            postgres_store.schema,
        )
    finally:
        await conn.close()
    full = {r["indexname"] for r in rows if " WHERE " not in r["indexdef"]}
    assert full == {
        "durably_runs_pkey",
        "durably_runs_id_prefix",
        "durably_runs_created",
        "durably_runs_namespace_created",
        "durably_runs_workflow_created",
        "durably_runs_updated_at",
    }, sorted(full)
    # the finished statuses but 'completed', which has its own index (migration 16)
    finished = "WHERE (status = ANY (ARRAY['cancelled'::text, 'dead'::text, 'failed'::text]))"
    status_led = [r for r in rows if "USING btree (status" in r["indexdef"]]
    assert status_led, "the finished runs' status index is missing"
    assert all(finished in r["indexdef"] for r in status_led), status_led
    completed = [r["indexdef"] for r in rows if r["indexname"] == "durably_runs_completed"]
    assert completed and completed[0].endswith("WHERE (status = 'completed'::text)"), completed


def test_status_match_writes_each_status_as_its_index_matches() -> None:
    """A finished or blocked status as a literal, a polled one in the polls'
    form, several as one OR; anything else is refused (it becomes SQL)."""
    from durably.stores._pg_sql import POLL_PENDING, POLL_RUNNING, status_match

    assert status_match(["failed"]) == "status = 'failed'"
    assert status_match(["blocked"]) == "status = 'blocked'"
    assert status_match(["pending"]) == POLL_PENDING
    assert status_match(["pending", "running", "pending"]) == f"({POLL_PENDING} OR {POLL_RUNNING})"
    assert status_match([]) == "false"
    with pytest.raises(ValueError, match="not a run status"):
        status_match(["failed' OR true --"])
