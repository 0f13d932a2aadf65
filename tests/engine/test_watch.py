"""The run watcher behind ``wait_for_run``: a caller's cancel is never lost."""

from __future__ import annotations

import asyncio

import pytest

from durably._watch import RunWatcher
from durably.model import Run, RunResult, RunStatus

_DONE = frozenset({RunStatus.COMPLETED})


async def _no_runs(run_ids: list[str]) -> list[Run]:
    return []


async def test_a_cancel_landing_as_the_run_settles_cancels_the_waiter() -> None:
    # asyncio.wait_for on Python 3.11 would return the result here and drop
    # the cancel: a task cancelled to stop it would go on running.
    watcher = RunWatcher(_no_runs, interval=60.0)
    try:
        task = asyncio.create_task(watcher.wait_local("r", _DONE, timeout=30.0))
        await asyncio.sleep(0)  # the waiter is registered
        watcher.settled(RunResult("r", RunStatus.COMPLETED))
        task.cancel()  # in the same iteration, before the waiter resumes
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await watcher.close()


async def test_a_waiter_gets_the_outcome_or_times_out() -> None:
    watcher = RunWatcher(_no_runs, interval=60.0)
    try:
        with pytest.raises(TimeoutError, match="wait_for_run"):
            await watcher.wait_local("slow", _DONE, timeout=0.01)
        task = asyncio.create_task(watcher.wait_local("r", _DONE, timeout=30.0))
        await asyncio.sleep(0)
        watcher.settled(RunResult("r", RunStatus.COMPLETED, output=7))
        assert (await task).output == 7
    finally:
        await watcher.close()
