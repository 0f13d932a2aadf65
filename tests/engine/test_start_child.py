"""``ctx.start_child``: a child created at the call, joined later or never."""

from __future__ import annotations

from collections import Counter

import pytest

import durably
from durably import CheckpointStatus, RunStatus

from .conftest import EngineFactory


def _register(engine: durably.Engine, log: Counter[str]) -> None:
    @engine.workflow("square")
    async def square(ctx: durably.WorkflowContext, n: int) -> int:
        log[f"square:{n}"] += 1
        if n < 0:
            raise durably.FatalError(f"negative: {n}", code="negative")
        return n * n

    @engine.workflow("gated")
    async def gated(ctx: durably.WorkflowContext, token: str) -> str:
        log[f"gated:{token}"] += 1
        return str(await ctx.wait_for_signal(token))


async def test_a_started_child_is_joined_later(make_engine: EngineFactory) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> list[int]:
        first = ctx.start_child("square", 3)
        second = ctx.start_child("square", 4, run_id="kid-4")
        # Both exist before anything waits: a signal wait parks the turn first.
        await ctx.wait_for_signal(f"go:{ctx.run_id}")
        assert first.run_id == "p.child.0" and second.run_id == "kid-4"
        return [await first.result(), await second.result()]

    async with engine:
        await engine.start("parent", run_id="p")
        await engine.wait_for_run("p", timeout=10)
        # Created at the call, while the parent waits on something else.
        kids = {r.run_id for r in (await engine.list_runs(parent_id="p")).runs}
        assert kids == {"p.child.0", "kid-4"}
        await engine.signal("go:p", None)
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
        history = await engine.history("p")
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == [9, 16]
    assert log == Counter({"square:3": 1, "square:4": 1})
    children = [cp for cp in history if cp.kind == "child"]
    assert [(cp.name, cp.status) for cp in children] == [
        ("child:square", CheckpointStatus.COMPLETED),
        ("child:square", CheckpointStatus.COMPLETED),
    ]


async def test_fire_and_forget_creates_the_child_once(make_engine: EngineFactory) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> str:
        ctx.start_child("square", 5, run_id="forgotten", detached=True)
        # Replayed on the next turn: the start is not made twice.
        await ctx.sleep(0)
        return "done"

    async with engine:
        await engine.start("parent", run_id="p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
        child = await engine.wait_for_run("forgotten", terminal=True, timeout=10)
        page = await engine.list_runs(parent_id="p")
    assert result.output == "done"
    assert child.status is RunStatus.COMPLETED and child.output == 25
    assert [r.run_id for r in page.runs] == ["forgotten"]
    assert log == Counter({"square:5": 1})


async def test_a_parent_that_ends_cancels_its_attached_children_not_detached_ones(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> str:
        ctx.start_child("gated", "t-attached", run_id="attached")
        ctx.start_child("gated", "t-detached", run_id="detached", detached=True)
        return "done"

    async with engine:
        await engine.start("parent", run_id="p")
        assert (await engine.wait_for_run("p", terminal=True, timeout=10)).output == "done"
        attached = await engine.wait_for_run("attached", terminal=True, timeout=10)
        assert attached.status is RunStatus.CANCELLED
        detached = await engine.get_run("detached")
        assert detached is not None and detached.status is not RunStatus.CANCELLED
        await engine.signal("t-detached", "still here")
        result = await engine.wait_for_run("detached", terminal=True, timeout=10)
    assert result.output == "still here"


async def test_a_cancelled_parent_leaves_its_detached_children_running(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> None:
        ctx.start_child("gated", "a", run_id="attached")
        ctx.start_child("gated", "d", run_id="detached", detached=True)
        await ctx.wait_for_signal("never")

    async with engine:
        await engine.start("parent", run_id="p")
        await engine.wait_for_run("p", timeout=10)
        await engine.cancel("p")
        assert (await engine.wait_for_run("attached", terminal=True, timeout=10)).status is (
            RunStatus.CANCELLED
        )
        detached = await engine.get_run("detached")
        assert detached is not None and detached.status is not RunStatus.CANCELLED
        await engine.signal("d", "ok")
        assert (await engine.wait_for_run("detached", terminal=True, timeout=10)).output == "ok"


async def test_ctx_child_with_a_started_id_joins_it(make_engine: EngineFactory) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> int:
        ctx.start_child("square", 6, run_id="six")
        value: int = await ctx.child("square", 6, run_id="six")
        return value

    async with engine:
        await engine.start("parent", run_id="p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
        history = await engine.history("p")
    assert result.output == 36
    assert log == Counter({"square:6": 1})
    assert len([cp for cp in history if cp.kind == "child"]) == 1


async def test_started_children_join_through_ctx_all(make_engine: EngineFactory) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> list[int]:
        handles = [ctx.start_child("square", n) for n in range(5)]
        return await ctx.all([h.result() for h in handles])

    async with engine:
        await engine.start("parent", run_id="p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
    assert result.output == [0, 1, 4, 9, 16]
    assert sum(log.values()) == 5


async def test_a_started_child_that_fails_raises_at_result(make_engine: EngineFactory) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> list[str]:
        bad = ctx.start_child("square", -1)
        missing = ctx.start_child("no-such-workflow", {})
        codes = []
        for handle in (bad, missing):
            try:
                await handle.result()
            except durably.ChildFailed as exc:
                codes.append(exc.code or "")
        return codes

    async with engine:
        await engine.start("parent", run_id="p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == ["negative", "workflow_not_registered"]


async def test_start_child_refuses_bad_input(make_engine: EngineFactory) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)
    cases = {
        "empty": lambda ctx: ctx.start_child(""),
        "run_id": lambda ctx: ctx.start_child("square", 1, run_id=""),
        "priority": lambda ctx: ctx.start_child("square", 1, priority="high"),
        "detached": lambda ctx: ctx.start_child("square", 1, detached="yes"),
        "twice": lambda ctx: (
            ctx.start_child("square", 1, run_id="x"),
            ctx.start_child("square", 1, run_id="x"),
        ),
        "other workflow": lambda ctx: (
            ctx.start_child("square", 1, run_id="y"),
            ctx.child("gated", "t", run_id="y"),
        ),
    }

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext, case: str) -> None:
        cases[case](ctx)

    async with engine:
        for case in cases:
            await engine.start("parent", case, run_id=f"p-{case}")
            result = await engine.wait_for_run(f"p-{case}", terminal=True, timeout=10)
            assert result.status is RunStatus.FAILED, case
            assert result.error is not None
            assert result.error["type"] in ("ValueError", "TypeError"), (case, result.error)
    assert log["square:1"] <= 2  # only the first start of "twice" / "other workflow" ran


@pytest.mark.parametrize("detached", [False, True])
async def test_start_child_shows_in_history_as_a_child(
    make_engine: EngineFactory, detached: bool
) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> None:
        ctx.start_child("gated", "t", run_id="kid", detached=detached)
        await ctx.wait_for_signal("never")

    async with engine:
        await engine.start("parent", run_id="p")
        await engine.wait_for_run("p", timeout=10)
        [child] = [cp for cp in await engine.history("p") if cp.kind == "child"]
    assert child.status is CheckpointStatus.PENDING
    expected = {"run_id": "kid", "workflow": "gated"}
    if detached:
        expected["detached"] = True
    assert child.input == expected


async def test_a_parent_that_goes_dead_cancels_its_attached_children(
    make_engine: EngineFactory,
) -> None:
    # Dead is an ending from outside a turn, as a cancel is: the children it
    # did not start detached must not outlive it unasked.
    engine = make_engine(lease="1s", max_recovery_attempts=0)
    log: Counter[str] = Counter()
    _register(engine, log)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> None:
        ctx.start_child("gated", "a", run_id="attached")
        ctx.start_child("gated", "d", run_id="detached", detached=True)
        await ctx.wait_for_signal("never")

    async with engine:
        await engine.start("parent", run_id="p")
        await engine.wait_for_run("p", timeout=10)
        # Its executor dies mid-turn (a lease held by a process that is gone),
        # and no recovery is allowed: the recovery sweep makes it dead.
        now = engine.clock.now_ms()
        leased = await engine.store.start_turns(
            ["p"], "dead-process", now, now + 1000, frozenset({RunStatus.SUSPENDED})
        )
        assert "p" in leased
        assert (await engine.wait_for_run("p", terminal=True, timeout=20)).status is RunStatus.DEAD
        attached = await engine.wait_for_run("attached", terminal=True, timeout=20)
        assert attached.status is RunStatus.CANCELLED
        detached = await engine.get_run("detached")
        assert detached is not None and detached.status is not RunStatus.CANCELLED
        await engine.signal("d", "ok")
        assert (await engine.wait_for_run("detached", terminal=True, timeout=10)).output == "ok"
