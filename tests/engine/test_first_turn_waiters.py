"""A run's ending clears its signal and event waiters, also when the store is
told it may skip that (``RunChanges.waiters``): a first turn that registered a
wait says so. Every store, PostgreSQL included (its one-step final statement
leaves the waiter tables out when the turn promises it has none)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.model import CheckpointKind
from durably.testing import eventually

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", ["signal", "event"])
async def test_a_first_turn_ending_with_a_registered_wait_leaves_no_waiter(
    make_engine: EngineFactory, kind: str
) -> None:
    engine = make_engine()
    pending: list[asyncio.Future[Any]] = []

    @engine.workflow("walks_away")
    async def walks_away(ctx: durably.WorkflowContext) -> str:
        # A wait left behind: registered in this, the run's first turn, and
        # never consumed; the run ends with one step result queued (the
        # single final statement on PostgreSQL).
        if kind == "signal":
            wait = ctx.wait_for_signal(f"tok:{ctx.run_id}")
        else:
            wait = ctx.wait_for_event(f"evt:{ctx.run_id}")
        pending.append(asyncio.ensure_future(wait))

        async def until_registered() -> str:
            # The wait's checkpoint is written with its waiter, in one transaction.
            wanted = CheckpointKind.SIGNAL if kind == "signal" else CheckpointKind.EVENT

            async def registered() -> bool:
                return any(cp.kind == wanted for cp in await engine.history(ctx.run_id))

            await eventually(registered, what="the wait's checkpoint")
            return "registered"

        return await ctx.local_step("until_registered", until_registered)

    async with engine:
        handle = await engine.start("walks_away", run_id="away")
        result = await engine.wait_for_run(handle.run_id, terminal=True, timeout=30)
        assert (result.status, result.output) == (RunStatus.COMPLETED, "registered")
        for wait in pending:
            wait.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # Nobody waits any more: a signal is buffered, an event wakes no run.
        if kind == "signal":
            assert await engine.signal("tok:away", 1) is None
        else:
            assert await engine.publish_event("evt:away", 1) == 0
        run = await engine.get_run("away")
        assert run is not None and run.status is RunStatus.COMPLETED


async def test_a_one_step_run_leaves_its_turn_promising_no_waiters(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    promised: list[bool] = []
    store = engine.store
    settle_run = store.settle_run

    def spy(run_id: str, owner: str, status: RunStatus, changes: Any, now: int) -> Any:
        promised.append(changes.waiters)
        return settle_run(run_id, owner, status, changes, now)

    store.settle_run = spy  # type: ignore[method-assign]

    async def step(x: int) -> int:
        return x

    @engine.workflow("one_step")
    async def one_step(ctx: durably.WorkflowContext, x: int) -> int:
        out: int = await ctx.local_step("s0", step, x)
        return out

    @engine.workflow("waits_then_ends")
    async def waits_then_ends(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal(f"go:{ctx.run_id}")

    async with engine:
        run = await engine.start("one_step", 7)
        assert (await engine.wait_for_run(run.run_id, terminal=True, timeout=30)).output == 7
        assert promised == [False]
        waiting = await engine.start("waits_then_ends", run_id="w")
        await engine.wait_for_run(waiting.run_id, timeout=30)  # suspended on the signal
        assert await engine.signal("go:w", 5) == "w"
        done = await engine.wait_for_run("w", terminal=True, timeout=30)
        assert (done.status, done.output) == (RunStatus.COMPLETED, 5)
    # The waiter's first turn registered a wait; its second began with a history.
    assert promised == [False, True, True]
