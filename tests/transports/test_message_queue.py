"""The stores' message queue (``store.messages()``), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from durably._queue import MessageQueue, OutMessage
from durably.stores import SqliteStore
from durably.testing.conformance import wait_until

StoreMaker = Callable[[], Any]


@pytest.fixture(params=["sqlite", "postgresql"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreMaker]:
    """Open store objects on one fresh database (each as another process would)."""
    async with AsyncExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / 'queue.db'}"
            new: Callable[[], Any] = lambda: SqliteStore(url)  # noqa: E731
        else:
            from durably.stores.postgres import PostgresStore

            pg_url = await stack.enter_async_context(request.getfixturevalue("isolated_postgres")())
            new = lambda: PostgresStore(pg_url)  # noqa: E731

        async def make() -> Any:
            store = new()
            await store.open()
            stack.push_async_callback(store.close)
            return store

        yield make


async def queue_of(make_store: StoreMaker) -> MessageQueue:
    store = await make_store()
    queue: MessageQueue = store.messages()
    assert isinstance(queue, MessageQueue)
    return queue


async def test_claims_highest_priority_then_oldest(make_store: StoreMaker) -> None:
    queue = await queue_of(make_store)
    await queue.push(
        [
            OutMessage("t", "a"),
            OutMessage("t", "b", priority=2),
            OutMessage("other", "x", priority=9),
            OutMessage("t", "c", priority=2),
            OutMessage("t", "d", priority=-1),
            OutMessage("t", "e"),
        ]
    )
    first = await queue.claim(["t"], "w", 3, 1000, 10)
    assert [m.body for m in first] == ["b", "c", "a"]
    assert all(m.topic == "t" and m.deliveries == 1 for m in first)
    rest = await queue.claim(["t"], "w2", 10, 1000, 10)
    assert [m.body for m in rest] == ["e", "d"]
    assert await queue.claim(["t"], "w3", 10, 1000, 10) == []
    both = await queue.claim(["t", "other"], "w3", 10, 1000, 10)
    assert [m.body for m in both] == ["x"]


async def test_a_claim_hides_messages_until_its_lease_passes(make_store: StoreMaker) -> None:
    queue = await queue_of(make_store)
    await queue.push([OutMessage("t", "a")])
    [held] = await queue.claim(["t"], "w1", 10, 100, 1000)
    assert await queue.claim(["t"], "w2", 10, 100, 1100) == []  # lease runs to 1100
    [again] = await queue.claim(["t"], "w2", 10, 100, 1101)
    assert again.id == held.id and again.deliveries == 2
    # the first holder lost it: it can neither extend nor release it
    assert await queue.extend([held.id], "w1", 100, 1150) == []
    await queue.release([held.id], "w1")
    assert await queue.claim(["t"], "w3", 10, 100, 1150) == []
    assert await queue.extend([again.id], "w2", 500, 1150) == [again.id]
    assert await queue.claim(["t"], "w3", 10, 100, 1601) == []
    [third] = await queue.claim(["t"], "w3", 10, 100, 1651)
    assert third.deliveries == 3


async def test_ack_deletes_and_release_hands_back(make_store: StoreMaker) -> None:
    queue = await queue_of(make_store)
    await queue.push([OutMessage("t", str(i)) for i in range(4)])
    claimed = await queue.claim(["t"], "w", 4, 60_000, 0)
    await queue.ack([claimed[0].id, claimed[1].id])
    await queue.release([claimed[2].id], "w")
    await queue.release([claimed[3].id], "w", available_at=500)
    assert await queue.depth() == {"t": 2}
    assert [m.body for m in await queue.claim(["t"], "v", 10, 1000, 1)] == ["2"]
    assert [m.body for m in await queue.claim(["t"], "v", 10, 1000, 500)] == ["3"]


async def test_a_delayed_message_is_invisible_until_it_is_due(make_store: StoreMaker) -> None:
    queue = await queue_of(make_store)
    await queue.push([OutMessage("t", "later", available_at=5000), OutMessage("t", "now")])
    assert [m.body for m in await queue.claim(["t"], "w", 10, 100, 4999)] == ["now"]
    assert [m.body for m in await queue.claim(["t"], "w", 10, 100, 5000)] == ["later"]


async def test_ten_thousand_messages_go_in_a_handful_of_statements(
    make_store: StoreMaker,
) -> None:
    store = await make_store()
    queue: MessageQueue = store.messages()
    await queue.depth()  # the table exists: count only the push
    inserts: list[str] = []
    if isinstance(store, SqliteStore):

        def trace(conn: Any) -> None:
            conn.set_trace_callback(
                lambda sql: inserts.append(sql) if sql.lstrip().startswith("INSERT") else None
            )

        await store._db.run(trace)
    messages = [OutMessage(f"t{i % 3}", f'{{"n":{i}}}', priority=i % 5) for i in range(10_000)]
    await queue.push(messages)
    assert await queue.depth() == {"t0": 3334, "t1": 3333, "t2": 3333}
    if isinstance(store, SqliteStore):
        await store._db.run(lambda conn: conn.set_trace_callback(None))
        assert len(inserts) == 10
    claimed = await queue.claim(["t0", "t1", "t2"], "w", 10_000, 1000, 1)
    assert len(claimed) == 10_000
    assert [m.priority for m in claimed[:3]] == [4, 4, 4]
    assert {m.body for m in claimed} == {m.body for m in messages}


async def test_concurrent_claimers_never_share_a_message(make_store: StoreMaker) -> None:
    queues = [await queue_of(make_store) for _ in range(4)]
    await queues[0].push([OutMessage("t", str(i)) for i in range(400)])

    async def drain(queue: MessageQueue, owner: str) -> list[int]:
        got: list[int] = []
        while batch := await queue.claim(["t"], owner, 7, 60_000, 1):
            got.extend(m.id for m in batch)
            await asyncio.sleep(0)
        return got

    claimed = await asyncio.gather(*(drain(q, f"w{i}") for i, q in enumerate(queues)))
    everything = [i for ids in claimed for i in ids]
    assert len(everything) == len(set(everything)) == 400


async def test_stores_on_one_database_create_the_table_once(make_store: StoreMaker) -> None:
    queues = [await queue_of(make_store) for _ in range(4)]
    await asyncio.gather(*(q.push([OutMessage("t", "x")]) for q in queues))
    assert await queues[0].depth(["t", "none"]) == {"t": 4}


async def test_a_push_wakes_listeners_of_another_store_object(make_store: StoreMaker) -> None:
    listening = await queue_of(make_store)
    heard: list[tuple[str, str]] = []
    unlisten = await listening.listen(lambda kind, arg: heard.append((kind, arg)))
    pusher = await queue_of(make_store)
    await pusher.push([OutMessage("tasks:g", "1"), OutMessage("tasks:g", "2"), OutMessage("r", "")])
    await pusher.broadcast("cancel", ["run-1"])
    wanted = {("message", "tasks:g"), ("message", "r"), ("cancel", "run-1")}
    await wait_until(lambda: wanted <= set(heard), what="the notifications")
    assert heard.count(("message", "tasks:g")) == 1  # once per topic per push
    unlisten()
    heard.clear()
    # A listener still registered on the same store object hears the next
    # push; by then every listener of that object has been called for it.
    still: list[tuple[str, str]] = []
    await listening.listen(lambda kind, arg: still.append((kind, arg)))
    await pusher.push([OutMessage("r", "")])
    await wait_until(lambda: ("message", "r") in still, what="the remaining listener")
    assert ("message", "r") not in heard
