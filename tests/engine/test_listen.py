"""PostgreSQL's LISTEN/NOTIFY path, and its connection dropping.

The worker engines here poll once an hour, and their first tick ran before
the work exists: whatever they pick up afterwards, only a notification can
have told them about. Delivery is asserted to happen at all (with a generous
wait), never within a time.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg
import pytest

import durably
from durably import RunStatus
from durably.stores.postgres import PostgresStore

ADMIN_URL = os.environ.get("DURABLY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

pytestmark = pytest.mark.timeout(120)

NEVER = 3600.0
"""A poll interval no test outlives: only a notification delivers."""


async def eventually(predicate: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


def register(engine: durably.Engine) -> None:
    @engine.workflow("greet")
    async def greet(ctx: durably.WorkflowContext, name: str) -> str:
        return f"hello {name}"

    @engine.workflow("await-signal")
    async def await_signal(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("go-token")


def channel_of(engine: durably.Engine) -> str:
    assert isinstance(engine.store, PostgresStore)
    return engine.store.channel


async def listeners(admin: Any, channel: str) -> set[int]:
    """The backends LISTENing on ``channel`` (their last statement is the LISTEN)."""
    rows = await admin.fetch(
        "SELECT pid FROM pg_stat_activity "
        "WHERE query ILIKE 'LISTEN %' AND position($1 IN query) > 0",
        channel,
    )
    return {row["pid"] for row in rows}


async def test_a_run_started_by_another_engine_is_picked_up_through_notify(
    postgres_url: str,
) -> None:
    worker = durably.Engine(postgres_url, poll_interval=NEVER)
    register(worker)
    producer = durably.Engine(postgres_url, drive=False)
    register(producer)
    try:
        async with worker:
            assert worker.listening
            run = await producer.start("greet", "notify", run_id="from-producer")
            result = await worker.wait_for_run(run.run_id, terminal=True, timeout=60)
            assert result.status is RunStatus.COMPLETED
            assert result.output == "hello notify"
    finally:
        await producer.close()


async def test_a_dropped_listen_connection_reconnects_and_delivers_again(
    postgres_url: str,
) -> None:
    worker = durably.Engine(postgres_url, poll_interval=NEVER)
    register(worker)
    producer = durably.Engine(postgres_url, drive=False)
    register(producer)
    admin = await asyncpg.connect(ADMIN_URL)
    try:
        async with worker:
            channel = channel_of(worker)
            # A run parked on a signal before the drop: its wake must get through after it.
            await worker.start("await-signal", run_id="waiter")

            async def parked() -> bool:
                current = await worker.get_run("waiter")
                return current is not None and current.status is RunStatus.SUSPENDED

            await eventually(parked)
            before = await listeners(admin, channel)
            assert len(before) == 1
            terminated = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE pid = ANY($1::int[]) AND pg_terminate_backend(pid)",
                list(before),
            )
            assert terminated == 1

            async def relistening() -> bool:
                now = await listeners(admin, channel)
                return bool(now) and not (now & before)

            await eventually(relistening)
            # Work another process signals from now on reaches the worker
            # through the new connection: a new run, and a signal.
            run = await producer.start("greet", "again", run_id="after-drop")
            result = await worker.wait_for_run(run.run_id, terminal=True, timeout=60)
            assert result.output == "hello again"
            assert await producer.signal("go-token", {"ok": True}) == "waiter"
            woken = await worker.wait_for_run("waiter", terminal=True, timeout=60)
            assert woken.status is RunStatus.COMPLETED
            assert woken.output == {"ok": True}
    finally:
        await producer.close()
        await admin.close()


async def test_a_listen_outage_longer_than_any_backoff_still_ends_in_listening(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A database restart can outlast any fixed retry schedule: an engine that
    # stopped retrying would hear nothing again until restarted, silently
    # leaning on a poll that may be an hour (as here).
    from durably.stores import _pg_connection

    monkeypatch.setattr(_pg_connection, "RELISTEN_DELAYS", (0.01, 0.02), raising=False)
    worker = durably.Engine(postgres_url, poll_interval=NEVER)
    register(worker)
    producer = durably.Engine(postgres_url, drive=False)
    register(producer)
    admin = await asyncpg.connect(ADMIN_URL)
    real_connect = asyncpg.connect
    refused = 0

    async def outage(*args: Any, **kwargs: Any) -> Any:
        nonlocal refused
        if refused < 12:  # many more than the schedule's steps
            refused += 1
            raise OSError("connection refused (the database is restarting)")
        return await real_connect(*args, **kwargs)

    try:
        async with worker:
            channel = channel_of(worker)
            before = await listeners(admin, channel)
            monkeypatch.setattr(_pg_connection.asyncpg, "connect", outage)
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) pid", list(before)
            )

            async def relistening() -> bool:
                now = await listeners(admin, channel)
                return bool(now) and not (now & before)

            await eventually(relistening)
            assert refused == 12
            run = await producer.start("greet", "after the outage", run_id="after-outage")
            result = await worker.wait_for_run(run.run_id, terminal=True, timeout=60)
            assert result.output == "hello after the outage"
    finally:
        await producer.close()
        await admin.close()


async def test_a_waiter_in_another_process_hears_the_settle_of_a_run_it_watches(
    postgres_url: str,
) -> None:
    """Settles are announced only for runs watched from elsewhere: a waiter in
    another engine marks the run as it reads it, and (its watcher never
    polling again) only the announcement can deliver the outcome."""
    worker = durably.Engine(postgres_url, poll_interval=NEVER)
    register(worker)
    waiter = durably.Engine(postgres_url, drive=False)
    register(waiter)
    try:
        async with worker:
            await waiter.open()
            waiter._watcher.interval = NEVER
            run = await worker.start("await-signal", run_id="watched")

            async def parked() -> bool:
                current = await worker.get_run("watched")
                return current is not None and current.status is RunStatus.SUSPENDED

            await eventually(parked)
            waiting = asyncio.create_task(waiter.wait_for_run(run.run_id, terminal=True))

            async def registered() -> bool:  # after its read (the mark)
                return "watched" in waiter._watcher._waiting

            await eventually(registered)
            await worker.signal("go-token", "done")
            result = await asyncio.wait_for(waiting, 60)
            assert (result.status, result.output) == (RunStatus.COMPLETED, "done")
    finally:
        await waiter.close()


async def test_an_engine_listening_on_postgresql_slows_its_waiters_safety_net(
    postgres_url: str, tmp_path: Any
) -> None:
    """Settles of watched runs are announced on PostgreSQL: the waiters' net
    reads at its announced interval there, at its own on SQLite (no channel)."""
    listening = durably.Engine(postgres_url, drive=False)
    polling = durably.Engine(f"sqlite:///{tmp_path / 'runs.db'}", drive=False)
    try:
        await listening.open()
        await polling.open()
        assert listening.listening and listening._watcher.announced
        assert not polling.listening and not polling._watcher.announced
    finally:
        await listening.close()
        await polling.close()
