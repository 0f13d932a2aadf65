"""The engine's polls walk their own partial indexes, whatever the statistics
say about the runs they look for.

A burst puts thousands of runs to sleep between two ``ANALYZE``: the
statistics still say no run is ``suspended`` (with 1,000,000 finished runs the
sample never sees one), so under the generic plan the store's pool uses, a
poll's ``status = 'suspended'`` looks like one row and any index led by
``status`` looks as cheap as the poll's partial index. The planner took the
generic ``durably_runs_updated (status, updated_at)``: one ``list_due`` read
every sleeping run (20,000, 437 pages) and sorted them to return none
(bench/RESULTS.md, "Flat at 1,000,000 runs, counted").

Counted here, not timed: 100,000 finished runs analyzed, then 20,000 runs
asleep (half due, half later) that the statistics have not seen. Each poll
that filters on status runs through the store with ``auto_explain`` under the
generic plan, and must look at no more rows of ``durably_runs`` than its page
(or the rows it counts) plus a few.
"""

from __future__ import annotations

import pytest

from durably.stores.postgres import PostgresStore

from ._explained import GENERIC, Call, calls_astray, capture_plans, finished_runs, seed_unseen

FINISHED = 100_000
ASLEEP = 20_000
NOW = 10_000_000
PAGE = 50

SEED = finished_runs(FINISHED)
# Run i wakes at NOW - ASLEEP/2 + i: the first half is due at NOW, the rest later.
# Every one of them was put to sleep after the last ANALYZE.
ASLEEP_SQL = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, wake_at, tags,
        created_at, updated_at)
    SELECT 'nap-' || lpad(i::text, 6, '0'), 'order', '1', 'suspended',
        {NOW} - {ASLEEP // 2} + i, '[]'::jsonb, {NOW} - {ASLEEP} + i, {NOW} - {ASLEEP} + i
    FROM generate_series(1, {ASLEEP}) AS i
"""


async def test_polls_walk_their_index_under_stale_statistics(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = capture_plans(monkeypatch)
    # after ANALYZE: the statistics know of no sleeper
    await seed_unseen(postgres_url, SEED, ASLEEP_SQL)

    store = PostgresStore(postgres_url, server_settings=GENERIC)
    await store.open()
    due = NOW - ASLEEP // 2  # run 0's time: nothing is due yet at this instant
    mine, theirs = frozenset({("order", "1")}), frozenset({("other", "1")})
    polls: list[Call] = [
        ("list_due, a page of due runs", lambda: store.list_due(NOW, PAGE), 2 * PAGE),
        ("list_due, none due yet", lambda: store.list_due(due, PAGE), 0),
        ("next_wake_at", lambda: store.next_wake_at(NOW), 1),
        ("list_pending", lambda: store.list_pending(NOW, PAGE), 0),
        ("count_pending", lambda: store.count_pending(), 0),
        ("list_orphans", lambda: store.list_orphans(NOW, PAGE), 0),
        ("list_blocked", lambda: store.list_blocked(PAGE, workflows=mine), 0),
        ("list_unclaimed", lambda: store.list_unclaimed(due, PAGE, workflows=theirs), 0),
        ("list_finished_before", lambda: store.list_finished_before(10, PAGE), 10),
    ]
    try:
        astray, _ = await calls_astray(plans, polls)
    finally:
        await store.close()
    assert not astray, "\n".join(astray)
