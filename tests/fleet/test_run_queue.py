"""The fleet's run queue (``transport="db://"``) on a real PostgreSQL.

Several in-process engines share one schema; each has its own pool and
instance id, so they compete for the queue's messages as separate processes
would. One test per rule of :mod:`durably._run_queue`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

import durably
from durably import RunStatus
from durably._queue import Message, MessageQueue, OutMessage
from durably._run_queue import MAX_HELD
from durably._worker import PENDING_GRACE_MS
from durably.testing import VirtualClock, eventually

pytestmark = [pytest.mark.timeout(300)]

POLL = 0.05
WAIT = 60.0
"""Seconds ``eventually`` waits here: several engines share two loaded cores."""
TOPIC = "runs:default"


def make_engine(url: str, **kwargs: Any) -> durably.Engine:
    kwargs.setdefault("poll_interval", POLL)
    return durably.Engine(url, transport="db://", **kwargs)


def register_refusing(engine: durably.Engine, name: str, ran: list[str]) -> None:
    """A producer's copy of workflow ``name``: it must never execute."""

    async def body(ctx: durably.WorkflowContext, n: int) -> None:
        ran.append(ctx.run_id)
        raise AssertionError(f"the producer executed {ctx.run_id}")

    engine.register(name, body)


def queue_of(engine: durably.Engine) -> Any:
    run_queue = engine._run_queue
    assert run_queue is not None, "the db:// transport carries a run queue"
    return run_queue


async def depth(engine: durably.Engine, topic: str = TOPIC) -> int:
    found = await engine.store.messages().depth([topic])  # type: ignore[attr-defined]
    return int(found.get(topic, 0))


async def unclaimed(url: str, topic: str = TOPIC) -> int:
    """Messages of ``topic`` nobody holds (read straight from the table)."""
    base, _, query = url.partition("?")
    schema = dict(part.split("=", 1) for part in query.split("&"))["schema"]
    conn = await asyncpg.connect(base)
    try:
        n = await conn.fetchval(
            f'SELECT count(*) FROM "{schema}".durably_messages '
            "WHERE topic = $1 AND claimed_by IS NULL",
            topic,
        )
    finally:
        await conn.close()
    return int(n)


async def wait_all(engine: durably.Engine, run_ids: list[str], timeout: float = 120) -> None:
    results = await asyncio.gather(
        *(engine.wait_for_run(r, terminal=True, timeout=timeout) for r in run_ids)
    )
    bad = [(r.run_id, r.status, r.error) for r in results if r.status is not RunStatus.COMPLETED]
    assert not bad, bad[:5]


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


class SpyQueue:
    """Wraps a message queue: records every push, claim and depth query, counts
    the consumer's passes, and fails pushes on demand.

    Installed on a running engine, it sees the consumer's next passes: the
    consumer reads ``poll_interval`` once a pass, as it goes to wait for the
    next one, so ``passes`` counts the passes whose claim decision was made.
    """

    def __init__(self, inner: MessageQueue) -> None:
        self._inner = inner
        self.pushes: list[list[OutMessage]] = []
        self.failing = False
        self.hold: asyncio.Event | None = None
        """Set: every push waits for it (a producer paused between its insert and its push)."""
        self.failures = 0
        self.claim_delay = 0.0
        self.claimed_late = asyncio.Event()
        self.claims: list[tuple[list[str], int]] = []  # (topics, messages taken)
        self.depths: list[tuple[list[str] | None, dict[str, int]]] = []
        self.passes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def poll_interval(self) -> float:
        self.passes += 1
        return float(self._inner.poll_interval)

    async def depth(self, topics: list[str] | None = None) -> dict[str, int]:
        found: dict[str, int] = await self._inner.depth(topics)
        self.depths.append((None if topics is None else list(topics), found))
        return found

    async def push(self, messages: list[OutMessage]) -> None:
        self.pushes.append(list(messages))
        if self.hold is not None:
            await self.hold.wait()
        if self.failing:
            self.failures += 1
            raise ConnectionError("the queue is down (test)")
        await self._inner.push(messages)

    async def claim(self, *args: Any) -> list[Message]:
        taken: list[Message] = await self._inner.claim(*args)
        self.claims.append((list(args[0]), len(taken)))
        if taken and self.claim_delay:
            self.claimed_late.set()
            await asyncio.sleep(self.claim_delay)  # the statement ran; its answer is slow
        return taken


def spy_on(engine: durably.Engine) -> SpyQueue:
    broker = queue_of(engine)._broker
    spy = SpyQueue(broker._queue)
    broker._queue = spy
    return spy


def sweep_signal(engine: durably.Engine) -> asyncio.Event:
    """Set once the engine's worker has finished a sweep of pending runs;
    install it before the engine opens (its worker sweeps at once)."""
    swept = asyncio.Event()
    worker = engine._worker
    sweep = worker.run_pending

    async def run_pending(limit: int = 1000) -> int:
        try:
            return await sweep(limit)
        finally:
            swept.set()

    worker.run_pending = run_pending  # type: ignore[method-assign]
    return swept


def register_short(engine: durably.Engine, done_by: Counter[str]) -> None:
    """A short workflow of a few local steps; counts executions per instance."""
    instance = engine.instance_id

    async def record(n: int) -> int:
        done_by[instance] += 1
        return n

    @engine.workflow("short")
    async def short(ctx: durably.WorkflowContext, n: int) -> int:
        a = await ctx.local_step("a", lambda: n + 1)
        await ctx.local_step("pause", asyncio.sleep, 0.005)
        return await ctx.local_step("b", record, a)


# -- 1. runs spread over the driving instances -------------------------------------------


async def test_runs_spread_over_consumers_and_never_run_on_the_producer(postgres_url: str) -> None:
    producer_ran: list[str] = []
    done_by: Counter[str] = Counter()

    producer = make_engine(postgres_url, consumers="never")
    register_refusing(producer, "short", producer_ran)
    consumers = [make_engine(postgres_url) for _ in range(2)]
    for engine in consumers:
        register_short(engine, done_by)

    async with producer, consumers[0], consumers[1]:
        ids = [(await producer.start("short", i, run_id=f"r{i}")).run_id for i in range(200)]
        await wait_all(consumers[0], ids)
        consumed = [queue_of(e).consumed for e in consumers]
        assert queue_of(producer).consumed == 0
        assert not queue_of(producer).consuming
        assert queue_of(producer).pushed == 200

    assert producer_ran == []
    assert sum(done_by.values()) == 200
    assert all(done_by[e.instance_id] > 0 for e in consumers), done_by
    assert all(n > 0 for n in consumed), consumed


# -- 2. at most MAX_HELD claimed per instance ---------------------------------------------


def register_gated(
    engine: durably.Engine,
    gates: dict[str, asyncio.Event],
    executing: dict[str, set[str]],
    done_by: dict[str, str],
) -> None:
    """Workflow ``gated``: its first step blocks while this engine's gate is shut."""
    instance = engine.instance_id
    gate = gates.setdefault(instance, asyncio.Event())
    inside = executing.setdefault(instance, set())

    async def block(run_id: str) -> str:
        inside.add(run_id)
        await gate.wait()
        return instance

    @engine.workflow("gated")
    async def gated(ctx: durably.WorkflowContext, n: int) -> str:
        by = await ctx.local_step("block", block, ctx.run_id)
        done_by[ctx.run_id] = by
        return by


async def test_an_instance_holds_at_most_64_and_another_takes_the_rest(postgres_url: str) -> None:
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    first, second = make_engine(postgres_url), make_engine(postgres_url)
    register_gated(first, gates, executing, done_by)
    register_gated(second, gates, executing, done_by)
    a, b = first.instance_id, second.instance_id

    async with first:
        ids = [(await first.start("gated", i, run_id=f"g{i:03}")).run_id for i in range(100)]
        await eventually(
            lambda: len(executing[a]) >= MAX_HELD, what="64 runs execute", timeout=WAIT
        )
        # It must not take more: watch three more passes of its consumer.
        spy = spy_on(first)
        await eventually(
            lambda: spy.passes >= 3, what="three passes of the first's consumer", timeout=WAIT
        )
        assert len(executing[a]) == MAX_HELD
        # Its slots hold claimed messages and runs born leased here (started
        # while a slot was free and nothing was queued): those never became
        # messages. Claimed or not, every message is still there.
        lent = queue_of(first).lent
        assert queue_of(first).held + lent == MAX_HELD
        assert await depth(first) == 100 - lent
        assert await unclaimed(postgres_url) == 100 - MAX_HELD
        async with second:
            await eventually(
                lambda: len(executing[b]) == 100 - MAX_HELD,
                what="the second takes the rest",
                timeout=WAIT,
            )
            assert len(executing[a]) == MAX_HELD  # the first is still blocked
            assert queue_of(first).held + queue_of(first).lent == MAX_HELD
            assert await unclaimed(postgres_url) == 0
            gates[a].set()
            gates[b].set()
            await wait_all(first, ids)
            await eventually(
                lambda: queue_of(first).held + queue_of(first).lent == 0,
                what="the first acks its messages and gets its lent slots back",
                timeout=WAIT,
            )
            await eventually(
                lambda: queue_of(second).held == 0,
                what="the second acks its messages",
                timeout=WAIT,
            )
            await eventually(
                lambda: _is(depth(first), 0), what="every message is acked", timeout=WAIT
            )
    assert Counter(done_by.values()) == {a: MAX_HELD, b: 100 - MAX_HELD}


# -- 3. priority ---------------------------------------------------------------------------


async def test_higher_priority_first_then_oldest(postgres_url: str) -> None:
    producer_ran: list[str] = []
    order: list[str] = []
    producer = make_engine(postgres_url, consumers="never")
    register_refusing(producer, "ordered", producer_ran)
    consumer = make_engine(postgres_url, max_concurrent_runs=1)

    async def record(run_id: str) -> None:
        order.append(run_id)

    @consumer.workflow("ordered")
    async def ordered(ctx: durably.WorkflowContext, n: int) -> None:
        await ctx.local_step("record", record, ctx.run_id)

    priorities = [0, 5, 10, 5, 0, 10, 0, 5, 10, 5, 0, 10, 0, 5, 10, -1, 3, -1, 3]
    async with producer:
        ids = []
        for i, priority in enumerate(priorities):
            run = await producer.start("ordered", i, run_id=f"p{i:02}", priority=priority)
            ids.append(run.run_id)
        n = len(priorities)
        await eventually(
            lambda: queue_of(producer).pushed == n, what="every start is pushed", timeout=WAIT
        )
        assert await depth(producer) == n
        async with consumer:
            await wait_all(consumer, ids)

    expected = [ids[i] for i in sorted(range(len(ids)), key=lambda i: (-priorities[i], i))]
    assert order == expected
    assert producer_ran == []


# -- 4. a failed push loses nothing --------------------------------------------------------


def enqueue_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "durably.runqueue" and "could not enqueue" in r.getMessage()
    ]


async def test_failed_start_pushes_stay_pending_for_the_safety_poll(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="durably.runqueue")
    producer_ran: list[str] = []
    done_by: Counter[str] = Counter()
    clock = VirtualClock()
    producer = make_engine(postgres_url, consumers="never", clock=clock)
    register_refusing(producer, "short", producer_ran)
    consumer = make_engine(postgres_url, clock=clock)
    register_short(consumer, done_by)

    async with producer:
        spy = spy_on(producer)
        spy.failing = True
        ids = []
        for i in range(6):
            ids.append((await producer.start("short", i, run_id=f"f{i}")).run_id)
            await eventually(
                lambda i=i: spy.failures > i, what="the push is tried (and fails)", timeout=WAIT
            )
        assert spy.failures == 6
        assert len(enqueue_errors(caplog)) == 1  # reported once for the minute
        assert queue_of(producer).pushed == 0
        for run_id in ids:
            run = await producer.get_run(run_id)
            assert run is not None and run.status is RunStatus.PENDING
        assert await depth(producer) == 0
        clock.advance(f"{PENDING_GRACE_MS}ms")  # no longer likely to be on their way
        async with consumer:  # its safety poll finds them (the queue holds no runs)
            await wait_all(consumer, ids)
        assert len(enqueue_errors(caplog)) == 1
    assert done_by[consumer.instance_id] == len(ids)
    assert producer_ran == []


async def test_a_wake_whose_push_fails_runs_locally(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="durably.runqueue")
    engine = make_engine(postgres_url)

    @engine.workflow("waiter")
    async def waiter(ctx: durably.WorkflowContext, token: str) -> str:
        got = await ctx.wait_for_signal(token)
        return await ctx.local_step("after", lambda: f"got {got}")

    async with engine:
        ids = [(await engine.start("waiter", f"t{i}", run_id=f"w{i}")).run_id for i in range(3)]
        for run_id in ids:
            result = await engine.wait_for_run(run_id, timeout=30)
            assert result.status is RunStatus.SUSPENDED
        await eventually(
            lambda: queue_of(engine).held == 0, what="the starts are handled", timeout=WAIT
        )
        await eventually(lambda: _is(depth(engine), 0), what="the queue is empty", timeout=WAIT)
        consumed = queue_of(engine).consumed
        spy = spy_on(engine)
        spy.failing = True  # from now on nothing reaches the queue
        for i in range(3):
            assert await engine.signal(f"t{i}", i) == f"w{i}"
        await wait_all(engine, ids, timeout=30)
        assert spy.failures >= 1
        assert queue_of(engine).consumed == consumed  # not one came through the queue
        await eventually(lambda: _is(depth(engine), 0), what="every message is acked", timeout=WAIT)
        assert len(enqueue_errors(caplog)) == 1
        for i, run_id in enumerate(ids):
            run = await engine.get_run(run_id)
            assert run is not None and run.output == f"got {i}"


# -- 5. a drain hands its messages back ----------------------------------------------------


async def test_drain_hands_back_what_it_holds(postgres_url: str) -> None:
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    first, second = make_engine(postgres_url), make_engine(postgres_url)
    register_gated(first, gates, executing, done_by)
    register_gated(second, gates, executing, done_by)
    a, b = first.instance_id, second.instance_id
    gates[b].set()  # only the first blocks
    n = 20

    try:
        async with first:
            ids = [(await first.start("gated", i, run_id=f"d{i:02}")).run_id for i in range(n)]
            await eventually(
                lambda: len(executing[a]) == n, what="the first executes every run", timeout=WAIT
            )
            # Claimed messages, or runs born leased here (no message at all).
            assert queue_of(first).held + queue_of(first).lent == n
            async with second:
                # Nothing for the second while the first holds all: its claims
                # come back empty.
                spy = spy_on(second)
                await eventually(
                    lambda: len(spy.claims) >= 3, what="three claims by the second", timeout=WAIT
                )
                assert [taken for _, taken in spy.claims] == [0] * len(spy.claims)
                assert not executing.get(b)
                await first.drain(timeout=0.2)
                assert queue_of(first).held == 0
                assert queue_of(first).lent == 0
                assert not queue_of(first).consuming
                await wait_all(second, ids)
                assert {done_by[r] for r in ids} == {b}
                assert executing[b] == set(ids)
                await eventually(
                    lambda: queue_of(second).held == 0, what="the second acks", timeout=WAIT
                )
                await eventually(
                    lambda: _is(depth(second), 0), what="the queue is empty", timeout=WAIT
                )
                assert queue_of(first).consumed == 0  # handed back, never acked there
    finally:
        gates[a].set()
    for run_id in ids:
        assert done_by[run_id] == b


async def test_a_drain_mid_claim_hands_back_what_the_claim_took(postgres_url: str) -> None:
    done_by: Counter[str] = Counter()
    first, second = make_engine(postgres_url), make_engine(postgres_url)
    register_short(first, done_by)
    register_short(second, done_by)
    n = 10
    await first.open()
    try:
        spy = spy_on(first)
        spy.claim_delay = 2.0
        ids = [(await first.start("short", i, run_id=f"m{i}")).run_id for i in range(n)]
        await eventually(
            lambda: queue_of(first).pushed == n, what="every start is pushed", timeout=WAIT
        )
        await first.start_worker()
        await spy.claimed_late.wait()  # the claim took them and has not answered yet
        await first.drain(timeout=0.2)
        assert queue_of(first).held == 0
        assert await unclaimed(postgres_url) == n  # not left invisible until the lease ends
        async with second:
            await wait_all(second, ids, timeout=20)  # well within the 30 s lease
    finally:
        await first.close()
    assert done_by == {second.instance_id: n}


def register_parent(engine: durably.Engine, gate: asyncio.Event | None) -> None:
    """``parent`` waits at a gate (when given one), then starts a child."""

    async def wait_gate() -> None:
        if gate is not None:
            await gate.wait()

    @engine.workflow("kid")
    async def kid(ctx: durably.WorkflowContext, n: int) -> int:
        return n

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext, n: int) -> int:
        await ctx.local_step("gate", wait_gate)
        child: int = await ctx.child("kid", n, run_id=f"{ctx.run_id}-kid")
        return child


async def test_a_child_spawned_during_a_drain_is_queued(postgres_url: str) -> None:
    gate = asyncio.Event()
    first, second = make_engine(postgres_url), make_engine(postgres_url)
    register_parent(first, gate)
    register_parent(second, None)
    await first.open()
    # Another instance is busy with a run: the queue is never empty meanwhile.
    queue = first.store.messages()  # type: ignore[attr-defined]
    await queue.push([OutMessage(TOPIC, '{"runId":"elsewhere","wake":false}')])
    assert len(await queue.claim([TOPIC], "elsewhere", 1, 120_000, int(time.time() * 1000))) == 1

    async with first:
        await first.start("parent", 7, run_id="p")
        await eventually(
            lambda: queue_of(first).held == 1, what="the first runs the parent", timeout=WAIT
        )
        async with second:
            try:
                draining = asyncio.create_task(first.drain(timeout=5))
                await asyncio.sleep(0.2)
                gate.set()  # the parent's turn goes on within the drain and spawns its child
                await draining
                result = await second.wait_for_run("p", terminal=True, timeout=10)
                assert result.status is RunStatus.COMPLETED and result.output == 7
            finally:
                gate.set()


# -- 6. a burst goes out in multi-row pushes -----------------------------------------------


async def test_a_fan_of_1000_children_is_pushed_in_a_few_statements(postgres_url: str) -> None:
    n = 1000
    engines = [make_engine(postgres_url) for _ in range(2)]
    for engine in engines:

        @engine.workflow("square")
        async def square(ctx: durably.WorkflowContext, x: int) -> int:
            return await ctx.local_step("mul", lambda: x * x)

        @engine.workflow("fan")
        async def fan(ctx: durably.WorkflowContext, count: int) -> int:
            results = await ctx.all([ctx.child("square", i) for i in range(count)])
            return sum(results)

    async with engines[0], engines[1]:
        spies = [spy_on(engine) for engine in engines]
        await engines[0].start("fan", n, run_id="fan")
        result = await engines[0].wait_for_run("fan", terminal=True, timeout=240)
        assert result.status is RunStatus.COMPLETED, result.error
        assert result.output == sum(i * i for i in range(n))

    def is_child(message: OutMessage) -> bool:
        return message.body.startswith('{"runId":"fan.child.') and '"wake":false' in message.body

    child_pushes = [[m for m in push if is_child(m)] for spy in spies for push in spy.pushes]
    child_pushes = [push for push in child_pushes if push]
    pushed = Counter(m.body for push in child_pushes for m in push)
    assert len(pushed) == n  # every child was queued
    assert len(child_pushes) <= 5, [len(p) for p in child_pushes]


# -- 7. a due timer is claimed before it is queued -----------------------------------------


def register_sleeper(engine: durably.Engine, after: list[tuple[str, str]]) -> None:
    instance = engine.instance_id

    async def record(run_id: str) -> str:
        after.append((run_id, instance))
        return instance

    @engine.workflow("sleeper")
    async def sleeper(ctx: durably.WorkflowContext, i: int) -> str:
        await ctx.sleep(0.3)
        by: str = await ctx.local_step("after", record, ctx.run_id)
        return by


async def test_due_timers_wake_each_run_once(postgres_url: str) -> None:
    n = 50
    after: list[tuple[str, str]] = []
    engines = [make_engine(postgres_url) for _ in range(2)]
    for engine in engines:
        register_sleeper(engine, after)

    async with engines[0], engines[1]:
        ids = [
            (await engines[i % 2].start("sleeper", i, run_id=f"s{i:02}")).run_id for i in range(n)
        ]
        await wait_all(engines[0], ids)
        queues = [queue_of(engine) for engine in engines]

        async def all_handled() -> bool:
            # Every message pushed (starts, timer wakes, duplicates if any) was
            # handled and acked: no duplicate wake is still on its way.
            pushed = sum(q.pushed for q in queues)
            return (
                pushed == sum(q.consumed for q in queues)
                and all(q.held == 0 for q in queues)
                and await depth(engines[0]) == 0
            )

        await eventually(all_handled, what="every queued message is handled", timeout=WAIT)
        for engine in engines:
            await engine.join()  # and every turn here has ended

    executions = Counter(run_id for run_id, _ in after)
    assert set(executions) == set(ids)
    assert [r for r, count in executions.items() if count != 1] == []


# -- 8. namespaces -------------------------------------------------------------------------


async def test_a_namespace_consumer_takes_only_its_topic(postgres_url: str) -> None:
    ran: list[tuple[str, str]] = []
    refused: list[str] = []
    producers = {
        ns: make_engine(postgres_url, namespace=ns, consumers="never") for ns in ("a", "b")
    }
    for producer in producers.values():
        register_refusing(producer, "where", refused)
    only_a = make_engine(postgres_url, namespace="a")
    every = make_engine(postgres_url)
    for engine in (only_a, every):
        instance = engine.instance_id

        async def record(run_id: str, instance: str = instance) -> str:
            ran.append((run_id, instance))
            return instance

        engine.register("where", _where(record))

    async with producers["a"], producers["b"]:
        async with only_a:
            await producers["b"].start("where", 0, run_id="b1")
            await producers["a"].start("where", 0, run_id="a1")
            await wait_all(only_a, ["a1"])
            await eventually(
                lambda: _is(depth(only_a, "runs:b"), 1), what="b1 is queued on runs:b", timeout=WAIT
            )
            # Several claims and two safety polls go by. A safety poll (once
            # a second) asks the depth of runs:a and, finding it empty, lists
            # the pending runs of namespace a; the second proves the first ended.
            spy = spy_on(only_a)

            def safety_polls() -> int:
                return sum(
                    1
                    for topics, found in spy.depths
                    if topics == ["runs:a"] and not any(found.values())
                )

            await eventually(
                lambda: len(spy.claims) >= 3 and safety_polls() >= 2,
                what="claims and safety polls",
                timeout=WAIT,
            )
            assert {topic for topics, _ in spy.claims for topic in topics} == {"runs:a"}
            b1 = await only_a.get_run("b1")
            assert b1 is not None and b1.status is RunStatus.PENDING
            assert await depth(only_a, "runs:b") == 1
            assert await unclaimed(postgres_url, "runs:b") == 1
        await producers["a"].start("where", 0, run_id="a2")
        await eventually(
            lambda: _is(depth(producers["a"], "runs:a"), 1),
            what="a2 is queued on runs:a",
            timeout=WAIT,
        )
        async with every:
            await wait_all(every, ["b1", "a2"])
            await eventually(
                lambda: queue_of(every).held == 0, what="every message is acked", timeout=WAIT
            )
            await eventually(
                lambda: _is(depth(every, "runs:a"), 0), what="runs:a is empty", timeout=WAIT
            )
            await eventually(
                lambda: _is(depth(every, "runs:b"), 0), what="runs:b is empty", timeout=WAIT
            )

    assert sorted(ran) == [
        ("a1", only_a.instance_id),
        ("a2", every.instance_id),
        ("b1", every.instance_id),
    ]
    assert refused == []


def _where(
    record: Callable[[str], Awaitable[str]],
) -> Callable[[durably.WorkflowContext, int], Awaitable[str]]:
    async def where(ctx: durably.WorkflowContext, i: int) -> str:
        by: str = await ctx.local_step("where", record, ctx.run_id)
        return by

    return where


# -- a rolling deploy: a queued run reaches an instance that can execute it --------------


async def test_a_queued_run_an_instance_lacks_is_left_for_one_that_has_it(
    postgres_url: str,
) -> None:
    """The old release's instance claims some of the new release's messages:
    it must leave those runs untouched (never fail them) for the new one."""
    producer_ran: list[str] = []
    done_by: Counter[str] = Counter()
    producer = make_engine(postgres_url, consumers="never")
    register_refusing(producer, "short", producer_ran)
    old = make_engine(postgres_url)

    @old.workflow("legacy")
    async def legacy(ctx: durably.WorkflowContext) -> None:
        return None

    new = make_engine(postgres_url)
    register_short(new, done_by)

    async with producer, old, new:
        ids = [(await producer.start("short", i, run_id=f"q{i}")).run_id for i in range(20)]
        await wait_all(new, ids)
        runs = [await new.get_run(run_id) for run_id in ids]
    assert done_by == {new.instance_id: len(ids)}
    assert all(run is not None and run.recovery_attempts == 0 for run in runs)
    assert producer_ran == []


# -- an ack claims again only if runs may be waiting ---------------------------------------


async def test_runs_one_at_a_time_cost_one_claim_each(postgres_url: str) -> None:
    """A finished run frees a slot, but a claim then is worth a round trip only
    if the last claim filled the slots (or found none free): after a claim that
    came back short, a new message announces itself (the push's notice)."""
    done_by: Counter[str] = Counter()
    # Started by a producer: a start on the consumer would be born leased there.
    producer = make_engine(postgres_url, drive=False)
    register_refusing(producer, "short", [])
    engine = make_engine(postgres_url, poll_interval=30.0)  # no poll: notices and acks only
    register_short(engine, done_by)
    swept = sweep_signal(engine)
    async with producer, engine:
        spy = spy_on(engine)
        # The consumer's start-up sweep of pending runs, racing the producer's
        # start (its run inserted, its message not pushed yet), would queue that
        # run a second time: a duplicate that is correct but not what is counted.
        await asyncio.wait_for(swept.wait(), WAIT)
        for i in range(20):
            run = await producer.start("short", i, run_id=f"one{i}")
            await wait_all(engine, [run.run_id])
        await eventually(lambda: queue_of(engine).held == 0, what="every run acked", timeout=WAIT)
        await asyncio.sleep(0.2)  # an ack's claim, if any, lands in the count
    empty = [taken for _, taken in spy.claims if taken == 0]
    assert sum(taken for _, taken in spy.claims) == 20
    assert len(empty) <= 2, f"{len(empty)} claims took nothing for 20 runs: {spy.claims}"


# -- a sweep leaves alone the starts other instances are pushing ---------------------------


def messages_for(spies: list[SpyQueue], run_id: str) -> int:
    """Messages for ``run_id`` the spied instances pushed (or tried to)."""
    return sum(run_id in m.body for spy in spies for push in spy.pushes for m in push)


async def sweep_now(engine: durably.Engine) -> int:
    """One sweep of pending runs by ``engine``, now (not at its worker's next
    tick, nor skipped as too soon after the last one), its pushes flushed."""
    engine._worker._last_sweep.pop("pending", None)
    routed = await engine.run_pending()
    await queue_of(engine).flush()
    return routed


async def test_a_sweep_leaves_alone_a_start_another_instance_is_about_to_push(
    postgres_url: str,
) -> None:
    """The producer inserted a run and has not pushed its message yet: another
    instance's sweep of pending runs, right then, must not queue it too (a
    second message, claim and delivery check for a run already on its way)."""
    clock = VirtualClock()
    done_by: Counter[str] = Counter()
    producer = make_engine(postgres_url, drive=False, clock=clock)
    register_refusing(producer, "short", [])
    sweeper = make_engine(postgres_url, poll_interval=30.0, clock=clock)
    register_short(sweeper, done_by)
    swept = sweep_signal(sweeper)
    async with producer, sweeper:
        await asyncio.wait_for(swept.wait(), WAIT)  # its start-up sweep is over
        pushing, taking = spy_on(producer), spy_on(sweeper)
        pushing.hold = asyncio.Event()
        await producer.start("short", 1, run_id="inflight")
        await eventually(lambda: pushing.pushes != [], what="the push is under way", timeout=WAIT)
        routed = await sweep_now(sweeper)
        pushing.hold.set()
        await wait_all(sweeper, ["inflight"])
        await eventually(lambda: queue_of(sweeper).held == 0, what="every run acked", timeout=WAIT)
        await eventually(lambda: _is(depth(sweeper), 0), what="the queue is empty", timeout=WAIT)
    assert routed == 0
    assert messages_for([pushing, taking], "inflight") == 1
    assert sum(taken for _, taken in taking.claims) == 1
    assert done_by[sweeper.instance_id] == 1


async def test_a_start_whose_push_failed_is_swept_once_its_grace_is_over(
    postgres_url: str,
) -> None:
    """The sweep still exists for a push that failed (or a crash between the
    insert and the push): such a run is queued by the first sweep after
    :data:`~durably._worker.PENDING_GRACE_MS`, never later."""
    clock = VirtualClock()
    done_by: Counter[str] = Counter()
    producer = make_engine(postgres_url, drive=False, clock=clock)
    register_refusing(producer, "short", [])
    sweeper = make_engine(postgres_url, poll_interval=30.0, clock=clock)
    register_short(sweeper, done_by)
    swept = sweep_signal(sweeper)
    async with producer, sweeper:
        await asyncio.wait_for(swept.wait(), WAIT)
        pushing, taking = spy_on(producer), spy_on(sweeper)
        pushing.failing = True
        await producer.start("short", 1, run_id="lost")
        await eventually(lambda: pushing.failures == 1, what="the push fails", timeout=WAIT)
        assert await sweep_now(sweeper) == 0
        clock.advance(f"{PENDING_GRACE_MS - 1}ms")
        assert await sweep_now(sweeper) == 0
        assert taking.pushes == []
        clock.advance("1ms")
        assert await sweep_now(sweeper) == 1
        await wait_all(sweeper, ["lost"])
    assert messages_for([taking], "lost") == 1
    assert done_by[sweeper.instance_id] == 1


# -- runs born leased on the instance that starts them ---------------------------------------


async def test_runs_started_on_a_consumer_with_free_slots_skip_the_queue(
    postgres_url: str,
) -> None:
    """A start on an instance that consumes the run's namespace, with a slot
    free and nothing queued, inserts the run leased here and runs it here: no
    message is pushed, claimed or acked."""
    done_by: Counter[str] = Counter()
    engine = make_engine(postgres_url, poll_interval=30.0)
    register_short(engine, done_by)
    async with engine:
        spy = spy_on(engine)
        await eventually(lambda: spy.passes >= 1, what="a pass of the consumer", timeout=WAIT)
        for i in range(20):
            run = await engine.start("short", i, run_id=f"born{i}")
            await wait_all(engine, [run.run_id])
        await eventually(
            lambda: queue_of(engine).lent == 0, what="every lent slot given back", timeout=WAIT
        )
        assert spy.pushes == []
        assert sum(taken for _, taken in spy.claims) == 0
        assert queue_of(engine).pushed == 0
    assert done_by[engine.instance_id] == 20


async def test_no_run_is_born_leased_while_runs_may_wait_in_the_queue(postgres_url: str) -> None:
    """Queued runs go first: while the consumer's last claim filled its slots,
    a start here pushes its run like any other."""
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    producer = make_engine(postgres_url, drive=False)
    register_refusing(producer, "gated", [])
    engine = make_engine(postgres_url, max_concurrent_runs=4)
    register_gated(engine, gates, executing, done_by)
    a = engine.instance_id
    try:
        async with producer, engine:
            queued = [(await producer.start("gated", i, run_id=f"q{i}")).run_id for i in range(6)]
            await eventually(lambda: len(executing[a]) == 4, what="4 run here", timeout=WAIT)
            assert queue_of(engine).held == 4
            mine = (await engine.start("gated", 9, run_id="mine")).run_id
            assert queue_of(engine).lent == 0
            await eventually(
                lambda: queue_of(engine).pushed == 1, what="its run is pushed", timeout=WAIT
            )
            gates[a].set()
            await wait_all(engine, [*queued, mine])
    finally:
        gates[a].set()


async def test_a_start_of_an_existing_run_gives_its_lent_slot_back(postgres_url: str) -> None:
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    engine = make_engine(postgres_url)
    register_gated(engine, gates, executing, done_by)
    a = engine.instance_id
    try:
        async with engine:
            spy = spy_on(engine)
            await eventually(lambda: spy.passes >= 1, what="a pass of the consumer", timeout=WAIT)
            await engine.start("gated", 1, run_id="same")
            await eventually(lambda: executing[a] == {"same"}, what="it runs here", timeout=WAIT)
            assert queue_of(engine).lent == 1
            await engine.start("gated", 1, run_id="same")  # exists: no new run, no slot
            assert queue_of(engine).lent == 1
            gates[a].set()
            await wait_all(engine, ["same"])
            await eventually(
                lambda: queue_of(engine).lent == 0, what="the slot given back", timeout=WAIT
            )
    finally:
        gates[a].set()


async def test_consumers_starting_runs_at_once_run_each_once(postgres_url: str) -> None:
    """Two consuming instances start runs together: some are born leased on
    their starter, the rest go through the queue; each runs once, and every
    lent slot comes back."""
    done_by: Counter[str] = Counter()
    engines = [make_engine(postgres_url) for _ in range(2)]
    for engine in engines:
        register_short(engine, done_by)
    async with engines[0], engines[1]:
        starts = [engines[i % 2].start("short", i, run_id=f"race{i:03}") for i in range(300)]
        ids = [run.run_id for run in await asyncio.gather(*starts)]
        await wait_all(engines[0], ids)
        for engine in engines:
            await eventually(
                lambda engine=engine: queue_of(engine).lent + queue_of(engine).held == 0,
                what="every slot back",
                timeout=WAIT,
            )
    assert sum(done_by.values()) == 300
