"""A step result that arrives after its run ended ``failed`` is dropped.

At-least-once delivery and slow workers make late results normal: the run
gave up on the step (its liveness window ran out) or failed for another
reason while the step was still out. The late result must not resurrect the
run, change its status, output or error, or make it take another turn.

"Took no turn" is counted, not waited for: the body counts its executions
(every turn replays it from the top), the late result is followed on the
same results stream by the result a second, parked run waits for, and the
engine is closed (which joins every turn it started) before counting.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably.testing import VirtualClock
from durably.wire import StepResult

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(60)


async def eventually(predicate: Any, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def out(engine: durably.Engine, run_id: str, seqs: set[int]) -> None:
    """Wait until the steps at ``seqs`` of ``run_id`` are dispatched."""

    async def sent() -> bool:
        history = {cp.seq: cp for cp in await engine.history(run_id)}
        return all(seq in history and history[seq].dispatched_at for seq in seqs)

    await eventually(sent)


def register(engine: durably.Engine, turns: Counter[str]) -> None:
    @engine.workflow("gives-up")
    async def gives_up(ctx: durably.WorkflowContext) -> Any:
        turns[ctx.run_id] += 1
        # Nobody serves it: the pickup window runs out, the run fails.
        return await ctx.step("slow-worker", timeout="5s", pickup_timeout="5s", retries=0)

    @engine.workflow("sibling-fails")
    async def sibling_fails(ctx: durably.WorkflowContext) -> Any:
        turns[ctx.run_id] += 1
        # The body fails at the first failure while the other step is out.
        return await asyncio.gather(ctx.step("slow-worker"), ctx.step("broken"))

    @engine.workflow("marker")
    async def marker(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step("marker-step")


async def test_a_late_result_for_a_failed_run_is_dropped(make_engine: EngineFactory) -> None:
    clock = VirtualClock()
    turns: Counter[str] = Counter()
    engine = make_engine(transport="local://", serve_steps=[], clock=clock)
    register(engine, turns)
    async with engine:
        # One run whose awaited step timed out, one that failed while a step
        # was still out (its sibling failed fatally).
        await engine.start("gives-up", run_id="timed-out")
        await engine.start("sibling-fails", run_id="sibling-failed")
        await engine.start("marker", run_id="marker")
        await out(engine, "timed-out", {0})
        await out(engine, "sibling-failed", {0, 1})
        await out(engine, "marker", {0})
        clock.advance("5s")
        await engine.transport.send_result(
            StepResult(
                "sibling-failed",
                1,
                ok=False,
                error={"message": "broken", "code": "broken", "retryable": False},
            )
        )
        before = {
            run_id: await engine.wait_for_run(run_id, terminal=True, timeout=15)
            for run_id in ("timed-out", "sibling-failed")
        }
        assert all(run.status is RunStatus.FAILED for run in before.values())
        records = {run_id: await engine.get_run(run_id) for run_id in before}
        still_out = {cp.seq: cp for cp in await engine.history("sibling-failed")}
        assert still_out[0].status is CheckpointStatus.PENDING
        turns_before = Counter(turns)
        # The slow worker finally answers both, then the marker's result follows.
        await engine.transport.send_result(StepResult("timed-out", 0, ok=True, output="late"))
        await engine.transport.send_result(StepResult("sibling-failed", 0, ok=True, output="late"))
        await engine.transport.send_result(StepResult("marker", 0, ok=True, output="after"))
        assert (await engine.wait_for_run("marker", terminal=True, timeout=15)).output == "after"
    # Closed: every turn the late results could have started has ended.
    assert turns == turns_before
    for run_id, previous in records.items():
        current = await engine.get_run(run_id)
        assert previous is not None and current is not None
        assert current.status is RunStatus.FAILED
        assert current.output is None
        assert current.error == previous.error
        assert current.updated_at == previous.updated_at
        assert current.wake_requested_at == previous.wake_requested_at
        assert current.locked_by is None
    timed_out = {cp.seq: cp for cp in await engine.history("timed-out")}
    assert timed_out[0].status is CheckpointStatus.FAILED
    assert timed_out[0].output is None
    # The work was done: the step's own record keeps its result (a retry of
    # the run does not do it again), but the run does not move.
    sibling = {cp.seq: cp for cp in await engine.history("sibling-failed")}
    assert sibling[0].status is CheckpointStatus.COMPLETED and sibling[0].output == "late"
