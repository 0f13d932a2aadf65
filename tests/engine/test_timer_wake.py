"""The worker ticks when a timer falls due, not only once a poll interval.

The engines here poll once an hour: a short ``ctx.sleep`` finishing at all
shows the worker woke for its timer (before, it waited for the next poll, and
the bounded waits below turned that hang into a failure). Nothing is asserted
about time; that the loop does not spin is shown by counting its ticks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.model import Run

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(60)

NEVER = 3600.0
"""A poll interval no test outlives."""

GENEROUS = 20.0
"""Only turns a hang into a failure; the sleeps here are 0.2 s."""


def register(engine: durably.Engine) -> None:
    @engine.workflow("nap")
    async def nap(ctx: durably.WorkflowContext) -> str:
        await ctx.sleep("0.2s")
        return "rested"

    @engine.workflow("naps")
    async def naps(ctx: durably.WorkflowContext, count: int) -> int:
        for _ in range(count):
            await ctx.sleep("0.05s")
        return count


async def test_a_short_sleep_wakes_without_waiting_for_the_poll(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(poll_interval=NEVER)
    register(engine)
    async with engine:
        handle = await engine.start("nap")

        assert await handle.result(timeout=GENEROUS) == "rested"


async def test_a_timer_set_by_another_process_is_read_from_the_store(
    make_engine: EngineFactory,
) -> None:
    """No turn here suspended the run (another process did, before this one
    started): the store's next wake time, read after the first tick, is what
    brings the next tick forward."""
    engine = make_engine(poll_interval=NEVER)
    register(engine)
    await engine.open()
    store = engine.store
    now = engine.clock.now_ms()
    await store.create_run(_suspended("asleep-elsewhere", wake_at=now + 200))
    async with engine:
        result = await engine.wait_for_run("asleep-elsewhere", terminal=True, timeout=GENEROUS)

        assert (result.status, result.output) == (RunStatus.COMPLETED, "rested")


async def test_many_timers_in_a_row_each_wake_the_run(make_engine: EngineFactory) -> None:
    engine = make_engine(poll_interval=NEVER)
    register(engine)
    async with engine:
        handle = await engine.start("naps", 5)

        assert await handle.result(timeout=GENEROUS) == 5


async def test_a_due_run_another_instance_holds_does_not_make_the_loop_spin(
    make_engine: EngineFactory,
) -> None:
    """A suspended run due but leased elsewhere is listed by every poll and
    claimed by none here: it must not bring the next tick forward again and
    again. Over a 0.2 s sleep, a loop ticking at its floor would tick dozens
    of times; this one ticks at start, for the sleep's timer, and at most a
    couple more (a tick racing the turn's suspension)."""
    engine = make_engine(poll_interval=NEVER)
    register(engine)
    async with engine:
        store = engine.store
        now = engine.clock.now_ms()
        await store.create_run(
            _suspended(
                "held-elsewhere",
                wake_at=now - 1,
                locked_by="another-instance",
                locked_until=now + 3_600_000,
            )
        )
        worker = engine._worker  # the loop and its tick count
        before = worker.ticks
        handle = await engine.start("nap")

        assert await handle.result(timeout=GENEROUS) == "rested"

        assert worker.ticks - before <= 4
        held = await store.get_run("held-elsewhere")
        assert held is not None
        assert (held.status, held.locked_by) == (RunStatus.SUSPENDED, "another-instance")


def _suspended(run_id: str, **fields: Any) -> Run:
    """A run of ``nap`` suspended (by another process) with ``fields``."""
    now = int(fields.get("wake_at", 0))
    return Run(
        run_id=run_id,
        workflow="nap",
        workflow_version="1",
        status=RunStatus.SUSPENDED,
        created_at=now,
        updated_at=now,
        **fields,
    )


async def test_a_tick_woken_for_a_timer_runs_only_the_timer_phase(
    make_engine: EngineFactory,
) -> None:
    """The other phases keep the poll's pace: timers due every few ms cost a
    claim each, not every sweep each."""
    engine = make_engine(poll_interval=NEVER)
    register(engine)
    sweeps = 0
    timer_passes = 0
    sweep_timeouts = engine.sweep_timeouts
    resume_due_timers = engine._worker.resume_due_timers

    async def counted_sweep(limit: int = 100) -> int:
        nonlocal sweeps
        sweeps += 1
        return await sweep_timeouts(limit)

    async def counted_timers() -> int:
        nonlocal timer_passes
        timer_passes += 1
        return await resume_due_timers()

    engine.sweep_timeouts = counted_sweep  # type: ignore[method-assign]
    engine._worker.resume_due_timers = counted_timers  # type: ignore[method-assign]
    async with engine:
        handle = await engine.start("naps", 3)

        assert await handle.result(timeout=GENEROUS) == 3

    assert sweeps == 1  # the first tick's; the hour-long poll never came again
    assert timer_passes >= 3


async def test_a_timer_due_while_its_previous_turn_finishes_still_wakes_the_run(
    make_engine: EngineFactory,
) -> None:
    """The tick claims a due timer (its wake moves to the claim's lease end)
    and hands the run to the executor; if the run's previous turn was still
    finishing here (settled, not yet returned), the executor merged the hand-over
    into that execution and dropped it, so the run slept until the claim's
    lease ran out (30 s by default) instead of waking. The settle of the first
    suspend is held up here, after its commit, while polls find the timer due."""
    engine = make_engine(poll_interval=0.02, lease="60s")
    register(engine)
    store = engine.store
    settle_run = store.settle_run
    held = {"done": False}

    async def slow_first_suspend(run_id: str, owner: str, status: RunStatus, *rest: Any) -> Any:
        result = await settle_run(run_id, owner, status, *rest)
        if status is RunStatus.SUSPENDED and not held["done"]:
            held["done"] = True
            await asyncio.sleep(0.5)  # committed; the 0.05 s timer falls due meanwhile
        return result

    store.settle_run = slow_first_suspend  # type: ignore[method-assign]
    async with engine:
        handle = await engine.start("naps", 2)

        assert await handle.result(timeout=GENEROUS) == 2
    assert held["done"]


async def test_a_due_run_whose_claim_took_nothing_is_claimed_again(
    make_engine: EngineFactory,
) -> None:
    """The tick lists the run as due, but its claim takes nothing and changes
    nothing: on PostgreSQL the row was being written at that moment (the
    claim skips locked rows), and nobody else claimed it. The run is still
    due and free, so the loop must ask again soon: the next timer it plans
    for counts only timers later than the tick, and the poll is an hour away.
    Seen under load as test_many_timers_in_a_row_each_wake_the_run[postgresql]
    timing out, with the run suspended, due and unleased."""
    engine = make_engine(poll_interval=NEVER)
    register(engine)
    store: Any = engine.store
    claim = store.claim_due_batch
    skipped: list[list[str]] = []

    async def first_takes_nothing(run_ids: list[str], now: int, next_wake_at: int) -> list[str]:
        if not skipped:
            skipped.append(list(run_ids))
            return []  # as FOR UPDATE SKIP LOCKED does with a row being written
        claimed: list[str] = await claim(run_ids, now, next_wake_at)
        return claimed

    store.claim_due_batch = first_takes_nothing
    async with engine:
        handle = await engine.start("nap")

        assert await handle.result(timeout=GENEROUS) == "rested"
    assert skipped == [[handle.run_id]]


async def test_a_run_left_free_then_taken_elsewhere_does_not_make_the_loop_spin(
    make_engine: EngineFactory,
) -> None:
    """The claim takes nothing and the run still looks free (the loop plans
    another look soon), then another instance takes it: the polls list it no
    more. The look-again must end there, not repeat every few ms: over a
    0.2 s wait the loop ticks at most a couple of times."""
    engine = make_engine(poll_interval=NEVER)
    register(engine)
    store: Any = engine.store
    list_due, claim = store.list_due, store.claim_due_batch
    taken_elsewhere: list[str] = []

    async def listed(now: int, limit: int, **options: Any) -> list[str]:
        due: list[str] = await list_due(now, limit, **options)
        return [run_id for run_id in due if run_id not in taken_elsewhere]

    async def takes_nothing(run_ids: list[str], now: int, next_wake_at: int) -> list[str]:
        if not taken_elsewhere:
            taken_elsewhere.extend(run_ids)  # from the next poll on
            return []
        claimed: list[str] = await claim(run_ids, now, next_wake_at)
        return claimed

    store.list_due, store.claim_due_batch = listed, takes_nothing
    worker = engine._worker
    async with engine:
        await engine.start("nap")
        for _ in range(400):  # bounded: 20 s
            if taken_elsewhere:
                break
            await asyncio.sleep(0.05)
        assert taken_elsewhere
        before = worker.ticks
        await asyncio.sleep(0.2)

        assert worker.ticks - before <= 3
