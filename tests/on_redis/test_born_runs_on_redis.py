"""Runs born leased on the instance that starts them, on the ``redis://``
run queue: a start on an instance that takes its namespace's runs, with a
slot free and every worker's last take short of its room, inserts its run
leased here and runs it here, with no BullMQ job (no add, take or finish).
What that must not break: jobs waiting go first, lent slots count against the
instance's slots, and runs started at once on two instances run once each."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import durably
from durably.testing import eventually
from durably.transports.redis._runs import RedisRuns

from .redis_fixtures import redis_prefix, store_url
from .test_run_queue_on_redis import (
    WAIT,
    jobs_in,
    make_engine,
    queue_of,
    register_gated,
    register_refusing,
    register_short,
    wait_all,
)

__all__ = ["redis_prefix", "store_url"]

pytestmark = [pytest.mark.timeout(240)]


def broker_of(engine: durably.Engine) -> RedisRuns:
    broker = queue_of(engine)._broker
    assert isinstance(broker, RedisRuns)
    return broker


def count_adds(engine: durably.Engine) -> list[int]:
    """Jobs added to the run queue by ``engine`` from now on (one entry per add)."""
    broker = broker_of(engine)
    added: list[int] = []
    add = broker._add_jobs

    async def counted(jobs: list[tuple[str, dict[str, Any]]]) -> None:
        added.append(len(jobs))
        await add(jobs)

    broker._add_jobs = counted
    return added


async def dry(engine: durably.Engine) -> None:
    """Every worker of the engine's run queue found its queue dry on its last
    take (from now on a start there may be born leased)."""
    broker = broker_of(engine)

    def drained() -> bool:
        workers = [c.worker for c in broker._consumers.values()]
        return bool(workers) and all(getattr(w, "drained", False) for w in workers)

    await eventually(drained, what="the run queue's workers to find it dry", timeout=WAIT)


async def test_runs_started_on_a_consumer_with_free_slots_need_no_job(
    store_url: str, redis_prefix: str
) -> None:
    done_by: Counter[str] = Counter()
    engine = make_engine(store_url, redis_prefix)
    register_short(engine, done_by)
    async with engine:
        await dry(engine)
        added = count_adds(engine)
        for i in range(20):
            run = await engine.start("short", i, run_id=f"born{i}")
            await wait_all(engine, [run.run_id])
        await eventually(
            lambda: queue_of(engine).lent == 0, what="every lent slot given back", timeout=WAIT
        )
        assert added == []
        assert queue_of(engine).pushed == 0
        assert queue_of(engine).consumed == 0
        assert await jobs_in(redis_prefix) == 0
    assert done_by[engine.instance_id] == 20


async def test_a_full_consumer_lends_nothing_and_its_queued_run_waits_for_a_slot(
    tmp_path: Path, redis_prefix: str
) -> None:
    """Jobs queued for a consumer whose slots are all taken are not overtaken:
    a start there adds a job, queued behind them."""
    store = f"sqlite:///{tmp_path / 'full.db'}"
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    producer = make_engine(store, redis_prefix, consumers="never")
    register_refusing(producer, "gated", [])
    engine = make_engine(store, redis_prefix, max_concurrent_runs=4)
    register_gated(engine, gates, executing, done_by)
    a = engine.instance_id
    try:
        async with producer, engine:
            queued = [(await producer.start("gated", i, run_id=f"q{i}")).run_id for i in range(6)]
            await eventually(lambda: len(executing[a]) == 4, what="4 run here", timeout=WAIT)
            assert queue_of(engine).held == 4
            # (its start-up sweep of pending runs may have queued some again)
            before = queue_of(engine).pushed
            mine = (await engine.start("gated", 9, run_id="mine")).run_id
            assert queue_of(engine).lent == 0
            await eventually(
                lambda: queue_of(engine).pushed == before + 1,
                what="its job is added",
                timeout=WAIT,
            )
            gates[a].set()
            await wait_all(engine, [*queued, mine])
            # The queue is dry again: the next start is born leased here.
            await dry(engine)
            after = (await engine.start("gated", 10, run_id="after")).run_id
            assert queue_of(engine).lent == 1
            await wait_all(engine, [after])
            assert queue_of(engine).pushed == before + 1
    finally:
        gates[a].set()


async def test_lent_slots_count_against_the_consumers_slots(
    tmp_path: Path, redis_prefix: str
) -> None:
    """A consumer whose slots are all lent takes no job: another instance
    takes the run its next start queues."""
    store = f"sqlite:///{tmp_path / 'lent.db'}"
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    first = make_engine(store, redis_prefix, max_concurrent_runs=2)
    second = make_engine(store, redis_prefix)
    register_gated(first, gates, executing, done_by)
    register_gated(second, gates, executing, done_by)
    a, b = first.instance_id, second.instance_id
    try:
        async with first:
            await dry(first)
            born = [(await first.start("gated", i, run_id=f"b{i}")).run_id for i in range(2)]
            await eventually(lambda: len(executing[a]) == 2, what="both run here", timeout=WAIT)
            assert queue_of(first).lent == 2
            extra = (await first.start("gated", 3, run_id="extra")).run_id
            await eventually(
                lambda: queue_of(first).pushed == 1, what="its job is added", timeout=WAIT
            )
            async with second:
                await eventually(
                    lambda: executing.get(b) == {"extra"},
                    what="the second takes it",
                    timeout=WAIT,
                )
                assert queue_of(first).held == 0  # never took it into a lent slot
                assert executing[a] == set(born)
                gates[a].set()
                gates[b].set()
                await wait_all(first, [*born, extra])
    finally:
        for gate in gates.values():
            gate.set()
    assert done_by == {"b0": a, "b1": a, "extra": b}


async def test_consumers_starting_runs_at_once_run_each_once(
    store_url: str, redis_prefix: str
) -> None:
    """Two consuming instances start runs together: some are born leased on
    their starter, the rest go through the queue; each runs once, and every
    lent slot comes back."""
    done_by: Counter[str] = Counter()
    engines = [make_engine(store_url, redis_prefix) for _ in range(2)]
    for engine in engines:
        register_short(engine, done_by)
    async with engines[0], engines[1]:
        for engine in engines:
            await dry(engine)
        starts = [engines[i % 2].start("short", i, run_id=f"race{i:03}") for i in range(300)]
        ids = [run.run_id for run in await asyncio.gather(*starts)]
        await wait_all(engines[0], ids)
        for engine in engines:
            await eventually(
                lambda engine=engine: queue_of(engine).lent + queue_of(engine).held == 0,
                what="every slot back",
                timeout=WAIT,
            )
        pushed = sum(queue_of(engine).pushed for engine in engines)
        assert pushed < 300  # some were born leased
    assert sum(done_by.values()) == 300


async def test_a_start_of_an_existing_run_gives_its_lent_slot_back(
    tmp_path: Path, redis_prefix: str
) -> None:
    store = f"sqlite:///{tmp_path / 'same.db'}"
    gates: dict[str, asyncio.Event] = {}
    executing: dict[str, set[str]] = {}
    done_by: dict[str, str] = {}
    engine = make_engine(store, redis_prefix)
    register_gated(engine, gates, executing, done_by)
    a = engine.instance_id
    try:
        async with engine:
            await dry(engine)
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
