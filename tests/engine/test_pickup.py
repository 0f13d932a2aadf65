"""``pickup_timeout`` and ``timeout`` are two windows, not one.

A dispatched step with a ``timeout`` is awaited in memory: until a worker's
first beat (the pickup) the window is ``pickup_timeout``, the time the task
may wait in the queue; from the pickup on it is ``timeout`` after the newest
beat. Queue wait is never counted as silence.

The worker here is written against the wire (a handler on the real
``local://`` transport that beats and answers when the test says), so pickup
and every beat land at a virtual instant the test chooses, and the moment a
window ran out is read back from the failed checkpoint's ``finished_at``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably.testing import VirtualClock
from durably.transports import LocalTransport
from durably.wire import Heartbeat, StepResult, StepTask, routing_token

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(60)

STEP = "remote-work"


class WireWorker:
    """A worker that takes tasks off the transport and holds them for the test."""

    def __init__(self, transport: LocalTransport) -> None:
        self.transport = transport
        self.tasks: asyncio.Queue[StepTask] = asyncio.Queue()

    async def serve(self) -> None:
        """Start picking up tasks of :data:`STEP` (nothing is served before)."""

        async def take(task: StepTask) -> None:
            await self.tasks.put(task)

        await self.transport.serve([routing_token(STEP)], take, concurrency=1)

    async def beat(self, task: StepTask) -> None:
        await self.transport.send_heartbeat(Heartbeat(task.run_id, task.seq, task.group))

    async def answer(self, task: StepTask, output: Any) -> None:
        await self.transport.send_result(StepResult(task.run_id, task.seq, ok=True, output=output))


async def eventually(predicate: Any, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def checkpoint(engine: durably.Engine, run_id: str) -> durably.Checkpoint | None:
    history = await engine.history(run_id)
    return history[0] if history else None


async def dispatched_at(engine: durably.Engine, run_id: str) -> int:
    """Wait until the step is out; when it was sent."""

    async def out() -> bool:
        cp = await checkpoint(engine, run_id)
        return cp is not None and cp.dispatched_at is not None

    await eventually(out)
    cp = await checkpoint(engine, run_id)
    assert cp is not None and cp.dispatched_at is not None
    return cp.dispatched_at


async def heard(engine: durably.Engine, run_id: str, clock: VirtualClock) -> None:
    """Wait until the engine received the beat just sent (persisted at ``now``:
    with a zero persist throttle, every beat is written when it is heard)."""

    async def persisted() -> bool:
        cp = await checkpoint(engine, run_id)
        return cp is not None and cp.last_heartbeat_at == clock.now_ms()

    await eventually(persisted)


async def round_trips(engine: durably.Engine, run_id: str, count: int = 5) -> None:
    """Give a dispatcher whose window just ran out the loop turns and store
    round trips it needs to record the failure (so a wrong window shows)."""
    for _ in range(count):
        await engine.history(run_id)
        await asyncio.sleep(0)


def build(
    make_engine: EngineFactory, clock: VirtualClock, *, timeout: str, pickup: str
) -> tuple[durably.Engine, WireWorker]:
    transport = LocalTransport()
    engine = make_engine(transport=transport, clock=clock, heartbeat_persist_throttle=0)

    @engine.workflow("calls-remote")
    async def calls_remote(ctx: durably.WorkflowContext) -> Any:
        try:
            return await ctx.step(STEP, "in", timeout=timeout, pickup_timeout=pickup, retries=0)
        except durably.StepFailed as failure:
            return {"code": failure.code, "message": str(failure)}

    return engine, WireWorker(transport)


async def test_queue_wait_longer_than_the_timeout_is_not_silence(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    """pickup_timeout > timeout: a task that waits in the queue for three
    times ``timeout``, then is served by a handler beating every 8 s for 40 s,
    succeeds on its first attempt."""
    engine, worker = build(make_engine, clock, timeout="10s", pickup="60s")
    async with engine:
        await engine.start("calls-remote", run_id="slow-pickup")
        sent = await dispatched_at(engine, "slow-pickup")
        clock.advance("30s")  # three silence windows of queue wait
        await round_trips(engine, "slow-pickup")
        await worker.serve()
        task = await asyncio.wait_for(worker.tasks.get(), 15)
        await worker.beat(task)  # the pickup beat
        await heard(engine, "slow-pickup", clock)
        for _ in range(5):
            clock.advance("8s")
            await round_trips(engine, "slow-pickup")
            await worker.beat(task)
            await heard(engine, "slow-pickup", clock)
        assert clock.now_ms() - sent == 70_000  # past both windows counted from the send
        await worker.answer(task, "done")
        result = await engine.wait_for_run("slow-pickup", terminal=True, timeout=15)
    assert result.status is RunStatus.COMPLETED
    assert result.output == "done"
    cp = await checkpoint(engine, "slow-pickup")
    assert cp is not None and cp.attempts == 1


async def test_a_task_never_picked_up_fails_after_the_pickup_window(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    """pickup_timeout < timeout: nobody serves the step; the attempt fails
    with ``remote_step_timeout`` exactly ``pickup_timeout`` after the send,
    long before ``timeout``, and says it was not picked up."""
    engine, _ = build(make_engine, clock, timeout="60s", pickup="5s")
    async with engine:
        await engine.start("calls-remote", run_id="unserved")
        sent = await dispatched_at(engine, "unserved")
        clock.advance("5s")
        result = await engine.wait_for_run("unserved", terminal=True, timeout=15)
    assert result.output["code"] == "remote_step_timeout"
    assert "picked up" in result.output["message"]
    cp = await checkpoint(engine, "unserved")
    assert cp is not None and cp.status is CheckpointStatus.FAILED
    assert cp.finished_at == sent + 5_000


async def test_a_picked_up_handler_that_goes_silent_fails_timeout_after_its_last_beat(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    """Picked up 30 s after the send, one more beat 8 s later, then silence:
    the attempt fails 10 s (``timeout``) after that last beat — not 10 s
    after the send or the pickup, and not when the 60 s pickup window ends."""
    engine, worker = build(make_engine, clock, timeout="10s", pickup="60s")
    async with engine:
        await engine.start("calls-remote", run_id="went-silent")
        sent = await dispatched_at(engine, "went-silent")
        clock.advance("30s")
        await round_trips(engine, "went-silent")
        await worker.serve()
        task = await asyncio.wait_for(worker.tasks.get(), 15)
        await worker.beat(task)
        await heard(engine, "went-silent", clock)
        clock.advance("8s")
        await round_trips(engine, "went-silent")
        await worker.beat(task)
        await heard(engine, "went-silent", clock)
        last_beat = clock.now_ms()
        clock.advance("2s")  # 10 s after the pickup beat: not silent yet
        await round_trips(engine, "went-silent")
        clock.advance("8s")  # 10 s after the last beat
        result = await engine.wait_for_run("went-silent", terminal=True, timeout=15)
    assert result.output["code"] == "remote_step_timeout"
    assert "heartbeat" in result.output["message"]
    cp = await checkpoint(engine, "went-silent")
    assert cp is not None and cp.status is CheckpointStatus.FAILED
    assert cp.finished_at == last_beat + 10_000
    assert cp.finished_at < sent + 60_000
