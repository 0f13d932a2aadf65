"""A statement about one run reaches it by its primary key, however many runs
are finished and whatever the statistics say about the live ones.

With 1,000,000 finished runs, ``ANALYZE`` sees no run ``running`` (or
``suspended``): too few to sample. Under the generic plan the store's pool uses,
the planner then found it cheaper to settle a run by scanning the ``running``
range of ``durably_runs_updated (status, updated_at)``, checking each entry's
id on the table, than to probe the primary key: every live run (and the dead
entries of recently finished ones) read once per settle, where the empty
database read one (bench/grow-explain.md; bench/grow_cost.py counted 43 pages
for the one-run settle at 1,000,000 runs against 25 on an empty database).

Counted here, not timed: with 100,000 finished runs analyzed, then 400 running
under another engine's lease, an engine runs one-step and five-step workflows,
one at a time and 20 at once, and PostgreSQL's ``auto_explain`` reports the
executed plan of every statement its store sends; then the lease-keeping calls
run on one of the 400. Each statement naming runs must read ``durably_runs``
through its primary key only. Before the fix the settles and the lease calls
did not: the one-run settle looked at 401 rows, a batch of settles 404-418, and
``renew_lease``, ``continue_turn``, ``release_run``, ``mark_awaiting`` and
``recover_orphans`` 400 each, all in ``durably_runs_updated``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

import durably
from durably.stores.postgres import PostgresStore

from ._explained import AUTO_EXPLAIN, capture_plans, examined, finished_runs, seed_unseen

FINISHED = 100_000
LIVE = 400

SEED = finished_runs(FINISHED)
# Leased far into the future by an engine that is not this one: not orphans.
LEASED = f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, locked_by,
        locked_until, tags, created_at, updated_at)
    SELECT 'live-' || lpad(i::text, 4, '0'), 'order', '1', 'running', 'elsewhere',
        9000000000000, '[]'::jsonb, {FINISHED} + i, {FINISHED} + i
    FROM generate_series(1, {LIVE}) AS i
"""

PKEY = "durably_runs_pkey"


# ``id = $1``, ``r.id = s.id``, ``id = ANY($4::text[])``: the statement says which runs
NAMES_A_RUN = re.compile(r"\bid = ")


async def _local(i: int) -> int:
    return i


async def test_statements_naming_a_run_probe_it_by_id(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = capture_plans(monkeypatch)
    # after ANALYZE: the statistics know of no live run
    await seed_unseen(postgres_url, SEED, LEASED)

    engine = durably.Engine(store=PostgresStore(postgres_url, server_settings=AUTO_EXPLAIN))

    @engine.workflow("one", version="1")
    async def one(ctx: Any, x: int) -> int:
        out: int = await ctx.local_step("s0", _local, x)
        return out

    @engine.workflow("five", version="1")
    async def five(ctx: Any, k: int) -> int:
        for i in range(k):
            await ctx.local_step(f"s{i}", _local, i)
        return k

    async with engine:
        plans.clear()  # opening: the schema check and the first polls
        for name, arg in (("one", 1), ("five", 5), ("one", 2), ("five", 5)):
            run = await engine.start(name, arg)
            done = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
            assert str(done.status) == "completed"
        # many at once: their settles share the write batcher's multi-run statement
        runs = [await engine.start("five", 5) for _ in range(20)]
        for run in runs:
            done = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
            assert str(done.status) == "completed"

    # and the lease keeping, one run at a time (the last of the 400 live runs)
    store = PostgresStore(postgres_url, server_settings=AUTO_EXPLAIN)
    await store.open()
    try:
        last, owner, until = f"live-{LIVE:04d}", "elsewhere", 9_000_000_000_001
        assert await store.renew_lease(last, owner, until)
        assert await store.continue_turn(last, owner, until) is not None
        assert await store.mark_awaiting(last, owner, None)
        assert await store.recover_orphans([last], 1, 3) == {}  # its lease has not expired
        assert await store.claim_due_batch([last], 1, 2) == []  # it is not asleep
        assert not await store.extend_decision_wait(last, 5, 1)  # nor awaiting a decision
        assert await store.release_run(last, owner, 1)
    finally:
        await store.close()

    naming_a_run = [p for p in plans if NAMES_A_RUN.search(p["Query Text"])]
    assert naming_a_run, "no statement naming a run was explained"
    looked = [(" ".join(p["Query Text"].split())[:120], examined(p["Plan"])) for p in naming_a_run]
    # each looks at the runs it names and no other: through the primary key
    astray = sorted(
        {(sql[:60], str(scans)) for sql, scans in looked if {i for i, _ in scans} - {PKEY}}
    )
    assert not astray, "\n".join(f"{sql}: {scans}" for sql, scans in astray)
