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
    """Polls ``store.list_changed`` every ``interval`` seconds."""

    def __init__(self, store: DashboardStore, interval: float = 1.0) -> None:
        self._store = store
        self._interval = interval

    async def changes(self, since_ms: int) -> AsyncIterator[list[Run]]:
        """Batches of runs changed after ``since_ms`` (each change once)."""
        newest = since_ms
        seen: dict[tuple[str, int], None] = {}
        while True:
            # Every row this returns is either fresh or in `seen` (what the
            # window holds): asking for that many more always reaches past
            # it, so a window with more changes than one batch never stalls.
            limit = len(seen) + _BATCH
            changed = await self._store.list_changed(max(newest - _OVERLAP_MS, since_ms), limit)
            fresh = [run for run in changed if (run.run_id, run.updated_at) not in seen]
            for run in fresh:
                seen[(run.run_id, run.updated_at)] = None
                newest = max(newest, run.updated_at)
            horizon = newest - _OVERLAP_MS
            for key in [k for k in seen if k[1] <= horizon]:
                del seen[key]
            if fresh:
                yield fresh
            if len(changed) < limit or not fresh:
                await asyncio.sleep(self._interval)  # else a full batch: read on at once


def now_ms() -> int:
    """The wall clock in epoch ms (what stores stamp ``updated_at`` with)."""
    return int(time.time() * 1000)
