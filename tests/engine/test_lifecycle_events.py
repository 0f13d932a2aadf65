"""Lifecycle events (``engine.subscribe``) and interceptors (``engine.use``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import EventKind, LifecycleEvent, StepInfo
from durably.testing import eventually

from .conftest import EngineFactory


async def _collect(sub: durably.Subscription, until: EventKind) -> list[LifecycleEvent]:
    seen: list[LifecycleEvent] = []
    async with asyncio.timeout(30):
        async for event in sub:
            seen.append(event)
            if event.kind is until:
                return seen
    raise AssertionError(f"the subscription ended before {until}: {seen}")


async def test_a_run_tells_its_turns_steps_and_end(make_engine: EngineFactory) -> None:
    engine = make_engine()
    calls = 0

    async def flaky(n: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("first attempt fails")
        return n * 2

    @engine.workflow("doubler")
    async def doubler(ctx: durably.WorkflowContext, n: int) -> int:
        value = await ctx.local_step("flaky", flaky, n, retries=2, backoff="fixed")
        await ctx.sleep(0.05)
        return int(value)

    async with engine:
        sub = engine.subscribe()
        run = await engine.start("doubler", 21, run_id="d1")
        events = await _collect(sub, EventKind.RUN_COMPLETED)
        sub.close()
    kinds = [e.kind for e in events]
    assert kinds[:2] == [EventKind.RUN_STARTED, EventKind.STEP_STARTED]
    assert kinds.count(EventKind.STEP_STARTED) == 2  # one per attempt
    failed = next(e for e in events if e.kind is EventKind.STEP_FAILED)
    assert (failed.step, failed.seq, failed.attempt, failed.final) == ("flaky", 0, 1, False)
    assert failed.error is not None and failed.error["message"] == "first attempt fails"
    done = next(e for e in events if e.kind is EventKind.STEP_COMPLETED)
    assert (done.attempt, done.workflow) == (2, "doubler")
    assert done.duration_ms is not None and done.duration_ms >= 0
    assert EventKind.RUN_SUSPENDED in kinds and EventKind.TIMER_FIRED in kinds
    resumed = [e.resumed for e in events if e.kind is EventKind.RUN_STARTED]
    assert resumed == [False, True]
    end = events[-1]
    assert end.run_id == run.run_id and end.origin == engine.instance_id and end.local


async def test_filters_take_only_one_run_and_the_kinds_asked(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("echo")
    async def echo(ctx: durably.WorkflowContext, n: int) -> int:
        return int(await ctx.local_step("id", lambda x: x, n))

    async with engine:
        async with engine.subscribe(run_id="b", kinds=["run.completed", "step.completed"]) as sub:
            await engine.start("echo", 1, run_id="a")
            await engine.start("echo", 2, run_id="b")
            events = await _collect(sub, EventKind.RUN_COMPLETED)
        assert sub.closed
    assert [(e.kind, e.run_id) for e in events] == [
        (EventKind.STEP_COMPLETED, "b"),
        (EventKind.RUN_COMPLETED, "b"),
    ]


async def test_a_slow_subscriber_drops_and_counts_and_never_blocks_a_run(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("many")
    async def many(ctx: durably.WorkflowContext) -> int:
        for i in range(20):
            await ctx.local_step(f"s{i}", lambda: None)
        return 20

    async with engine:
        stalled = engine.subscribe(maxsize=3)  # never read
        run = await engine.start("many")
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
    assert result.output == 20
    # 1 start + 20 * 2 step events + 1 end: three kept, the rest counted.
    assert stalled.dropped == 42 - 3
    assert [e.kind for e in [await anext(stalled) for _ in range(3)]] == [
        EventKind.RUN_STARTED,
        EventKind.STEP_STARTED,
        EventKind.STEP_COMPLETED,
    ]
    with pytest.raises(StopAsyncIteration):  # the engine closed: the stream ended
        await anext(stalled)


async def test_a_failing_listener_never_reaches_the_engine(make_engine: EngineFactory) -> None:
    engine = make_engine()
    heard: list[EventKind] = []

    class Broken(durably.Interceptor):
        def on_event(self, event: LifecycleEvent) -> None:
            raise RuntimeError("listener bug")

    class Recorder(durably.Interceptor):
        def on_event(self, event: LifecycleEvent) -> None:
            heard.append(event.kind)

    engine.use(Broken())
    engine.use(Recorder())

    @engine.workflow("fine")
    async def fine(ctx: durably.WorkflowContext) -> str:
        await ctx.local_step("one", lambda: 1)
        return "ok"

    async with engine:
        run = await engine.start("fine")
        assert (await engine.wait_for_run(run.run_id, terminal=True, timeout=30)).output == "ok"
    assert heard[0] is EventKind.RUN_STARTED and heard[-1] is EventKind.RUN_COMPLETED


async def test_cancel_signal_and_progress_are_told(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="local://")
    release = asyncio.Event()

    @engine.step("slow")
    async def slow(data: Any, log: durably.StepLogger) -> str:
        log.heartbeat({"pct": 50})
        await release.wait()
        return "done"

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> Any:
        got = await ctx.wait_for_signal(f"go:{ctx.run_id}")
        return await ctx.step(slow, got)

    @engine.workflow("idle")
    async def idle(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("never")

    async with engine:
        sub = engine.subscribe()
        await engine.start("waits", run_id="w")
        await engine.start("idle", run_id="i")
        await eventually(lambda: _suspended(engine, "w"), what="w to wait")
        assert await engine.signal("go:w", 1) == "w"
        await eventually(lambda: _has(sub, EventKind.STEP_PROGRESS), what="a progress event")
        release.set()
        await engine.wait_for_run("w", terminal=True, timeout=30)
        await engine.cancel("i")
        seen = await _collect(sub, EventKind.RUN_CANCELLED)
    everything = _seen[id(sub)] + seen
    delivered = next(e for e in everything if e.kind is EventKind.SIGNAL_DELIVERED)
    assert (delivered.run_id, delivered.token) == ("w", "go:w")
    progress = next(e for e in everything if e.kind is EventKind.STEP_PROGRESS)
    assert (progress.run_id, progress.seq, progress.progress) == ("w", 1, {"pct": 50})
    served = [e for e in everything if e.served]
    assert [e.kind for e in served] == [EventKind.STEP_STARTED, EventKind.STEP_COMPLETED]
    assert served[0].queue_ms is not None and served[0].queue_ms >= 0
    assert everything[-1].run_id == "i"


_seen: dict[int, list[LifecycleEvent]] = {}


async def _suspended(engine: durably.Engine, run_id: str) -> bool:
    run = await engine.get_run(run_id)
    return run is not None and run.status is durably.RunStatus.SUSPENDED


def _has(sub: durably.Subscription, kind: EventKind) -> bool:
    seen = _seen.setdefault(id(sub), [])
    while True:
        try:
            seen.append(sub._buffer.popleft())
        except IndexError:
            return any(e.kind is kind for e in seen)


async def test_interceptors_wrap_executions_outermost_first_never_replays(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="local://")
    order: list[str] = []

    class Outer(durably.Interceptor):
        async def intercept_step(self, info: StepInfo, call_next: Any) -> Any:
            order.append(f"outer>{info.step}:{info.kind}:{info.attempt}")
            result = await call_next()
            order.append(f"outer<{info.step}")
            return result

    async def inner(info: StepInfo, call_next: Any) -> Any:
        order.append(f"inner>{info.step}")
        return await call_next()

    engine.use(Outer())
    engine.use(inner)

    @engine.step("remote")
    def remote(data: int) -> int:
        return data + 1

    @engine.workflow("both")
    async def both(ctx: durably.WorkflowContext) -> Any:
        a = await ctx.local_step("here", lambda: 1)
        await ctx.sleep(0.05)  # a second turn replays "here"
        return await ctx.step(remote, a)

    async with engine:
        run = await engine.start("both")
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
    assert result.output == 2
    assert order == [
        "outer>here:local:1",
        "inner>here",
        "outer<here",
        "outer>remote:served:1",
        "inner>remote",
        "outer<remote",
    ]


def test_use_refuses_what_is_no_interceptor() -> None:
    engine = durably.Engine("memory://")
    with pytest.raises(TypeError, match="Interceptor"):
        engine.use(42)  # type: ignore[arg-type]


def test_a_broadcast_event_fits_the_notice_bound() -> None:
    big = LifecycleEvent(
        EventKind.STEP_PROGRESS,
        "r" * 200,
        1,
        step="s",
        seq=3,
        progress={"blob": "x" * 5000},
        origin="me",
    )
    text = big.to_notice()
    assert 0 < len(text.encode()) <= 1024
    back = LifecycleEvent.from_notice(text)
    assert back is not None and back.partial and back.progress is None
    assert (back.kind, back.run_id, back.seq, back.local) == (
        EventKind.STEP_PROGRESS,
        "r" * 200,
        3,
        False,
    )
    assert LifecycleEvent.from_notice("{not json") is None
    assert LifecycleEvent.from_notice('{"kind": "nope", "run_id": "r", "at": 1}') is None
    assert LifecycleEvent.from_notice('{"kind": "run.started", "run_id": 5, "at": 1}') is None
    assert LifecycleEvent.from_notice('{"kind": "run.started", "run_id": "r", "at": "x"}') is None
    assert (
        LifecycleEvent.from_notice('{"kind": "run.started", "run_id": "r", "at": 1, "seq": []}')
        is None
    )
    assert LifecycleEvent.from_notice('{"kind": "run.started", "run_id": "r"}') is None


async def test_a_buffered_signal_is_told_when_its_wait_takes_it(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("late")
    async def late(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("early-token")

    async with engine:
        assert await engine.signal("early-token", "hi") is None  # nobody waits: buffered
        sub = engine.subscribe(kinds=["signal.delivered", "run.completed"])
        await engine.start("late", run_id="late")
        events = await _collect(sub, EventKind.RUN_COMPLETED)
    delivered = events[0]
    assert (delivered.kind, delivered.run_id, delivered.token, delivered.seq) == (
        EventKind.SIGNAL_DELIVERED,
        "late",
        "early-token",
        0,
    )


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_failing_turn_interceptor_never_strands_a_run(
    make_engine: EngineFactory, when: str
) -> None:
    engine = make_engine()
    seen: list[str | None] = []

    class Buggy(durably.Interceptor):
        async def intercept_turn(self, info: durably.TurnInfo, call_next: Any) -> Any:
            if when == "after":
                await call_next()
                seen.append(info.outcome)
            raise RuntimeError(f"bug {when} the turn")

    engine.use(Buggy())

    @engine.workflow("sturdy")
    async def sturdy(ctx: durably.WorkflowContext) -> str:
        await ctx.local_step("one", lambda: 1)
        return "ok"

    async with engine:
        run = await engine.start("sturdy")
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
    assert result.output == "ok"
    assert seen == ([] if when == "before" else ["completed"])


async def test_failing_start_and_outbound_hooks_are_logged_not_raised(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="local://")

    class Buggy(durably.Interceptor):
        def start_context(self, run: durably.Run) -> str | None:
            raise RuntimeError("start hook bug")

        def outbound_task(self, task: Any) -> None:
            raise RuntimeError("outbound hook bug")

    engine.use(Buggy())

    @engine.step("served")
    def served(data: int) -> int:
        return data * 3

    @engine.workflow("dispatches")
    async def dispatches(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(served, 2)

    async with engine:
        run = await engine.start("dispatches")
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
    assert result.output == 6 and run.run.trace_context is None
