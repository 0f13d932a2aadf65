"""Replay: completed checkpoints short-circuit, positions follow call order,
divergence is detected, runs stay pinned to their version."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any
from uuid import UUID

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably.testing import VirtualClock

from .conftest import EngineFactory


async def test_resume_never_reexecutes_completed_steps(make_engine: EngineFactory) -> None:
    """A second engine (a restarted process) finishes the run from its checkpoints."""
    executed: Counter[str] = Counter()

    def define(engine: durably.Engine) -> None:
        def effect(name: str) -> str:
            executed[name] += 1
            return name.upper()

        @engine.workflow("three")
        async def three(ctx: durably.WorkflowContext) -> list[str]:
            a = await ctx.local_step("a", effect, "a")
            b = await ctx.local_step("b", effect, "b")
            await ctx.wait_for_signal("continue")
            c = await ctx.local_step("c", effect, "c")
            return [a, b, c]

    first = make_engine()
    define(first)
    async with first:
        await first.start("three", run_id="r")
        assert (await first.wait_for_run("r", timeout=10)).status is RunStatus.SUSPENDED

    second = make_engine()
    define(second)
    async with second:
        await second.signal("continue", None)
        result = await second.wait_for_run("r", terminal=True, timeout=10)
    assert result.output == ["A", "B", "C"]
    assert executed == Counter({"a": 1, "b": 1, "c": 1})


async def test_gather_takes_positions_in_call_order(make_engine: EngineFactory) -> None:
    """Branches finishing in a different order still map to the same seqs on replay."""
    engine = make_engine()
    executed: Counter[str] = Counter()

    async def slow(name: str, delay: float) -> str:
        executed[name] += 1
        await asyncio.sleep(delay)
        return name

    @engine.workflow("fan")
    async def fan(ctx: durably.WorkflowContext) -> list[str]:
        results = await asyncio.gather(
            ctx.local_step("first", slow, "first", 0.05),
            ctx.local_step("second", slow, "second", 0.0),
            ctx.wait_for_signal("go"),
            ctx.local_step("third", slow, "third", 0.02),
        )
        return [str(r) for r in results]

    async with engine:
        await engine.start("fan", run_id="g")
        assert (await engine.wait_for_run("g", timeout=10)).status is RunStatus.SUSPENDED
        history = await engine.history("g")
        assert [(c.seq, c.name) for c in history] == [
            (0, "first"),
            (1, "second"),
            (2, "signal:go"),
            (3, "third"),
        ]
        await engine.signal("go", "sig")
        result = await engine.wait_for_run("g", terminal=True, timeout=10)
    assert result.output == ["first", "second", "sig", "third"]
    assert executed == Counter({"first": 1, "second": 1, "third": 1})


async def test_parked_branches_of_a_gather_are_all_recorded(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, reconcile="1d")

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> list[object]:
        return list(
            await asyncio.gather(ctx.sleep("1h"), ctx.wait_for_signal("x"), ctx.sleep("10m"))
        )

    async with engine:
        await engine.start("waits", run_id="w")
        await engine.wait_for_run("w", timeout=10)
        run = await engine.get_run("w")
        assert run is not None and run.status is RunStatus.SUSPENDED
        assert run.wake_at == clock.now_ms() + 10 * 60_000  # the earliest parked wake
        history = await engine.history("w")
        assert [c.status for c in history] == [CheckpointStatus.PENDING] * 3
        await engine.signal("x", 1)
        clock.advance("1h")
        await engine.resume_due_timers()
        result = await engine.wait_for_run("w", terminal=True, timeout=10)
    assert result.output == [None, 1, None]


async def test_deterministic_sources_replay_verbatim(make_engine: EngineFactory) -> None:
    seen: list[tuple[object, ...]] = []

    def define(engine: durably.Engine) -> None:
        @engine.workflow("sources")
        async def sources(ctx: durably.WorkflowContext) -> None:
            now = await ctx.now()
            ident = await ctx.uuid()
            roll = await ctx.random()
            flag = await ctx.side_effect(lambda: len(seen))
            seen.append((now, ident, roll, flag))
            assert isinstance(ident, UUID) and 0 <= roll < 1 and now.tzinfo is not None
            await ctx.wait_for_signal("again")
            seen.append((now, ident, roll, flag))

    first = make_engine()
    define(first)
    async with first:
        await first.start("sources", run_id="s")
        await first.wait_for_run("s", timeout=10)
    second = make_engine()
    define(second)
    async with second:
        await second.signal("again")
        assert (await second.wait_for_run("s", terminal=True, timeout=10)).ok
    # turn 1 records the values; turn 2 replays them twice (before and after the wait)
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]


async def test_divergent_body_fails_with_nondeterminism(make_engine: EngineFactory) -> None:
    old = make_engine()

    @old.workflow("changing")
    async def before(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("reserve", lambda: 1)
        await ctx.wait_for_signal("go")

    async with old:
        await old.start("changing", run_id="n")
        await old.wait_for_run("n", timeout=10)

    new = make_engine()

    @new.workflow("changing")
    async def after(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("charge", lambda: 1)  # a different step at position 0
        await ctx.wait_for_signal("go")

    async with new:
        await new.signal("go")
        result = await new.wait_for_run("n", terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None and result.error["code"] == "nondeterminism"
    assert "reserve" in result.error["message"] and "charge" in result.error["message"]


async def test_runs_replay_on_their_pinned_version(make_engine: EngineFactory) -> None:
    old = make_engine()

    @old.workflow("pinned", version="1")
    async def v1(ctx: durably.WorkflowContext) -> str:
        await ctx.wait_for_signal("go")
        return "v1"

    async with old:
        await old.start("pinned", run_id="p1")
        await old.wait_for_run("p1", timeout=10)

    new = make_engine()
    new.register("pinned", v1, version="1")

    @new.workflow("pinned", version="2")
    async def v2(ctx: durably.WorkflowContext) -> str:
        return "v2"

    async with new:
        fresh = await new.start("pinned", run_id="p2")
        assert fresh.run.workflow_version == "2"
        await new.signal("go")
        assert (await new.wait_for_run("p1", terminal=True, timeout=10)).output == "v1"
        assert (await new.wait_for_run("p2", terminal=True, timeout=10)).output == "v2"


async def test_a_run_whose_version_is_gone_waits_blocked_and_says_why(
    make_engine: EngineFactory,
) -> None:
    """Never failed (another instance may still have the version: a rolling
    deploy), but loud: shown ``blocked`` with the missing version, until an
    instance that registers it executes the run."""
    clock = VirtualClock()
    old = make_engine(clock=clock)

    @old.workflow("gone", version="1")
    async def v1(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("go")

    async with old:
        await old.start("gone", run_id="g1")
        await old.wait_for_run("g1", timeout=10)

    new = make_engine(clock=clock)

    @new.workflow("gone", version="2")
    async def v2(ctx: durably.WorkflowContext) -> None:
        return None

    async with new:
        await new.signal("go", "sent")
        await new.join()  # the wake was tried here (and stamped on the run)
        await new.tick()
        clock.advance("31s")  # no instance took it for a lease
        await new.tick()
        run = await new.get_run("g1")
    assert run is not None and run.status is RunStatus.BLOCKED, run
    assert run.error is not None and run.error["code"] == "workflow_not_registered"
    assert "'1'" in run.error["message"]
    async with old:
        result = await old.wait_for_run("g1", terminal=True, timeout=10)
    assert (result.status, result.output) == (RunStatus.COMPLETED, "sent")


async def test_broad_except_cannot_swallow_the_end_of_a_turn(make_engine: EngineFactory) -> None:
    """A body that catches BaseException around a parked wait still suspends
    cleanly and never runs code after the turn ended."""
    engine = make_engine(sticky_runs=0)  # every turn replays (the cache has its own tests)
    after_turn: list[str] = []

    @engine.workflow("greedy")
    async def greedy(ctx: durably.WorkflowContext) -> str:
        try:
            value = await ctx.wait_for_signal("go")
        except BaseException as exc:
            if durably.is_control_flow(exc):
                after_turn.append("caught")
                try:
                    await ctx.local_step("sneaky", lambda: "x")
                except BaseException:
                    after_turn.append("refused")
                    raise
            raise
        return str(value)

    async with engine:
        await engine.start("greedy", run_id="gr")
        assert (await engine.wait_for_run("gr", timeout=10)).status is RunStatus.SUSPENDED
        assert [c.name for c in await engine.history("gr")] == ["signal:go"]
        await engine.signal("go", "ok")
        assert (await engine.wait_for_run("gr", terminal=True, timeout=10)).output == "ok"
    assert after_turn == ["caught", "refused"]


async def test_continue_as_new_persists_the_next_link(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("counter")
    async def counter(ctx: durably.WorkflowContext, n: int) -> int:
        total = await ctx.local_step("add", lambda: n + 1)
        if total < 3:
            ctx.continue_as_new(total)
        return total

    async with engine:
        await engine.start("counter", 0, run_id="c")
        first = await engine.wait_for_run("c", terminal=True, timeout=10)
        assert first.output == {"continued_as": "c~1"}
        second = await engine.wait_for_run("c~1", terminal=True, timeout=10)
        assert second.output == {"continued_as": "c~2"}
        last = await engine.wait_for_run("c~2", terminal=True, timeout=10)
    assert last.output == 3


@pytest.mark.parametrize("bad", [-1, "soon", object()])
async def test_bad_durations_raise_in_the_body(make_engine: EngineFactory, bad: object) -> None:
    engine = make_engine()

    @engine.workflow("bad-sleep")
    async def bad_sleep(ctx: durably.WorkflowContext) -> None:
        await ctx.sleep(bad)  # type: ignore[arg-type]

    async with engine:
        await engine.start("bad-sleep", run_id="bs")
        result = await engine.wait_for_run("bs", terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None and "sleep duration" in result.error["message"]
