"""Small asyncio helpers the background loops share."""

from __future__ import annotations

import asyncio
import contextvars
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

__all__ = ["EarliestTimer", "start_eagerly", "wait_event"]


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


def start_eagerly(awaitable: Awaitable[None]) -> asyncio.Future[None] | None:
    """Run ``awaitable`` now, up to its first suspension, as a task would run it
    (in a copy of the current context); ``None`` if it finished there, else the
    task that runs the rest. A failure before the first suspension raises here.

    Python 3.11 has no eager tasks (3.12's ``eager_start``), and most served
    steps end without ever suspending: a task made for each (its first step a
    loop callback, its done callback another) was a large share of the cost of
    serving one. Anything other than a coroutine gets a task as before.
    """
    if not isinstance(awaitable, types.CoroutineType):
        return asyncio.ensure_future(awaitable)
    # A copy, as a task's: what the coroutine sets in context variables
    # stays its own, and a token it made resets in the same context later.
    context = contextvars.copy_context()
    loop = asyncio.get_running_loop()
    try:
        first = context.run(awaitable.send, None)
    except StopIteration:
        return None
    except asyncio.CancelledError:
        # Raised by the coroutine itself: its task would have ended
        # cancelled, not failed (nor taken its caller down with it).
        cancelled: asyncio.Future[None] = loop.create_future()
        cancelled.cancel()
        return cancelled
    return loop.create_task(_Rest(awaitable, first), context=context)


_STARTED = object()


class _Rest(Coroutine[Any, Any, None]):
    """The rest of a coroutine :func:`start_eagerly` started, for a task to
    drive: its first step hands the task what the coroutine awaits (a future,
    or ``None`` for a bare yield), then sends and throws (a cancel, even one
    that came before that first step) go to the coroutine, as if the task had
    run it from the start."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self._coro = coro
        self._first = first

    def send(self, value: Any) -> Any:
        first = self._first
        if first is not _STARTED:
            self._first = _STARTED
            return first
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._first = _STARTED
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        raise TypeError("driven by its task only")
