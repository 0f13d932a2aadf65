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
