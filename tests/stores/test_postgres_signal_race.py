"""A signal racing a waiter's run as it ends, on PostgreSQL (READ COMMITTED).

A run ending deletes its signal waiters without the token's advisory lock. A
signal that picked that waiter as the oldest must then go to the next one, not
be buffered while a live run still waits (which would strand it).
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from durably.stores.postgres import PostgresStore
from durably.testing.conformance.stores._helpers import OWNER, leased, signal_cp
from durably.testing.conformance.stores.steps import NOW

pytestmark = pytest.mark.timeout(60)


async def test_a_signal_skips_a_waiter_deleted_under_it(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    await store.open()
    ender = await asyncpg.connect(postgres_url.split("?")[0])
    watcher = await asyncpg.connect(postgres_url.split("?")[0])
    try:
        await ender.execute(f'SET search_path TO "{store.schema}"')
        for run_id in ("ending", "next"):
            await leased(store, run_id)
            await store.wait_signal(signal_cp(run_id, 0, "tok"), "tok", OWNER, NOW)

        ending = ender.transaction()
        await ending.start()
        # the oldest waiter's run ends: its waiters go, not yet committed
        await ender.execute("DELETE FROM durably_signal_waiters WHERE run_id = 'ending'")
        ender_pid = await ender.fetchval("SELECT pg_backend_pid()")
        signal = asyncio.ensure_future(store.send_signal("tok", "hello", NOW + 1))
        blocked = False
        for _ in range(2_000):  # until the signal waits for the ending run's row lock
            # Whichever pooled connection carries the signal, it is the one the
            # ending transaction blocks (other tests on the server are not).
            waiting = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))",
                ender_pid,
            )
            if waiting:
                blocked = True
                break
            assert not signal.done()
            await asyncio.sleep(0.005)
        assert blocked, "the signal never waited for the ending run's row"
        await ending.commit()

        assert await signal == "next"
        assert await store.list_buffered_signals("tok") == []
        assert (await store.load_checkpoints("next"))[0].output == "hello"
    finally:
        await ender.close()
        await watcher.close()
        await store.close()
