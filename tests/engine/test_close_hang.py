"""Closing an engine whose worker loop swallowed a cancellation must not hang."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import durably
from durably.testing import eventually


async def test_close_ends_a_worker_loop_whose_phase_swallowed_the_cancel() -> None:
    """redis-py swallows a cancellation inside a SCAN (the blocked-runs phase
    lists the live workers): the loop went on and ``close`` waited for it forever."""
    engine = durably.Engine("memory://", poll_interval=0.01)
    entered = asyncio.Event()

    async def swallowing_phase(limit: int = 0, **_: Any) -> int:
        entered.set()
        with contextlib.suppress(asyncio.CancelledError):  # a misbehaving client library
            await asyncio.sleep(0.05)
        return 0

    engine.resume_due_timers = swallowing_phase  # type: ignore[method-assign]
    await engine.start_worker()
    await eventually(entered.is_set, what="the phase to run")
    # Bounded only so that the old hang fails the test instead of stalling the suite.
    await asyncio.wait_for(engine.close(), timeout=60)
