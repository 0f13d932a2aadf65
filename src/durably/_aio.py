"""Small asyncio helpers the background loops share."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import types
from asyncio.tasks import _enter_task, _leave_task
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
    """Start a task for ``awaitable`` and run its first step now, as Python
    3.12's eager tasks do: ``None`` if it finished there without failing
    (nothing left to watch), else the task (pending, or ending as that step
    ended: failed, cancelled). Anything other than a coroutine gets a plain task.

    Most served steps end without ever suspending, and a task's first step
    a loop iteration later, then its done callback, were a large share of the
    cost of serving one. The first step runs as the task's own (its context,
    and ``asyncio.current_task()``), so ``asyncio.timeout``, task groups and
    cancel scopes entered before the first suspension belong to the task that
    goes on after it.
    """
    if not isinstance(awaitable, types.CoroutineType):
        return asyncio.ensure_future(awaitable)
    loop = asyncio.get_running_loop()
    if _EAGER_START:  # pragma: no cover - Python 3.12+
        task: asyncio.Task[None] = asyncio.Task(  # type: ignore[call-arg,unused-ignore]
            awaitable, loop=loop, eager_start=True
        )
        if task.done() and not task.cancelled() and task.exception() is None:
            return None
        return task
    # Before 3.12: the task's coroutine is a _Rest of ``awaitable``, whose
    # first step runs here with the task current; the task's own first step
    # (queued when it was made) then hands over what that step awaits, or
    # ends as that step ended.
    context = contextvars.copy_context()
    rest = _Rest(awaitable)
    task = loop.create_task(rest, context=context)
    current = asyncio.current_task(loop)
    if current is not None:
        _leave_task(loop, current)
    _enter_task(loop, task)
    try:
        rest.first = context.run(awaitable.send, None)
    except StopIteration:
        rest.first = _FINISHED
        return None
    except (Exception, asyncio.CancelledError) as exc:
        rest.first, rest.error = _FINISHED, exc
    finally:
        _leave_task(loop, task)
        if current is not None:
            _enter_task(loop, current)
    return task


_EAGER_START = sys.version_info >= (3, 12)
_STARTED = object()
_FINISHED = object()


class _Rest(Coroutine[Any, Any, None]):
    """What the task of a coroutine :func:`start_eagerly` started drives: its
    first step hands the task what the first step awaited (a future, or
    ``None`` for a bare yield), or ends as it ended; then sends and throws go
    to the coroutine (a cancel too, even one that came before that step), as
    if the task had run it from the start."""

    __slots__ = ("_coro", "error", "first")

    def __init__(self, coro: Coroutine[Any, Any, None]) -> None:
        self._coro = coro
        self.first: Any = _STARTED
        self.error: BaseException | None = None

    def send(self, value: Any) -> Any:
        first = self.first
        if first is _STARTED:
            return self._coro.send(value)
        self.first = _STARTED
        if first is _FINISHED:
            error, self.error = self.error, None
            if error is not None:
                raise error
            raise StopIteration
        return first

    def throw(self, *exc: Any) -> Any:
        self.first = _STARTED
        self.error = None
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        raise TypeError("driven by its task only")
