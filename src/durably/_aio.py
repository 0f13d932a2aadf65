"""Small asyncio helpers the background loops share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["EarliestTimer", "wait_event"]


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True if set.

    Every loop that is stopped by cancelling it waits with this, and a cancel
    must never be lost here, or the drain or close waiting for the loop hangs
    forever. Hence neither ``asyncio.wait_for(event.wait(), timeout)`` (on
    Python 3.11 it drops a cancel that lands while the event is being set)
    nor an inner task that is cancelled on timeout and awaited under
    ``suppress(CancelledError)`` (a cancel landing during that await is taken
    for the inner task's and dropped). ``asyncio.timeout`` counts cancel
    requests: it turns only its own into ``TimeoutError`` and lets any other
    propagate, whichever lands first.
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        # The timeout may fire in the iteration that set the event.
        return event.is_set()
    return True


class EarliestTimer:
    """One event-loop timer armed at the earliest loop time asked of it.

    Many deadlines (held turns' windows, running handlers' beats) share one
    timer instead of a timer each: most of them are over before they are
    due, and a ``TimerHandle`` made and cancelled per dispatched step was a
    measurable share of its CPU. The callback finds what is due itself and
    arms the timer again for what is left."""

    __slots__ = ("_at", "_callback", "_handle")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0

    def arm(self, at: float) -> None:
        """Call back at loop time ``at`` (seconds), unless it will by then already."""
        if self._handle is not None:
            if self._at <= at:
                return
            self._handle.cancel()
        self._at = at
        self._handle = asyncio.get_running_loop().call_at(at, self._fire)

    @property
    def armed(self) -> bool:
        """Whether a call back is pending."""
        return self._handle is not None

    def _fire(self) -> None:
        self._handle = None
        self._callback()
