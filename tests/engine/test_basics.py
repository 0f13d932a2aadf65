"""Start → steps → completed, through the public API, and the client calls around it."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pydantic
import pytest

import durably
from durably import RunStatus
from durably.testing import eventually

from .conftest import EngineFactory


async def test_start_runs_local_steps_to_completion(make_engine: EngineFactory) -> None:
    engine = make_engine()
    executed: list[str] = []

    def reserve(order: str) -> dict[str, str]:
        executed.append(f"reserve {order}")
        return {"order": order, "slot": "A1"}

    async def charge(order: str, amount: int) -> int:
        executed.append(f"charge {order}")
        return amount * 100

    @engine.workflow("checkout")
    async def checkout(ctx: durably.WorkflowContext, order: str) -> dict[str, object]:
        slot = await ctx.local_step("reserve", reserve, order)
        cents = await ctx.local_step("charge", charge, order, 12)
        return {"slot": slot["slot"], "cents": cents}

    async with engine:
        run = await engine.start("checkout", "o-1", run_id="checkout:o-1")
        assert run.run.status is RunStatus.PENDING
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=10)

    assert result.status is RunStatus.COMPLETED
    assert result.output == {"slot": "A1", "cents": 1200}
    assert executed == ["reserve o-1", "charge o-1"]


async def test_start_is_idempotent_by_run_id(make_engine: EngineFactory) -> None:
    engine = make_engine()
    calls = 0

    @engine.workflow("once")
    async def once(ctx: durably.WorkflowContext, n: int) -> int:
        def bump() -> int:
            nonlocal calls
            calls += 1
            return n

        return await ctx.local_step("bump", bump)

    async with engine:
        first = await engine.start("once", 1, run_id="same")
        second = await engine.start("once", 2, run_id="same")
        assert second.run.input == 1 and first.run_id == second.run_id
        result = await engine.wait_for_run("same", terminal=True, timeout=10)
        third = await engine.start("once", 3, run_id="same")
    assert result.output == 1
    assert third.run.status is RunStatus.COMPLETED
    assert calls == 1


async def test_unknown_workflow_or_bad_input_raises_before_any_run(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(drive=False)

    class Order(pydantic.BaseModel):
        id: str
        amount: int

    @engine.workflow("typed", input=Order)
    async def typed(ctx: durably.WorkflowContext, order: Order) -> int:
        return order.amount

    with pytest.raises(durably.WorkflowNotRegistered):
        await engine.start("nope", {}, run_id="r-unknown")
    with pytest.raises(durably.WorkflowNotRegistered):
        await engine.start("typed", {"id": "x", "amount": 1}, run_id="r-v", version="9")
    with pytest.raises(durably.SchemaValidationError) as info:
        await engine.start("typed", {"id": "x", "amount": "lots"}, run_id="r-bad")
    assert info.value.details  # pydantic's error list travels along
    with pytest.raises(ValueError, match="tags"):
        await engine.start("typed", Order(id="x", amount=1), run_id="r-tags", tags="oops")  # type: ignore[arg-type]
    for run_id in ("r-unknown", "r-v", "r-bad", "r-tags"):
        assert await engine.get_run(run_id) is None
    page = await engine.list_runs()
    assert page.runs == []


async def test_typed_input_reaches_the_body_as_the_model(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @dataclass
    class Point:
        x: int
        y: int

    class Order(pydantic.BaseModel):
        id: str
        amount: int

    @engine.workflow("model", input=Order)
    async def model_wf(ctx: durably.WorkflowContext, order: Order) -> str:
        assert isinstance(order, Order)
        return f"{order.id}:{order.amount}"

    @engine.workflow("dc", input=Point)
    async def dc_wf(ctx: durably.WorkflowContext, p: Point) -> int:
        assert isinstance(p, Point)
        return p.x + p.y

    async with engine:
        await engine.start("model", Order(id="a", amount=3), run_id="m")
        await engine.start("dc", {"x": 1, "y": 2}, run_id="d")
        m = await engine.wait_for_run("m", terminal=True, timeout=10)
        d = await engine.wait_for_run("d", terminal=True, timeout=10)
    assert m.output == "a:3"
    assert d.output == 3


async def test_sync_steps_run_off_the_event_loop(make_engine: EngineFactory) -> None:
    engine = make_engine()
    main_thread = threading.get_ident()

    def where() -> bool:
        return threading.get_ident() != main_thread

    @engine.workflow("threads")
    async def threads(ctx: durably.WorkflowContext) -> bool:
        return await ctx.local_step("where", where)

    async with engine:
        await engine.start("threads", run_id="t")
        result = await engine.wait_for_run("t", terminal=True, timeout=10)
    assert result.output is True


async def test_a_failing_body_fails_the_run_with_its_error(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("boom")
    async def boom(ctx: durably.WorkflowContext) -> None:
        raise durably.FatalError("card declined", code="declined", details={"last4": "4242"})

    async with engine:
        await engine.start("boom", run_id="b")
        result = await engine.wait_for_run("b", terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None
    assert result.error["code"] == "declined"
    assert result.error["message"] == "card declined"
    assert result.error["details"] == {"last4": "4242"}


async def test_unserialisable_step_output_fails_the_step_clearly(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("opaque")
    async def opaque(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("opaque", lambda: object(), retries=3, backoff_base=0)

    async with engine:
        await engine.start("opaque", run_id="o")
        result = await engine.wait_for_run("o", terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None and "JSON" in result.error["message"]
    history = await engine.history("o")
    assert history[0].attempts == 1  # an encoding error is not retried


async def test_wait_for_run_timeout_and_unknown_run(make_engine: EngineFactory) -> None:
    engine = make_engine(drive=False)

    @engine.workflow("idle")
    async def idle(ctx: durably.WorkflowContext) -> None:
        return None

    await engine.start("idle", run_id="never-driven")
    with pytest.raises(TimeoutError):
        await engine.wait_for_run("never-driven", timeout=0.1)
    assert (await engine.get_run("never-driven")).status is RunStatus.PENDING  # type: ignore[union-attr]
    with pytest.raises(durably.RunNotFound):
        await engine.wait_for_run("missing", timeout=1)
    with pytest.raises(durably.RunNotFound):
        await engine.cancel("missing")


async def test_list_runs_filters_and_pages(make_engine: EngineFactory) -> None:
    engine = make_engine(drive=False)

    @engine.workflow("a")
    async def a(ctx: durably.WorkflowContext) -> None:
        return None

    @engine.workflow("b")
    async def b(ctx: durably.WorkflowContext) -> None:
        return None

    for i in range(7):
        await engine.start("a", run_id=f"a{i}", tags=["even"] if i % 2 == 0 else ["odd"])
    for i in range(3):
        await engine.start("b", run_id=f"b{i}")

    seen: list[str] = []
    cursor = None
    while True:
        page = await engine.list_runs(workflow="a", limit=3, cursor=cursor)
        seen.extend(r.run_id for r in page.runs)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert sorted(seen) == [f"a{i}" for i in range(7)]
    assert len(seen) == len(set(seen))
    evens = await engine.list_runs(tag="even")
    assert sorted(r.run_id for r in evens.runs) == ["a0", "a2", "a4", "a6"]
    pending = await engine.list_runs(status="pending", limit=100)
    assert len(pending.runs) == 10
    with pytest.raises(ValueError, match="limit"):
        await engine.list_runs(limit=0)


async def test_history_is_the_step_timeline(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("timeline")
    async def timeline(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("one", lambda: 1)
        await ctx.now()
        await ctx.local_step("two", lambda: 2)

    async with engine:
        await engine.start("timeline", run_id="tl")
        await engine.wait_for_run("tl", terminal=True, timeout=10)
        history = await engine.history("tl")
    assert [(c.seq, c.name, c.status.value) for c in history] == [
        (0, "one", "completed"),
        (1, "now", "completed"),
        (2, "two", "completed"),
    ]
    assert history[0].step_id == "tl:0"
    assert all(c.started_at is not None and c.finished_at is not None for c in history)


async def test_runs_execute_concurrently_but_bounded(make_engine: EngineFactory) -> None:
    engine = make_engine(max_concurrent_runs=4)
    running = 0
    peak = 0
    gate = asyncio.Event()

    async def hold() -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await gate.wait()
        running -= 1

    @engine.workflow("hold")
    async def hold_wf(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("hold", hold)

    async with engine:
        for i in range(12):
            await engine.start("hold", run_id=f"h{i}")
        await eventually(lambda: peak == 4, what="4 runs holding their step")
        gate.set()
        for i in range(12):
            assert (await engine.wait_for_run(f"h{i}", terminal=True, timeout=10)).ok
    assert peak == 4


async def test_registration_errors_are_clear(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(TypeError, match="async def"):

        @engine.workflow("sync")
        def not_async(ctx: durably.WorkflowContext) -> None:
            return None

    @engine.workflow("dup")
    async def first(ctx: durably.WorkflowContext) -> None:
        return None

    with pytest.raises(ValueError, match="already registered"):

        @engine.workflow("dup")
        async def second(ctx: durably.WorkflowContext) -> None:
            return None
