"""Several runs waiting on one signal token (issue 12, item 5), through the engine.

One signal reaches exactly one waiter, the oldest first; a signal nobody
waits for is buffered. Two engines signalling one store at once never deliver
a signal twice nor lose one. Every store, PostgreSQL included.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(120)


async def test_two_engines_signalling_serve_each_waiter_once(make_engine: EngineFactory) -> None:
    engines = [make_engine(), make_engine()]
    waiters, extra = 12, 4
    for engine in engines:

        @engine.workflow("waiter")
        async def waiter(ctx: durably.WorkflowContext) -> Any:
            return await ctx.wait_for_signal("crowd")

    async with engines[0], engines[1]:
        for n in range(waiters):
            await engines[n % 2].start("waiter", run_id=f"w{n}")
        for n in range(waiters):
            run = await engines[0].wait_for_run(f"w{n}", timeout=30)
            assert run.status is RunStatus.SUSPENDED  # parked on the token

        sent = await asyncio.gather(
            *(engines[i % 2].signal("crowd", i) for i in range(waiters + extra))
        )
        results = [
            await engines[0].wait_for_run(f"w{n}", terminal=True, timeout=30)
            for n in range(waiters)
        ]
        buffered = await engines[0].store.list_buffered_signals("crowd")

    served = [run_id for run_id in sent if run_id is not None]
    assert sorted(served) == sorted(f"w{n}" for n in range(waiters))  # each waiter once
    assert all(r.status is RunStatus.COMPLETED for r in results)
    outputs = [r.output for r in results]
    # each signal exactly once: a waiter's output or buffered for a later wait
    assert sorted(outputs + buffered) == list(range(waiters + extra))
    assert len(buffered) == extra


async def test_a_waiter_that_times_out_leaves_the_next_one_first_in_line(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("patient")
    async def patient(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("line")

    @engine.workflow("hasty")
    async def hasty(ctx: durably.WorkflowContext) -> Any:
        try:
            return await ctx.wait_for_signal("line", timeout="50ms")
        except durably.SignalTimeout:
            return "gave up"

    async with engine:
        await engine.start("hasty", run_id="hasty")
        await engine.wait_for_run("hasty", timeout=10)
        await engine.start("patient", run_id="patient")
        await engine.wait_for_run("patient", timeout=10)
        gave_up = await engine.wait_for_run("hasty", terminal=True, timeout=30)
        assert await engine.signal("line", "for you") == "patient"
        served = await engine.wait_for_run("patient", terminal=True, timeout=30)
    assert (gave_up.output, served.output) == ("gave up", "for you")
