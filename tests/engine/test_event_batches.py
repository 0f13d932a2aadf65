"""``ctx.wait_for_events``: a batch of events, closed by ``max_items`` or by a
window fixed from the first event; recorded, so a replay returns the same list."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.testing import VirtualClock

from .conftest import EngineFactory


async def test_buffered_events_fill_a_batch_in_arrival_order(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> list[list[Any]]:
        full = await ctx.wait_for_events("click", max_items=3, window="1h")
        rest = await ctx.wait_for_events("click", max_items=10, window=0)  # the buffered ones
        return [full, rest]

    async with engine:
        for n in range(5):
            assert await engine.publish_event("click", {"n": n}) == 0  # buffered
        await engine.start("collect", run_id="c")
        result = await engine.wait_for_run("c", terminal=True, timeout=10)
        history = await engine.history("c")
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == [[{"n": 0}, {"n": 1}, {"n": 2}], [{"n": 3}, {"n": 4}]]
    events = [cp for cp in history if cp.kind == "event"]
    assert [cp.name for cp in events] == ["events:click"] * 5 + ["events:click"]
    assert [cp.output for cp in events[:5]] == [{"n": n} for n in range(5)]
    assert events[-1].status.value == "failed"  # the window=0 batch's closing wait


async def test_a_batch_returns_once_max_items_arrived(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> list[Any]:
        return await ctx.wait_for_events("job", max_items=3, window="1d", match={"q": "a"})

    async with engine:
        await engine.start("collect", run_id="c")
        for n in range(3):
            assert (await engine.wait_for_run("c", timeout=10)).status is RunStatus.SUSPENDED
            await engine.publish_event("job", {"q": "b", "n": n}, buffer=False)  # no match
            assert await engine.publish_event("job", {"q": "a", "n": n}) == 1
        result = await engine.wait_for_run("c", terminal=True, timeout=10)
    assert result.output == [{"q": "a", "n": n} for n in range(3)]


async def test_the_window_closes_a_partial_batch(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> list[Any]:
        return await ctx.wait_for_events("tick", max_items=10, window="5m")

    await engine.open()
    await engine.start("collect", run_id="c")
    await engine.join()
    assert await engine.publish_event("tick", 1) == 1
    await engine.join()
    clock.advance("1m")
    assert await engine.publish_event("tick", 2) == 1
    await engine.join()
    assert (await engine.get_run("c")) is not None
    assert (await engine.wait_for_run("c", timeout=10)).status is RunStatus.SUSPENDED
    clock.advance("4m")  # five minutes after the first event, not after the last
    assert await engine.resume_due_timers() == 1
    result = await engine.wait_for_run("c", terminal=True, timeout=10)
    assert result.output == [1, 2]
    # The run waits no more: a later event is not taken.
    assert await engine.publish_event("tick", 3, buffer=False) == 0


async def test_no_first_event_times_out(make_engine: EngineFactory, clock: VirtualClock) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> str:
        try:
            await ctx.wait_for_events("never", max_items=2, window="1m", timeout="1h")
        except durably.EventTimeout as exc:
            return exc.code
        return "got some"

    await engine.open()
    await engine.start("collect", run_id="c")
    await engine.join()
    clock.advance("1h")
    assert await engine.resume_due_timers() == 1
    result = await engine.wait_for_run("c", terminal=True, timeout=10)
    assert result.output == "event_timeout"


async def test_a_batch_replays_to_the_same_list(make_engine: EngineFactory) -> None:
    engine = make_engine(sticky_runs=0)  # every turn replays: that is what is checked
    seen: list[list[Any]] = []

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> int:
        batch = await ctx.wait_for_events("e", max_items=2, window="1h")
        seen.append(batch)
        await ctx.sleep(0)  # another turn: the batch is replayed from history
        await ctx.wait_for_signal("go")
        return len(batch)

    async with engine:
        await engine.publish_event("e", "a")
        await engine.publish_event("e", "b")
        await engine.start("collect", run_id="c")
        assert (await engine.wait_for_run("c", timeout=10)).status is RunStatus.SUSPENDED
        await engine.publish_event("e", "late")  # buffered: nobody waits for "e" now
        await engine.signal("go", None)
        result = await engine.wait_for_run("c", terminal=True, timeout=10)
    assert result.output == 2
    assert len(seen) >= 2 and all(batch == ["a", "b"] for batch in seen)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_items": 0, "window": "1m"}, ValueError),
        ({"max_items": -1, "window": "1m"}, ValueError),
        ({"max_items": 1001, "window": "1m"}, ValueError),
        ({"max_items": True, "window": "1m"}, TypeError),
        ({"max_items": 2.5, "window": "1m"}, TypeError),
        ({"max_items": 2, "window": -1}, ValueError),
        ({"max_items": 2, "window": "soon"}, ValueError),
        ({"max_items": 2, "window": "1m", "match": ["x"]}, TypeError),
    ],
)
async def test_wait_for_events_refuses_bad_input(
    make_engine: EngineFactory, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    engine = make_engine()

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_events("e", **kwargs)

    @engine.workflow("unnamed")
    async def unnamed(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_events("", max_items=1, window=0)

    async with engine:
        for workflow in ("collect", "unnamed"):
            await engine.start(workflow, run_id=workflow)
            result = await engine.wait_for_run(workflow, terminal=True, timeout=10)
            assert result.status is RunStatus.FAILED and result.error is not None
            expected = error.__name__ if workflow == "collect" else "ValueError"
            assert result.error["type"] == expected, result.error
            assert await engine.history(workflow) == []


async def test_a_batch_gathered_with_other_calls_replays_deterministically(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> list[Any]:
        batch, x = await asyncio.gather(
            ctx.wait_for_events("e", max_items=3, window="1h"), ctx.local_step("x", lambda: 1)
        )
        y = await ctx.local_step("y", lambda: 2)  # its position follows all the batch's
        await ctx.wait_for_signal("go")
        return [batch, x, y]

    async with engine:
        await engine.start("collect", run_id="c")
        for n in range(3):
            assert (await engine.wait_for_run("c", timeout=10)).status is RunStatus.SUSPENDED
            assert await engine.publish_event("e", n) == 1
        assert (await engine.wait_for_run("c", timeout=10)).status is RunStatus.SUSPENDED
        await engine.signal("go", None)
        result = await engine.wait_for_run("c", terminal=True, timeout=10)
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == [[0, 1, 2], 1, 2]
