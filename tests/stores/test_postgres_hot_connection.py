"""The PostgreSQL store's hot connection (``PgConnection.connection``).

Sequential calls reuse one connection without going through the pool; a call
that raises (or is cancelled) gives its connection back to the pool and it is
never reused as the hot one; callers waiting for the pool are served in order
and the pool's last idle connection is never kept out of it; closing the store
gives the hot connection back (``close`` does not hang).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import asyncpg.pool
import pytest

from durably.stores._pg_connection import PgConnection
from durably.testing import eventually


@pytest.fixture
async def db(postgres_url: str) -> AsyncIterator[PgConnection]:
    """An open pool (and schema) of its own: two connections open, at most three."""
    db = PgConnection(postgres_url, schema=None, min_size=2, max_size=3, connect_kwargs={})
    await db.open()
    try:
        yield db
    finally:
        await asyncio.wait_for(db.close(), 30)  # a hang guard, not a timing


async def _backend(db: PgConnection) -> int:
    async with db.connection() as conn:
        pid: int = await conn.fetchval("SELECT pg_backend_pid()")
        return pid


async def test_sequential_calls_share_one_backend_and_skip_the_pool(
    db: PgConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await _backend(db)
    acquired: list[int] = []
    original = asyncpg.pool.Pool.acquire

    def counting_acquire(pool: asyncpg.pool.Pool, *, timeout: float | None = None) -> object:
        acquired.append(1)
        return original(pool, timeout=timeout)

    monkeypatch.setattr(asyncpg.pool.Pool, "acquire", counting_acquire)
    backends = {await _backend(db) for _ in range(20)}
    async with db.transaction() as conn:
        backends.add(await conn.fetchval("SELECT pg_backend_pid()"))
    monkeypatch.undo()
    assert backends == {first}
    assert acquired == []


async def test_a_failed_call_gives_its_connection_back_and_it_is_not_kept(
    db: PgConnection,
) -> None:
    first = await _backend(db)

    async def failing_call() -> None:
        async with db.connection() as conn:
            await conn.execute("SELECT 1/0")

    with pytest.raises(asyncpg.PostgresError):
        await failing_call()
    assert db._hot is None
    # The pool cleaned it up: the next call works (on any backend).
    assert isinstance(await _backend(db), int)

    async def failing_transaction() -> None:
        async with db.transaction() as conn:
            await conn.execute("CREATE TEMP TABLE t (x int)")
            await conn.execute("SELECT 1/0")

    with pytest.raises(asyncpg.PostgresError):
        await failing_transaction()
    # The transaction rolled back and its connection went to the pool.
    async with db.transaction() as conn:
        assert await conn.fetchval("SELECT to_regclass('pg_temp.t')") is None
    assert first > 0


async def test_a_cancelled_call_is_not_kept_as_the_hot_connection(db: PgConnection) -> None:
    await _backend(db)
    started = asyncio.Event()

    async def sleeper() -> None:
        async with db.connection() as conn:
            started.set()
            await conn.execute("SELECT pg_sleep(30)")

    task = asyncio.create_task(sleeper())
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert db._hot is None
    assert await asyncio.wait_for(_backend(db), 30) > 0


async def test_callers_waiting_for_the_pool_get_it_in_order(postgres_url: str) -> None:
    """One connection in all: while it is out, callers queue for the pool.
    When it comes back it goes to that queue (not kept idle as the hot one,
    which would leave them waiting for ever), first come first served."""
    db = PgConnection(postgres_url, schema=None, min_size=1, max_size=1, connect_kwargs={})
    await db.open()
    try:
        order: list[str] = []
        release = asyncio.Event()
        holding = asyncio.Event()

        async def holder() -> None:
            async with db.connection() as conn:
                holding.set()
                await release.wait()
                await conn.fetchval("SELECT 1")
                order.append("holder")

        async def asker(name: str) -> None:
            async with db.connection() as conn:
                await conn.fetchval("SELECT 1")
                order.append(name)

        tasks = [asyncio.create_task(holder())]
        await asyncio.wait_for(holding.wait(), 30)
        tasks.append(asyncio.create_task(asker("first")))
        await eventually(lambda: db._queued == 1, what="the first caller queued", timeout=30)
        tasks.append(asyncio.create_task(asker("second")))
        await eventually(lambda: db._queued == 2, what="the second caller queued", timeout=30)
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert order == ["holder", "first", "second"]
        # The pool's only connection is never kept out of it.
        assert db._hot is None
    finally:
        await asyncio.wait_for(db.close(), 30)


async def test_the_pools_last_idle_connection_stays_in_the_pool(postgres_url: str) -> None:
    """Kept out while the pool had nothing else idle, a concurrent caller
    (another run's turn) would wait for a new connection to open and fall
    behind callers that came after it (a singleton's queue saw runs admitted
    out of order)."""
    db = PgConnection(postgres_url, schema=None, min_size=1, max_size=2, connect_kwargs={})
    await db.open()
    try:
        await _backend(db)
        assert db._hot is None  # the pool's one connection went back
        both = asyncio.Event()
        inside = 0

        async def hold() -> None:
            nonlocal inside
            async with db.connection() as conn:
                inside += 1
                if inside == 2:
                    both.set()
                await asyncio.wait_for(both.wait(), 30)
                await conn.fetchval("SELECT 1")

        await asyncio.gather(hold(), hold())
        await asyncio.wait_for(asyncio.gather(*db._releasing), 30)
        await _backend(db)
        # Two connections now: one is kept out, the other idles in the pool.
        assert db._hot is not None
        assert db.pool().get_idle_size() == 1
    finally:
        await asyncio.wait_for(db.close(), 30)
