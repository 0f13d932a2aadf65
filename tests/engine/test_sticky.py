"""Sticky runs: a suspended turn's body kept in memory and resumed by the run's next turn.

Cache hits are proven by counting how often a body started from the top (a
replay starts it again; a resumed body does not), never by timing. Every test
runs on memory, SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import durably
from durably import RunStatus
from durably._sticky import StickyRuns

from .conftest import EngineFactory


def _sticky(engine: durably.Engine) -> StickyRuns:
    sticky = engine._turns.sticky
    assert sticky is not None
    return sticky


async def _suspended(engine: durably.Engine, run_id: str) -> None:
    run = await engine.wait_for_run(run_id, timeout=10)
    assert run.status is RunStatus.SUSPENDED, run


def _signals(engine: durably.Engine, starts: list[str], count: int) -> None:
    @engine.workflow("signals")
    async def signals(ctx: durably.WorkflowContext) -> list[Any]:
        starts.append(ctx.run_id)
        got = []
        for i in range(count):
            got.append(await ctx.wait_for_signal(f"{ctx.run_id}:{i}"))
        return got


async def test_a_kept_run_resumes_without_replaying(make_engine: EngineFactory) -> None:
    engine = make_engine()
    starts: list[str] = []
    _signals(engine, starts, 5)
    async with engine:
        await engine.start("signals", run_id="r")
        for i in range(5):
            await _suspended(engine, "r")
            await engine.signal(f"r:{i}", i)
        result = await engine.wait_for_run("r", terminal=True, timeout=10)
    assert result.output == [0, 1, 2, 3, 4]
    assert starts == ["r"]  # five more turns, none replayed the body
    assert _sticky(engine).resumed == 5


async def test_without_the_cache_every_turn_replays(make_engine: EngineFactory) -> None:
    engine = make_engine(sticky_runs=0)
    starts: list[str] = []
    _signals(engine, starts, 3)
    async with engine:
        await engine.start("signals", run_id="r")
        for i in range(3):
            await _suspended(engine, "r")
            await engine.signal(f"r:{i}", i)
        result = await engine.wait_for_run("r", terminal=True, timeout=10)
    assert result.output == [0, 1, 2]
    assert starts == ["r"] * 4
    assert engine._turns.sticky is None


def _mixed(engine: durably.Engine, starts: list[str], effects: list[str]) -> None:
    """A body using dispatched steps, local steps, timers, signals and children."""

    @engine.step("add")
    async def add(value: int) -> int:
        effects.append(f"add:{value}")
        return value + 1

    @engine.workflow("leaf")
    async def leaf(ctx: durably.WorkflowContext, value: int) -> int:
        await ctx.sleep("10ms")
        return value * 10

    @engine.workflow("mixed")
    async def mixed(ctx: durably.WorkflowContext, n: int) -> dict[str, Any]:
        starts.append(ctx.run_id)
        total = 0
        for i in range(n):
            total += await ctx.step(add, i)
            total += await ctx.local_step(f"local{i}", lambda i=i: effects.append(f"l{i}") or i)
        await ctx.sleep("10ms")
        token = await ctx.wait_for_signal(f"go:{ctx.run_id}")
        child = await ctx.child("leaf", total)
        fan = await ctx.all([ctx.child("leaf", 1), ctx.step(add, 100), ctx.child("leaf", 2)])
        started = ctx.start_child("leaf", 3)
        await ctx.sleep("10ms")
        joined = await started.result()
        return {"total": total, "token": token, "child": child, "fan": fan, "joined": joined}


async def _run_mixed(engine: durably.Engine, run_id: str) -> tuple[Any, list[tuple[Any, ...]]]:
    async with engine:
        await engine.start("mixed", 4, run_id=run_id)
        await engine.signal(f"go:{run_id}", "tok")
        result = await engine.wait_for_run(run_id, terminal=True, timeout=20)
        history = [
            (cp.seq, cp.name.replace(run_id, "<id>"), cp.kind, cp.status, cp.output, cp.attempts)
            for cp in await engine.history(run_id)
        ]
    assert result.status is RunStatus.COMPLETED, result
    return result.output, history


async def test_a_resumed_body_does_what_a_replayed_one_does(make_engine: EngineFactory) -> None:
    outputs, histories, effects, starts = [], [], [], []
    for size in (0, 1000):
        engine = make_engine(sticky_runs=size)
        ran: list[str] = []
        started: list[str] = []
        _mixed(engine, started, ran)
        output, history = await _run_mixed(engine, f"m{size}")
        outputs.append(output)
        histories.append(history)
        effects.append(sorted(ran))
        starts.append(len(started))
    assert (
        outputs[0]
        == outputs[1]
        == {
            "total": (1 + 2 + 3 + 4) + (0 + 1 + 2 + 3),
            "token": "tok",
            "child": 160,
            "fan": [10, 101, 20],
            "joined": 30,
        }
    )
    assert histories[0] == histories[1]
    assert effects[0] == effects[1]  # each step executed once either way
    assert starts[0] > 5  # every turn replayed without the cache
    assert starts[1] == 1  # with it, none did
