"""PostgreSQL's batched turn starts in a fleet: a run another instance has
already leased is passed over by the batch and not retried on its own, while a
run whose row another transaction holds still gets the one-row statement,
which waits for the lock and leases it. Measured before the fix (bench/fleet.py,
two engine processes): every run the other process took cost one single-row
transaction, 204 statements per 1,000 steps instead of 1.3."""

from __future__ import annotations

import asyncio

import asyncpg

from durably.model import Run, RunStatus
from durably.stores.postgres import PostgresStore
from durably.testing import eventually

NOW = 1_700_000_000_000
LEASE = NOW + 30_000
STARTABLE = frozenset({RunStatus.PENDING})


def _run(run_id: str) -> Run:
    return Run(
        run_id=run_id,
        workflow="wf",
        workflow_version="1",
        status=RunStatus.PENDING,
        created_at=NOW,
        updated_at=NOW,
    )


def _alone(store: PostgresStore) -> list[str]:
    """Record the ids retried by the one-row statement (a spy: it still runs)."""
    ids: list[str] = []
    one = store._start_turn  # pyright: ignore[reportPrivateUsage]

    async def spy(run_id: str, *args: object) -> object:
        ids.append(run_id)
        return await one(run_id, *args)  # type: ignore[arg-type]

    store._start_turn = spy  # type: ignore[method-assign]  # pyright: ignore[reportPrivateUsage]
    return ids


async def test_runs_leased_elsewhere_are_not_retried_one_by_one(
    postgres_store: PostgresStore,
) -> None:
    await postgres_store.create_runs([_run(f"r{i}") for i in range(20)])
    taken = await postgres_store.start_turns(
        [f"r{i}" for i in range(10)], "other", NOW, LEASE, STARTABLE
    )
    assert sorted(taken) == sorted(f"r{i}" for i in range(10))

    alone = _alone(postgres_store)
    mine = await postgres_store.start_turns(
        [f"r{i}" for i in range(20)], "me", NOW, LEASE, STARTABLE
    )

    assert sorted(mine) == sorted(f"r{i}" for i in range(10, 20))
    assert alone == []  # the ten leased by "other" cost no statement each
    for run_id, (run, _) in mine.items():
        assert run.locked_by == "me", run_id


async def test_a_row_held_by_another_transaction_is_waited_for(
    postgres_store: PostgresStore, postgres_url: str
) -> None:
    await postgres_store.create_runs([_run("held"), _run("free")])
    alone = _alone(postgres_store)
    conn = await asyncpg.connect(postgres_url.split("?")[0])
    try:
        await conn.execute(f'SET search_path TO "{postgres_store.schema}"')
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM durably_runs WHERE id = 'held' FOR UPDATE")
        starting = asyncio.create_task(
            postgres_store.start_turns(["held", "free"], "me", NOW, LEASE, STARTABLE)
        )

        holder = await conn.fetchval("SELECT pg_backend_pid()")

        async def waiting_on_the_lock() -> bool:
            # blocked by this connection: not by another test's on the same server
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    holder,
                )
            )

        await eventually(waiting_on_the_lock)
        await tx.rollback()
        leased = await asyncio.wait_for(starting, 30)
    finally:
        await conn.close()
    assert sorted(leased) == ["free", "held"]
    assert alone == ["held"]
