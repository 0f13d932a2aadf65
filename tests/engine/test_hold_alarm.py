"""The holds' shared alarm: one timer wakes every held turn whose window ran
out, in deadline order, and none whose hold is over."""

from __future__ import annotations

import asyncio

from durably.steps._holds import LiveHolds, LiveStep, loop_time_ms


async def test_one_timer_wakes_each_waiter_at_its_deadline_in_order() -> None:
    holds = LiveHolds(lambda: 1000)
    loop = asyncio.get_running_loop()
    timers = 0
    call_at = loop.call_at

    def counting(when: float, callback: object, *args: object, **kw: object) -> asyncio.TimerHandle:
        nonlocal timers
        if callback == holds._timer._fire:
            timers += 1
        return call_at(when, callback, *args, **kw)  # type: ignore[arg-type]

    loop.call_at = counting  # type: ignore[method-assign]
    try:
        now = loop_time_ms()
        waiters = [LiveStep() for _ in range(4)]
        gone = LiveStep()
        gone.gone = True  # its hold ended before its window
        # Set in an order unlike their deadlines'.
        for waiter, after in zip(waiters, (40, 10, 30, 20), strict=True):
            holds.alarm(waiter, now + after)
        holds.alarm(gone, now + 15)
        assert timers <= 2  # one armed, re-armed once for a sooner deadline
        woken: list[int] = []

        async def watch(n: int) -> None:
            await waiters[n].changed.wait()
            woken.append(n)

        await asyncio.wait_for(asyncio.gather(*(watch(n) for n in range(4))), 5)
    finally:
        del loop.call_at
    assert woken == [1, 3, 2, 0]
    assert not gone.changed.is_set()
    assert holds._alarms == [] and not holds._timer.armed
