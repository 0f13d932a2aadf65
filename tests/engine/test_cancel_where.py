"""``cancel_where``: bulk cancel of the live runs matching a filter, capped per call."""

from __future__ import annotations

import pytest

import durably
from durably import RunStatus

from .conftest import EngineFactory


async def test_cancel_where_cancels_the_matching_live_runs_in_capped_calls(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_signal(f"go:{ctx.run_id}")

    @engine.workflow("other")
    async def other(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_signal(f"go:{ctx.run_id}")

    async with engine:
        for n in range(5):
            await engine.start("waits", run_id=f"w{n}", tags=["batch"] if n < 4 else [])
        await engine.start("other", run_id="o", tags=["batch"])
        await engine.start("waits", run_id="done")
        await engine.signal("go:done")
        await engine.wait_for_run("done", terminal=True, timeout=30)
        for n in range(5):
            await engine.wait_for_run(f"w{n}", timeout=30)

        first = await engine.cancel_where(workflow="waits", tag="batch", limit=3)
        assert (first.matched, first.cancelled, first.more) == (3, 3, True)
        second = await engine.cancel_where(workflow="waits", tag="batch", limit=3)
        assert (second.matched, second.cancelled, second.more) == (1, 1, False)
        assert await engine.cancel_where(workflow="waits", tag="batch") == durably.BulkCancel(
            0, 0, False
        )
        statuses = {r: (await engine.get_run(r)).status for r in ("w0", "w3", "w4", "o", "done")}  # type: ignore[union-attr]
        assert statuses == {
            "w0": RunStatus.CANCELLED,
            "w3": RunStatus.CANCELLED,
            "w4": RunStatus.SUSPENDED,  # no tag
            "o": RunStatus.SUSPENDED,  # another workflow
            "done": RunStatus.COMPLETED,  # ended: never touched
        }
        with pytest.raises(ValueError, match="limit"):
            await engine.cancel_where(limit=501)
