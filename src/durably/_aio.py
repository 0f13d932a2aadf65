"""Small asyncio helpers the background loops share."""

from __future__ import annotations

import asyncio

__all__ = ["wait_event"]


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
