"""Events (publish_event / ctx.wait_for_event / on_event) and signal_with_start,
through the engine on every store."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest

import durably
from durably import RunStatus
from durably.testing import VirtualClock

from .conftest import EngineFactory


async def _suspended(engine: durably.Engine, run_id: str) -> None:
    assert (await engine.wait_for_run(run_id, timeout=10)).status is RunStatus.SUSPENDED


async def test_a_published_event_wakes_the_waiting_run(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("ship")
    async def ship(ctx: durably.WorkflowContext, order: int) -> Any:
        await ctx.local_step("pack", lambda: None)
        return await ctx.wait_for_event("order.paid", match={"order": order})

    async with engine:
        await engine.start("ship", 7, run_id="s7")
        await _suspended(engine, "s7")
        assert await engine.publish_event("order.paid", {"order": 8}, buffer=False) == 0
        assert await engine.publish_event("order.paid", {"order": 7, "paid": 12.5}) == 1
        result = await engine.wait_for_run("s7", terminal=True, timeout=10)
    assert result.output == {"order": 7, "paid": 12.5}
    history = await engine.history("s7")
    assert [(c.kind, c.name, c.input) for c in history][-1] == (
        "event",
        "event:order.paid",
        {"match": {"order": 7}},
    )


async def test_an_event_published_before_the_wait_is_buffered(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("late")
    async def late(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_event("ready", match={"id": {"b": [1, 2], "a": None}})

    async with engine:
        assert await engine.publish_event("ready", {"id": "other"}) == 0
        assert await engine.publish_event("ready", {"id": {"a": None, "b": [1, 2]}, "n": 1}) == 0
        assert len(await engine.store.list_buffered_events("ready")) == 2
        await engine.start("late", run_id="l")
        result = await engine.wait_for_run("l", terminal=True, timeout=10)
        assert await engine.store.list_buffered_events("ready") == [{"id": "other"}]
    assert result.output == {"id": {"a": None, "b": [1, 2]}, "n": 1}


async def test_one_publish_reaches_every_waiting_run(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("listener")
    async def listener(ctx: durably.WorkflowContext, region: str | None) -> Any:
        match = {"region": region} if region else None
        first, second = await asyncio.gather(
            ctx.wait_for_event("deploy", match=match), ctx.wait_for_event("deploy", match=match)
        )
        assert first == second
        return first

    async with engine:
        for run_id, region in (("all", None), ("eu", "eu"), ("us", "us")):
            await engine.start("listener", region, run_id=run_id)
            await _suspended(engine, run_id)
        assert await engine.publish_event("deploy", {"region": "eu", "v": 2}) == 2
        for run_id in ("all", "eu"):
            result = await engine.wait_for_run(run_id, terminal=True, timeout=10)
            assert result.output == {"region": "eu", "v": 2}
        assert (await engine.get_run("us")).status is RunStatus.SUSPENDED  # type: ignore[union-attr]


async def test_an_event_wait_times_out(make_engine: EngineFactory, clock: VirtualClock) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("impatient")
    async def impatient(ctx: durably.WorkflowContext) -> str:
        try:
            await ctx.wait_for_event("never", timeout="1h")
        except durably.SignalTimeout as exc:  # EventTimeout is a SignalTimeout
            return f"{type(exc).__name__}: gave up on {exc.token} ({exc.code})"
        return "got it"

    await engine.open()
    await engine.start("impatient", run_id="i")
    await engine.join()
    clock.advance("1h")
    assert await engine.resume_due_timers() == 1
    result = await engine.wait_for_run("i", terminal=True, timeout=10)
    assert result.output == "EventTimeout: gave up on never (event_timeout)"
    # the timed-out wait no longer receives anything
    assert await engine.publish_event("never", 1, buffer=False) == 0


async def test_an_event_that_beats_the_timeout_wins(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, drive=False)  # nothing executes until run_one

    @engine.workflow("race")
    async def race(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_event("e", timeout="1m")

    await engine.start("race", run_id="r")
    assert await engine.run_one("r")
    clock.advance("2m")  # the timeout passed, but the event arrives before the timer fires
    assert await engine.publish_event("e", "first") == 1
    assert await engine.run_one("r")
    assert (await engine.wait_for_run("r", terminal=True, timeout=10)).output == "first"


async def test_buffer_false_and_idempotent_publishes(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("one")
    async def one(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_event("tick")

    async with engine:
        assert await engine.publish_event("tick", "dropped", buffer=False) == 0
        assert await engine.store.list_buffered_events("tick") == []
        await engine.start("one", run_id="a")
        await _suspended(engine, "a")
        assert await engine.publish_event("tick", "x", id="tick-1") == 1
        assert (await engine.wait_for_run("a", terminal=True, timeout=10)).output == "x"
        await engine.start("one", run_id="b")
        await _suspended(engine, "b")
        assert await engine.publish_event("tick", "x", id="tick-1") == 1  # the recorded count
        assert (await engine.get_run("b")).status is RunStatus.SUSPENDED  # type: ignore[union-attr]


async def test_on_event_starts_one_run_per_publish(make_engine: EngineFactory) -> None:
    engine = make_engine()

    class Order(pydantic.BaseModel):
        id: int
        total: float

    @engine.workflow("fulfil", input=Order, on_event="order.created")
    async def fulfil(ctx: durably.WorkflowContext, order: Order) -> float:
        return order.total

    @engine.workflow("audit")
    async def audit(ctx: durably.WorkflowContext) -> str:
        return "seen"

    engine.on_event(["order.created", "order.cancelled"], "audit")

    async with engine:
        assert await engine.publish_event("order.created", {"id": 1, "total": 9.5}, id="o1") == 2
        assert await engine.publish_event("order.created", {"id": 1, "total": 9.5}, id="o1") == 2
        assert await engine.publish_event("order.cancelled", {"id": 1}) == 1
        with pytest.raises(durably.SchemaValidationError):
            await engine.publish_event("order.created", {"id": "x"})
        fulfilled = await engine.wait_for_run("evt:o1:fulfil", terminal=True, timeout=10)
        audited = await engine.wait_for_run("evt:o1:audit", terminal=True, timeout=10)
        page = await engine.list_runs(tag="event:order.created")
        cancelled = await engine.list_runs(tag="event:order.cancelled")
        # triggers received the events: nothing was buffered
        assert await engine.store.list_buffered_events("order.created") == []
    assert fulfilled.output == 9.5
    assert audited.output == "seen"
    assert sorted(r.run_id for r in page.runs) == ["evt:o1:audit", "evt:o1:fulfil"]
    assert len(cancelled.runs) == 1 and cancelled.runs[0].workflow == "audit"


async def test_a_client_engine_publishes_to_runs_of_a_worker(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    worker = make_engine(clock=clock)
    client = make_engine(clock=clock, drive=False)

    @worker.workflow("wait")
    async def wait(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_event("go")

    await worker.open()
    await worker.start("wait", run_id="w")
    await worker.join()

    assert await client.publish_event("go", [1, 2, 3]) == 1

    # The client cannot run it: it stamps a wake, which the worker's timer
    # poll sees (on PostgreSQL the notification may have handed it over first).
    woken = await worker.resume_due_timers()
    assert woken == 1 or worker.listening
    assert (await worker.wait_for_run("w", terminal=True, timeout=10)).output == [1, 2, 3]


async def test_signal_with_start_feeds_an_entity(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("counter")
    async def counter(ctx: durably.WorkflowContext, start: int) -> int:
        total = start
        for _ in range(3):
            total += int(await ctx.wait_for_signal(f"add:{ctx.run_id}"))
        return total

    async with engine:
        runs = [
            await engine.signal_with_start(
                "counter", 100, run_id="c1", token="add:c1", payload=amount
            )
            for amount in (1, 2, 3)
        ]
        result = await engine.wait_for_run("c1", terminal=True, timeout=10)
        page = await engine.list_runs(workflow="counter")
    assert {r.run_id for r in runs} == {"c1"}
    assert result.output == 106
    assert len(page.runs) == 1
    with pytest.raises(durably.SchemaValidationError):
        await engine.signal_with_start("counter", 1, run_id="c2", token="t", payload=object())
    assert await engine.get_run("c2") is None  # a bad payload starts nothing


async def test_event_arguments_are_validated(make_engine: EngineFactory) -> None:
    engine = make_engine()
    problems: list[str] = []

    @engine.workflow("bad")
    async def bad(ctx: durably.WorkflowContext) -> None:
        for call in (
            lambda: ctx.wait_for_event(""),
            lambda: ctx.wait_for_event("e", match=["not", "a", "mapping"]),  # type: ignore[arg-type]
            lambda: ctx.wait_for_event("e", match={"k": object()}),
            lambda: ctx.wait_for_event("e", timeout="soon"),
        ):
            try:
                call()
            except (TypeError, ValueError) as exc:
                problems.append(type(exc).__name__)

    async with engine:
        await engine.start("bad", run_id="b")
        assert (await engine.wait_for_run("b", terminal=True, timeout=10)).ok
        with pytest.raises(ValueError, match="non-empty"):
            await engine.publish_event("", 1)
        with pytest.raises(ValueError, match="event id"):
            await engine.publish_event("e", 1, id="")
        with pytest.raises(durably.SchemaValidationError):
            await engine.publish_event("e", object())
    assert problems == ["ValueError", "TypeError", "ValueError", "ValueError"]


async def test_event_waits_replay_from_history(make_engine: EngineFactory) -> None:
    engine = make_engine(sticky_runs=0)  # every turn replays (the cache has its own tests)
    seen: list[Any] = []

    @engine.workflow("two")
    async def two(ctx: durably.WorkflowContext) -> list[Any]:
        first = await ctx.wait_for_event("a")
        seen.append(first)
        second = await ctx.wait_for_event("b")
        return [first, second]

    async with engine:
        await engine.start("two", run_id="t")
        await _suspended(engine, "t")
        await engine.publish_event("a", 1)
        await engine.join()
        await _suspended(engine, "t")
        await engine.publish_event("b", 2)
        result = await engine.wait_for_run("t", terminal=True, timeout=10)
    assert result.output == [1, 2]
    assert seen == [1, 1]  # the second turn replayed the first wait from its checkpoint
