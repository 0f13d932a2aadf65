"""Lifecycle events of runs executing in another process, heard through
PostgreSQL's NOTIFY (an engine made with ``publish_events=True``)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import pytest

import durably
from durably import EventKind, LifecycleEvent

pytestmark = pytest.mark.timeout(120)

# The other process: it executes one run, publishing its events, and exits.
_OTHER = textwrap.dedent(
    """
    import asyncio, sys
    import durably

    async def main(url, publish, run_id):
        engine = durably.Engine(url, publish_events=publish == "1", poll_interval=0.05)

        @engine.workflow("far")
        async def far(ctx, n):
            await ctx.local_step("big", lambda: "x" * 5000)
            return n + 1

        async with engine:
            await engine.start("far", 1, run_id=run_id)
            await engine.wait_for_run(run_id, terminal=True, timeout=60)

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def _run_other(url: str, publish: bool, run_id: str = "far-1") -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _OTHER, url, "1" if publish else "0", run_id
    )
    assert await proc.wait() == 0


async def test_events_of_a_run_in_another_process_reach_a_subscriber(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> None:
    async with isolated_postgres() as url:
        watcher = durably.Engine(url, drive=False)
        try:
            async with watcher.subscribe(run_id="far-1") as sub:
                other = asyncio.ensure_future(_run_other(url, publish=True))
                seen: list[LifecycleEvent] = []
                async with asyncio.timeout(60):
                    async for event in sub:
                        seen.append(event)
                        if event.kind is EventKind.RUN_COMPLETED:
                            break
                await other
        finally:
            await watcher.close()
    assert [e.kind for e in seen] == [
        EventKind.RUN_STARTED,
        EventKind.STEP_STARTED,
        EventKind.STEP_COMPLETED,
        EventKind.RUN_COMPLETED,
    ]
    assert all(not e.local and e.origin and e.origin != watcher.instance_id for e in seen)
    step = seen[2]
    assert (step.workflow, step.step, step.seq, step.attempt) == ("far", "big", 0, 1)


async def test_an_engine_that_does_not_publish_sends_nothing(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> None:
    async with isolated_postgres() as url:
        watcher = durably.Engine(url, drive=False)
        try:
            async with watcher.subscribe(kinds=["run.completed"]) as sub:
                await _run_other(url, publish=False, run_id="quiet")
                await _run_other(url, publish=True, run_id="loud")
                # Notifications arrive in commit order: had the first process
                # published, its run's end would come before the second's.
                async with asyncio.timeout(60):
                    first = await anext(sub)
        finally:
            await watcher.close()
    assert first.run_id == "loud"
