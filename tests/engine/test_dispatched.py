"""Dispatched steps (``ctx.step``): handlers served by name, durable waiting,
retries, liveness, lost-dispatch nets and cancellation reaching the worker."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably.testing import VirtualClock, eventually
from durably.transports import LocalTransport
from durably.wire import StepResult, StepTask

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(60)


async def finish(engine: durably.Engine, run_id: str, timeout: float = 15) -> durably.RunResult:
    return await engine.wait_for_run(run_id, terminal=True, timeout=timeout)


async def step_checkpoint(engine: durably.Engine, run_id: str, seq: int = 0) -> durably.Checkpoint:
    history = {cp.seq: cp for cp in await engine.history(run_id)}
    return history[seq]


@pytest.mark.parametrize("transport", ["memory://", "local://"])
async def test_step_by_ref_and_by_name_sync_and_async(
    make_engine: EngineFactory, transport: str
) -> None:
    engine = make_engine(transport=transport)
    seen: list[str] = []

    @engine.step("double")
    async def double(data: dict[str, int], log: durably.StepLogger) -> dict[str, int]:
        log.info("doubling", n=data["n"])
        seen.append(log.step_id)
        return {"n": data["n"] * 2}

    @engine.step("plus-one")
    def plus_one(data: int) -> int:  # sync: runs in a worker thread
        return data + 1

    @engine.workflow("pipeline")
    async def pipeline(ctx: durably.WorkflowContext, n: int) -> int:
        doubled = await ctx.step(double, {"n": n})
        return int(await ctx.step("plus-one", doubled["n"]))

    async with engine:
        run = await engine.start("pipeline", 20, run_id="p1")
        result = await finish(engine, run.run_id)
    assert result.status is RunStatus.COMPLETED and result.output == 41
    assert seen == ["p1:0"]
    history = await engine.history("p1")
    assert [(cp.kind, cp.name, cp.status, cp.attempts) for cp in history] == [
        ("step", "double", CheckpointStatus.COMPLETED, 1),
        ("step", "plus-one", CheckpointStatus.COMPLETED, 1),
    ]


@pytest.mark.parametrize("transport", ["memory://", "local://"])
async def test_a_handlers_log_lines_and_sub_events_are_stored_on_its_checkpoint(
    make_engine: EngineFactory, transport: str
) -> None:
    engine = make_engine(transport=transport)

    @engine.step("fetcher")
    async def fetcher(data: Any, log: durably.StepLogger) -> str:
        log.info("x", n=1)
        log.sub("fetch", status="ok")
        return "fetched"

    @engine.step("quiet")
    async def quiet(data: Any) -> str:
        return "q"

    @engine.workflow("logging")
    async def logging_wf(ctx: durably.WorkflowContext) -> list[str]:
        return [await ctx.step(fetcher), await ctx.step(quiet)]

    async with engine:
        run = await engine.start("logging")
        result = await finish(engine, run.run_id)
    assert result.output == ["fetched", "q"]
    history = await engine.history(run.run_id)
    events = history[0].events
    assert events is not None
    assert all(isinstance(event.pop("at"), int) for event in events)
    assert events == [
        {"level": "info", "message": "x", "data": {"n": 1}},
        {"level": "info", "message": "fetch", "name": "fetch", "status": "ok"},
    ]
    assert history[1].events is None


async def test_the_stored_events_are_those_of_the_attempt_that_settled_the_step(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="memory://")

    @engine.step("flaky", retries=1, backoff="fixed", backoff_base="10ms", jitter=False)
    def flaky(data: Any, log: durably.StepLogger) -> int:
        log.warn(f"attempt {log.attempt}")
        if log.attempt == 1:
            raise RuntimeError("boom")
        return log.attempt

    @engine.workflow("retrying")
    async def retrying(ctx: durably.WorkflowContext) -> int:
        return int(await ctx.step(flaky))

    async with engine:
        run = await engine.start("retrying")
        result = await finish(engine, run.run_id)
    assert result.output == 2
    checkpoint = await step_checkpoint(engine, run.run_id)
    assert checkpoint.attempts == 2
    assert [(e["level"], e["message"]) for e in checkpoint.events or []] == [("warn", "attempt 2")]


async def test_a_step_out_suspends_the_run_and_its_result_resumes_it(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="local://")
    release = asyncio.Event()

    @engine.step("slow")
    async def slow(data: Any) -> str:
        await release.wait()
        return "done"

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> str:
        return str(await ctx.step(slow))

    async with engine:
        run = await engine.start("waits", run_id="w1")

        async def suspended() -> bool:
            current = await engine.get_run("w1")
            return current is not None and current.status is RunStatus.SUSPENDED

        await eventually(suspended, what="w1 to suspend")
        checkpoint = await step_checkpoint(engine, "w1")
        assert checkpoint.status is CheckpointStatus.PENDING
        assert checkpoint.dispatched_at is not None
        release.set()
        result = await finish(engine, run.run_id)
    assert result.output == "done"


async def test_retries_wait_on_a_durable_timer(make_engine: EngineFactory) -> None:
    clock = VirtualClock()
    engine = make_engine(transport="memory://", clock=clock)
    calls: list[int] = []

    @engine.step("flaky", retries=2, backoff="fixed", backoff_base="10s", jitter=False)
    def flaky(data: Any, log: durably.StepLogger) -> int:
        calls.append(log.attempt)
        if len(calls) < 3:
            raise RuntimeError(f"boom {len(calls)}")
        return len(calls)

    @engine.workflow("retrying")
    async def retrying(ctx: durably.WorkflowContext) -> int:
        return int(await ctx.step(flaky))

    async with engine:
        await engine.start("retrying", run_id="r1")

        async def backing_off() -> bool:
            current = await engine.get_run("r1")
            return current is not None and current.status is RunStatus.SUSPENDED and bool(calls)

        await eventually(backing_off, what="the first backoff")
        checkpoint = await step_checkpoint(engine, "r1")
        # Waiting for the backoff: not out, an error kept, a timer set.
        assert checkpoint.status is CheckpointStatus.PENDING
        assert checkpoint.dispatched_at is None
        assert checkpoint.error is not None and "boom 1" in checkpoint.error["message"]
        assert checkpoint.wake_at == clock.now_ms() + 10_000
        assert calls == [1]
        clock.advance("10s")

        async def second_backoff() -> bool:
            # The retry timer of attempt 2 is saved (on the advanced clock)
            # before the clock moves again, or it would never be due.
            checkpoint = await step_checkpoint(engine, "r1")
            return checkpoint.attempts == 2 and checkpoint.dispatched_at is None

        await eventually(second_backoff, what="the second backoff")
        assert calls == [1, 2]
        clock.advance("10s")
        result = await finish(engine, "r1")
    assert result.output == 3 and calls == [1, 2, 3]
    assert (await step_checkpoint(engine, "r1")).attempts == 3


async def _true(value: bool) -> bool:
    return value


async def test_fatal_error_is_not_retried_and_reaches_the_workflow(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="local://")
    calls = 0

    @engine.step("charge", retries=5)
    def charge(data: Any) -> None:
        nonlocal calls
        calls += 1
        raise durably.FatalError("card declined", code="declined", details={"last4": "4242"})

    @engine.workflow("checkout")
    async def checkout(ctx: durably.WorkflowContext) -> dict[str, Any]:
        try:
            await ctx.step(charge, {"amount": 5})
        except durably.StepFailed as failure:
            return {"code": failure.code, "details": failure.details, "step": failure.step}
        return {}

    async with engine:
        run = await engine.start("checkout")
        result = await finish(engine, run.run_id)
    assert result.output == {"code": "declined", "details": {"last4": "4242"}, "step": "charge"}
    assert calls == 1


async def test_a_step_without_a_handler_fails_on_the_memory_transport(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="memory://")

    @engine.workflow("orphan")
    async def orphan(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step("nobody-serves-this", retries=3)

    async with engine:
        run = await engine.start("orphan")
        result = await finish(engine, run.run_id)
    assert result.status is RunStatus.FAILED
    assert (
        result.error is not None and "no handler for nobody-serves-this" in result.error["message"]
    )


async def test_input_and_output_models_are_checked_where_the_handler_runs(
    make_engine: EngineFactory,
) -> None:
    class Order(pydantic.BaseModel):
        id: int
        amount: float

    class Receipt(pydantic.BaseModel):
        order: int

    engine = make_engine(transport="memory://")
    calls = 0

    @engine.step("receipt", input=Order, output=Receipt, retries=3)
    def receipt(order: Order) -> Receipt:
        nonlocal calls
        calls += 1
        assert isinstance(order, Order)
        return Receipt(order=order.id)

    @engine.workflow("orders")
    async def orders(ctx: durably.WorkflowContext, data: Any) -> Any:
        try:
            return await ctx.step(receipt, data)
        except durably.StepFailed as failure:
            return failure.code

    async with engine:
        good = await engine.start("orders", {"id": 7, "amount": 1.5})
        bad = await engine.start("orders", {"id": "not a number"})
        assert (await finish(engine, good.run_id)).output == {"order": 7}
        assert (await finish(engine, bad.run_id)).output == "schema_validation"
    assert calls == 1


async def test_heartbeats_keep_a_step_with_a_timeout_alive(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="local://")

    @engine.step("long", timeout=0.4)
    async def long(data: Any, log: durably.StepLogger) -> str:
        for i in range(12):  # 1.2 s in all, three times the silence window
            await asyncio.sleep(0.1)
            log.heartbeat({"done": i})
        return "finished"

    @engine.workflow("patient")
    async def patient(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(long)

    async with engine:
        run = await engine.start("patient")
        result = await finish(engine, run.run_id)
    assert result.output == "finished"


async def test_a_silent_worker_fails_the_attempt_after_the_window(
    make_engine: EngineFactory,
) -> None:
    # Served by nobody here: the task sits in the queue, no beat ever comes.
    engine = make_engine(transport="local://", serve_steps=["other"])

    @engine.step("ghost", timeout=0.3, pickup_timeout=0.3)
    def ghost(data: Any) -> None:  # pragma: no cover - never served
        raise AssertionError("not served")

    @engine.workflow("waits-for-ghost")
    async def waits_for_ghost(ctx: durably.WorkflowContext) -> Any:
        try:
            return await ctx.step(ghost)
        except durably.StepFailed as failure:
            return failure.code

    async with engine:
        run = await engine.start("waits-for-ghost")
        result = await finish(engine, run.run_id)
    assert result.output == "remote_step_timeout"


async def test_a_beat_persisted_by_another_instance_is_honoured(
    make_engine: EngineFactory,
) -> None:
    """The dispatcher hears nothing itself, but another instance persisted
    beats: it must not fail a live worker, and must fail a dead one once the
    newest persisted beat is ``timeout`` plus one persist throttle old — not
    earlier, not later (on a virtual clock)."""
    clock = VirtualClock()
    engine = make_engine(
        transport="local://", serve_steps=["other"], heartbeat_persist_throttle="10s", clock=clock
    )

    @engine.step("elsewhere", timeout="30s")
    def elsewhere(data: Any) -> None:  # pragma: no cover - never served
        raise AssertionError("not served")

    @engine.workflow("remote")
    async def remote(ctx: durably.WorkflowContext) -> Any:
        try:
            return await ctx.step(elsewhere)
        except durably.StepFailed as failure:
            return failure.code

    async def status() -> RunStatus:
        current = await engine.get_run("x1")
        assert current is not None
        return current.status

    def watching_until(deadline: int) -> bool:
        # The step's liveness window is the only timer at that moment (the
        # lease renewals fall at sent + 15 s, 30 s, ... and after each advance).
        return deadline in clock.deadlines

    async with engine:
        await engine.start("remote", run_id="x1")

        async def dispatched() -> bool:
            history = await engine.history("x1")
            return bool(history) and history[0].dispatched_at is not None

        await eventually(dispatched, what="the step to go out")
        sent = (await step_checkpoint(engine, "x1")).dispatched_at
        assert sent is not None
        await eventually(lambda: watching_until(sent + 30_000), what="the first 30 s window")
        # "Another instance" persists a beat every 20 s for 80 s: the 30 s
        # window runs out here three times without a beat heard here. Each
        # time, the dispatcher reads the beat persisted 20 s ago and waits
        # until it is timeout + throttle (40 s) old: that new timer is the
        # proof it looked and kept the step, not that time passed.
        for n in range(5):
            beat = clock.now_ms()
            await engine.store.record_heartbeat("x1", 0, beat, None)
            clock.advance("20s")
            expected = sent + 30_000 if n == 0 else beat + 40_000
            await eventually(
                lambda t=expected: watching_until(t),
                what=f"a liveness window ending at sent + {(expected - sent) // 1000} s",
            )
            assert await status() is RunStatus.RUNNING
        # The worker is dead now: the window ends exactly timeout + throttle
        # after its last beat (the timer shown above), not a millisecond earlier.
        clock.advance((beat + 40_000 - 1 - clock.now_ms()) / 1000)
        assert watching_until(beat + 40_000)
        assert await status() is RunStatus.RUNNING
        clock.advance(0.001)
        result = await finish(engine, "x1")
    assert result.output == "remote_step_timeout"


class _DropFirst(LocalTransport):
    """Loses the first dispatch of every step, as a broker outage would."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[str] = []

    async def dispatch(self, tasks: list[StepTask]) -> None:
        kept = []
        for task in tasks:
            if task.step_id in self.dropped:
                kept.append(task)
            else:
                self.dropped.append(task.step_id)
        await super().dispatch(kept)


async def test_a_lost_dispatch_is_sent_again(make_engine: EngineFactory) -> None:
    transport = _DropFirst()
    engine = make_engine(transport=transport, remote_redispatch=0.2, remote_redispatch_max=3)

    @engine.step("echo")
    def echo(data: Any) -> Any:
        return data

    @engine.workflow("resend")
    async def resend(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(echo, "hello")

    async with engine:
        run = await engine.start("resend", run_id="rs")
        result = await finish(engine, run.run_id)
    assert result.output == "hello"
    assert transport.dropped == ["rs:0"]
    assert (await step_checkpoint(engine, "rs")).redispatches == 1


async def test_a_step_lost_every_time_fails_with_remote_step_lost(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(
        transport="local://", serve_steps=[], remote_redispatch=0.1, remote_redispatch_max=2
    )

    @engine.workflow("lost")
    async def lost(ctx: durably.WorkflowContext) -> Any:
        try:
            return await ctx.step("unserved")
        except durably.StepFailed as failure:
            return failure.code

    async with engine:
        run = await engine.start("lost")
        result = await finish(engine, run.run_id)
    assert result.output == "remote_step_lost"


async def test_redispatch_pending_sends_the_outstanding_tasks_again(
    make_engine: EngineFactory,
) -> None:
    transport = _DropFirst()
    engine = make_engine(transport=transport)  # no redispatch timer: only the API helps

    @engine.step("echo")
    def echo(data: Any) -> Any:
        return data

    @engine.workflow("manual")
    async def manual(ctx: durably.WorkflowContext) -> Any:
        return await ctx.all([ctx.step(echo, 1), ctx.step(echo, 2)])

    async with engine:
        await engine.start("manual", run_id="m1")

        async def both_out() -> bool:
            history = await engine.history("m1")
            return len(history) == 2 and all(cp.dispatched_at for cp in history)

        await eventually(both_out, what="both steps to go out")
        assert await engine.redispatch_pending("m1") == 2
        result = await finish(engine, "m1")
    assert result.output == [1, 2]


async def test_a_late_result_for_a_finished_run_is_dropped(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="local://", serve_steps=[])

    @engine.workflow("abandoned")
    async def abandoned(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step("slow-elsewhere")

    async with engine:
        await engine.start("abandoned", run_id="a1")

        async def out() -> bool:
            history = await engine.history("a1")
            return bool(history) and history[0].dispatched_at is not None

        await eventually(out, what="the step to go out")
        await engine.cancel("a1")
        await engine.transport.send_result(StepResult("a1", 0, ok=True, output="late"))
        await asyncio.sleep(0.3)
        current = await engine.get_run("a1")
    assert current is not None and current.status is RunStatus.CANCELLED
    assert current.output is None


async def test_cancelling_a_run_reaches_its_running_handler(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="local://")
    started = asyncio.Event()
    stopped: list[bool] = []

    @engine.step("loop")
    async def loop(data: Any, log: durably.StepLogger) -> str:
        started.set()
        await log.wait_cancelled()
        assert log.cancelled
        stopped.append(True)
        return "stopped early"

    @engine.workflow("cancellable")
    async def cancellable(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(loop)

    async with engine:
        await engine.start("cancellable", run_id="c1")
        await asyncio.wait_for(started.wait(), 10)
        await engine.cancel("c1")
        await eventually(lambda: bool(stopped), what="the handler to stop")
    assert stopped == [True]
    current = await engine.get_run("c1")
    assert current is not None and current.status is RunStatus.CANCELLED


async def test_a_queue_caps_concurrent_steps(make_engine: EngineFactory) -> None:
    """Two slots: never three steps at once, and two do run side by side. The
    first step holds its slot until a second one runs beside it: a sleep alone
    left them apart on a loaded machine (each ask is a turn; under load the
    next one came back after the step before it had ended: ``peak`` was 1)."""
    engine = make_engine(transport="local://")
    engine.register_queue("api", concurrency=2, retry=0.05)
    running = 0
    peak = 0
    two_at_once = asyncio.Event()

    @engine.step("call-api", queue="api")
    async def call_api(data: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 2:
            two_at_once.set()
        await two_at_once.wait()
        await asyncio.sleep(0.05)  # room for a third, were the cap not kept
        running -= 1
        return data

    @engine.workflow("caller")
    async def caller(ctx: durably.WorkflowContext, n: int) -> int:
        return int(await ctx.step(call_api, n))

    async with engine:
        runs = [await engine.start("caller", i) for i in range(8)]
        results = [await finish(engine, run.run_id, timeout=30) for run in runs]
    assert [r.output for r in results] == list(range(8))
    assert peak == 2


async def test_a_step_in_an_unknown_queue_is_refused(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="memory://")

    @engine.workflow("bad-queue")
    async def bad_queue(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step("x", queue="nope")

    async with engine:
        run = await engine.start("bad-queue")
        result = await finish(engine, run.run_id)
    assert result.status is RunStatus.FAILED
    assert result.error is not None and "queue 'nope' is not registered" in result.error["message"]


def test_step_registration_errors() -> None:
    engine = durably.Engine("memory://")
    engine.register_step("a", lambda data: data)
    with pytest.raises(ValueError, match="already registered"):
        engine.register_step("a", lambda data: data)
    with pytest.raises(ValueError, match="non-empty name"):
        engine.register_step("", lambda data: data)
    with pytest.raises(TypeError, match="not callable"):
        engine.register_step("b", 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency"):
        engine.register_queue("q", concurrency=0)
    with pytest.raises(ValueError, match="give concurrency"):
        engine.register_queue("q")
    with pytest.raises(ValueError, match="consumers"):
        durably.Engine("memory://", consumers="sometimes")  # type: ignore[arg-type]


async def test_a_queue_rate_limit_spreads_admissions_over_periods(
    make_engine: EngineFactory,
) -> None:
    clock = VirtualClock()
    engine = make_engine(transport="memory://", clock=clock)
    engine.register_queue("metered", rate=(2, "10s"), retry="1s")
    calls: list[int] = []

    @engine.step("metered-call", queue="metered")
    def metered_call(n: int) -> int:
        calls.append(n)
        return n

    @engine.workflow("metered")
    async def metered(ctx: durably.WorkflowContext, n: int) -> int:
        return int(await ctx.step(metered_call, n))

    async with engine:
        runs = [await engine.start("metered", i) for i in range(5)]

        async def waiting() -> list[str]:
            states = [await engine.get_run(r.run_id) for r in runs]
            return [s.run_id for s in states if s is not None and s.status is RunStatus.SUSPENDED]

        async def settled_after(count: int) -> bool:
            return len(calls) == count and len(await waiting()) == 5 - count

        async def refused_again(count: int) -> bool:
            # Every step still waiting asked again at the current time and was
            # told to come back in 1 s: none was admitted.
            left = await waiting()
            retry_at = [(await step_checkpoint(engine, run_id)).wake_at for run_id in left]
            return len(left) == 5 - count and retry_at == [clock.now_ms() + 1000] * len(left)

        for admitted in (2, 4):
            await eventually(lambda n=admitted: settled_after(n), what=f"{admitted} admitted")
            # Still inside the period: the waiting steps' 1 s retry timers are
            # due, they ask again, and are refused again.
            clock.advance("9s")
            await eventually(
                lambda n=admitted: refused_again(n), what="the waiting steps to be refused again"
            )
            assert len(calls) == admitted  # nothing more inside this period
            clock.advance("1s")  # the next period
        results = [await finish(engine, r.run_id) for r in runs]
    assert sorted(r.output for r in results) == [0, 1, 2, 3, 4]
    assert sorted(calls) == [0, 1, 2, 3, 4]  # each admitted and executed once


class _RefuseFirst(LocalTransport):
    """Refuses the first dispatch, as a broker that is briefly down would."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def dispatch(self, tasks: list[StepTask]) -> None:
        if not self.refused:
            self.refused += 1
            raise durably.TransportError("broker down")
        await super().dispatch(tasks)


@pytest.mark.parametrize("timeout", [None, 5.0])
async def test_a_refused_dispatch_is_sent_again_without_a_redispatch_net(
    make_engine: EngineFactory, timeout: float | None
) -> None:
    transport = _RefuseFirst()
    engine = make_engine(transport=transport)  # no remote_redispatch

    @engine.step("echo", timeout=timeout)
    def echo(data: Any) -> Any:
        return data

    @engine.workflow("refused")
    async def refused(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(echo, "through")

    async with engine:
        run = await engine.start("refused", run_id="rf")
        result = await finish(engine, run.run_id)
    assert transport.refused == 1
    assert result.output == "through"
    assert (await step_checkpoint(engine, "rf")).attempts == 1
