"""Singleton workflows: at most ``limit`` live runs per key, FIFO, across engines."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.testing import eventually

from .conftest import EngineFactory


def _register(engine: durably.Engine, live: list[str], peak: list[int], **options: Any) -> None:
    @engine.workflow("sync-account", singleton=lambda data: data["account"], **options)
    async def sync_account(ctx: durably.WorkflowContext, data: dict[str, Any]) -> str:
        async def enter() -> None:
            live.append(ctx.run_id)
            peak[0] = max(peak[0], len(live))

        async def leave() -> None:
            live.remove(ctx.run_id)

        await ctx.local_step("enter", enter)
        await ctx.wait_for_signal(f"done:{ctx.run_id}")
        await ctx.local_step("leave", leave)
        return str(data["n"])


async def _status(engine: durably.Engine, run_id: str) -> RunStatus | None:
    run = await engine.get_run(run_id)
    return None if run is None else run.status


async def test_one_live_run_per_key_and_the_next_starts_when_it_ends(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    live: list[str] = []
    peak = [0]
    _register(engine, live, peak)
    async with engine:
        for n in range(3):
            await engine.start("sync-account", {"account": "a", "n": n}, run_id=f"a{n}")
        await engine.start("sync-account", {"account": "b", "n": 9}, run_id="b9")
        await eventually(lambda: sorted(live) == ["a0", "b9"], what="one run per key")
        for run_id in ("a0", "a1", "a2"):
            await eventually(lambda r=run_id: live.count(r) == 1, what=f"{run_id} to run")
            assert [r for r in live if r.startswith("a")] == [run_id]
            await engine.signal(f"done:{run_id}")
            await engine.wait_for_run(run_id, terminal=True, timeout=20)
        await engine.signal("done:b9")
        await engine.wait_for_run("b9", terminal=True, timeout=20)
        assert peak[0] == 2  # a and b at once, never two a's
        # The queued runs executed nothing while they waited.
        history = await engine.history("a2")
        assert [c.name for c in history] == ["enter", "signal:done:a2", "leave"]


async def test_limit_allows_that_many_per_key(make_engine: EngineFactory) -> None:
    engine = make_engine()
    live: list[str] = []
    peak = [0]
    _register(engine, live, peak, limit=2)
    async with engine:
        for n in range(5):
            await engine.start("sync-account", {"account": "a", "n": n}, run_id=f"a{n}")
        for remaining in range(5, 0, -1):
            await eventually(lambda r=remaining: len(live) == min(2, r), what="the live runs")
            finished = live[0]
            await engine.signal(f"done:{finished}")
            await engine.wait_for_run(finished, terminal=True, timeout=20)
        assert peak[0] == 2
        assert await _all_done(engine, 5)


async def test_waiting_runs_start_in_the_order_they_were_created(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    live: list[str] = []
    peak = [0]
    _register(engine, live, peak)
    async with engine:
        await engine.start("sync-account", {"account": "a", "n": 0}, run_id="a0")
        await eventually(lambda: live == ["a0"], what="a0")
        for n in (1, 2, 3):
            await engine.start("sync-account", {"account": "a", "n": n}, run_id=f"a{n}")
        for n in (1, 2, 3):
            await eventually(
                lambda r=f"a{n}": _is(engine, r, RunStatus.SUSPENDED), what="the waiters"
            )
        order = []
        for _ in range(4):
            await eventually(lambda: len(live) == 1, what="the next run")
            order.append(live[0])
            await engine.signal(f"done:{live[0]}")
            await engine.wait_for_run(order[-1], terminal=True, timeout=20)
        assert order == ["a0", "a1", "a2", "a3"]


async def _is(engine: durably.Engine, run_id: str, status: RunStatus) -> bool:
    return await _status(engine, run_id) == status


async def _all_done(engine: durably.Engine, count: int) -> bool:
    statuses = [await _status(engine, f"a{n}") for n in range(count)]
    return statuses == [RunStatus.COMPLETED] * count


async def test_a_full_queue_refuses_the_start_before_creating_the_run(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    live: list[str] = []
    peak = [0]
    _register(engine, live, peak, max_queue=1)
    async with engine:
        await engine.start("sync-account", {"account": "a", "n": 0}, run_id="a0")
        await engine.start("sync-account", {"account": "a", "n": 1}, run_id="a1")
        with pytest.raises(durably.SingletonQueueFull) as refused:
            await engine.start("sync-account", {"account": "a", "n": 2}, run_id="a2")
        assert refused.value.key == "a" and refused.value.live == 2
        assert await engine.get_run("a2") is None
        # A start of an id that exists is idempotent, never refused.
        assert (await engine.start("sync-account", {"account": "a", "n": 1}, run_id="a1")).run_id
        # Another key has room.
        await engine.start("sync-account", {"account": "b", "n": 0}, run_id="b0")
        # a0 and a1 were started an instant apart: either may hold the key.
        await eventually(lambda: len([r for r in live if r.startswith("a")]) == 1, what="a run")
        holder = next(r for r in live if r.startswith("a"))
        await engine.signal(f"done:{holder}")
        await engine.wait_for_run(holder, terminal=True, timeout=20)
        await engine.start("sync-account", {"account": "a", "n": 3}, run_id="a3")


async def test_cancelling_the_live_run_lets_the_next_start(make_engine: EngineFactory) -> None:
    engine = make_engine()
    live: list[str] = []
    peak = [0]
    _register(engine, live, peak)
    async with engine:
        await engine.start("sync-account", {"account": "a", "n": 0}, run_id="a0")
        await engine.start("sync-account", {"account": "a", "n": 1}, run_id="a1")
        # Started an instant apart: whichever took its first turn first holds the key.
        await eventually(lambda: len(live) == 1, what="one run of key a")
        first = live[0]
        other = "a1" if first == "a0" else "a0"
        assert peak[0] == 1
        await engine.cancel(first)
        await eventually(lambda: other in live, what="the other run to start after the cancel")
        # A cancelled run never reaches its "leave" step, so ``live`` keeps it
        # (a peak of 2 from here on says nothing); the other started only once
        # the first had ended.
        assert await _status(engine, first) is RunStatus.CANCELLED


async def test_bad_singleton_options_and_keys_are_refused_clearly(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    async def body(ctx: durably.WorkflowContext, data: Any) -> None:
        return None

    with pytest.raises(ValueError, match="need singleton"):
        engine.register("x", body, limit=2)
    with pytest.raises(ValueError, match="limit must be"):
        engine.register("x", body, singleton=lambda d: "k", limit=0)
    with pytest.raises(TypeError, match="singleton= must be"):
        engine.register("x", body, singleton="account")  # type: ignore[arg-type]
    engine.register("keyed", body, singleton=lambda d: d["missing"], max_queue=1)
    async with engine:
        with pytest.raises(durably.SchemaValidationError, match="key function raised"):
            await engine.start("keyed", {"account": "a"}, run_id="k")
        assert await engine.get_run("k") is None


async def test_two_engines_racing_starts_never_run_two_of_a_key(
    make_engine: EngineFactory,
) -> None:
    live: list[str] = []
    peak = [0]
    first, second = make_engine(), make_engine()
    _register(first, live, peak)
    _register(second, live, peak)
    async with first, second:
        starts = [
            (first if n % 2 else second).start(
                "sync-account", {"account": "a", "n": n}, run_id=f"a{n}"
            )
            for n in range(8)
        ]
        await asyncio.gather(*starts)
        done: set[str] = set()
        while len(done) < 8:
            await eventually(lambda: len(live) == 1, what="the next run of key a")
            assert peak[0] == 1
            current = live[0]
            await first.signal(f"done:{current}")
            await first.wait_for_run(current, terminal=True, timeout=30)
            done.add(current)
        statuses = {await _status(first, f"a{n}") for n in range(8)}
        assert statuses == {RunStatus.COMPLETED}
        assert peak[0] == 1


async def test_runs_started_in_order_are_admitted_in_that_order_whoever_asks_first(
    make_engine: EngineFactory,
) -> None:
    # Starts return in order a0, a1, a2, but their first turns race to ask
    # for the key's slot (here a0's is held back until a1 has asked): the
    # line must still follow creation, as documented, not the turns' race.
    producer = make_engine(drive=False)
    _register(producer, [], [0])
    for n in range(3):
        await producer.start("sync-account", {"account": "a", "n": n}, run_id=f"a{n}")
    worker = make_engine()
    live: list[str] = []
    _register(worker, live, [0])
    store: Any = worker.store
    asked_by_a1 = asyncio.Event()
    try_admit = store.try_admit

    async def a0_asks_last(request: Any, now: int) -> Any:
        if request.run_id == "a0":
            await asyncio.wait_for(asked_by_a1.wait(), 30)
        answer = await try_admit(request, now)
        if request.run_id == "a1":
            asked_by_a1.set()
        return answer

    store.try_admit = a0_asks_last
    try:
        async with worker:
            order = []
            for _ in range(3):
                await eventually(lambda: len(live) == 1, what="the next run")
                order.append(live[0])
                await worker.signal(f"done:{live[0]}")
                await worker.wait_for_run(order[-1], terminal=True, timeout=20)
    finally:
        store.try_admit = try_admit
    assert order == ["a0", "a1", "a2"]
