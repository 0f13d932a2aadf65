"""PostgreSQL's batched lease, claim and recovery statements under row locks.

The batches take their rows with ``FOR UPDATE SKIP LOCKED`` so they never wait
on (or deadlock with) another transaction. These tests hold a row lock in a
transaction of their own, the way a concurrent write would, and show what each
batch does with that row: ``start_turns`` waits for it alone and re-checks it
(exactly what ``start_turn`` would do); ``claim_due_batch`` and
``recover_orphans`` pass over it, and the next pass takes it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus
from durably.stores.base import RunChanges, SettleResult
from durably.stores.postgres import PostgresStore
from stores._locks import until_blocked

NOW = 1_700_000_000_000
LEASE = 30_000
WAKEABLE = frozenset({RunStatus.PENDING, RunStatus.SUSPENDED})


async def _holding(store: PostgresStore, run_id: str) -> Any:
    """A connection holding ``run_id``'s row lock in an open transaction."""
    dsn = store.url.partition("?")[0]
    conn = await asyncpg.connect(dsn, server_settings={"search_path": str(store.schema)})
    tx = conn.transaction()
    await tx.start()
    await conn.execute("SELECT 1 FROM durably_runs WHERE id = $1 FOR UPDATE", run_id)
    return conn, tx


def _run(run_id: str, status: RunStatus = RunStatus.PENDING, **fields: Any) -> Run:
    return Run(
        run_id=run_id,
        workflow="wf",
        workflow_version="1",
        status=status,
        created_at=NOW,
        updated_at=NOW,
        **fields,
    )


async def test_start_turns_waits_for_a_locked_row_and_rechecks_it(
    postgres_store: PostgresStore,
) -> None:
    for run_id in ("free", "contended", "taken"):
        await postgres_store.create_run(_run(run_id))
    conns = [await _holding(postgres_store, "contended"), await _holding(postgres_store, "taken")]
    try:
        batch = asyncio.ensure_future(
            postgres_store.start_turns(
                ["free", "contended", "taken"], "me", NOW, NOW + LEASE, WAKEABLE
            )
        )
        await until_blocked(postgres_store, conns[0][0])
        await until_blocked(postgres_store, conns[1][0])
        assert not batch.done()
        # one holder lets go unchanged; the other leased its run meanwhile
        await conns[1][0].execute(
            "UPDATE durably_runs SET status = 'running', locked_by = 'other', "
            "locked_until = $1 WHERE id = 'taken'",
            NOW + LEASE,
        )
        for _, held in conns:
            await held.commit()
        turns = await batch
    finally:
        for conn, _ in conns:
            await conn.close()

    assert sorted(turns) == ["contended", "free"]
    taken = await postgres_store.get_run("taken")
    assert taken is not None and taken.locked_by == "other"


async def test_claims_and_recoveries_pass_over_a_locked_row_for_the_next_pass(
    postgres_store: PostgresStore,
) -> None:
    await postgres_store.create_run(_run("due-1", RunStatus.SUSPENDED, wake_at=NOW - 1))
    await postgres_store.create_run(_run("due-2", RunStatus.SUSPENDED, wake_at=NOW - 1))
    for run_id in ("orphan-1", "orphan-2"):
        await postgres_store.create_run(
            _run(run_id, RunStatus.RUNNING, locked_by="x", locked_until=NOW - 1)
        )
    conns = [await _holding(postgres_store, "due-2"), await _holding(postgres_store, "orphan-2")]
    try:
        assert await postgres_store.claim_due_batch(["due-1", "due-2"], NOW, NOW + LEASE) == [
            "due-1"
        ]
        recovered = await postgres_store.recover_orphans(["orphan-1", "orphan-2"], NOW, 3)
        assert recovered == {"orphan-1": RunStatus.PENDING}
    finally:
        for conn, tx in conns:
            await tx.rollback()
            await conn.close()

    assert await postgres_store.list_due(NOW, 10) == ["due-2"]
    assert await postgres_store.claim_due_batch(["due-1", "due-2"], NOW, NOW + LEASE) == ["due-2"]
    assert await postgres_store.list_orphans(NOW, 10) == ["orphan-2"]
    assert await postgres_store.recover_orphans(["orphan-2"], NOW, 3) == {
        "orphan-2": RunStatus.PENDING
    }


# -- a run's last result and its terminal settle, committed together ----------------------

OWNER = "engine-a"


async def _leased_run(store: PostgresStore, run_id: str) -> None:
    run = Run(run_id, "w", "1", RunStatus.RUNNING, input=1, locked_by=OWNER)
    run.locked_until, run.created_at, run.updated_at = NOW + LEASE, NOW, NOW
    assert (await store.create_run(run))[1]


def _result(run_id: str, seq: int) -> Checkpoint:
    return Checkpoint(
        run_id, seq, "s", "local", CheckpointStatus.COMPLETED, output={"v": seq}, attempts=1
    )


async def test_a_last_result_and_its_settle_in_one_batch_both_land(
    postgres_store: PostgresStore,
) -> None:
    await _leased_run(postgres_store, "r")
    waiting = Checkpoint("r", 0, "signal:t", "signal", CheckpointStatus.PENDING)
    assert await postgres_store.wait_signal(waiting, "t", OWNER, NOW) is not None
    # Queued together, as a turn's last step result and its outcome are.
    saved = postgres_store.save_checkpoint(_result("r", 1), OWNER)
    settled = postgres_store.settle_run(
        "r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
    )
    assert await saved is True
    assert await settled is SettleResult.SETTLED
    run = await postgres_store.get_run("r")
    assert run is not None and run.status is RunStatus.COMPLETED and run.output == 7
    assert run.locked_by is None and run.locked_until is None and run.updated_at == NOW + 1
    history = await postgres_store.load_checkpoints("r")
    assert history[1].status is CheckpointStatus.COMPLETED and history[1].output == {"v": 1}
    assert (
        await postgres_store.send_signal("t", "late", NOW + 2) is None
    )  # the waiter went with the run


async def test_a_last_result_and_its_settle_are_fenced_together(
    postgres_store: PostgresStore,
) -> None:
    await _leased_run(postgres_store, "r")
    taken = await postgres_store.update_run_if(
        "r", frozenset({RunStatus.RUNNING}), {"locked_by": "engine-b"}, NOW
    )
    assert taken
    saved = postgres_store.save_checkpoint(_result("r", 0), OWNER)
    settled = postgres_store.settle_run(
        "r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
    )
    assert await saved is False
    assert await settled is SettleResult.LOST
    run = await postgres_store.get_run("r")
    assert run is not None and run.status is RunStatus.RUNNING and run.locked_by == "engine-b"
    assert await postgres_store.load_checkpoints("r") == {}


# -- a row the database refuses fails its own write, never its batch ----------------------


async def test_a_row_the_database_refuses_fails_only_its_own_write(
    postgres_store: PostgresStore,
) -> None:
    runs = [f"r{i}" for i in range(20)]
    for run_id in runs:
        await _leased_run(postgres_store, run_id)
    # The engine refuses such names before they reach a store; the batch must
    # still keep what slips through (or a future bug) to its own row.
    refused = {
        ("r0", 2): Checkpoint("r0", 2, "nul\x00name", "local", CheckpointStatus.COMPLETED),
        ("r1", 2): Checkpoint("r1", 2, "caf\udce9", "local", CheckpointStatus.COMPLETED),
    }
    saves = {
        (run_id, 1): postgres_store.save_checkpoint(_result(run_id, 1), OWNER) for run_id in runs
    }
    bad = {key: postgres_store.save_checkpoint(cp, OWNER) for key, cp in refused.items()}
    settles = {
        run_id: postgres_store.settle_run(
            run_id, OWNER, RunStatus.COMPLETED, RunChanges(output=n), NOW + 1
        )
        for n, run_id in enumerate(runs)
        if n >= 2
    }
    assert [await future for future in saves.values()] == [True] * len(runs)
    for future in bad.values():
        with pytest.raises((asyncpg.PostgresError, asyncpg.DataError)):
            await future
    assert [await future for future in settles.values()] == [SettleResult.SETTLED] * 18
    for n, run_id in enumerate(runs):
        history = await postgres_store.load_checkpoints(run_id)
        assert sorted(history) == [1]
        run = await postgres_store.get_run(run_id)
        assert run is not None
        assert run.status is (RunStatus.COMPLETED if n >= 2 else RunStatus.RUNNING)


# -- NOTIFY payloads stay under PostgreSQL's 8,000-byte limit whatever the id --------------


async def test_notices_stay_bounded_whatever_the_run_id(postgres_store: PostgresStore) -> None:
    # Stored before ids were bounded at the API (or written around it).
    long_ids = [f"{n}" + "L" * 8192 for n in range(3)]
    for run_id in long_ids:
        await _leased_run(postgres_store, run_id)
    batched = [
        postgres_store.settle_run(run_id, OWNER, RunStatus.COMPLETED, RunChanges(output=1), NOW + 1)
        for run_id in long_ids[:2]
    ]
    assert [await settled for settled in batched] == [SettleResult.SETTLED] * 2
    ended = await postgres_store.update_run_if(
        long_ids[2], frozenset({RunStatus.RUNNING}), {"status": RunStatus.CANCELLED}, NOW + 2
    )
    assert ended
    dying = Run("D" * 8192, "w", "1", RunStatus.RUNNING, input=1, locked_by="gone")
    dying.locked_until, dying.created_at, dying.updated_at = NOW - 1, NOW - 2, NOW - 2
    await postgres_store.create_run(dying)
    assert await postgres_store.recover_orphans([dying.run_id], NOW, 0) == {
        dying.run_id: RunStatus.DEAD
    }
