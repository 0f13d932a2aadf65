"""``wait_for_run`` after a wake: a run this process drives that was just woken
(an event, a signal) is not settled until the woken turn settles it, so a
wait right after the wake never answers with the settle from before it."""

from __future__ import annotations

from typing import Any

import pytest

import durably
from durably import RunStatus

from .conftest import EngineFactory


@pytest.mark.parametrize("wake", ["event", "signal"])
async def test_a_wait_after_a_wake_sees_the_turn_it_woke(
    make_engine: EngineFactory, wake: str
) -> None:
    engine = make_engine()
    heard: list[Any] = []

    @engine.workflow("twice")
    async def twice(ctx: durably.WorkflowContext) -> Any:
        if wake == "event":
            first = await ctx.wait_for_event("first")
        else:
            first = await ctx.wait_for_signal("first")
        await ctx.local_step("note", lambda: heard.append(first))
        return await ctx.wait_for_signal("second")

    async with engine:
        await engine.start("twice", run_id="w")
        for n in range(5):
            assert (await engine.wait_for_run("w", timeout=10)).status is RunStatus.SUSPENDED
            if n == 0:
                if wake == "event":
                    assert await engine.publish_event("first", "one") == 1
                else:
                    await engine.signal("first", "one")
                # Right after the wake: the settle from before it is stale.
                woken = await engine.wait_for_run("w", timeout=10)
                assert woken.status is RunStatus.SUSPENDED
                assert heard == ["one"], "wait_for_run answered with the settle before the wake"
        await engine.signal("second", "two")
        result = await engine.wait_for_run("w", terminal=True, timeout=10)
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == "two"
