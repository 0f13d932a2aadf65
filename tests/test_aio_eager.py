"""``_aio.start_eagerly``: a coroutine run at once up to its first suspension,
then as a task would have run it (served handlers on ``local://``)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars

import pytest

from durably._aio import start_eagerly

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("_VAR", default="outside")


async def test_a_coroutine_that_never_suspends_runs_at_once_and_leaves_nothing() -> None:
    ran: list[str] = []

    async def quick() -> None:
        ran.append(_VAR.get())
        _VAR.set("inside")  # never reset: it must not leak out

    assert start_eagerly(quick()) is None
    assert ran == ["outside"]
    assert _VAR.get() == "outside"


async def test_a_coroutine_that_suspends_goes_on_in_a_task_in_its_own_context() -> None:
    gate = asyncio.Event()
    seen: list[str] = []

    async def slow() -> None:
        token = _VAR.set("inside")
        seen.append("started")
        await gate.wait()
        seen.append(_VAR.get())
        _VAR.reset(token)  # a token made before the suspension, reset after it

    runner = start_eagerly(slow())
    assert runner is not None
    assert seen == ["started"]  # up to the first suspension, before returning
    assert _VAR.get() == "outside"
    gate.set()
    await runner
    assert seen == ["started", "inside"]
    assert _VAR.get() == "outside"


async def test_a_coroutine_suspending_many_times_gets_each_result() -> None:
    loop = asyncio.get_running_loop()

    async def chain() -> None:
        for value in range(3):
            future: asyncio.Future[int] = loop.create_future()
            loop.call_soon(future.set_result, value)
            assert await future == value
            await asyncio.sleep(0)  # a bare yield to the loop passes through too

    runner = start_eagerly(chain())
    assert runner is not None
    await runner
    assert runner.exception() is None


async def test_a_failure_before_the_first_suspension_is_the_tasks() -> None:
    async def broken() -> None:
        raise RuntimeError("before any await")

    runner = start_eagerly(broken())
    assert runner is not None
    with pytest.raises(RuntimeError, match="before any await"):
        await runner


async def test_a_failure_after_suspending_is_the_tasks() -> None:
    async def broken_later() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("after an await")

    runner = start_eagerly(broken_later())
    assert runner is not None
    with pytest.raises(RuntimeError, match="after an await"):
        await runner


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    cleaned: list[str] = []
    waiting = asyncio.Event()

    async def waits() -> None:
        try:
            waiting.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cleaned.append("cancelled inside")
            raise

    runner = start_eagerly(waits())
    assert runner is not None
    assert waiting.is_set()
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert cleaned == ["cancelled inside"]
    assert runner.cancelled()


async def test_a_cancel_the_coroutine_swallows_lets_it_finish() -> None:
    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await asyncio.sleep(0)

    runner = start_eagerly(stubborn())
    assert runner is not None
    await asyncio.sleep(0)
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    assert runner.done()


async def test_an_awaitable_that_is_not_a_coroutine_gets_a_task() -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    runner = start_eagerly(future)
    assert runner is future  # ensure_future's answer for a future: itself
    future.set_result(None)
    await runner


async def test_a_coroutine_raising_cancelled_at_once_ends_cancelled_not_raising() -> None:
    async def gives_up() -> None:
        raise asyncio.CancelledError

    runner = start_eagerly(gives_up())
    assert runner is not None
    await asyncio.gather(runner, return_exceptions=True)
    assert runner.cancelled()


async def test_the_first_step_runs_as_the_task_that_goes_on() -> None:
    seen: list[asyncio.Task[object] | None] = []

    async def looks() -> None:
        seen.append(asyncio.current_task())
        await asyncio.sleep(0)
        seen.append(asyncio.current_task())

    caller = asyncio.current_task()
    runner = start_eagerly(looks())
    assert runner is not None
    assert asyncio.current_task() is caller  # the caller's task is current again
    await runner
    assert seen == [runner, runner]


async def test_a_timeout_entered_before_the_first_suspension_cancels_its_own_task() -> None:
    outcome: list[str] = []

    async def bounded() -> None:
        try:
            async with asyncio.timeout(0):  # due at once: expires at the first await
                await asyncio.Event().wait()
        except TimeoutError:
            outcome.append("timed out")

    caller = asyncio.current_task()
    assert caller is not None
    runner = start_eagerly(bounded())
    assert runner is not None
    await asyncio.wait([runner])  # no cancel reaches the caller through the wait
    assert caller.cancelling() == 0  # the timeout did not cancel the caller
    assert outcome == ["timed out"]
