"""Live updates: which runs changed, as streams the SSE endpoint relays.

:class:`PollingChanges` reads the store: runs whose ``updated_at`` moved (for
the runs list), and one run's row, steps and children (for its page: a step
finishing mid-turn does not touch the run's row). Reading the store, it sees
runs executed by any process. When the backend has lifecycle events
(``engine.subscribe()``), an event wakes the next poll at once instead of
after the interval: the store stays the one source of truth, events only cut
the delay. Any other source can replace it: anything with ``changes()`` and
``run_changes()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ..model import Run
from ..stores.base import RunQuery
from ._backend import DashboardBackend

__all__ = ["ChangeSource", "PollingChanges"]

_log = logging.getLogger("durably.dashboard")

# A write can commit a little after the time it stamped: each poll looks this
# far behind the newest change it saw, and forgets what it already reported.
_OVERLAP_MS = 2000
_BATCH = 200
# However many events arrive, one viewer polls at most this often.
_MIN_GAP_S = 0.25


class _Nudges:
    """Wakes a poll early on each lifecycle event of the backend (if it has
    ``subscribe``); otherwise, and without events, a poll waits the interval."""

    def __init__(self, backend: DashboardBackend) -> None:
        subscribe = getattr(backend, "subscribe", None)
        self._subscribe: Callable[[], Any] | None = subscribe if callable(subscribe) else None
        self._nudged = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Nudges:
        if self._subscribe is not None:
            self._task = asyncio.create_task(self._listen(self._subscribe))
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _listen(self, subscribe: Callable[[], Any]) -> None:
        try:
            async with subscribe() as events:
                async for _ in events:
                    self._nudged.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            # Events only shorten the wait; without them polling goes on.
            _log.debug("lifecycle events unavailable to the dashboard", exc_info=True)

    async def wait(self, interval: float) -> None:
        """Until the interval passes or an event arrives (then at least the
        minimum gap)."""
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._nudged.wait(), interval)
        self._nudged.clear()
        rest = _MIN_GAP_S - (time.monotonic() - started)
        if rest > 0:
            await asyncio.sleep(rest)


class ChangeSource(Protocol):
    """Where the live view learns that runs changed."""

    def changes(self, since_ms: int) -> AsyncIterator[list[Run]]:
        """Batches of runs changed after ``since_ms``, for as long as iterated."""

    def run_changes(self, run_id: str, *, resync: bool = False) -> AsyncIterator[None]:
        """One item each time the run, one of its steps or children changes;
        with ``resync``, also one as soon as watching has begun."""


class PollingChanges:
    """Polls the store every ``interval`` seconds."""

    def __init__(self, backend: DashboardBackend, interval: float = 1.0) -> None:
        self._backend = backend
        self._store = backend.store
        self._interval = interval

    async def run_changes(self, run_id: str, *, resync: bool = False) -> AsyncIterator[None]:
        """One item each time what the run's page shows changes; with
        ``resync`` (a page rendered before this stream began), one first, once
        watching has begun."""
        async with _Nudges(self._backend) as nudges:
            last = await self._signature(run_id)
            if resync:
                # A change committed between the page's render and the read
                # above is in ``last`` already and would never be pushed: the
                # page re-reads now, and every later change differs from ``last``.
                yield None
            while True:
                await nudges.wait(self._interval)
                current = await self._signature(run_id)
                if current != last:
                    last = current
                    yield None

    async def _signature(self, run_id: str) -> tuple[object, ...]:
        run = await self._backend.get_run(run_id)
        if run is None:
            return ()
        history = await self._backend.history(run_id)
        children = await self._store.list_runs(RunQuery(parent_id=run_id, limit=200))
        return (
            run.status,
            run.updated_at,
            tuple(
                (cp.seq, str(cp.status), cp.attempts, cp.last_heartbeat_at, cp.dispatched_at)
                for cp in history
            ),
            tuple((c.run_id, c.status, c.updated_at) for c in children.runs),
        )

    async def changes(self, since_ms: int) -> AsyncIterator[list[Run]]:
        """Batches of runs changed after ``since_ms`` (each change once)."""
        async with _Nudges(self._backend) as nudges:
            async for batch in self._changes(since_ms, nudges):
                yield batch

    async def _changes(self, since_ms: int, nudges: _Nudges) -> AsyncIterator[list[Run]]:
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
                await nudges.wait(self._interval)  # else a full batch: read on at once


def now_ms() -> int:
    """The wall clock in epoch ms (what stores stamp ``updated_at`` with)."""
    return int(time.time() * 1000)
