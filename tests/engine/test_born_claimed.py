"""Steps an engine on ``db://`` serves itself: their tasks are born claimed
(inserted held by this process, handed to its server in memory), and a run
behaves as with a claimed task: its steps complete once each, a cancel
reaches a running handler, and nothing is left queued."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.testing import eventually
from durably.transports.db import DbTransport, task_topic

from .conftest import EngineFactory


def _transport(engine: durably.Engine) -> DbTransport:
    assert isinstance(engine.transport, DbTransport)
    return engine.transport


@pytest.fixture
def db_engine(make_engine: EngineFactory, store_url: str) -> EngineFactory:
    if store_url == "memory://":
        pytest.skip("db:// needs a SQL store")
    return lambda **options: make_engine(transport="db://", **options)


async def test_steps_served_here_are_born_claimed_and_run_once_each(
    db_engine: EngineFactory,
) -> None:
    engine = db_engine()
    calls: list[int] = []

    @engine.step("inc")
    async def inc(n: int) -> int:
        calls.append(n)
        return n + 1

    @engine.workflow("three")
    async def three(ctx: durably.WorkflowContext, n: int) -> int:
        for _ in range(3):
            n = int(await ctx.step("inc", n))
        return n

    async with engine:
        runs = [await engine.start("three", i * 10) for i in range(6)]
        done = [await engine.wait_for_run(r.run_id, terminal=True, timeout=30) for r in runs]
        queue = _transport(engine)._q()
        depth = await queue.depth([task_topic("inc")])
    assert [r.output for r in done] == [i * 10 + 3 for i in range(6)]
    assert sorted(calls) == sorted(i * 10 + k for i in range(6) for k in range(3))
    assert _transport(engine).born >= 1
    assert depth == {}


async def test_a_cancel_reaches_the_handler_of_a_born_claimed_task(
    db_engine: EngineFactory,
) -> None:
    engine = db_engine()
    started = asyncio.Event()
    stopped: list[bool] = []

    @engine.step("loop")
    async def loop(data: Any, log: durably.StepLogger) -> str:
        started.set()
        await log.wait_cancelled()
        stopped.append(log.cancelled)
        return "stopped early"

    @engine.workflow("cancellable")
    async def cancellable(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(loop)

    async with engine:
        await engine.start("cancellable", run_id="c1")
        await asyncio.wait_for(started.wait(), 10)
        assert _transport(engine).born == 1  # it runs as born claimed
        await engine.cancel("c1")
        await eventually(lambda: bool(stopped), what="the handler to stop")
        current = await engine.get_run("c1")
        await eventually(lambda: not _transport(engine)._running, what="its task to be done with")
    assert stopped == [True]
    assert current is not None and current.status is RunStatus.CANCELLED
