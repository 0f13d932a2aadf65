"""Born claimed tasks on ``db://``: a task sent with its checkpoint for a group
the sending transport serves, while its server has a free slot and nothing is
queued for it, is inserted already claimed and handed to the server in
memory. What that must not break: other instances still get what this one
cannot take, a task of a server that stopped or died comes back, and tasks
already queued are not overtaken."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from durably import _codec as codec
from durably._notices import StoreNotice
from durably._queue import OutMessage
from durably.testing.conformance import TransportFactory, wait_until
from durably.testing.conformance.stores.steps import OWNER, _leased, dispatched_cp
from durably.testing.conformance.transports.contract import Handler, task
from durably.transports.db import DbTransport, task_topic
from durably.wire import StepTask


def _db(transport: object) -> DbTransport:
    assert isinstance(transport, DbTransport)
    return transport


class _Claims:
    """Counts the claims a transport makes from now on."""

    def __init__(self, transport: DbTransport) -> None:
        self.count = 0
        queue = transport._q()
        claim = queue.claim

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await claim(*args, **kwargs)

        queue.claim = counted  # type: ignore[method-assign]


async def _send(transport: DbTransport, run_id: str) -> bool:
    """Send ``run_id``'s step 1 with its checkpoint, as a turn does."""
    store: Any = transport.store
    await _leased(store, run_id)
    send = transport.checkpoint_sender(store)
    assert send is not None
    return await send(dispatched_cp(run_id, 1), OWNER, [task(run_id)])


async def _drained(transport: DbTransport) -> None:
    """Its server's first claim found the queue empty (from now on a send may
    be born claimed)."""
    await wait_until(lambda: not transport._backlog, what="the first claim to drain the queue")


async def _acked(transport: DbTransport) -> None:
    """Wait until no task is queued (each one acked after its handler)."""
    deadline = asyncio.get_running_loop().time() + 5
    while await transport._q().depth([task_topic("g")]) != {}:
        assert asyncio.get_running_loop().time() < deadline, "a task was never acked"
        await asyncio.sleep(0.01)


class _Gate:
    """A handler that records its tasks and holds each until opened."""

    def __init__(self) -> None:
        self.seen: list[StepTask] = []
        self.open = asyncio.Event()

    async def __call__(self, t: StepTask) -> None:
        self.seen.append(t)
        await self.open.wait()

    @property
    def runs(self) -> list[str]:
        return [t.run_id for t in self.seen]


async def test_a_task_for_a_served_group_is_born_claimed_and_needs_no_claim(
    db_factory: TransportFactory,
) -> None:
    server = _db(await db_factory())
    handler = Handler()
    await server.serve(["g"], handler, concurrency=8)
    await _drained(server)
    claims = _Claims(server)

    for n in range(5):
        assert await _send(server, f"r{n}")
    await wait_until(lambda: len(handler.seen) == 5, what="5 tasks served")

    assert [t.run_id for t in handler.seen] == [f"r{n}" for n in range(5)]
    assert server.born == 5
    assert claims.count == 0  # handed over in memory: no claim, none after either
    await _acked(server)


async def test_a_born_claimed_task_reaches_its_handler_as_a_claimed_one_would(
    db_factory: TransportFactory,
) -> None:
    """The server gets a born claimed task as sent (not decoded from its
    message again): every field the wire carries must match what a claim of
    the same message gives another instance."""
    busy = _db(await db_factory())
    gate = _Gate()
    await busy.serve(["g"], gate, concurrency=1)
    await _drained(busy)
    other = _db(await db_factory())
    handler = Handler()
    await other.serve(["g"], handler, concurrency=4)
    store: Any = busy.store
    send = busy.checkpoint_sender(store)
    assert send is not None
    fields: dict[str, Any] = {
        "input": {"a": [1, "x"], "b": None},
        "attempt": 3,
        "priority": 7,
        "traceparent": "00-abc-def-01",
        "context": {"k": "v"},
        "transport": "db://",
        "sent_at": 1234,
    }

    for run_id in ("born", "claimed"):
        await _leased(store, run_id)
        sent = task(run_id, 1, **fields)
        assert await send(dispatched_cp(run_id, 1), OWNER, [sent])
        if run_id == "born":
            await wait_until(lambda: gate.runs == ["born"], what="the born task to run here")
    await wait_until(lambda: len(handler.seen) == 1, what="the other instance to claim one")

    assert busy.born == 1 and other.born == 0
    assert gate.seen == [task("born", 1, **fields)]
    assert handler.seen == [task("claimed", 1, **fields)]
    gate.open.set()


async def test_another_instance_serves_what_a_full_server_cannot_take(
    db_factory: TransportFactory,
) -> None:
    busy = _db(await db_factory())
    gate = _Gate()
    await busy.serve(["g"], gate, concurrency=1)
    await _drained(busy)
    other = _db(await db_factory())
    handler = Handler()
    await other.serve(["g"], handler, concurrency=4)

    assert await _send(busy, "mine")
    await wait_until(lambda: gate.runs == ["mine"], what="the first task to run here")
    assert await _send(busy, "overflow")  # no free slot here: queued for anyone
    await wait_until(lambda: len(handler.seen) == 1, what="the other instance to take it")

    assert [t.run_id for t in handler.seen] == ["overflow"]
    assert gate.runs == ["mine"] and busy.born == 1 and other.born == 0
    gate.open.set()


async def test_a_born_claimed_task_of_a_server_that_stopped_is_handed_back(
    db_factory: TransportFactory,
) -> None:
    """The server stops while the write carrying a born claimed task is in
    flight: the task is handed back at once (not held for a lease) and
    another instance serves it."""
    stopping = _db(await db_factory())
    gate = _Gate()
    await stopping.serve(["g"], gate, concurrency=4)
    await _drained(stopping)
    other = _db(await db_factory())
    handler = Handler()
    await other.serve(["g"], handler, concurrency=4)

    store: Any = stopping.store
    await _leased(store, "r1")
    send = stopping.checkpoint_sender(store)
    assert send is not None
    sent = send(dispatched_cp("r1", 1), OWNER, [task("r1")])  # born claimed: a slot is free
    assert stopping._reserved == 1
    await stopping.stop_serving()
    assert await sent

    await wait_until(lambda: len(handler.seen) == 1, what="the other instance to serve it")
    assert gate.seen == [] and stopping.born == 0
    assert [t.run_id for t in handler.seen] == ["r1"]


async def test_a_born_claimed_task_of_a_dead_server_comes_back_after_its_lease(
    db_factory: TransportFactory,
) -> None:
    """The process dies right after the insert that holds its task commits
    (its handler never ran): any server claims the task once the lease
    passes, as its second delivery, and runs it once."""
    doomed = _db(await db_factory(lease_ms=300))
    gate = _Gate()
    await doomed.serve(["g"], gate, concurrency=4)
    await _drained(doomed)
    committed: list[bool] = []

    def dies(messages: Any, generation: int, answer: Any, written: Any) -> None:
        committed.append(written.result() is not None)
        answer.set_result(True)  # and then nothing: the process is gone

    doomed._born = dies  # type: ignore[method-assign]
    assert await _send(doomed, "r1")
    await doomed.stop_serving()  # a dead process claims nothing more
    assert committed == [True]

    heir = _db(await db_factory())
    seen: list[tuple[str, int]] = []

    async def record(t: StepTask) -> None:
        seen.append((t.run_id, t.seq))

    claimed = heir._q().claim
    deliveries: list[int] = []

    async def noting(*args: Any, **kwargs: Any) -> Any:
        got = await claimed(*args, **kwargs)
        deliveries.extend(m.deliveries for m in got)
        return got

    heir._q().claim = noting  # type: ignore[method-assign]
    await heir.serve(["g"], record, concurrency=4)
    await wait_until(lambda: seen == [("r1", 1)], what="the heir to serve it after the lease")
    assert deliveries == [2]  # born claimed was its first delivery
    assert gate.seen == []
    await _acked(heir)


async def test_tasks_queued_for_a_server_are_not_overtaken_by_new_ones(
    db_factory: TransportFactory,
) -> None:
    """Once a push for its topics is heard, a server's free slot belongs to
    the queue (in its order) until a claim drains it: a send meanwhile is
    queued like any task, not born claimed."""
    server = _db(await db_factory())
    handler = Handler()
    await server.serve(["g"], handler, concurrency=4)
    await _drained(server)

    store: Any = server.store
    await _leased(store, "after-the-push")
    send = server.checkpoint_sender(store)
    assert send is not None
    # What a push from elsewhere sounds like, before the claim it wakes runs.
    server._heard(StoreNotice.MESSAGE, task_topic("g"))
    assert await send(dispatched_cp("after-the-push", 1), OWNER, [task("after-the-push")])

    assert server.born == 0
    await wait_until(lambda: len(handler.seen) == 1, what="the claim to serve it")
    await _drained(server)
    assert await _send(server, "born")
    await wait_until(lambda: len(handler.seen) == 2, what="the born one")
    assert server.born == 1


async def test_a_lost_lease_sends_nothing_and_frees_the_slot(
    db_factory: TransportFactory,
) -> None:
    server = _db(await db_factory())
    gate = _Gate()
    await server.serve(["g"], gate, concurrency=1)
    await _drained(server)
    store: Any = server.store
    await _leased(store, "lost", owner="someone-else")
    send = server.checkpoint_sender(store)
    assert send is not None

    assert await send(dispatched_cp("lost", 1), OWNER, [task("lost")]) is False

    assert server._reserved == 0 and server.born == 0
    assert await server._q().depth() == {}
    assert await _send(server, "next")  # the slot is free again
    await wait_until(lambda: gate.runs == ["next"], what="the next task")
    assert server.born == 1
    gate.open.set()


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_burst_never_runs_more_than_the_slots(
    db_factory: TransportFactory, concurrency: int
) -> None:
    server = _db(await db_factory())
    handler = Handler(delay=0.02)
    await server.serve(["g"], handler, concurrency=concurrency)
    await _drained(server)

    sent = await asyncio.gather(*(_send(server, f"r{n:02}") for n in range(12)))

    assert sent == [True] * 12
    await wait_until(lambda: len(handler.seen) == 12, what="12 tasks served")
    assert sorted(t.run_id for t in handler.seen) == [f"r{n:02}" for n in range(12)]
    assert handler.most <= concurrency
    assert 1 <= server.born <= 12


async def test_tasks_a_poll_finds_are_not_overtaken_by_new_ones(
    db_factory: TransportFactory,
) -> None:
    """Tasks pushed where this server hears no notice (another process on
    SQLite, a lost notice on PostgreSQL) are found by its poll: a poll that
    fills every free slot leaves the rest queued, so a slot freed afterwards
    belongs to them, not to a task sent here meanwhile."""
    server = _db(await db_factory())
    server._poll_interval = 3600.0  # the test ticks the poll itself
    held: dict[str, asyncio.Event] = {}

    async def handler(t: StepTask) -> None:
        seen.append(t.run_id)
        await held.setdefault(t.run_id, asyncio.Event()).wait()

    seen: list[str] = []
    await server.serve(["g"], handler, concurrency=2)
    await _drained(server)
    unlisten = server._unlisten
    assert unlisten is not None
    unlisten()  # from now on it hears no push: only its poll finds them
    server._unlisten = None

    await server._q().push(
        [
            OutMessage(task_topic("g"), codec.dumps(task(run).to_wire()))
            for run in ("q1", "q2", "q3")
        ]
    )
    server._task_wake.set()  # a poll tick
    await wait_until(lambda: seen == ["q1", "q2"], what="the poll to fill both slots")
    held["q1"].set()
    # Its freed slot is the queue's: claimed for q3 at once, or about to be.
    await wait_until(lambda: len(server._running) == 1 or "q3" in seen, what="q1 to finish")

    assert await _send(server, "new")
    assert server.born == 0  # q3 was queued first: "new" waits its turn
    await wait_until(lambda: seen == ["q1", "q2", "q3"], what="the queue's next task")
    for run in ("q2", "q3"):
        held[run].set()
    held.setdefault("new", asyncio.Event()).set()
    await wait_until(lambda: seen[-1:] == ["new"], what="the new task after them")
