"""Durable timers, signals and timeouts, driven by a virtual clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably.testing import VirtualClock, eventually

from .conftest import EngineFactory


async def test_sleep_suspends_until_the_timer_is_due(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)
    after: list[int] = []

    @engine.workflow("nap")
    async def nap(ctx: durably.WorkflowContext) -> str:
        await ctx.sleep("2h")
        after.append(clock.now_ms())
        return "rested"

    await engine.open()
    start = clock.now_ms()
    await engine.start("nap", run_id="n")
    await engine.join()
    run = await engine.get_run("n")
    assert run is not None and run.status is RunStatus.SUSPENDED
    assert run.wake_at == start + 2 * 3_600_000

    clock.advance("1h59m")
    assert await engine.resume_due_timers() == 0
    clock.advance("1m")
    assert await engine.resume_due_timers() == 1
    await engine.join()
    result = await engine.wait_for_run("n", terminal=True, timeout=10)
    assert result.output == "rested"
    assert after == [start + 2 * 3_600_000]


async def test_replay_does_not_restart_the_countdown(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, reconcile="1d")

    @engine.workflow("nap-then-signal")
    async def wf(ctx: durably.WorkflowContext) -> None:
        await asyncio.gather(ctx.sleep("1h"), ctx.wait_for_signal("poke"))

    await engine.open()
    start = clock.now_ms()
    await engine.start("nap-then-signal", run_id="r")
    await engine.join()
    clock.advance("30m")
    await engine.signal("poke")  # a turn in between replays the pending sleep
    await engine.join()
    run = await engine.get_run("r")
    assert run is not None and run.status is RunStatus.SUSPENDED
    assert run.wake_at == start + 3_600_000


async def test_sleep_until_and_past_times(make_engine: EngineFactory, clock: VirtualClock) -> None:
    engine = make_engine(clock=clock)
    base = datetime.fromtimestamp(clock.now_ms() / 1000, tz=UTC)

    @engine.workflow("until")
    async def until(ctx: durably.WorkflowContext) -> str:
        await ctx.sleep_until(base - timedelta(days=1))  # already past: no suspension
        await ctx.sleep_until(base + timedelta(minutes=5))
        return "done"

    await engine.open()
    await engine.start("until", run_id="u")
    await engine.join()
    run = await engine.get_run("u")
    assert run is not None and run.wake_at == clock.now_ms() + 5 * 60_000
    clock.advance("5m")
    await engine.resume_due_timers()
    await engine.join()
    assert (await engine.wait_for_run("u", terminal=True, timeout=10)).output == "done"
    with pytest.raises(ValueError, match="timezone-aware"):
        await engine.start("until", run_id="naive", start_at=datetime(2030, 1, 1))


async def test_delayed_start(make_engine: EngineFactory, clock: VirtualClock) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("later")
    async def later(ctx: durably.WorkflowContext) -> int:
        return 7

    await engine.open()
    run = await engine.start("later", run_id="l", start_at="10m")
    assert run.run.status is RunStatus.SUSPENDED
    await engine.run_pending()
    await engine.join()
    assert (await engine.get_run("l")).status is RunStatus.SUSPENDED  # type: ignore[union-attr]
    clock.advance("10m")
    assert await engine.resume_due_timers() == 1
    assert (await engine.wait_for_run("l", terminal=True, timeout=10)).output == 7


async def test_timer_batches_are_bounded_and_claimed_once(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, timer_batch_size=5, drive=False)
    other = make_engine(clock=clock, timer_batch_size=5, drive=False)

    @engine.workflow("t")
    async def t(ctx: durably.WorkflowContext) -> None:
        return None

    other.register("t", t)  # another instance of the same app (claims take only its workflows)
    await engine.open()
    await other.open()
    for i in range(12):
        await engine.start("t", run_id=f"t{i:02}", start_at=f"{i + 1}s")
    clock.advance("1m")
    assert await engine.resume_due_timers() == 5
    assert await other.resume_due_timers() == 5  # the first five are claimed
    assert await engine.resume_due_timers() == 2
    assert await other.resume_due_timers() == 0
    clock.advance(engine.lease_ms / 1000)
    # Claims that were never followed by a wake come due again after a lease.
    assert await other.resume_due_timers() == 5


async def test_signal_before_the_waiter_is_buffered(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("approve")
    async def approve(ctx: durably.WorkflowContext) -> object:
        await ctx.local_step("prepare", lambda: None)
        return await ctx.wait_for_signal("approve:1")

    async with engine:
        assert await engine.signal("approve:1", {"ok": True}) is None  # nobody waits yet
        assert await engine.store.list_buffered_signals("approve:1") == [{"ok": True}]
        await engine.start("approve", run_id="a")
        result = await engine.wait_for_run("a", terminal=True, timeout=10)
        assert await engine.store.list_buffered_signals("approve:1") == []
    assert result.output == {"ok": True}


async def test_signal_after_the_waiter_wakes_the_run(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("approve")
    async def approve(ctx: durably.WorkflowContext) -> object:
        return await ctx.wait_for_signal("approve:2")

    async with engine:
        await engine.start("approve", run_id="a")
        assert (await engine.wait_for_run("a", timeout=10)).status is RunStatus.SUSPENDED
        assert await engine.signal("approve:2", [1, "two"]) == "a"
        result = await engine.wait_for_run("a", terminal=True, timeout=10)
    assert result.output == [1, "two"]


async def test_signals_to_one_token_are_consumed_in_order(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("collect")
    async def collect(ctx: durably.WorkflowContext) -> list[object]:
        return [await ctx.wait_for_signal("q") for _ in range(3)]

    async with engine:
        for i in range(3):
            await engine.signal("q", i)
        await engine.start("collect", run_id="c")
        assert (await engine.wait_for_run("c", terminal=True, timeout=10)).output == [0, 1, 2]


async def test_signal_timeout_raises_in_the_body(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("impatient")
    async def impatient(ctx: durably.WorkflowContext) -> str:
        try:
            await ctx.wait_for_signal("late", timeout="2d")
        except durably.SignalTimeout as exc:
            return f"gave up on {exc.token}"
        return "approved"

    await engine.open()
    await engine.start("impatient", run_id="i")
    await engine.join()
    run = await engine.get_run("i")
    assert run is not None and run.wake_at == clock.now_ms() + 5 * 60_000  # reconcile first
    clock.advance("2d")
    assert await engine.resume_due_timers() == 1
    result = await engine.wait_for_run("i", terminal=True, timeout=10)
    assert result.output == "gave up on late"
    # The timed-out waiter is gone: a late signal is buffered, not delivered.
    assert await engine.signal("late", "too late") is None
    history = await engine.history("i")
    assert history[0].status is CheckpointStatus.FAILED
    assert history[0].error is not None and history[0].error["code"] == "signal_timeout"


async def test_a_signal_that_beats_the_timeout_wins(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("close-call")
    async def close_call(ctx: durably.WorkflowContext) -> object:
        return await ctx.wait_for_signal("close", timeout="1m")

    await engine.open()
    await engine.start("close-call", run_id="c")
    await engine.join()
    clock.advance("2m")  # the deadline passed, but the signal lands before the wake
    await engine.signal("close", "in time")
    await engine.resume_due_timers()
    result = await engine.wait_for_run("c", terminal=True, timeout=10)
    assert result.output == "in time"


async def _signal_wait_registered(engine: durably.Engine, run_id: str) -> None:
    """The wait registers itself while the local step gathered with it runs: a
    signal sent before that is buffered (another test's case), not delivered."""

    async def registered() -> bool:
        return any(
            cp.kind == "signal" and cp.status is CheckpointStatus.PENDING
            for cp in await engine.history(run_id)
        )

    await eventually(registered, what=f"the signal wait of {run_id} to be registered")


async def test_signal_during_a_running_turn_is_not_lost(make_engine: EngineFactory) -> None:
    """The waiter is registered, and the signal arrives while the same turn
    still holds the lease: the holder runs one more turn instead of letting go."""
    engine = make_engine()
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def slow() -> str:
        entered.set()
        await gate.wait()
        return "slow"

    @engine.workflow("race")
    async def race(ctx: durably.WorkflowContext) -> list[object]:
        return list(await asyncio.gather(ctx.wait_for_signal("r"), ctx.local_step("slow", slow)))

    async with engine:
        await engine.start("race", run_id="r")
        await asyncio.wait_for(entered.wait(), 10)
        await _signal_wait_registered(engine, "r")
        assert await engine.signal("r", "signal") == "r"
        run = await engine.get_run("r")
        assert run is not None and run.status is RunStatus.RUNNING
        assert run.wake_requested_at is not None
        gate.set()
        result = await engine.wait_for_run("r", terminal=True, timeout=10)
    assert result.output == ["signal", "slow"]


async def test_signal_from_another_engine_during_a_turn(make_engine: EngineFactory) -> None:
    """Same race across instances: the sender cannot take the lease, stamps
    the wake, and the holder serves it."""
    engine = make_engine()
    sender = make_engine(drive=False)
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def slow() -> None:
        entered.set()
        await gate.wait()

    @engine.workflow("race2")
    async def race2(ctx: durably.WorkflowContext) -> object:
        results = await asyncio.gather(ctx.wait_for_signal("r2"), ctx.local_step("slow", slow))
        return results[0]

    async with engine:
        await engine.start("race2", run_id="r2")
        await asyncio.wait_for(entered.wait(), 10)
        await _signal_wait_registered(engine, "r2")
        assert await sender.signal("r2", "remote") == "r2"
        gate.set()
        result = await engine.wait_for_run("r2", terminal=True, timeout=10)
    assert result.output == "remote"


@pytest.mark.parametrize("order", ["signal-first", "wait-first", "together"])
async def test_no_lost_signal_under_interleavings(make_engine: EngineFactory, order: str) -> None:
    engine = make_engine()
    n = 40

    @engine.workflow("inbox")
    async def inbox(ctx: durably.WorkflowContext, i: int) -> object:
        return await ctx.wait_for_signal(f"msg:{i}")

    async with engine:
        if order == "signal-first":
            for i in range(n):
                await engine.signal(f"msg:{i}", i)
            for i in range(n):
                await engine.start("inbox", i, run_id=f"in{i}")
        elif order == "wait-first":
            for i in range(n):
                await engine.start("inbox", i, run_id=f"in{i}")
            for i in range(n):
                await engine.signal(f"msg:{i}", i)
        else:
            await asyncio.gather(
                *(engine.start("inbox", i, run_id=f"in{i}") for i in range(n)),
                *(engine.signal(f"msg:{i}", i) for i in range(n)),
            )
        results = [await engine.wait_for_run(f"in{i}", terminal=True, timeout=20) for i in range(n)]
    assert [r.output for r in results] == list(range(n))


async def test_reconcile_wakes_a_run_whose_wake_was_lost(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    """The sender completed the wait but died before waking the run."""
    engine = make_engine(clock=clock, reconcile="5m")

    @engine.workflow("stranded")
    async def stranded(ctx: durably.WorkflowContext) -> object:
        return await ctx.wait_for_signal("lost")

    await engine.open()
    await engine.start("stranded", run_id="s")
    await engine.join()
    # Deliver through the store only, as a sender that crashed before its wake.
    assert await engine.store.send_signal("lost", "payload", clock.now_ms()) == "s"
    assert (await engine.get_run("s")).status is RunStatus.SUSPENDED  # type: ignore[union-attr]
    clock.advance("5m")
    assert await engine.resume_due_timers() == 1
    assert (await engine.wait_for_run("s", terminal=True, timeout=10)).output == "payload"
