"""Live updates: which runs changed, as a stream the SSE endpoint relays.

:class:`PollingChanges` reads the store for runs whose ``updated_at`` moved,
so it sees runs executed by any process on any store. A source fed by the
engine's lifecycle events can replace it: anything with ``changes()``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from ..model import Run
from ..stores.base import RunQuery
from ._backend import DashboardStore

__all__ = ["ChangeSource", "PollingChanges"]

# A write can commit a little after the time it stamped: each poll looks this
# far behind the newest change it saw, and forgets what it already reported.
_OVERLAP_MS = 2000
_BATCH = 200


class ChangeSource(Protocol):
    """Where the live view learns that runs changed."""

    def changes(self, since_ms: int) -> AsyncIterator[list[Run]]:
        """Batches of runs changed after ``since_ms``, for as long as iterated."""


class PollingChanges:
    """Polls ``store.list_runs(updated_after=…)`` every ``interval`` seconds."""

    def __init__(self, store: DashboardStore, interval: float = 1.0) -> None:
        self._store = store
        self._interval = interval

    async def changes(self, since_ms: int) -> AsyncIterator[list[Run]]:
        """Batches of runs changed after ``since_ms`` (each change once)."""
        newest = since_ms
        seen: dict[tuple[str, int], None] = {}
        while True:
            page = await self._store.list_runs(
                RunQuery(updated_after=newest - _OVERLAP_MS, limit=_BATCH)
            )
            fresh = [
                run
                for run in page.runs
                if run.updated_at > since_ms and (run.run_id, run.updated_at) not in seen
            ]
            for run in fresh:
                seen[(run.run_id, run.updated_at)] = None
                newest = max(newest, run.updated_at)
            horizon = newest - _OVERLAP_MS
            for key in [k for k in seen if k[1] <= horizon]:
                del seen[key]
            if fresh:
                yield fresh
            await asyncio.sleep(self._interval)


def now_ms() -> int:
    """The wall clock in epoch ms (what stores stamp ``updated_at`` with)."""
    return int(time.time() * 1000)
