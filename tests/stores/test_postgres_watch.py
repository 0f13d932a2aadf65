"""PostgreSQL announces a settle (NOTIFY) only for a run watched from another
process (``watch_runs``), and a watch racing a settle never loses it.

Every NOTIFY wakes each listening backend of the database, and the process
that settles a run hands its outcome to its own waiters in memory: a run nobody
watches from elsewhere settles with two commits and no wake-up anywhere.
Counted by listening on the schema's channel; a notice that must not come is
proven absent by a later one that must (notices arrive in commit order).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus
from durably.stores.base import RunChanges, SettleResult
from durably.stores.postgres import PostgresStore

from ._locks import until_blocked

NOW = 1_700_000_000_000
LEASE = 30_000
OWNER = "owner-1"
PENDING = frozenset({RunStatus.PENDING, RunStatus.SUSPENDED})

pytestmark = pytest.mark.timeout(120)


class Notices:
    """The notices on the store's channel, as ``kind:argument`` strings."""

    def __init__(self) -> None:
        self.heard: asyncio.Queue[str] = asyncio.Queue()

    def __call__(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.heard.put_nowait(payload)

    async def next_settled(self) -> str:
        """The next ``settled`` notice (others, such as new runs, are skipped)."""
        while True:
            payload = await asyncio.wait_for(self.heard.get(), 30)  # a hang guard
            if payload.startswith("settled:"):
                return payload.partition(":")[2]


@pytest.fixture
async def notices(postgres_store: PostgresStore) -> AsyncIterator[Notices]:
    """Listening on the store's channel from a connection of its own."""
    conn = await asyncpg.connect(postgres_store.url.partition("?")[0])
    heard = Notices()
    await conn.add_listener(postgres_store.channel, heard)
    try:
        yield heard
    finally:
        await conn.close()


async def _leased(store: PostgresStore, run_id: str) -> None:
    run = Run(run_id=run_id, workflow="wf", workflow_version="1", status=RunStatus.PENDING)
    await store.create_run(run)
    assert await store.start_turns([run_id], OWNER, NOW, NOW + LEASE, PENDING)


def _result(run_id: str) -> Checkpoint:
    return Checkpoint(
        run_id=run_id, seq=0, name="s0", kind="local", status=CheckpointStatus.COMPLETED, output=1
    )


async def _last_step_and_settle(store: PostgresStore, run_id: str) -> SettleResult:
    """A one-step run's end: its result and its terminal settle, queued together."""
    saved = store.save_checkpoint(_result(run_id), OWNER)
    settled = await store.settle_run(run_id, OWNER, RunStatus.COMPLETED, RunChanges(output=1), NOW)
    assert await saved
    return settled


async def test_only_a_watched_run_announces_its_settle(
    postgres_store: PostgresStore, notices: Notices
) -> None:
    for run_id in ("quiet", "watched", "marker"):
        await _leased(postgres_store, run_id)
    [seen] = await postgres_store.watch_runs(["watched"])
    assert seen.status is RunStatus.RUNNING

    # A batch of one, its result and terminal settle in one statement.
    assert await _last_step_and_settle(postgres_store, "quiet") is SettleResult.SETTLED
    assert await _last_step_and_settle(postgres_store, "watched") is SettleResult.SETTLED
    assert await notices.next_settled() == "watched"  # and not "quiet" before it

    # A batch of many: settles queued together, one of them watched.
    runs = [f"many{i}" for i in range(6)]
    for run_id in runs:
        await _leased(postgres_store, run_id)
    await postgres_store.watch_runs(["many3"])
    results = await asyncio.gather(
        *(
            postgres_store.settle_run(run_id, OWNER, RunStatus.COMPLETED, RunChanges(output=1), NOW)
            for run_id in runs
        )
    )
    assert results == [SettleResult.SETTLED] * len(runs)
    assert await notices.next_settled() == "many3"

    # A suspend is a settle too (a waiter may wait for it).
    await postgres_store.watch_runs(["marker"])
    suspended = await postgres_store.settle_run(
        "marker", OWNER, RunStatus.SUSPENDED, RunChanges(wake_at=NOW + 10), NOW
    )
    assert suspended is SettleResult.SETTLED
    assert await notices.next_settled() == "marker"
    assert notices.heard.empty()


async def test_a_terminal_run_is_read_but_not_marked(postgres_store: PostgresStore) -> None:
    await _leased(postgres_store, "done")
    assert await _last_step_and_settle(postgres_store, "done") is SettleResult.SETTLED
    [run] = await postgres_store.watch_runs(["done"])
    assert run.status is RunStatus.COMPLETED
    async with postgres_store._db.connection() as conn:
        assert await conn.fetchval("SELECT watched FROM durably_runs WHERE id = 'done'") is False


async def test_a_watch_waiting_behind_a_settle_reads_the_settled_run(
    postgres_store: PostgresStore,
) -> None:
    """The settle commits while the watch waits for the row: the watch
    returns the run as settled (its snapshot had it running and unwatched)."""
    await _leased(postgres_store, "r")
    conn = await asyncpg.connect(
        postgres_store.url.partition("?")[0],
        server_settings={"search_path": str(postgres_store.schema)},
    )
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute(
            "UPDATE durably_runs SET status = 'completed', output = '7', locked_by = NULL "
            "WHERE id = 'r'"
        )
        watch = asyncio.create_task(postgres_store.watch_runs(["r"]))
        await until_blocked(postgres_store, conn)
        await tx.commit()
        [run] = await asyncio.wait_for(watch, 30)
    finally:
        await conn.close()
    assert (run.status, run.output) == (RunStatus.COMPLETED, 7)


async def test_a_settle_waiting_behind_a_watch_announces(
    postgres_store: PostgresStore, notices: Notices
) -> None:
    """The watch holds the row first: the settle waits, then sees it watched."""
    await _leased(postgres_store, "r")
    conn = await asyncpg.connect(
        postgres_store.url.partition("?")[0],
        server_settings={"search_path": str(postgres_store.schema)},
    )
    try:
        tx = conn.transaction()
        await tx.start()
        # What watch_runs writes, held open so the settle has to wait for it.
        await conn.execute("UPDATE durably_runs SET watched = true WHERE id = 'r'")
        settle = asyncio.create_task(_last_step_and_settle(postgres_store, "r"))
        await until_blocked(postgres_store, conn)
        await tx.commit()
        assert await asyncio.wait_for(settle, 30) is SettleResult.SETTLED
    finally:
        await conn.close()
    assert await notices.next_settled() == "r"


async def test_the_engine_does_not_hear_its_own_settles_echoed(postgres_url: str) -> None:
    """A settle made through this store was handed to this process's waiters
    in memory; its NOTIFY coming back made the engine re-read the run (once per
    turn of every watched run: ~14% of a dispatched step's CPU). The engine's
    subscriber hears only other processes' settles (a second store, its own
    pool); the channel's other listeners still hear everything."""
    here = PostgresStore(postgres_url)
    elsewhere = PostgresStore(postgres_url)
    await here.open()
    await elsewhere.open()
    engine_heard: asyncio.Queue[str] = asyncio.Queue()
    listener_heard: asyncio.Queue[str] = asyncio.Queue()
    try:
        await here.subscribe(lambda kind, run_id: engine_heard.put_nowait(f"{kind}:{run_id}"))
        await here.listen(lambda kind, run_id: listener_heard.put_nowait(f"{kind}:{run_id}"))
        for run_id in ("ours", "theirs"):
            await _leased(here, run_id)
        await elsewhere.watch_runs(["ours", "theirs"])

        assert await _last_step_and_settle(here, "ours") is SettleResult.SETTLED
        # The other process settles "theirs" (it took the run over).
        await elsewhere.settle_run("theirs", OWNER, RunStatus.COMPLETED, RunChanges(), NOW)

        async def next_settled(queue: asyncio.Queue[str]) -> str:
            while True:
                payload = await asyncio.wait_for(queue.get(), 30)  # a hang guard
                if payload.startswith("settled:"):
                    return payload.partition(":")[2]

        # Notices arrive in commit order: "theirs" first means "ours" never came.
        assert await next_settled(engine_heard) == "theirs"
        assert await next_settled(listener_heard) == "ours"
        assert await next_settled(listener_heard) == "theirs"
    finally:
        await elsewhere.close()
        await here.close()
