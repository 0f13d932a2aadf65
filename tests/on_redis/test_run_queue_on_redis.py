"""The fleet's run queue on BullMQ (``transport="redis://…"``), with SQLite and
PostgreSQL stores: runs spread over the driving instances, a producer with
``consumers="never"`` never takes one, a start pushed twice is queued once,
an instance holds at most 64, every delivery is checked against the store,
and a drain hands back what it holds.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis
from bullmq import Queue

import durably
from durably import RunStatus
from durably._queue import QueuedRun
from durably._run_queue import MAX_HELD
from durably.testing import VirtualClock, eventually

from .redis_fixtures import REDIS_URL, redis_prefix, store_url

__all__ = ["redis_prefix", "store_url"]

pytestmark = [pytest.mark.timeout(240)]

WAIT = 60.0


def make_engine(store: str, prefix: str, **kwargs: Any) -> durably.Engine:
    kwargs.setdefault("poll_interval", 0.05)
    return durably.Engine(store, transport=f"{REDIS_URL}?prefix={prefix}", **kwargs)


def queue_of(engine: durably.Engine) -> Any:
    run_queue = engine._run_queue
    assert run_queue is not None, "the redis:// transport carries a run queue"
    return run_queue


async def jobs_in(prefix: str, name: str = "runs") -> int:
    """Jobs in the run queue, taken or not."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        counts = await Queue(f"{prefix}-{name}", {"connection": client}).getJobCounts(
            "wait", "active", "delayed", "prioritized", "paused"
        )
        return sum(counts.values())
    finally:
        await client.aclose()


def register_refusing(engine: durably.Engine, name: str, ran: list[str]) -> None:
    async def body(ctx: durably.WorkflowContext, n: int) -> None:
        ran.append(ctx.run_id)
        raise AssertionError(f"the producer executed {ctx.run_id}")

    engine.register(name, body)


def register_short(engine: durably.Engine, done_by: Counter[str]) -> None:
    instance = engine.instance_id

    async def record(n: int) -> int:
        done_by[instance] += 1
        return n

    @engine.workflow("short")
    async def short(ctx: durably.WorkflowContext, n: int) -> int:
        a = await ctx.local_step("a", lambda: n + 1)
        await ctx.local_step("pause", asyncio.sleep, 0.005)
        return await ctx.local_step("b", record, a)


async def wait_all(engine: durably.Engine, run_ids: list[str], timeout: float = 120) -> None:
    results = await asyncio.gather(
        *(engine.wait_for_run(r, terminal=True, timeout=timeout) for r in run_ids)
    )
    bad = [(r.run_id, r.status, r.error) for r in results if r.status is not RunStatus.COMPLETED]
    assert not bad, bad[:5]


async def test_runs_spread_over_two_engines_and_never_run_on_the_producer(
    store_url: str, redis_prefix: str
) -> None:
    producer_ran: list[str] = []
    done_by: Counter[str] = Counter()
    producer = make_engine(store_url, redis_prefix, consumers="never")
    register_refusing(producer, "short", producer_ran)
    consumers = [make_engine(store_url, redis_prefix) for _ in range(2)]
    for engine in consumers:
        register_short(engine, done_by)

    async with producer, consumers[0], consumers[1]:
        for engine in consumers:
            await engine.start_worker()
        ids = [(await producer.start("short", i, run_id=f"r{i}")).run_id for i in range(200)]
        await wait_all(consumers[0], ids)
        consumed = [queue_of(e).consumed for e in consumers]
        assert queue_of(producer).consumed == 0
        assert not queue_of(producer).consuming
        assert queue_of(producer).pushed == 200
        await eventually(
            lambda: _zero(jobs_in(redis_prefix)), what="every job is done", timeout=WAIT
        )

    assert producer_ran == []
    assert sum(done_by.values()) == 200  # each run's last step ran once
    assert all(done_by[e.instance_id] > 0 for e in consumers), done_by
    assert all(n > 0 for n in consumed), consumed


async def _zero(count: Any) -> bool:
    return bool(await count == 0)


async def test_a_start_pushed_twice_is_queued_once_and_a_new_pending_state_queues_again(
    store_url: str, redis_prefix: str
) -> None:
    executions: Counter[str] = Counter()
    producer = make_engine(store_url, redis_prefix, consumers="never")
    register_refusing(producer, "once", [])
    consumer = make_engine(store_url, redis_prefix)

    async def count(run_id: str) -> None:
        executions[run_id] += 1

    @consumer.workflow("once")
    async def once(ctx: durably.WorkflowContext, n: int) -> int:
        await ctx.local_step("count", count, ctx.run_id)
        return n

    async with producer:
        run = await producer.start("once", 1, run_id="dup")
        queue = queue_of(producer)
        await eventually(lambda: queue.pushed == 1, what="the start is pushed", timeout=WAIT)
        # The pending-run poll (or a second instance) routes it again, twice.
        queue.submit("dup", wake=False, namespace=None)
        queue.submit("dup", wake=False, namespace="default")
        await eventually(lambda: queue.pushed == 3, what="the repeats are pushed", timeout=WAIT)
        assert await jobs_in(redis_prefix) == 1
        # The same run pending again (a retry, a recovery: the run was written
        # since) is a start of its own.
        stored = await producer.get_run(run.run_id)
        assert stored is not None
        again = QueuedRun("dup", False, "default", 0, f"{stored.updated_at + 1}")
        await queue._broker.push([again])
        assert await jobs_in(redis_prefix) == 2
        async with consumer:
            await consumer.start_worker()
            result = await consumer.wait_for_run("dup", terminal=True, timeout=WAIT)
            assert result.status is RunStatus.COMPLETED
            await eventually(
                lambda: _zero(jobs_in(redis_prefix)), what="both jobs are taken", timeout=WAIT
            )
            # Stale deliveries for the finished run: a start and a wake.
            await queue._broker.push(
                [
                    QueuedRun("dup", False, "default", 0, "stale"),
                    QueuedRun("dup", True, "default", 0, None),
                ]
            )
            await eventually(
                lambda: queue_of(consumer).consumed >= 3,
                what="the stale deliveries are taken",
                timeout=WAIT,
            )
            await eventually(
                lambda: _zero(jobs_in(redis_prefix)), what="every job is done", timeout=WAIT
            )
    assert executions == {"dup": 1}


async def test_a_sweep_leaves_alone_a_start_another_instance_is_about_to_push(
    store_url: str, redis_prefix: str
) -> None:
    """The producer inserted a run and has not pushed its job yet: another
    instance's sweep of pending runs, right then, must not queue it too. (Its
    job id would be the producer's, but once that job ran and was removed the
    producer's push adds it again: a second delivery for a run already done.)"""
    clock = VirtualClock()
    done_by: Counter[str] = Counter()
    producer = make_engine(store_url, redis_prefix, drive=False, clock=clock)
    register_refusing(producer, "short", [])
    sweeper = make_engine(store_url, redis_prefix, poll_interval=30.0, clock=clock)
    register_short(sweeper, done_by)
    swept = asyncio.Event()
    sweep = sweeper._worker.run_pending

    async def run_pending(limit: int = 1000) -> int:
        try:
            return await sweep(limit)
        finally:
            swept.set()

    sweeper._worker.run_pending = run_pending  # type: ignore[method-assign]
    async with producer, sweeper:
        await asyncio.wait_for(swept.wait(), WAIT)  # its start-up sweep is over
        broker = queue_of(producer)._broker
        push = broker.push
        hold = asyncio.Event()
        pushing: list[QueuedRun] = []

        async def held_push(runs: list[QueuedRun]) -> None:
            pushing.extend(runs)
            await hold.wait()
            await push(runs)

        broker.push = held_push
        await producer.start("short", 1, run_id="inflight")
        await eventually(lambda: pushing != [], what="the push is under way", timeout=WAIT)
        sweeper._worker._last_sweep.pop("pending", None)  # a sweep now, not at the next tick
        routed = await sweeper.run_pending()
        await queue_of(sweeper).flush()
        if routed:
            # What the sweep queued runs, and its job is removed, before the
            # producer's push lands.
            await wait_all(sweeper, ["inflight"])
            await eventually(lambda: _zero(jobs_in(redis_prefix)), what="no job", timeout=WAIT)
        hold.set()
        await wait_all(sweeper, ["inflight"])
        await eventually(lambda: queue_of(producer).pushed == 1, what="it is pushed", timeout=WAIT)
        await eventually(lambda: _zero(jobs_in(redis_prefix)), what="every job done", timeout=WAIT)
        pushed, consumed = queue_of(sweeper).pushed, queue_of(sweeper).consumed
    assert routed == 0
    assert (pushed, consumed) == (0, 1)
    assert done_by[sweeper.instance_id] == 1


def register_gated(
    engine: durably.Engine,
    gates: dict[str, asyncio.Event],
    executing: dict[str, set[str]],
    done_by: dict[str, str],
) -> None:
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


async def test_an_instance_holds_at_most_64_and_another_takes_the_rest(
    postgres_url: str, redis_prefix: str
) -> None:
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    first, second = make_engine(postgres_url, redis_prefix), make_engine(postgres_url, redis_prefix)
    register_gated(first, gates, executing, done_by)
    register_gated(second, gates, executing, done_by)
    a, b = first.instance_id, second.instance_id

    async with first:
        await first.start_worker()
        ids = [(await first.start("gated", i, run_id=f"g{i:03}")).run_id for i in range(100)]
        await eventually(
            lambda: len(executing[a]) >= MAX_HELD, what="64 runs execute", timeout=WAIT
        )
        # Its slots hold taken jobs and runs born leased here (started while a
        # slot was free and the queue dry): those never became jobs.
        await eventually(
            lambda: queue_of(first).pushed == 100 - queue_of(first).lent,
            what="every other start is pushed",
            timeout=WAIT,
        )
        lent = queue_of(first).lent
        assert queue_of(first).held + lent == MAX_HELD
        assert await jobs_in(redis_prefix) == 100 - lent  # taken or not, every job is there
        async with second:
            await second.start_worker()
            await eventually(
                lambda: len(executing[b]) == 100 - MAX_HELD,
                what="the second takes the rest",
                timeout=WAIT,
            )
            assert len(executing[a]) == MAX_HELD  # the first never took more
            assert queue_of(first).held + queue_of(first).lent == MAX_HELD
            gates[a].set()
            gates[b].set()
            await wait_all(first, ids)
            await eventually(
                lambda: _zero(jobs_in(redis_prefix)), what="every job is done", timeout=WAIT
            )
    assert Counter(done_by.values()) == {a: MAX_HELD, b: 100 - MAX_HELD}


async def test_a_wake_travels_through_the_queue(store_url: str, redis_prefix: str) -> None:
    producer = make_engine(store_url, redis_prefix, consumers="never")
    consumer = make_engine(store_url, redis_prefix)
    ran: list[str] = []
    register_refusing(producer, "waiter", ran)

    @consumer.workflow("waiter")
    async def waiter(ctx: durably.WorkflowContext, token: str) -> str:
        got = await ctx.wait_for_signal(token)
        return f"got {got}"

    async with producer, consumer:
        await consumer.start_worker()
        ids = [(await producer.start("waiter", f"t{i}", run_id=f"w{i}")).run_id for i in range(5)]
        for run_id in ids:
            result = await consumer.wait_for_run(run_id, timeout=WAIT)
            assert result.status is RunStatus.SUSPENDED
        for i in range(5):
            assert await producer.signal(f"t{i}", i) == f"w{i}"
        await wait_all(consumer, ids)
    assert ran == []


async def test_drain_hands_back_what_it_holds(postgres_url: str, redis_prefix: str) -> None:
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    first, second = make_engine(postgres_url, redis_prefix), make_engine(postgres_url, redis_prefix)
    register_gated(first, gates, executing, done_by)
    register_gated(second, gates, executing, done_by)
    a, b = first.instance_id, second.instance_id
    gates[b].set()
    n = 20
    try:
        async with first:
            await first.start_worker()
            ids = [(await first.start("gated", i, run_id=f"d{i:02}")).run_id for i in range(n)]
            await eventually(
                lambda: len(executing[a]) == n, what="the first executes every run", timeout=WAIT
            )
            async with second:
                await second.start_worker()
                await first.drain(timeout=0.2)
                assert queue_of(first).held == 0
                assert queue_of(first).lent == 0
                assert not queue_of(first).consuming
                await wait_all(second, ids)
                assert queue_of(first).consumed == 0
    finally:
        gates[a].set()
    assert {done_by[r] for r in ids} == {b}
