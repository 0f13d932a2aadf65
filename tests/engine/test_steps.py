"""Local steps: retries and backoff, fatal errors, the running checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

import durably
from durably import CheckpointStatus, RetryPolicy, RunStatus
from durably.testing import VirtualClock, eventually

from .conftest import EngineFactory


def test_backoff_schedules() -> None:
    exp = RetryPolicy(retries=5, backoff="exp", base_ms=100, max_delay_ms=1000, jitter=False)
    assert [exp.delay_ms(n) for n in range(1, 6)] == [100, 200, 400, 800, 1000]
    linear = RetryPolicy(retries=3, backoff="linear", base_ms=100, jitter=False)
    assert [linear.delay_ms(n) for n in range(1, 4)] == [100, 200, 300]
    fixed = RetryPolicy(retries=3, backoff="fixed", base_ms=250, jitter=False)
    assert [fixed.delay_ms(n) for n in range(1, 4)] == [250, 250, 250]
    jittered = RetryPolicy(retries=3, backoff="fixed", base_ms=1000, jitter=True)
    rng = random.Random(7)
    delays = [jittered.delay_ms(1, rng) for _ in range(200)]
    assert all(500 <= d <= 1000 for d in delays) and len(set(delays)) > 50
    with pytest.raises(ValueError, match="backoff"):
        RetryPolicy.build(backoff="sometimes")
    with pytest.raises(ValueError, match="retries"):
        RetryPolicy.build(retries=-1)


async def test_retries_with_backoff_on_the_engine_clock(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(clock.now_ms())
        if len(attempts) < 3:
            raise ConnectionError("downstream unavailable")
        return "ok"

    @engine.workflow("flaky")
    async def flaky_wf(ctx: durably.WorkflowContext) -> str:
        return await ctx.local_step(
            "call", flaky, retries=3, backoff="exp", backoff_base="1s", jitter=False
        )

    def backing_off(failed: int, delay_ms: int) -> bool:
        # ``failed`` attempts ran, and the backoff timer after the last one is armed.
        return len(attempts) == failed and attempts[-1] + delay_ms in clock.deadlines

    await engine.open()
    await engine.start("flaky", run_id="f")
    await eventually(lambda: backing_off(1, 1000), what="the first failure's 1 s backoff")
    clock.advance("1s")
    await eventually(lambda: backing_off(2, 2000), what="the second failure's 2 s backoff")
    clock.advance("1999ms")
    # Its timer is not due yet (nothing else can start the third attempt).
    assert backing_off(2, 2000)
    clock.advance("1ms")
    result = await engine.wait_for_run("f", terminal=True, timeout=10)
    assert result.output == "ok"
    start = attempts[0]
    assert [t - start for t in attempts] == [0, 1000, 3000]
    history = await engine.history("f")
    assert history[0].attempts == 3 and history[0].status is CheckpointStatus.COMPLETED


async def test_exhausted_retries_raise_step_failed_in_the_body(make_engine: EngineFactory) -> None:
    engine = make_engine()
    calls = 0

    def broken() -> None:
        nonlocal calls
        calls += 1
        raise ValueError(f"bad attempt {calls}")

    @engine.workflow("handled")
    async def handled(ctx: durably.WorkflowContext) -> dict[str, object]:
        try:
            await ctx.local_step("broken", broken, retries=2, backoff_base=0)
        except durably.StepFailed as exc:
            return {"step": exc.step, "attempts": exc.attempts, "message": exc.message}
        return {}

    async with engine:
        await engine.start("handled", run_id="h")
        result = await engine.wait_for_run("h", terminal=True, timeout=10)
    assert result.output == {"step": "broken", "attempts": 3, "message": "bad attempt 3"}
    assert calls == 3


async def test_fatal_error_is_never_retried(make_engine: EngineFactory) -> None:
    engine = make_engine()
    calls = 0

    def declined() -> None:
        nonlocal calls
        calls += 1
        raise durably.FatalError("card declined", code="card_declined", details={"bank": "x"})

    @engine.workflow("fatal")
    async def fatal(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("charge", declined, retries=5, backoff_base=0)

    async with engine:
        await engine.start("fatal", run_id="f")
        result = await engine.wait_for_run("f", terminal=True, timeout=10)
    assert calls == 1
    assert result.status is RunStatus.FAILED
    assert result.error is not None
    assert result.error["code"] == "card_declined"
    assert result.error["details"] == {"bank": "x"}
    assert result.error["type"] == "StepFailed"


async def test_a_failed_step_stays_failed_on_replay(make_engine: EngineFactory) -> None:
    engine = make_engine()
    calls = 0

    def once() -> None:
        nonlocal calls
        calls += 1
        raise durably.FatalError("no")

    @engine.workflow("replayed-failure")
    async def wf(ctx: durably.WorkflowContext) -> str:
        with contextlib.suppress(durably.StepFailed):
            await ctx.local_step("once", once)
        await ctx.wait_for_signal("go")
        try:
            await ctx.local_step("once", once)
        except durably.StepFailed as exc:
            return exc.code
        return "?"

    async with engine:
        await engine.start("replayed-failure", run_id="r")
        await engine.wait_for_run("r", timeout=10)
        await engine.signal("go")
        result = await engine.wait_for_run("r", terminal=True, timeout=10)
    assert result.output == "fatal"
    assert calls == 2  # once per position; the first position replayed its failure


async def test_running_checkpoint_is_recorded_while_the_step_runs(
    make_engine: EngineFactory,
) -> None:
    """Under a fresh lease the first step's ``running`` record goes out beside
    the step rather than before it, but it does go out: history shows a step
    that is still running (and would show one a crash interrupted)."""
    engine = make_engine()
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def long_step() -> int:
        entered.set()
        await gate.wait()
        return 1

    @engine.workflow("tracked")
    async def tracked(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("long", long_step)
        await ctx.local_step("untracked", lambda: 2, track_start=False)

    async with engine:
        await engine.start("tracked", run_id="t")
        await asyncio.wait_for(entered.wait(), 10)
        history = await eventually(lambda: engine.history("t"), what="a checkpoint of run t")
        assert [(c.name, c.status) for c in history] == [("long", CheckpointStatus.RUNNING)]
        assert history[0].attempts == 1
        gate.set()
        await engine.wait_for_run("t", terminal=True, timeout=10)


async def test_step_argument_validation(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("bad-step")
    async def bad_step(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("x", "not callable")  # type: ignore[arg-type]

    async with engine:
        await engine.start("bad-step", run_id="b")
        result = await engine.wait_for_run("b", terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None and "not callable" in result.error["message"]
