"""Faults: a flaky store never fails a run, the determinism guard cannot be
swallowed, and any exception a body raises is stored as an error (issue 13)."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.testing import VirtualClock, eventually

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


class _Outage:
    """Make some of a store's methods raise a connection error while ``down``."""

    def __init__(self, store: Any, methods: list[str]) -> None:
        self.down = False
        self.refused = 0
        for method in methods:
            setattr(store, method, self._wrap(getattr(store, method)))

    def _wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        async def flaky(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                self.refused += 1
                raise ConnectionError("injected outage")
            return await real(*args, **kwargs)

        return flaky


_TURN_METHODS = [
    "save_checkpoint",
    "save_checkpoints",
    "continue_turn",
    "renew_lease",
    "settle_run",
]


async def test_a_run_mid_turn_through_an_outage_resumes_here_and_counts_no_crash(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, lease="30s")
    outage = _Outage(engine.store, _TURN_METHODS)
    executed: Counter[str] = Counter()

    def step(name: str) -> str:
        executed[name] += 1
        if name == "a" and executed[name] == 1:
            outage.down = True  # the store goes away while the step first runs
        return name

    @engine.workflow("through")
    async def through(ctx: durably.WorkflowContext) -> list[str]:
        return [await ctx.local_step("a", step, "a"), await ctx.local_step("b", step, "b")]

    async with engine:
        await engine.start("through", run_id="t")
        await eventually(lambda: outage.refused >= 2, what="the turn retrying its store")
        clock.advance("2m")  # the lease this process holds runs out during the outage
        assert await engine.recover_incomplete() == 0  # ours: not an orphan, not a crash
        outage.down = False
        result = await engine.wait_for_run("t", terminal=True, timeout=20)
        run = await engine.store.get_run("t")
    assert result.status is RunStatus.COMPLETED, result.error
    assert run is not None and run.recovery_attempts == 0
    assert executed["b"] == 1 and executed["a"] <= 2


async def test_an_outage_logs_one_line_per_failing_phase_not_one_per_tick(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine()
    reads = ["list_pending", "list_orphans", "list_due", "list_expired", "claim_due_batch"]
    outage = _Outage(engine.store, reads)
    await engine.open()
    caplog.set_level(logging.INFO, logger="durably")
    outage.down = True
    for _ in range(50):
        await engine.tick()
    failing = [r for r in caplog.records if r.levelno >= logging.WARNING]
    outage.down = False
    await engine.tick()
    recovered = [r for r in caplog.records if "recovered" in r.getMessage()]
    assert outage.refused >= 50
    assert 1 <= len(failing) <= len(reads)
    assert len(recovered) == len(failing)
    assert sum(1 for r in caplog.records if r.exc_info) == 0


async def test_buffered_signals_and_events_expire_after_the_buffer_ttl(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, buffer_ttl="1h")
    async with engine:
        for i in range(5):
            assert await engine.signal("stray", i) is None
        await engine.publish_event("nobody.listens", {"n": 1})
        clock.advance("30m")
        await engine.signal("stray", "fresh")
        assert await engine.sweep_buffered(force=True) == 0  # nothing is an hour old yet
        clock.advance("31m")
        assert await engine.sweep_buffered(force=True) == 6
        assert await engine.store.list_buffered_signals("stray") == ["fresh"]
        assert await engine.store.list_buffered_events("nobody.listens") == []
        clock.advance("2h")
        assert await engine.sweep_buffered(force=True) == 1
        assert await engine.store.list_buffered_signals("stray") == []


async def test_a_sqlite_file_deleted_under_a_running_engine_stops_it_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gone.db"
    engine = durably.Engine(f"sqlite:///{path}", poll_interval=0.05)

    @engine.workflow("w")
    async def w(ctx: durably.WorkflowContext) -> int:
        return await ctx.local_step("a", lambda: 1)

    async with engine:
        await engine.start("w", run_id="before")
        assert (await engine.wait_for_run("before", terminal=True, timeout=10)).ok
        _remove(tmp_path, "gone.db*")  # an operator's rm, or a cleanup job
        caplog.set_level(logging.INFO, logger="durably")
        for _ in range(5):
            await engine.tick()
        lines = [r for r in caplog.records if "gone.db" in r.getMessage()]
        assert len(lines) == 1 and "deleted" in lines[0].getMessage()
        # nothing more goes into the unlinked file, where it would be lost
        with pytest.raises(OSError, match="deleted"):
            await engine.start("w", run_id="after")


def _remove(folder: Path, pattern: str) -> None:
    for leftover in folder.glob(pattern):
        leftover.unlink()
