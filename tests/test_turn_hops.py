"""Event-loop turns on a run's latency path, counted (not timed): each is a
hop a one-step run pays between its store round trips."""

from __future__ import annotations

import asyncio
from typing import Any

import durably
from durably._replay import Turn, TurnEnd
from durably.model import Checkpoint, Run, RunStatus


def _turn() -> Turn:
    run = Run("r", "w", "1", RunStatus.RUNNING, locked_by="me", locked_until=10**15)
    return Turn(run, {}, "me", lambda: 0, 0, 30_000)


async def _loop_turns_until(future: asyncio.Future[object]) -> int:
    """How many loop turns pass until ``future`` is done."""
    turns = 0
    while not future.done():
        await asyncio.sleep(0)
        turns += 1
    return turns


async def test_a_turn_ends_in_the_loop_turn_its_body_returns_in() -> None:
    """The turn hears its body end from the body's own last step, not from a
    done callback that schedules the turn's wake-up one loop turn later."""
    turn = _turn()

    async def body() -> int:
        return 7

    outcome = asyncio.ensure_future(turn.execute(body))
    assert await _loop_turns_until(outcome) <= 2  # three before: body, callback, turn
    assert outcome.result().end is TurnEnd.COMPLETED
    assert outcome.result().output == 7


async def test_a_failed_body_stores_a_traceback_that_starts_at_the_body() -> None:
    """No engine frame heads a stored failure's traceback."""
    engine = durably.Engine("memory://")

    @engine.workflow("boom")
    async def boom(ctx: durably.WorkflowContext) -> None:
        raise ValueError("the body's own failure")

    async with engine:
        handle = await engine.start("boom")
        result = await engine.wait_for_run(handle.run_id, terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None
    lines = result.error["traceback"].splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "in boom" in lines[1], lines
    assert "_replay.py" not in result.error["traceback"]


async def test_a_cancelled_body_still_ends_its_turn() -> None:
    """A body cancelled from outside pokes its turn as it unwinds."""
    turn = _turn()
    started = asyncio.Event()

    async def body() -> None:
        started.set()
        await asyncio.sleep(3600)

    outcome = asyncio.ensure_future(turn.execute(body))
    await started.wait()
    body_task = next(
        t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t is not outcome
    )
    body_task.cancel()
    assert (await asyncio.wait_for(outcome, 10)).end is TurnEnd.CLOSED


async def _written_statuses(step: Any) -> list[str]:
    """The statuses of the checkpoints a one-step run hands the store, in order."""
    engine = durably.Engine("memory://")
    written: list[str] = []
    save = engine.store.save_checkpoint

    async def counting(checkpoint: Checkpoint, owner: str) -> bool:
        written.append(str(checkpoint.status))
        return await save(checkpoint, owner)

    engine.store.save_checkpoint = counting  # type: ignore[method-assign]

    @engine.workflow("one")
    async def one(ctx: durably.WorkflowContext) -> Any:
        return await ctx.local_step("s", step)

    async with engine:
        handle = await engine.start("one")
        result = await engine.wait_for_run(handle.run_id, terminal=True, timeout=10)
    assert result.status is RunStatus.COMPLETED, result
    return written


async def test_a_step_that_never_yields_writes_only_its_result() -> None:
    """Its ``running`` record would be superseded in the same commit: never queued."""

    async def quick() -> int:
        return 1

    assert await _written_statuses(quick) == ["completed"]


async def test_a_step_that_yields_records_running_while_it_runs() -> None:
    async def slow() -> int:
        await asyncio.sleep(0.05)
        return 1

    def blocking() -> int:  # a step thread
        return 1

    assert await _written_statuses(slow) == ["running", "completed"]
    assert await _written_statuses(blocking) == ["running", "completed"]


async def test_a_quick_step_that_fails_records_running_before_failed() -> None:
    """The attempt's records keep their order when it fails without yielding."""
    calls: list[int] = []

    async def flaky() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first attempt")
        return 1

    engine = durably.Engine("memory://")
    written: list[tuple[str, int]] = []
    save = engine.store.save_checkpoint

    async def counting(checkpoint: Checkpoint, owner: str) -> bool:
        written.append((str(checkpoint.status), checkpoint.attempts))
        return await save(checkpoint, owner)

    engine.store.save_checkpoint = counting  # type: ignore[method-assign]

    @engine.workflow("one")
    async def one(ctx: durably.WorkflowContext) -> Any:
        return await ctx.local_step("s", flaky, retries=1, backoff_base=0.001)

    async with engine:
        handle = await engine.start("one")
        result = await engine.wait_for_run(handle.run_id, terminal=True, timeout=10)
    assert result.status is RunStatus.COMPLETED, result
    assert written[0] == ("running", 1)
    assert written[-1] == ("completed", 2)
