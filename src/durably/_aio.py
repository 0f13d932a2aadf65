"""Small asyncio helpers the background loops share."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["wait_event"]


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True if set.

    Used instead of ``asyncio.wait_for(event.wait(), timeout)`` in every loop
    that is stopped by cancelling it: on Python 3.11 ``wait_for`` swallows a
    cancellation that lands while the event is being set, and the loop then
    runs on forever (a drain or close would hang waiting for it).
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
    return bool(done)
