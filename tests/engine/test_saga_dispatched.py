"""Sagas over dispatched steps: ``ctx.step(..., compensate=)`` with a dispatched
or local undo, ``compensation_retries``, and an unwind that waits durably."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably.testing import VirtualClock, eventually

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(60)


def _register(engine: durably.Engine, undone: list[Any]) -> dict[str, Any]:
    @engine.step("book-flight")
    async def book_flight(req: dict[str, str]) -> str:
        return f"F-{req['who']}"

    @engine.step("book-hotel")
    async def book_hotel(req: dict[str, str]) -> dict[str, str]:
        return {"hotel": f"H-{req['who']}"}

    @engine.step("cancel-flight", retries=0)
    async def cancel_flight(data: dict[str, Any]) -> None:
        undone.append(("cancel-flight", data))

    @engine.step("cancel-hotel", retries=0)
    async def cancel_hotel(data: dict[str, Any]) -> None:
        undone.append(("cancel-hotel", data))

    @engine.step("book-car")
    async def book_car(req: dict[str, str]) -> str:
        raise durably.FatalError("no cars left", code="sold_out")

    return {"flight": book_flight, "hotel": book_hotel, "car": book_car}


async def test_dispatched_undos_run_last_in_first_out_with_input_and_output(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    undone: list[Any] = []
    steps = _register(engine, undone)

    @engine.workflow("trip")
    async def trip(ctx: durably.WorkflowContext, who: str) -> None:
        req = {"who": who}
        await ctx.local_step("quote", lambda: "Q1", compensate=lambda q: undone.append(("q", q)))
        await ctx.step(steps["flight"], req, compensate="cancel-flight")
        await ctx.step("book-hotel", req, compensate=engine_steps["cancel-hotel"])
        await ctx.step(steps["car"], req)

    engine_steps = {"cancel-hotel": "cancel-hotel"}
    async with engine:
        await engine.start("trip", "ann", run_id="t")
        result = await engine.wait_for_run("t", terminal=True, timeout=15)
        history = await engine.history("t")
    assert result.status is RunStatus.FAILED
    assert result.error is not None and result.error["code"] == "sold_out"
    assert undone == [
        ("cancel-hotel", {"input": {"who": "ann"}, "output": {"hotel": "H-ann"}}),
        ("cancel-flight", {"input": {"who": "ann"}, "output": "F-ann"}),
        ("q", "Q1"),
    ]
    undos = {cp.seq: (cp.kind, cp.name, cp.status) for cp in history if cp.seq < 0}
    assert undos == {
        -2: ("compensation", "compensate:quote", CheckpointStatus.COMPLETED),
        -3: ("step", "cancel-flight", CheckpointStatus.COMPLETED),
        -4: ("step", "cancel-hotel", CheckpointStatus.COMPLETED),
    }


async def test_an_undo_that_keeps_failing_is_skipped_and_the_original_error_kept(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(compensation_retries=0)
    undone: list[Any] = []
    attempts: list[str] = []
    steps = _register(engine, undone)

    @engine.step("refund", retries=5)
    async def refund(data: dict[str, Any]) -> None:
        attempts.append("refund")
        raise RuntimeError("refund service down")

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.step(steps["flight"], {"who": "bo"}, compensate="cancel-flight")
        await ctx.step(steps["hotel"], {"who": "bo"}, compensate=refund, compensation_retries=2)
        await ctx.step(steps["car"], {"who": "bo"})

    async with engine:
        await engine.start("order", run_id="o")
        result = await engine.wait_for_run("o", terminal=True, timeout=15)
        history = await engine.history("o")
    assert result.status is RunStatus.FAILED
    assert result.error is not None and result.error["code"] == "sold_out"
    assert "no cars left" in result.error["message"]
    [failure] = result.error["details"]["compensation_failures"]
    assert "refund service down" in failure["message"]
    assert attempts == ["refund"] * 3  # compensation_retries=2, not the step's retries=5
    # The next undo still ran.
    assert [name for name, _ in undone] == ["cancel-flight"]
    refund_cp = next(cp for cp in history if cp.seq == -3)
    assert refund_cp.status is CheckpointStatus.FAILED and refund_cp.attempts == 3


async def test_the_unwind_waits_durably_for_a_slow_dispatched_undo(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    undone: list[Any] = []
    steps = _register(engine, undone)
    release = asyncio.Event()

    @engine.step("slow-undo", retries=0)
    async def slow_undo(data: dict[str, Any]) -> None:
        await release.wait()
        undone.append(("slow", data["output"]))

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.step(steps["flight"], {"who": "cy"}, compensate=slow_undo)
        await ctx.step(steps["car"], {"who": "cy"})

    async with engine:
        await engine.start("order", run_id="o")

        async def mid_unwind() -> bool:
            run = await engine.get_run("o")
            history = {cp.seq: cp for cp in await engine.history("o")}
            return (
                run is not None
                and run.status is RunStatus.SUSPENDED
                and -2 in history
                and history[-2].status is CheckpointStatus.PENDING
            )

        # The run holds no turn while its undo is out: it is suspended.
        await eventually(mid_unwind, timeout=15)
        release.set()
        result = await engine.wait_for_run("o", terminal=True, timeout=15)
    assert result.status is RunStatus.FAILED and result.error is not None
    assert result.error["code"] == "sold_out"
    assert undone == [("slow", "F-cy")]


async def test_a_compensating_cancel_dispatches_the_undos(make_engine: EngineFactory) -> None:
    engine = make_engine()
    undone: list[Any] = []
    steps = _register(engine, undone)

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.step(steps["flight"], {"who": "di"}, compensate="cancel-flight")
        await ctx.wait_for_signal("never")

    async with engine:
        await engine.start("order", run_id="o")
        await engine.wait_for_run("o", timeout=15)
        await engine.cancel("o", compensate=True)
        result = await engine.wait_for_run("o", terminal=True, timeout=15)
    assert result.status is RunStatus.CANCELLED
    assert undone == [("cancel-flight", {"input": {"who": "di"}, "output": "F-di"})]


async def test_a_local_undo_of_a_dispatched_step_gets_its_decoded_output(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    undone: list[Any] = []
    steps = _register(engine, undone)

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.step(steps["hotel"], {"who": "ed"}, compensate=lambda out: undone.append(out))
        await ctx.step(steps["car"], {"who": "ed"})

    async with engine:
        await engine.start("order", run_id="o")
        result = await engine.wait_for_run("o", terminal=True, timeout=15)
    assert result.status is RunStatus.FAILED
    assert undone == [{"hotel": "H-ed"}]


async def test_compensate_refuses_bad_input(make_engine: EngineFactory) -> None:
    engine = make_engine()
    undone: list[Any] = []
    steps = _register(engine, undone)
    cases = {
        "not callable": lambda ctx: ctx.step(steps["flight"], {}, compensate=42),
        "empty name": lambda ctx: ctx.step(steps["flight"], {}, compensate=""),
        "bad name": lambda ctx: ctx.step(steps["flight"], {}, compensate="bad\x00name"),
        "negative": lambda ctx: ctx.step(
            steps["flight"], {}, compensate="cancel-flight", compensation_retries=-1
        ),
        "bool": lambda ctx: ctx.local_step(
            "x", lambda: 1, compensate=print, compensation_retries=True
        ),
    }

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext, case: str) -> None:
        cases[case](ctx)

    async with engine:
        for case in cases:
            await engine.start("order", case, run_id=f"o-{case}")
            result = await engine.wait_for_run(f"o-{case}", terminal=True, timeout=15)
            assert result.status is RunStatus.FAILED, case
            assert result.error is not None
            assert result.error["type"] in ("TypeError", "ValueError", "UnstorableValue"), case
            history = await engine.history(f"o-{case}")
            assert history == [], case  # refused before anything was recorded
    with pytest.raises(ValueError, match="compensation_retries"):
        durably.Engine("memory://", compensation_retries=-1)


async def test_the_lease_is_renewed_through_a_long_unwind(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, lease="1s")
    undoing = asyncio.Event()
    release = asyncio.Event()

    async def slow_undo(_: Any) -> None:
        undoing.set()
        await release.wait()

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("reserve", lambda: "R", compensate=slow_undo)
        raise durably.FatalError("boom")

    async with engine:
        await engine.start("order", run_id="o")
        await asyncio.wait_for(undoing.wait(), timeout=15)

        async def renewed() -> bool:
            # Renewed since the last advance (a lease of 1 s renewed every
            # 0.5 s reaches past now + 0.5 s only then): advancing again on a
            # stale lease would let the orphan sweep take the run over.
            run = await engine.get_run("o")
            assert run is not None
            return run.locked_until is not None and run.locked_until > clock.now_ms() + 500

        for _ in range(8):  # four leases pass while the undo runs, each renewed
            clock.advance("0.5s")
            await eventually(renewed, timeout=15)
        release.set()
        result = await engine.wait_for_run("o", terminal=True, timeout=15)
    assert result.status is RunStatus.FAILED


async def test_an_undo_handler_is_not_told_its_unwinding_run_is_cancelled(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from durably.steps import _server

    monkeypatch.setattr(_server, "_CANCEL_POLL_S", 0.01)
    engine = make_engine()
    seen: dict[str, bool] = {}
    polled = asyncio.Event()

    @engine.step("book")
    async def book(_: Any) -> str:
        return "B"

    @engine.step("unbook", retries=0)
    async def unbook(data: dict[str, Any], log: durably.StepLogger) -> None:
        polled.clear()
        await polled.wait()  # the cancel watcher looked at this run meanwhile
        seen["undo told cancelled"] = log.cancelled

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.step(book, None, compensate=unbook)
        await ctx.wait_for_signal("never")

    async with engine:
        check = engine._step_server._cancelled_runs

        async def watched(run_ids: list[str]) -> dict[str, bool]:
            found = await check(run_ids)
            if "o" in found:
                polled.set()
            return found

        engine._step_server._cancelled_runs = watched
        await engine.start("order", run_id="o")
        await engine.wait_for_run("o", timeout=15)
        await engine.cancel("o", compensate=True)
        result = await engine.wait_for_run("o", terminal=True, timeout=15)
    assert result.status is RunStatus.CANCELLED, result.error
    assert seen == {"undo told cancelled": False}
