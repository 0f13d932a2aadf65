"""Dead letters, error routes, retention with archival, stalled detection."""

from __future__ import annotations

import durably
from durably import Checkpoint, Run, RunStatus
from durably.testing import VirtualClock, eventually

from .conftest import EngineFactory


async def test_on_error_routes_by_code_to_a_handler_workflow(make_engine: EngineFactory) -> None:
    engine = make_engine()
    seen: list[str] = []

    @engine.workflow("charge")
    async def charge(ctx: durably.WorkflowContext, code: str) -> None:
        raise durably.FatalError("no", code=code)

    @engine.workflow("refund-desk")
    async def refund_desk(ctx: durably.WorkflowContext, failure: dict[str, object]) -> str:
        return f"handled {failure['run_id']} ({failure['workflow']})"

    async def any_failure(run: Run) -> None:
        seen.append(run.run_id)

    engine.on_error("card_declined", "refund-desk")
    engine.on_error("*", any_failure)
    async with engine:
        await engine.start("charge", "card_declined", run_id="c1")
        await engine.start("charge", "other", run_id="c2")
        await engine.wait_for_run("c1", terminal=True, timeout=10)
        await engine.wait_for_run("c2", terminal=True, timeout=10)
        # The handler run is started after the failed run is settled (and its
        # waiters told), so it may not exist yet when wait_for_run("c1") returns.
        await eventually(lambda: engine.get_run("onerror:card_declined:c1"), what="the handler run")
        await eventually(lambda: sorted(seen) == ["c1", "c2"], what="both failures heard")
        handled = await engine.wait_for_run("onerror:card_declined:c1", terminal=True, timeout=10)
        assert await engine.get_run("onerror:other:c2") is None
    assert handled.output == "handled c1 (charge)"
    assert sorted(seen) == ["c1", "c2"]


async def test_on_dead_starts_a_dead_letter_run(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, max_recovery_attempts=0)

    @engine.workflow("fragile")
    async def fragile(ctx: durably.WorkflowContext) -> None:
        return None

    @engine.workflow("dead-letters")
    async def dead_letters(ctx: durably.WorkflowContext, run: dict[str, object]) -> object:
        return run["status"]

    engine.on_dead("dead-letters")
    await engine.open()
    engine.drive = False
    await engine.start("fragile", run_id="f")
    now = clock.now_ms()
    leased = await engine.store.start_turns(
        ["f"], "crashed", now, now + 1, frozenset({RunStatus.PENDING})
    )
    assert "f" in leased
    clock.advance("1s")
    engine.drive = True
    assert await engine.recover_incomplete() == 1
    result = await engine.wait_for_run("dlq:f", terminal=True, timeout=10)
    assert result.output == "dead"


async def test_retention_archives_then_deletes(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, retention="7d")
    archived: list[tuple[str, list[str]]] = []
    refuse = {"keep"}

    async def archive(run: Run, history: list[Checkpoint]) -> None:
        if run.run_id in refuse:
            raise RuntimeError("archive store down")
        archived.append((run.run_id, [c.name for c in history]))

    engine.on_evict(archive)

    @engine.workflow("done")
    async def done(ctx: durably.WorkflowContext) -> int:
        return await ctx.local_step("one", lambda: 1)

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_signal("never")

    await engine.open()
    for run_id in ("old", "keep"):
        await engine.start("done", run_id=run_id)
    await engine.start("waits", run_id="live")
    for run_id in ("old", "keep"):
        await engine.wait_for_run(run_id, terminal=True, timeout=10)
    clock.advance("6d")
    assert await engine.sweep_retention(force=True) == 0
    clock.advance("1d1s")
    assert await engine.sweep_retention(force=True) == 1
    assert archived == [("old", ["one"])]
    assert await engine.get_run("old") is None
    assert await engine.get_run("keep") is not None  # its archive hook raised
    assert await engine.get_run("live") is not None  # never evicts a live run
    assert await engine.sweep_retention() == 0  # at most one pass a minute


async def test_stalled_runs_are_reported_once_per_episode(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock, stalled_after="1h", reconcile=0)
    reported: list[str] = []

    async def alert(run: Run) -> None:
        reported.append(run.run_id)

    engine.on_stalled(alert)

    @engine.workflow("w")
    async def w(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_signal("nobody-sends-it")

    await engine.open()
    await engine.start("w", run_id="stuck")  # suspended, and nothing can wake it
    await engine.join()
    clock.advance("30m")
    assert await engine.sweep_stalled(force=True) == 0
    clock.advance("31m")
    assert await engine.sweep_stalled(force=True) == 1
    assert await engine.sweep_stalled(force=True) == 0  # same episode
    assert reported == ["stuck"]
    # It moves (a turn touches it), then stalls again: a new episode.
    await engine.store.update_run_if(
        "stuck", frozenset({RunStatus.SUSPENDED}), {"priority": 1}, clock.now_ms()
    )
    clock.advance("2h")
    assert await engine.sweep_stalled(force=True) == 1
    assert reported == ["stuck", "stuck"]
