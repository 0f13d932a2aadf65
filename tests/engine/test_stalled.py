"""Stalled-run detection (issue 12, item 6): the stranded signature.

A live run counts as stalled once it made no progress for ``stalled_after``
and either nothing of its own can wake it (suspended with no timer, no child,
no step in flight: at most waits without a deadline, whatever the reconcile
fallback does), or it is parked on a dispatched step whose worker has been
silent that long. A long sleep, a beating step, a queue backlog and a long
in-process step are healthy long work, never stalled. Every store; the clock
is virtual, so no test waits for time to pass.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import Run, RunStatus
from durably.testing import VirtualClock

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(120)


def _pager(engine: durably.Engine) -> list[str]:
    reported: list[str] = []

    async def page(run: Run) -> None:
        reported.append(run.run_id)

    engine.on_stalled(page)
    return reported


async def _suspended(engine: durably.Engine, run_id: str) -> Run:
    await engine.join()
    run = await engine.get_run(run_id)
    assert run is not None and run.status is RunStatus.SUSPENDED, run
    return run


async def _reconcile(engine: durably.Engine) -> None:
    """Let every due reconcile wake take its turn (nothing arrives)."""
    await engine.resume_due_timers()
    await engine.join()


async def test_a_signal_wait_nobody_answers_is_stalled_without_reconcile(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h", reconcile=0)
    reported = _pager(engine)

    @engine.workflow("approval")
    async def approval(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("approve")

    await engine.open()
    await engine.start("approval", run_id="forgotten")
    run = await _suspended(engine, "forgotten")
    assert run.wake_at is None  # wake-forever: nothing will ever drive it
    clock.advance("59m")
    assert await engine.sweep_stalled(force=True) == 0
    clock.advance("2m")
    assert await engine.sweep_stalled(force=True) == 1
    assert await engine.sweep_stalled(force=True) == 0  # one page per episode
    assert reported == ["forgotten"]


async def test_the_reconcile_fallback_is_no_wake_of_its_own(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    """A signal wait without a deadline is stranded although reconcile turns
    touch the run every few minutes: they re-check, they never progress."""
    engine = make_engine(clock=clock, stalled_after="1h", reconcile="5m")
    reported = _pager(engine)

    @engine.workflow("approval")
    async def approval(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("approve")

    await engine.open()
    await engine.start("approval", run_id="forgotten")
    first = await _suspended(engine, "forgotten")
    assert first.wake_at is not None  # only the reconcile fallback
    for _ in range(13):  # 65 minutes of reconcile turns
        clock.advance("5m")
        await _reconcile(engine)
        assert await engine.sweep_stalled(force=True) <= 1
    later = await _suspended(engine, "forgotten")
    assert later.updated_at > first.updated_at  # the turns did touch it
    assert reported == ["forgotten"]  # and it was paged once, not once per turn

    # It progresses (a signal, then a new wait): a new episode, an hour later.
    await engine.signal("approve", "yes")
    await engine.join()
    clock.advance("30m")
    await _reconcile(engine)
    assert await engine.sweep_stalled(force=True) == 0
    assert (await engine.wait_for_run("forgotten", terminal=True, timeout=10)).output == "yes"


async def test_a_second_episode_is_paged_again(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h", reconcile=0)
    reported = _pager(engine)

    @engine.workflow("twice")
    async def twice(ctx: durably.WorkflowContext) -> Any:
        first = await ctx.wait_for_signal("one")
        return [first, await ctx.wait_for_signal("two")]

    await engine.open()
    await engine.start("twice", run_id="r")
    await _suspended(engine, "r")
    clock.advance("2h")
    assert await engine.sweep_stalled(force=True) == 1
    await engine.signal("one", 1)  # it moves on, then waits again
    await _suspended(engine, "r")
    assert await engine.sweep_stalled(force=True) == 0  # just progressed
    clock.advance("2h")
    assert await engine.sweep_stalled(force=True) == 1
    assert reported == ["r", "r"]


async def test_healthy_long_waits_are_never_stalled(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h", reconcile=0)
    reported = _pager(engine)

    @engine.workflow("nap")
    async def nap(ctx: durably.WorkflowContext) -> None:
        await ctx.sleep("30d")

    @engine.workflow("bounded")
    async def bounded(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("late", timeout="7d")  # its deadline wakes it

    @engine.workflow("both")
    async def both(ctx: durably.WorkflowContext) -> Any:
        return await asyncio.gather(ctx.sleep("10d"), ctx.wait_for_signal("any"))

    @engine.workflow("child")
    async def child(ctx: durably.WorkflowContext) -> None:
        await ctx.sleep("10d")

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> Any:
        return await ctx.child("child", run_id="kid")  # the child's end wakes it

    await engine.open()
    for workflow in ("nap", "bounded", "both", "parent"):
        await engine.start(workflow, run_id=workflow)
    for run_id in ("nap", "bounded", "both", "parent", "kid"):
        await _suspended(engine, run_id)
    clock.advance("3d")
    assert await engine.sweep_stalled(force=True) == 0
    assert reported == []


async def test_a_backlog_and_a_long_in_process_step_are_not_stalled(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h", drive=False)
    reported = _pager(engine)

    @engine.workflow("queued")
    async def queued(ctx: durably.WorkflowContext) -> None:
        return None

    await engine.open()
    await engine.start("queued", run_id="waiting-its-turn")  # pending, no worker yet
    clock.advance("2h")
    assert await engine.sweep_stalled(force=True) == 0
    assert reported == []


async def test_a_long_local_step_is_not_stalled(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h")
    reported = _pager(engine)
    started = asyncio.Event()
    finish = asyncio.Event()

    @engine.workflow("crunch")
    async def crunch(ctx: durably.WorkflowContext) -> Any:
        async def work() -> str:
            started.set()
            await finish.wait()
            return "crunched"

        return await ctx.local_step("work", work)

    await engine.open()
    await engine.start("crunch", run_id="crunch")
    await asyncio.wait_for(started.wait(), 10)
    clock.advance("2h")
    try:
        assert await engine.sweep_stalled(force=True) == 0
    finally:
        finish.set()
    assert reported == []


async def _parked_on_step(engine: durably.Engine, clock: VirtualClock) -> int:
    @engine.step("remote-work")
    async def remote_work(data: Any) -> str:  # pragma: no cover - nobody serves it
        return "done"

    @engine.workflow("dispatcher")
    async def dispatcher(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(remote_work)

    await engine.open()
    await engine.start("dispatcher", run_id="d")
    await _suspended(engine, "d")
    steps = [cp for cp in await engine.history("d") if cp.dispatched_at is not None]
    assert len(steps) == 1
    return steps[0].seq


async def test_a_dispatched_step_whose_worker_is_silent_is_stalled(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h", reconcile="5m", transport="memory://")
    reported = _pager(engine)
    await _parked_on_step(engine, clock)
    for _ in range(11):  # 55 minutes of reconcile turns, the step still silent
        clock.advance("5m")
        await _reconcile(engine)
    assert await engine.sweep_stalled(force=True) == 0
    clock.advance("6m")
    await _reconcile(engine)
    assert await engine.sweep_stalled(force=True) == 1
    assert reported == ["d"]


async def test_a_dispatched_step_that_beats_is_not_stalled(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h", reconcile=0, transport="memory://")
    reported = _pager(engine)
    seq = await _parked_on_step(engine, clock)
    for _ in range(4):  # a worker beating every half hour, for two hours
        clock.advance("30m")
        assert await engine.store.record_heartbeat("d", seq, clock.now_ms(), None)
        assert await engine.sweep_stalled(force=True) == 0
    clock.advance("61m")  # then silent past the window
    assert await engine.sweep_stalled(force=True) == 1
    assert reported == ["d"]
