"""What only the ``db`` transport promises: tasks survive the process that
dispatched or claimed them, and several processes share one queue."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

import durably
from durably._queue import MessageQueue
from durably.stores import MemoryStore
from durably.testing.conformance import TransportFactory, wait_until
from durably.testing.conformance.transports.contract import Handler, Results, task
from durably.transports.base import TransportError
from durably.transports.db import RESULTS_TOPIC, DbTransport, task_topic
from durably.wire import Heartbeat, StepResult, StepTask


def _store(transport: object) -> object:
    assert isinstance(transport, DbTransport)
    return transport.store


async def _until_acked(queue: MessageQueue, timeout: float = 5.0) -> None:
    """Wait until the queue holds no message at all (each one acked): the
    count the queue keeps, so the absence of a further delivery is proven,
    not slept on."""
    deadline = time.monotonic() + timeout
    while (left := await queue.depth()) != {}:
        if time.monotonic() > deadline:
            pytest.fail(f"messages still queued after {timeout}s: {left}")
        await asyncio.sleep(0.01)


async def test_a_second_process_serves_what_the_first_dispatched(
    db_factory: TransportFactory,
) -> None:
    engine = await db_factory()
    worker = await db_factory()  # its own store object, as another process has
    results = Results()
    await engine.consume_results(results.on_results, results.on_heartbeat)

    async def answer(t: StepTask) -> None:
        await worker.send_result(StepResult(t.run_id, t.seq, ok=True, output=t.input))

    await worker.serve(["g"], answer, concurrency=8)
    await engine.dispatch([task(f"r{i}", input=i) for i in range(20)])
    await wait_until(lambda: len(results.results) == 20, what="20 results")
    assert sorted(r.output for r in results.results) == list(range(20))


async def test_two_servers_never_get_the_same_task(db_factory: TransportFactory) -> None:
    handlers = [Handler(delay=0.01) for _ in range(3)]
    for handler in handlers:
        server = await db_factory()
        await server.serve(["g"], handler, concurrency=5)
    sender = await db_factory()
    await sender.dispatch([task(f"r{i}") for i in range(150)])
    await wait_until(lambda: sum(len(h.seen) for h in handlers) >= 150, what="150 tasks")
    await asyncio.sleep(0.2)
    ids = [i for h in handlers for i in h.ids]
    assert sorted(ids) == sorted(f"r{i}:1" for i in range(150))


async def test_a_task_claimed_by_a_vanished_process_comes_back_after_its_lease(
    db_factory: TransportFactory,
) -> None:
    sender = await db_factory()
    await sender.dispatch([task("r1")])
    # a process claims it, then dies without ack or hand-back
    queue = _store(sender).messages()  # type: ignore[attr-defined]
    claimed_at = int(time.time() * 1000)
    ghost = await queue.claim([task_topic("g")], "ghost", 10, 300, claimed_at)
    assert len(ghost) == 1 and ghost[0].deliveries == 1
    server = await db_factory()
    arrived: list[int] = []

    async def handler(t: StepTask) -> None:
        arrived.append(int(time.time() * 1000))

    await server.serve(["g"], handler, concurrency=1)
    await wait_until(lambda: len(arrived) == 1, what="the redelivery")
    assert arrived[0] >= claimed_at + 300
    await _until_acked(queue)  # gone from the queue: it can never come back
    assert len(arrived) == 1


async def test_a_running_handler_keeps_its_task_past_the_lease(
    db_factory: TransportFactory,
) -> None:
    slow_server = await db_factory(lease_ms=300)
    slow = Handler(delay=1.2)
    await slow_server.serve(["g"], slow, concurrency=1)
    other_server = await db_factory(lease_ms=300)
    other = Handler()
    sender = await db_factory()
    await sender.dispatch([task("r1")])
    await wait_until(lambda: len(slow.seen) == 1, what="the slow handler to start")
    await other_server.serve(["g"], other, concurrency=1)
    await wait_until(lambda: slow.running == 0, what="the slow handler to finish")
    await _until_acked(_store(sender).messages())  # type: ignore[attr-defined]
    # acked by the slow server: nobody else was given it meanwhile, nor can be
    assert other.seen == []
    assert slow.ids == ["r1:1"]


async def test_results_whose_handler_raised_are_delivered_again(
    db_factory: TransportFactory,
) -> None:
    batches: list[list[str]] = []

    async def flaky(batch: list[StepResult]) -> None:
        batches.append([r.step_id for r in batch])
        if len(batches) == 1:
            raise RuntimeError("the store was down")

    consumer = await db_factory()
    results = Results()
    await consumer.consume_results(flaky, results.on_heartbeat)
    worker = await db_factory()
    await worker.send_result(StepResult("r1", 1, ok=True))
    await wait_until(lambda: len(batches) == 2, what="the result delivered again")
    await _until_acked(_store(worker).messages())  # type: ignore[attr-defined]
    # acked after the second delivery returned: there will be no third
    assert batches == [["r1:1"], ["r1:1"]]


async def test_a_beat_claimed_with_a_failing_result_acks_the_beat_not_the_result(
    db_factory: TransportFactory,
) -> None:
    """A beat and another step's result claimed together, the result's settle
    failing: the beat is acked (fire and forget) and the result comes back.
    (The beat's ack once took the id of the batch's last message: the result
    was deleted unsettled, lost, and the beat stayed queued.)"""
    from durably.wire import Heartbeat

    worker = await db_factory()
    await worker.send_heartbeat(Heartbeat("r1", 1, "g", at=1_700_000_000_000))
    await worker.send_result(StepResult("r2", 1, ok=True))
    batches: list[list[str]] = []

    async def flaky(batch: list[StepResult]) -> None:
        batches.append([r.step_id for r in batch])
        if len(batches) == 1:
            raise RuntimeError("the store was down")

    consumer = await db_factory()
    results = Results()
    await consumer.consume_results(flaky, results.on_heartbeat)
    await wait_until(lambda: len(batches) == 2, what="the result delivered again")
    await _until_acked(_store(worker).messages())  # type: ignore[attr-defined]
    assert batches == [["r2:1"], ["r2:1"]]
    assert [b.step_id for b in results.beats] == ["r1:1"]


async def test_close_hands_back_the_tasks_of_running_handlers(
    db_factory: TransportFactory,
) -> None:
    first = await db_factory()
    gate = asyncio.Event()
    started: list[str] = []

    async def blocked(t: StepTask) -> None:
        started.append(t.step_id)
        await gate.wait()

    await first.serve(["g"], blocked, concurrency=2)
    await first.dispatch([task("r1"), task("r2")])
    await wait_until(lambda: len(started) == 2, what="both handlers to start")
    await first.close()
    second = await db_factory()
    handler = Handler()
    await second.serve(["g"], handler, concurrency=2)
    await wait_until(lambda: sorted(handler.ids) == ["r1:1", "r2:1"], what="the hand-back")


async def test_dispatch_and_send_raise_transport_error_when_the_database_fails(
    db_factory: TransportFactory,
) -> None:
    transport = await db_factory()
    await _store(transport).close()  # type: ignore[attr-defined]
    with pytest.raises(TransportError):
        await transport.dispatch([task("r1")])
    with pytest.raises(TransportError):
        await transport.send_result(StepResult("r1", 1, ok=True))


async def test_a_malformed_message_is_dropped_not_redelivered(
    db_factory: TransportFactory,
) -> None:
    from durably._queue import OutMessage

    transport = await db_factory()
    queue = _store(transport).messages()  # type: ignore[attr-defined]
    await queue.push(
        [
            OutMessage(task_topic("g"), '{"seq": 1}'),
            OutMessage("results", "not json"),
            OutMessage("beats", "[]"),
        ]
    )
    handler = Handler()
    await transport.serve(["g"], handler, concurrency=1)
    results = Results()
    await transport.consume_results(results.on_results, results.on_heartbeat)
    for _ in range(100):
        if not await queue.depth():
            break
        await asyncio.sleep(0.05)
    assert await queue.depth() == {}
    assert handler.seen == [] and results.results == [] and results.beats == []


def test_a_memory_store_is_refused() -> None:
    with pytest.raises(ValueError, match="SQLite or PostgreSQL"):
        DbTransport(MemoryStore())


async def test_two_engines_on_one_schema_settle_results_without_a_deadlock(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two engines share one PostgreSQL schema and its ``db://`` transport:
    while one settles a batch of step results (locking the runs it wakes),
    the runs' owners commit their turns' writes on the same runs. No write
    may fail on a deadlock (it would cost a second and a redelivery)."""
    failures: list[BaseException] = []

    def build(instance: str) -> durably.Engine:
        engine = durably.Engine(
            postgres_url, transport="db://", instance_id=instance, poll_interval=0.05
        )

        @engine.step("times2")
        async def times2(n: int) -> int:
            await asyncio.sleep((n % 7) / 500)  # results come back spread out
            return n * 2

        @engine.workflow("double")
        async def double(ctx: durably.WorkflowContext, n: int) -> int:
            first = int(await ctx.step("times2", n))
            return int(await ctx.step("times2", first)) + 1

        settle = engine._steps.on_results

        async def counted(batch: list[StepResult], settle: Any = settle) -> None:
            try:
                await settle(batch)
            except BaseException as exc:
                failures.append(exc)
                raise

        engine._steps.on_results = counted  # type: ignore[method-assign]
        return engine

    engines = [build(f"i{i}") for i in range(2)]
    caplog.set_level(logging.WARNING, logger="durably")
    try:
        for engine in engines:
            await engine.start_worker()
        runs = await asyncio.gather(*(engines[i % 2].start("double", i) for i in range(400)))
        done = await asyncio.gather(
            *(engines[0].wait_for_run(run.run_id, terminal=True, timeout=90) for run in runs)
        )
        assert [r.output for r in done] == [4 * i + 1 for i in range(400)]
    finally:
        for engine in engines:
            await engine.close()
    deadlocks = [r.getMessage() for r in caplog.records if "deadlock" in r.getMessage()]
    assert not failures, failures
    assert not deadlocks, deadlocks


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_an_engine_on_its_own_store_settles_in_its_own_transactions(
    kind: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    """db:// on the engine's own store: a served task's result never enters
    the queue (settled with the task's deletion), a dispatched task enters it
    only in the transaction of its checkpoint, and nothing is left queued."""
    if kind == "sqlite":
        await _counted_run(f"sqlite:///{tmp_path / 'own.db'}")
    else:
        async with request.getfixturevalue("isolated_postgres")() as url:
            await _counted_run(url)


async def _counted_run(url: str) -> None:
    engine = durably.Engine(url, transport="db://", poll_interval=0.05)

    @engine.step("inc")
    async def inc(n: int) -> int:
        return n + 1

    @engine.workflow("three")
    async def three(ctx: durably.WorkflowContext, n: int) -> int:
        for _ in range(3):
            n = int(await ctx.step("inc", n))
        return n

    pushed: list[str] = []
    try:
        await engine.start_worker()
        queue = engine.store.messages()  # type: ignore[attr-defined]
        push = queue.push

        async def counted(messages: list[Any]) -> None:
            pushed.extend(m.topic for m in messages)
            await push(messages)

        queue.push = counted
        runs = [await engine.start("three", i) for i in range(10)]
        done = [await engine.wait_for_run(r.run_id, terminal=True, timeout=60) for r in runs]
        assert [r.output for r in done] == [i + 3 for i in range(10)]
        # neither a task nor a result went through a push of its own (runs do)
        assert [t for t in pushed if t == RESULTS_TOPIC or t.startswith("tasks:")] == []
        assert await queue.depth([RESULTS_TOPIC, task_topic("inc")]) == {}
    finally:
        await engine.close()


async def test_a_served_result_settled_here_is_never_followed_by_its_beat(
    db_factory: TransportFactory,
) -> None:
    """A result settled with its task's deletion skips the queue; a beat its
    step sent earlier may still be queued behind it. That beat is dropped:
    no beat is delivered after its step's result."""
    transport = await db_factory()
    assert isinstance(transport, DbTransport)
    seen: list[tuple[str, str]] = []

    async def settle(take: Any) -> None:
        results, _, _ = await take(lambda results: [], 0, None)
        seen.extend(("result", r.step_id) for r in results)

    async def on_results(results: list[StepResult]) -> None:
        seen.extend(("result", r.step_id) for r in results)

    async def on_heartbeat(beat: Any) -> None:
        seen.append(("beat", beat.step_id))

    assert await transport.consume_settling(transport.store, settle, on_results, on_heartbeat)

    async def serve(t: StepTask) -> None:
        await transport.send_result(StepResult(t.run_id, t.seq, ok=True, output=1))

    await transport.serve(["g"], serve, concurrency=1)
    await transport.dispatch([task("r1")])
    await wait_until(lambda: ("result", "r1:1") in seen, what="the result")
    # A beat of the same step, late (sent before the result, queued after it)
    await transport.send_heartbeat(Heartbeat("r1", 1, "g", 0))
    await transport.send_heartbeat(Heartbeat("r2", 1, "g", 0))  # another step's: delivered
    await wait_until(lambda: ("beat", "r2:1") in seen, what="the other step's beat")
    assert seen == [("result", "r1:1"), ("beat", "r2:1")]
    queue = transport.store.messages()  # type: ignore[attr-defined]
    assert await queue.depth() == {}  # the task went with its result; no ack left


async def test_served_results_alone_take_nothing_until_a_push_is_heard(
    db_factory: TransportFactory,
) -> None:
    """The settle of results served here takes nothing off the queue (no
    take statement) once a take found it drained and no push was heard
    since; a result another transport pushes is heard and taken."""
    transport = await db_factory()
    other = await db_factory()
    assert isinstance(transport, DbTransport) and isinstance(other, DbTransport)
    transport._poll_interval = 3600.0  # only notices and served results wake it
    store: Any = transport.store
    limits: list[tuple[int, list[str]]] = []
    claim_and_resolve = store.claim_and_resolve

    async def recorded(topics: Any, limit: int, *args: Any, **kwargs: Any) -> Any:
        got = await claim_and_resolve(topics, limit, *args, **kwargs)
        results, _ = got.decoded
        limits.append((limit, [r.step_id for r in results]))
        return got

    store.claim_and_resolve = recorded
    seen: list[str] = []

    async def settle(take: Any) -> None:
        results, _, _ = await take(lambda results: [], 0, None)
        seen.extend(r.step_id for r in results)

    async def on_results(results: list[StepResult]) -> None:
        raise AssertionError("the settling consumer delivers through settle")

    async def on_heartbeat(beat: Any) -> None:
        pass

    assert await transport.consume_settling(store, settle, on_results, on_heartbeat)

    async def serve(t: StepTask) -> None:
        await transport.send_result(StepResult(t.run_id, t.seq, ok=True, output=1))

    await transport.serve(["g"], serve, concurrency=1)

    async def served(run_id: str) -> None:
        await transport.dispatch([task(run_id)])
        await wait_until(lambda: f"{run_id}:1" in seen, what=f"the result of {run_id}")

    await served("r1")
    await other.send_result(StepResult("queued", 1, ok=True, output=2))
    await wait_until(lambda: "queued:1" in seen, what="the pushed result")
    # The push's notice may reach us after its result was taken: it costs
    # at most the next two settles a take (the one it lands in, the next).
    for run_id in ("r2", "r3", "r4"):
        await served(run_id)

    assert [limit for limit, steps in limits if "queued:1" in steps] == [256]
    assert [limit for limit, steps in limits if "r4:1" in steps] == [0]
    assert seen.count("queued:1") == 1 and len(seen) == len(set(seen)) == 5
    assert await transport._q().depth() == {}
