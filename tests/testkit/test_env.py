"""``TestEnv``: virtual time skipped in big steps, every due thing fired in order."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

import durably
from durably.testing import TestEnv, VirtualClock

DAY = 86_400_000


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'env.db'}"
    else:
        isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
            "isolated_postgres"
        )
        async with isolated() as url:
            yield url


def trial_app(seen: list[tuple[str, int]], env_clock: list[VirtualClock]) -> Any:
    """A trial that sleeps 14 days between steps, and a reminder started at day 3
    that itself sleeps until day 5."""

    def register(engine: durably.Engine) -> None:
        def day() -> int:
            return (engine.clock.now_ms() - env_clock[0].now_ms()) // DAY

        @engine.workflow("trial")
        async def trial(ctx: durably.WorkflowContext, user: str) -> str:
            await ctx.local_step("welcome", lambda: seen.append(("welcome", day())))
            await ctx.sleep("14d")
            await ctx.local_step("convert", lambda: seen.append(("convert", day())))
            return f"{user} converted"

        @engine.workflow("reminders")
        async def reminders(ctx: durably.WorkflowContext) -> None:
            await ctx.sleep("3d")
            await ctx.local_step("remind", lambda: seen.append(("remind", day())))
            await ctx.child("nudge", None, run_id="nudge")
            await ctx.sleep("5d")  # after the child returned at day 5
            await ctx.local_step("last-call", lambda: seen.append(("last-call", day())))

        @engine.workflow("nudge")
        async def nudge(ctx: durably.WorkflowContext) -> None:
            await ctx.sleep("2d")
            await ctx.local_step("nudged", lambda: seen.append(("nudged", day())))

    return register


async def test_advance_fires_timers_in_due_order_and_what_they_schedule(store: str) -> None:
    seen: list[tuple[str, int]] = []
    origin: list[VirtualClock] = []
    async with TestEnv(trial_app(seen, origin), store=store) as env:
        origin.append(VirtualClock(env.clock.now_ms()))
        trial = await env.start("trial", "ada")
        await env.start("reminders", run_id="rem")
        assert seen == [("welcome", 0)]

        await env.advance("14d")

        # day 3's reminder starts a child due at day 5, which fires before day 10.
        assert seen == [
            ("welcome", 0),
            ("remind", 3),
            ("nudged", 5),
            ("last-call", 10),
            ("convert", 14),
        ]
        await env.assert_completed(trial, output="ada converted")
        await env.assert_completed("rem")
        assert env.clock.now_ms() == origin[0].now_ms() + 14 * DAY
        assert env.now.timestamp() * 1000 == env.clock.now_ms()
        assert env.step_calls("convert") == 1


async def test_a_signal_timeout_fires_at_its_deadline_and_a_signal_before_it_wins() -> None:
    def register(engine: durably.Engine) -> None:
        @engine.workflow("approval")
        async def approval(ctx: durably.WorkflowContext, token: str) -> str:
            try:
                decision = await ctx.wait_for_signal(token, timeout="2d")
            except durably.SignalTimeout:
                return "expired"
            return str(decision)

    async with TestEnv(register) as env:
        late = await env.start("approval", "t-late")
        early = await env.start("approval", "t-early")
        await env.advance("1d")
        await env.assert_status(late, "suspended")
        assert await env.signal("t-early", "approved") == early
        await env.assert_completed(early, output="approved")
        await env.advance("23h59m")
        await env.assert_status(late, "suspended")
        await env.advance("1m")
        await env.assert_completed(late, output="expired")


async def test_a_daily_schedule_fires_once_per_window_crossed() -> None:
    def register(engine: durably.Engine) -> None:
        @engine.workflow("digest", schedule={"every": "1d"})
        async def digest(ctx: durably.WorkflowContext) -> int:
            return (await ctx.now()).day

    async with TestEnv(register) as env:
        await env.advance("7d")
        runs = await env.engine.list_runs(workflow="digest", limit=100)
        assert len(runs.runs) == 7
        assert {run.status for run in runs.runs} == {durably.RunStatus.COMPLETED}


async def test_events_reach_waiters_and_start_triggered_runs() -> None:
    def register(engine: durably.Engine) -> None:
        @engine.workflow("on-paid", on_event="paid")
        async def on_paid(ctx: durably.WorkflowContext, payload: dict[str, str]) -> str:
            return payload["order"]

        @engine.workflow("await-paid")
        async def await_paid(ctx: durably.WorkflowContext, order: str) -> str:
            try:
                paid = await ctx.wait_for_event("paid", match={"order": order}, timeout="1h")
            except durably.EventTimeout:
                return "unpaid"
            return str(paid["order"])

    async with TestEnv(register) as env:
        waiting = await env.start("await-paid", "o-1")
        expiring = await env.start("await-paid", "o-2")
        assert await env.publish_event("paid", {"order": "o-1"}) == 2  # one waiter, one start
        await env.assert_completed(waiting, output="o-1")
        await env.advance("1h")
        await env.assert_completed(expiring, output="unpaid")
        started = await env.engine.list_runs(workflow="on-paid")
        assert [run.output for run in started.runs] == ["o-1"]


async def test_an_execution_timeout_cancels_the_run_at_its_deadline() -> None:
    def register(engine: durably.Engine) -> None:
        @engine.workflow("slow", execution_timeout="1h")
        async def slow(ctx: durably.WorkflowContext) -> None:
            await ctx.sleep("1d")

    async with TestEnv(register) as env:
        run_id = await env.start("slow")
        await env.advance("59m")
        await env.assert_status(run_id, "suspended")
        await env.advance("1m")
        await env.assert_status(run_id, "cancelled")


async def test_an_engine_given_must_have_a_virtual_clock() -> None:
    with pytest.raises(TypeError, match="clock=VirtualClock"):
        TestEnv(durably.Engine("memory://"))
    with pytest.raises(TypeError, match="setup function"):
        TestEnv("memory://")  # type: ignore[arg-type]
    clock = VirtualClock()
    engine = durably.Engine("memory://", clock=clock, reconcile=0)

    @engine.workflow("nap")
    async def nap(ctx: durably.WorkflowContext) -> str:
        await ctx.sleep("1h")
        return "up"

    async with TestEnv(engine) as env:
        run_id = await env.start("nap")
        await env.advance("1h")
        await env.assert_completed(run_id, output="up")
        with pytest.raises(TypeError, match="restart"):
            await env.restart()


async def test_assertion_helpers_say_what_they_found() -> None:
    def register(engine: durably.Engine) -> None:
        @engine.workflow("boom")
        async def boom(ctx: durably.WorkflowContext) -> None:
            raise ValueError("no stock")

    async with TestEnv(register) as env:
        run_id = await env.start("boom")
        with pytest.raises(AssertionError, match="is failed, expected completed; error: no stock"):
            await env.assert_completed(run_id)
        await env.assert_failed(run_id, match="no stock")
        with pytest.raises(AssertionError, match="not 'other'"):
            await env.assert_failed(run_id, match="other")
