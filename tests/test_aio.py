"""The background loops' event wait must not swallow the cancel that stops them."""

from __future__ import annotations

import asyncio

import pytest

from durably._aio import wait_event


async def _loop(event: asyncio.Event, passes: list[int]) -> None:
    while True:
        await wait_event(event, 1.0)
        event.clear()
        passes.append(1)


@pytest.mark.timeout(30)
async def test_a_cancel_landing_as_the_event_is_set_stops_the_loop() -> None:
    # asyncio.wait_for on Python 3.11 returns the event's result here and
    # drops the cancel, so a drain waiting for the loop hangs forever.
    for _ in range(200):
        event = asyncio.Event()
        passes: list[int] = []
        task = asyncio.create_task(_loop(event, passes))
        await asyncio.sleep(0)  # the loop is waiting
        event.set()
        await asyncio.sleep(0)  # the inner wait finishes first...
        task.cancel()  # ...and the cancel lands before the loop resumes
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)


async def test_wait_event_reports_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0) is True


async def _spin(event: asyncio.Event, stop: list[bool]) -> None:
    # A loop whose every wait times out at once: a cancel lands on each
    # phase of the timeout path in turn as the test shifts it by one
    # loop iteration.
    while not stop:
        await wait_event(event, 0)


@pytest.mark.parametrize("iterations", range(12))
async def test_a_cancel_landing_as_the_wait_times_out_stops_the_loop(iterations: int) -> None:
    # The old wait_event cancelled its inner waiter on timeout and awaited it
    # under suppress(CancelledError): a cancel arriving during that await was
    # taken for the waiter's and dropped, so `durably worker` hung in drain
    # (its worker loop never stopped) after a SIGTERM that landed there.
    event = asyncio.Event()
    stop: list[bool] = []
    task = asyncio.create_task(_spin(event, stop))
    for _ in range(iterations):
        await asyncio.sleep(0)
    task.cancel()
    # A cancel that is honoured ends the task within an iteration or two; one
    # that was swallowed leaves it spinning. Counting iterations, not seconds,
    # keeps the check deterministic.
    for _ in range(20):
        if task.done():
            break
        await asyncio.sleep(0)
    swallowed = not task.done()
    stop.append(True)  # let a spinning loop end, so the test itself cannot hang
    await asyncio.gather(task, return_exceptions=True)
    assert not swallowed, "the cancel was swallowed: the loop went on waiting"
    assert task.cancelled()
