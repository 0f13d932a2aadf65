"""A clock that only moves when the test says so."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from datetime import datetime

from ..durations import Duration, to_ms

__all__ = ["VirtualClock"]


class VirtualClock:
    """A :class:`durably.clock.Clock` whose time advances only through :meth:`advance`.

    ``sleep`` waits until the clock has been advanced past its deadline, so
    step retries, lease renewals and durable timers can be driven precisely::

        clock = VirtualClock()
        engine = durably.Engine("memory://", clock=clock)
        ...
        clock.advance("1h")
        await engine.resume_due_timers()
    """

    def __init__(self, start: datetime | int | None = None) -> None:
        if isinstance(start, datetime):
            self._now = int(start.timestamp() * 1000)
        else:
            self._now = 1_800_000_000_000 if start is None else int(start)
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now_ms(self) -> int:
        """The virtual time in epoch milliseconds."""
        return self._now

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock is advanced by at least ``seconds``."""
        deadline = self._now + max(0, round(seconds * 1000))
        if deadline <= self._now:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline, next(self._order), future))
        await future

    def advance(self, duration: Duration) -> None:
        """Move time forward and release every sleeper whose deadline passed."""
        self._now += to_ms(duration, name="advance")
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    @property
    def deadlines(self) -> list[int]:
        """When each waiting sleep ends, in epoch milliseconds, soonest first.

        A test can wait until the engine sleeps until a given moment before
        it advances the clock again: proof that a timer loop ran and re-armed,
        which a real-time sleep cannot give::

            await eventually(lambda: beat + 40_000 in clock.deadlines)
        """
        return sorted(deadline for deadline, _, f in self._sleepers if not f.done())

    @property
    def sleepers(self) -> int:
        """How many sleeps are waiting (cancelled ones included until released)."""
        return sum(1 for _, _, f in self._sleepers if not f.done())
