"""Leases, recovery, fencing, cancellation, drain and execution timeouts."""

from __future__ import annotations

import asyncio

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably._replay import Turn
from durably.model import Run
from durably.stores.memory import MemoryStore
from durably.testing import VirtualClock

from .conftest import EngineFactory


async def _orphan(engine: durably.Engine, run_id: str, owner: str = "dead-process") -> None:
    """Make ``run_id`` look like a run whose executor died mid-turn."""
    now = engine.clock.now_ms()
    run = await engine.store.acquire_run(
        run_id, owner, now, now + engine.lease_ms, frozenset({RunStatus.PENDING})
    )
    assert run is not None


async def test_orphans_are_recovered_after_their_lease(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, drive=False)
    worker = make_engine(clock=clock)
    ran: list[str] = []

    async def body(ctx: durably.WorkflowContext) -> str:
        return await ctx.local_step("work", lambda: ran.append("x") or "done")

    engine.register("job", body)
    worker.register("job", body)
    await engine.start("job", run_id="j")
    await _orphan(engine, "j")
    await worker.open()
    assert await worker.recover_incomplete() == 0  # the lease is still live
    clock.advance(engine.lease_ms / 1000 + 0.001)
    assert await worker.recover_incomplete() == 1
    result = await worker.wait_for_run("j", terminal=True, timeout=10)
    assert result.output == "done" and ran == ["x"]
    run = await worker.get_run("j")
    assert run is not None and run.recovery_attempts == 1


async def test_a_run_that_keeps_crashing_goes_dead(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, drive=False, max_recovery_attempts=2)

    @engine.workflow("poison")
    async def poison(ctx: durably.WorkflowContext) -> None:
        return None

    await engine.start("poison", run_id="p")
    for attempt in range(3):
        await _orphan(engine, "p")
        clock.advance(engine.lease_ms / 1000 + 0.001)
        assert await engine.recover_incomplete() == 1
        run = await engine.get_run("p")
        assert run is not None and run.recovery_attempts == attempt + 1
    assert run.status is RunStatus.DEAD
    assert run.error is not None and run.error["code"] == "max_recovery_attempts"
    result = await engine.wait_for_run("p", timeout=5)
    assert result.status is RunStatus.DEAD


async def test_recovery_lists_orphans_only_and_is_bounded(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, drive=False)

    @engine.workflow("w")
    async def w(ctx: durably.WorkflowContext) -> None:
        return None

    for i in range(5):
        await engine.start("w", run_id=f"o{i}")
        await _orphan(engine, f"o{i}")
    await engine.start("w", run_id="healthy")
    clock.advance(engine.lease_ms / 1000 + 0.001)
    await engine.start("w", run_id="fresh-pending")
    assert await engine.recover_incomplete(limit=3) == 3
    assert await engine.recover_incomplete(limit=3) == 2
    assert await engine.recover_incomplete(limit=3) == 0


async def test_a_fenced_turn_writes_nothing(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    """A turn whose lease renewal fails (another instance took over) stops
    without writing checkpoints or its outcome."""
    engine = make_engine(clock=clock, lease="10s")
    entered = asyncio.Event()
    gate = asyncio.Event()

    async def slow() -> str:
        entered.set()
        await gate.wait()
        return "late"

    @engine.workflow("zombie")
    async def zombie(ctx: durably.WorkflowContext) -> str:
        return await ctx.local_step("slow", slow)

    await engine.open()
    await engine.start("zombie", run_id="z")
    await asyncio.wait_for(entered.wait(), 10)
    # Another instance takes over after the lease ran out (e.g. a long GC pause here).
    clock_now = clock.now_ms()
    assert await engine.store.update_run_if(
        "z",
        frozenset({RunStatus.RUNNING}),
        {"locked_by": "usurper", "locked_until": clock_now + 60_000},
        clock_now,
    )
    clock.advance("5s")  # the renewal fires and fails
    await asyncio.sleep(0.05)
    gate.set()
    await engine.join()
    run = await engine.get_run("z")
    assert run is not None and run.status is RunStatus.RUNNING and run.locked_by == "usurper"
    history = await engine.history("z")
    assert [c.status for c in history] == [CheckpointStatus.RUNNING]


async def test_a_turn_needs_a_fenced_write_once_half_its_lease_is_gone() -> None:
    now = [1_000_000]
    run = Run("r", "w", "1", RunStatus.RUNNING, locked_until=now[0] + 10_000)
    turn = Turn(run, {}, "me", lambda: now[0], reconcile_ms=0, lease_ms=10_000)
    assert not turn.needs_fence()  # just taken: a write would prove nothing new
    now[0] += 5_000
    assert not turn.needs_fence()
    now[0] += 1
    assert turn.needs_fence()  # the lease may have been taken over meanwhile
    turn.lease_until = now[0] + 10_000  # renewed
    assert not turn.needs_fence()
    turn.write_later(asyncio.sleep(0, True))
    assert turn.needs_fence()  # an earlier result is not durable yet
    await turn.flush()
    assert not turn.needs_fence()


class _RenewalsFail(MemoryStore):
    """A store that cannot be reached for lease renewals (a network blip)."""

    async def renew_lease(self, run_id: str, owner: str, lease_until: int) -> bool:
        raise OSError("connection reset")


async def test_a_step_after_a_stale_lease_proves_it_before_its_effect(clock: VirtualClock) -> None:
    """The first step of a turn skips its fenced write only while the lease is
    fresh: once the renewals have failed for half a lease and another
    instance took the run over, the step's effect never happens here."""
    engine = durably.Engine(_RenewalsFail(), clock=clock, lease="10s")
    started, gate = asyncio.Event(), asyncio.Event()
    effects: list[str] = []

    @engine.workflow("late-step")
    async def late_step(ctx: durably.WorkflowContext) -> str:
        started.set()
        await gate.wait()  # the body computes a while before its first step
        return await ctx.local_step("effect", lambda: effects.append("ran") or "done")

    try:
        await engine.open()
        await engine.start("late-step", run_id="s")
        await asyncio.wait_for(started.wait(), 10)
        clock.advance("6s")  # the renewal fails: the lease is known only until +10 s
        await asyncio.sleep(0.05)
        now = clock.now_ms()
        assert await engine.store.update_run_if(
            "s",
            frozenset({RunStatus.RUNNING}),
            {"locked_by": "usurper", "locked_until": now + 60_000},
            now,
        )
        gate.set()
        await engine.join()
        assert effects == []
        run = await engine.get_run("s")
        assert run is not None and run.locked_by == "usurper"
        assert await engine.history("s") == []
    finally:
        await engine.close()


async def test_cancel_stops_a_running_turn_and_is_never_overwritten(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    entered = asyncio.Event()
    gate = asyncio.Event()
    after_cancel: list[str] = []

    async def slow() -> None:
        entered.set()
        await gate.wait()

    @engine.workflow("cancellable")
    async def cancellable(ctx: durably.WorkflowContext) -> str:
        await ctx.local_step("slow", slow)
        after_cancel.append("next step reached")
        await ctx.local_step("next", lambda: None)
        return "completed"

    async with engine:
        await engine.start("cancellable", run_id="c")
        await asyncio.wait_for(entered.wait(), 10)
        assert await engine.cancel("c") is RunStatus.RUNNING
        gate.set()
        result = await engine.wait_for_run("c", terminal=True, timeout=10)
        await engine.join()
        assert result.status is RunStatus.CANCELLED
        assert after_cancel == []
        run = await engine.get_run("c")
        assert run is not None and run.status is RunStatus.CANCELLED and run.locked_by is None
        assert await engine.cancel("c") is RunStatus.CANCELLED  # idempotent


async def test_cancel_from_another_instance_fences_the_holder(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    operator = make_engine(drive=False)
    entered = asyncio.Event()
    gate = asyncio.Event()

    async def slow() -> None:
        entered.set()
        await gate.wait()

    @engine.workflow("remote-cancel")
    async def wf(ctx: durably.WorkflowContext) -> str:
        await ctx.local_step("slow", slow)
        return "completed"

    async with engine:
        await engine.start("remote-cancel", run_id="rc")
        await asyncio.wait_for(entered.wait(), 10)
        assert await operator.cancel("rc") is RunStatus.RUNNING
        gate.set()  # the stale turn tries to write its step and its outcome
        await engine.join()
        run = await engine.get_run("rc")
    assert run is not None and run.status is RunStatus.CANCELLED and run.output is None


async def test_cancel_suspended_and_pending_runs(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("waiting")
    async def waiting(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_signal("never")

    async with engine:
        await engine.start("waiting", run_id="s")
        await engine.wait_for_run("s", timeout=10)
        assert await engine.cancel("s") is RunStatus.SUSPENDED
        # Its waiter is gone: a signal to the token is buffered, not delivered.
        assert await engine.signal("never") is None
        assert (await engine.get_run("s")).status is RunStatus.CANCELLED  # type: ignore[union-attr]


async def test_execution_timeout_sweep(make_engine: EngineFactory, clock: VirtualClock) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("bounded", execution_timeout="1h")
    async def bounded(ctx: durably.WorkflowContext) -> None:
        await ctx.sleep("1d")

    await engine.open()
    await engine.start("bounded", run_id="b")
    await engine.join()
    clock.advance("59m")
    assert await engine.sweep_timeouts() == 0
    clock.advance("1m")
    assert await engine.sweep_timeouts() == 1
    result = await engine.wait_for_run("b", timeout=5)
    assert result.status is RunStatus.CANCELLED
    assert result.error is not None and result.error["code"] == "execution_timeout"
    clock.advance("1d")
    assert await engine.resume_due_timers() == 0  # a cancelled run is never woken


async def test_drain_hands_running_turns_back(make_engine: EngineFactory) -> None:
    engine = make_engine()
    entered = asyncio.Event()

    async def forever() -> None:
        entered.set()
        await asyncio.Event().wait()

    @engine.workflow("stuck")
    async def stuck(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("forever", forever)

    await engine.start_worker()
    await engine.start("stuck", run_id="s")
    await asyncio.wait_for(entered.wait(), 10)
    await engine.drain(0.1)
    run = await engine.get_run("s")
    assert run is not None and run.status is RunStatus.PENDING and run.locked_by is None


async def test_a_stable_instance_id_reclaims_its_own_runs_at_once(
    make_engine: EngineFactory,
) -> None:
    first = make_engine(instance_id="worker-1", drive=False)

    @first.workflow("mine")
    async def mine(ctx: durably.WorkflowContext) -> str:
        return "recovered"

    await first.start("mine", run_id="m")
    await _orphan(first, "m", owner="worker-1")  # worker-1 died mid-turn

    restarted = make_engine(instance_id="worker-1")
    restarted.register("mine", mine)
    async with restarted:
        assert await restarted.recover_incomplete() == 1
        assert (await restarted.wait_for_run("m", terminal=True, timeout=10)).output == "recovered"


async def test_tick_isolates_failing_phases(make_engine: EngineFactory) -> None:
    engine = make_engine()
    calls: list[str] = []

    async def broken(limit: int = 0) -> int:
        calls.append("broken")
        raise RuntimeError("phase exploded")

    async def counted() -> int:
        calls.append("timers")
        return 0

    engine.recover_incomplete = broken  # type: ignore[method-assign]
    engine.resume_due_timers = counted  # type: ignore[method-assign]
    await engine.open()
    await engine.tick()
    assert calls == ["broken", "timers"]


async def test_starts_gathered_at_once_insert_at_most_the_free_slots_leased(
    make_engine: EngineFactory, clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start with a free executor slot inserts its run leased to this
    process; starts whose inserts are in flight together must not all claim
    the same free slots (the rest would wait here while their leases ran out)."""
    engine = make_engine(clock=clock, max_concurrent_runs=3)

    @engine.workflow("quick")
    async def quick(ctx: durably.WorkflowContext) -> int:
        return 1

    leased_inserts: list[bool] = []
    create_run = engine.store.create_run

    async def spy(run: durably.Run) -> tuple[durably.Run, bool]:
        leased_inserts.append(run.locked_by is not None)
        return await create_run(run)

    monkeypatch.setattr(engine.store, "create_run", spy)
    async with engine:
        await asyncio.gather(*(engine.start("quick", run_id=f"q{i}") for i in range(10)))
        results = [await engine.wait_for_run(f"q{i}", terminal=True, timeout=10) for i in range(10)]
    assert len(leased_inserts) == 10
    assert 1 <= leased_inserts.count(True) <= 3
    assert [r.output for r in results] == [1] * 10


async def test_a_pending_backlog_larger_than_a_poll_drains_without_waiting_for_ticks(
    make_engine: EngineFactory,
) -> None:
    """A crashed process leaves thousands of pending runs. A poll hands out at
    most 1,000; once the executor has started the last of them, the next page
    is polled at once (here the next tick is an hour away)."""
    producer = make_engine(drive=False)
    worker = make_engine(poll_interval=3600, max_concurrent_runs=50)

    async def quick(ctx: durably.WorkflowContext) -> int:
        return 1

    producer.register("quick", quick)
    worker.register("quick", quick)
    ids = [f"p{i}" for i in range(2_100)]
    for run_id in ids:
        await producer.start("quick", run_id=run_id)
    async with worker:
        for run_id in ids:
            result = await worker.wait_for_run(run_id, terminal=True, timeout=60)
            assert result.output == 1
