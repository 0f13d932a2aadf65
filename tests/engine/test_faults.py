"""Faults: a flaky store never fails a run, the determinism guard cannot be
swallowed, and any exception a body raises is stored as an error (issue 13)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import durably
from durably import RunStatus

from .conftest import EngineFactory


def _inject_once(store: Any, method: str, *, after: int = 0) -> Callable[[], int]:
    """Make ``store.method`` raise a connection error once, on call ``after + 1``;
    return a function telling how many times it raised."""
    real = getattr(store, method)
    calls = 0
    raised = 0

    @functools.wraps(real)
    async def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls, raised
        calls += 1
        if calls == after + 1:
            raised += 1
            raise ConnectionError(f"injected: {method} lost its connection")
        return await real(*args, **kwargs)

    setattr(store, method, flaky)
    return lambda: raised


_POINTS = [
    ("start_turns", 0),
    ("save_checkpoint", 0),
    ("save_checkpoint", 1),
    ("save_checkpoint", 2),
    ("save_checkpoint", 3),
    ("save_checkpoints", 0),
    ("create_runs", 0),
    ("settle_run", 0),
    ("settle_run", 1),
    ("resolve_checkpoints", 0),
    ("load_checkpoints", 0),
]


@pytest.mark.parametrize(("method", "after"), _POINTS)
async def test_a_store_error_mid_turn_never_reaches_the_body_or_fails_the_run(
    make_engine: EngineFactory, method: str, after: int
) -> None:
    engine = make_engine()
    executed: Counter[str] = Counter()
    caught: list[BaseException] = []

    def effect(name: str) -> str:
        executed[name] += 1
        return name

    @engine.workflow("leaf")
    async def leaf(ctx: durably.WorkflowContext, n: int) -> int:
        return n * 2

    @engine.workflow("flaky")
    async def flaky(ctx: durably.WorkflowContext) -> list[Any]:
        out: list[Any] = []
        try:
            out.append(await ctx.local_step("a", effect, "a"))
            out.append((await ctx.now()).year > 2000)
            out.append(await ctx.child("leaf", 21))
            out.append(await ctx.local_step("b", effect, "b"))
        except Exception as exc:  # the body must never see an infrastructure error
            caught.append(exc)
            raise
        return out

    async with engine:
        raised = _inject_once(engine.store, method, after=after)
        await engine.start("flaky", run_id="f")
        result = await engine.wait_for_run("f", terminal=True, timeout=20)

    assert caught == []
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == ["a", True, 42, "b"]
    assert raised() <= 1
    # one lost write may cost one re-execution of the step it recorded; no more
    assert all(count <= 2 for count in executed.values())
    assert sum(executed.values()) <= 2 + raised()


async def test_a_caught_nondeterminism_still_fails_the_run_and_runs_no_side_effect(
    make_engine: EngineFactory,
) -> None:
    old = make_engine()

    @old.workflow("changing")
    async def before(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("reserve", lambda: 1)
        await ctx.wait_for_signal("go")

    async with old:
        await old.start("changing", run_id="n")
        await old.wait_for_run("n", timeout=10)

    new = make_engine()
    shipped: list[str] = []

    @new.workflow("changing")
    async def after(ctx: durably.WorkflowContext) -> str:
        try:  # noqa: SIM105 - the broad except a body author writes
            await ctx.local_step("charge", lambda: 1)  # a different step at position 0
        except Exception:
            pass  # a broad except must not let the body go on on the wrong history
        await ctx.wait_for_signal("go")
        await ctx.local_step("ship", lambda: shipped.append("ship"))
        return "done"

    async with new:
        await new.signal("go")
        result = await new.wait_for_run("n", terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None and result.error["code"] == "nondeterminism"
    assert shipped == []


class _Hostile(Exception):
    """An exception with an object for a code and a message that cannot print."""

    def __init__(self) -> None:
        super().__init__()
        self.code: Any = object()
        self.details: Any = {"when": object()}

    def __str__(self) -> str:
        raise RuntimeError("no string for you")


@pytest.mark.parametrize("where", ["body", "step"])
async def test_an_unprintable_exception_with_an_object_code_fails_the_run_cleanly(
    make_engine: EngineFactory, where: str
) -> None:
    engine = make_engine()

    def boom() -> None:
        raise _Hostile()

    @engine.workflow("hostile")
    async def hostile(ctx: durably.WorkflowContext) -> None:
        if where == "step":
            await ctx.local_step("boom", boom, retries=0)
        boom()

    async with engine:
        await engine.start("hostile", run_id="h")
        result = await engine.wait_for_run("h", terminal=True, timeout=10)
    assert result.status is RunStatus.FAILED
    assert result.error is not None
    assert isinstance(result.error["message"], str) and result.error["message"]
    assert isinstance(result.error["code"], str)
    assert "crashed" not in result.error["message"]
