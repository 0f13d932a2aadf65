"""The ``db`` transport's write batching (:class:`durably._batch.BatchCall`,
as the transport configures it): nobody may be left awaiting forever.

Before the transport used ``BatchCall`` it had a copy of it without the
``CancelledError`` branch; this test failed on that copy with both callers
still awaiting after two seconds.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from durably._batch import BatchCall
from durably.stores import SqliteStore
from durably.transports.db import DbTransport


async def test_cancelling_a_batch_in_flight_releases_every_waiter() -> None:
    """The batching task cancelled mid-write (the loop shutting down, or the
    store's call cancelled under it) must not leave the callers of that batch,
    nor those queued behind it, awaiting a future nobody will ever settle."""
    started = asyncio.Event()
    never = asyncio.Event()

    async def write(items: list[int]) -> list[None]:
        started.set()
        await never.wait()
        return [None] * len(items)

    batcher: BatchCall[int, None] = BatchCall(write, max_batch=None)
    in_flight = asyncio.create_task(batcher(1))
    await started.wait()
    queued = asyncio.create_task(batcher.many([2, 3]))
    await asyncio.sleep(0)  # let the second caller queue behind the batch in flight
    assert batcher._task is not None
    batcher._task.cancel()

    done, pending = await asyncio.wait({in_flight, queued}, timeout=2)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} caller(s) left awaiting forever"
    for task in done:
        with pytest.raises(asyncio.CancelledError):
            task.result()


async def test_the_db_transport_batches_its_writes_without_a_size_limit(tmp_path: Path) -> None:
    """What queues up while a write is in flight goes out as one write,
    however much it is (the queue chunks its INSERTs itself)."""
    writes: list[int] = []
    gate = asyncio.Event()

    async def write(items: list[int]) -> list[None]:
        writes.append(len(items))
        await gate.wait()
        return [None] * len(items)

    transport = DbTransport(SqliteStore(f"sqlite:///{tmp_path / 't.db'}"))
    assert isinstance(transport._pushes, BatchCall)
    assert transport._pushes._max_batch is None
    batcher: BatchCall[int, None] = BatchCall(write, max_batch=None)
    first = asyncio.create_task(batcher(0))
    await asyncio.sleep(0)
    rest = asyncio.create_task(batcher.many(list(range(1, 1201))))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(first, rest)
    assert writes == [1, 1200]
