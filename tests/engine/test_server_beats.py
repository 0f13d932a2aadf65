"""The step server's own beats: one at pickup for a handler still running a
moment later, then one per interval for a handler that never beats itself,
and none for a handler done before its pickup beat is due. The server keeps
one sweep timer for all of its handlers, not timers per step."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

import pytest

from durably._intercept import Interceptors
from durably._lifecycle_events import EventHub
from durably._threads import StepThreads
from durably.steps import _server
from durably.steps._server import StepServer
from durably.steps.definition import StepLogger, define_step
from durably.transports.base import CancelHandler, TaskHandler
from durably.wire import Heartbeat, StepResult, StepTask, routing_token


class _Wire:
    """The slice of a transport a server uses, recording what it sends."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []
        self.results: list[StepResult] = []
        self.cancels: list[CancelHandler] = []
        self.beaten = asyncio.Event()

    def on_cancel(self, handler: CancelHandler) -> None:
        self.cancels.append(handler)

    async def serve(
        self, groups: Collection[str], on_task: TaskHandler, *, concurrency: int
    ) -> None:
        pass

    async def stop_serving(self) -> None:
        pass

    async def send_result(self, result: StepResult) -> None:
        self.results.append(result)

    async def send_heartbeat(self, beat: Heartbeat) -> None:
        self.beats.append(beat)
        self.beaten.set()

    async def beats_reach(self, count: int) -> None:
        while len(self.beats) < count:
            self.beaten.clear()
            await self.beaten.wait()


async def _no_cancels(run_ids: list[str]) -> dict[str, bool]:
    return {}


def _server_for(wire: _Wire, fn: Any) -> StepServer:
    server = StepServer(
        wire,  # type: ignore[arg-type]
        StepThreads(1),
        _no_cancels,
        Interceptors(),
        EventHub(lambda: "test", "event"),
    )
    definition = define_step(
        "s", fn, taken=lambda _: False, group=None, input=None, output=None, policy={}
    )
    server._by_token = {routing_token("s"): definition}
    return server


def _task(n: int) -> StepTask:
    return StepTask(run_id=f"r{n}", seq=1, name="s", group=routing_token("s"), input=n)


async def test_a_quick_handler_sends_no_beat_and_arms_no_timer_per_step() -> None:
    wire = _Wire()

    async def quick(x: int) -> int:
        return x

    server = _server_for(wire, quick)
    calls = 0
    original = asyncio.get_running_loop().call_at

    def counting(when: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        nonlocal calls
        calls += 1
        return original(when, callback, *args, **kw)

    loop = asyncio.get_running_loop()
    loop.call_at = counting  # type: ignore[method-assign,assignment]
    try:
        await asyncio.gather(*(server.handle(_task(n)) for n in range(50)))
    finally:
        del loop.call_at  # back to the class's
    assert [r.output for r in wire.results] == list(range(50))
    assert calls == 1  # one sweep timer for fifty handlers
    await asyncio.sleep(_server._PICKUP_BEAT_DELAY_S * 2)
    assert wire.beats == []  # all done before their pickup beat was due


async def test_a_slow_handler_beats_at_pickup_then_each_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_server, "BEAT_INTERVAL_S", 0.05)
    wire = _Wire()
    release = asyncio.Event()

    async def slow(x: int, log: StepLogger) -> int:
        await release.wait()
        return x

    server = _server_for(wire, slow)
    running = asyncio.ensure_future(server.handle(_task(1)))
    await wire.beats_reach(3)  # the pickup beat, then two of the ticker's
    release.set()
    await running
    beats = len(wire.beats)
    assert {(b.run_id, b.seq) for b in wire.beats} == {("r1", 1)}
    assert wire.beats[0].at == wire.results[0].started_at  # the pickup beat
    await asyncio.sleep(0.15)
    assert len(wire.beats) == beats  # none once the handler is done


async def test_a_handler_that_beats_itself_gets_no_extra_beat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_server, "BEAT_INTERVAL_S", 0.05)
    wire = _Wire()
    ticks = 0
    enough = asyncio.Event()

    async def beating(x: int, log: StepLogger) -> int:
        nonlocal ticks
        # Its own beats go out at most every 5 s (the logger's interval):
        # a fresh one makes the server's ticker stay quiet.
        while ticks < 30:  # 0.3 s: six intervals
            log._last_beat = asyncio.get_running_loop().time()
            ticks += 1
            await asyncio.sleep(0.01)
        enough.set()
        return x

    server = _server_for(wire, beating)
    running = asyncio.ensure_future(server.handle(_task(1)))
    await enough.wait()
    await running
    assert len(wire.beats) == 1  # the pickup beat only


async def test_stop_waits_for_a_running_handler_and_not_when_idle() -> None:
    wire = _Wire()
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(x: int) -> int:
        entered.set()
        await release.wait()
        return x

    server = _server_for(wire, slow)
    await server.stop(timeout=600)  # nothing running: returns at once
    running = asyncio.ensure_future(server.handle(_task(7)))
    await entered.wait()
    stopping = asyncio.ensure_future(server.stop(timeout=600))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not stopping.done()  # the handler still runs
    release.set()
    await stopping
    assert running.done()
    assert [r.output for r in wire.results] == [7]
    await server.stop(timeout=600)  # idle again: at once
