"""Wait, in real time, until a condition holds: the one polling helper for tests."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

__all__ = ["eventually"]

T = TypeVar("T")


async def eventually(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    what: str = "the condition",
    timeout: float = 10.0,
    interval: float = 0.01,
) -> T:
    """Call ``predicate`` until it returns a truthy value, and return that value.

    ``predicate`` may be a plain function or a coroutine function. It is called
    at once, then every ``interval`` seconds of real (event-loop) time, never on
    the virtual clock: a test advances a :class:`VirtualClock` and then waits
    here for the engine to react.

    An :class:`AssertionError` raised by ``predicate`` means "not yet", like a
    falsy answer; any other exception fails the wait at once. After ``timeout``
    seconds without a truthy answer, ``eventually`` raises
    :class:`AssertionError` naming ``what`` and the last thing observed: the
    predicate's last answer when it says more than ``False`` (``None``, an
    empty list, ``0``), or its last assertion message::

        run = await eventually(lambda: engine.get_run("r"), what="run r to exist")
        await eventually(lambda: len(calls) == 2, what="the second attempt", timeout=5)

    Use it to wait for something that *will* happen. To show that something
    does *not* happen, wait for a later event that proves the loop in question
    ran, or advance the virtual clock past its next turn and
    ``await engine.join()``: a sleep followed by "nothing happened" also passes
    when the loop never ran.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            answer = predicate()
            value = cast(T, await answer) if inspect.isawaitable(answer) else answer
        except AssertionError as failed:
            observed = f"; last check failed: {failed}" if str(failed) else ""
        else:
            if value:
                return value
            observed = "" if isinstance(value, bool) else f"; last saw {value!r}"
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{observed}")
        await asyncio.sleep(interval)
