"""Promises that break only under a particular interleaving (issue 12).

Each test drives the public API the way a careful user would and pins one
promise: a child's parent hears exactly the child's final outcome, a timeout
does all a cancel does, every waiter on a token is served, a run only an engine
that can execute it may take. They run on every store, PostgreSQL included.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
from typing import Any

import pytest

import durably
from durably import RunStatus

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(120)


async def _exists(engine: durably.Engine, run_id: str) -> None:
    """Until ``run_id`` was created (a chain's next link appears as its turn ends)."""
    async with asyncio.timeout(30):
        while await engine.get_run(run_id) is None:  # noqa: ASYNC110 (another task creates it)
            await asyncio.sleep(0.01)


async def _finish(engine: durably.Engine, run_id: str, timeout: float = 30) -> durably.RunResult:
    return await engine.wait_for_run(run_id, terminal=True, timeout=timeout)


async def test_a_child_that_continues_as_new_hands_its_parent_the_last_links_output(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("looper")
    async def looper(ctx: durably.WorkflowContext, n: int) -> dict[str, int]:
        if n < 2:
            ctx.continue_as_new(n + 1)
        return {"final": n}

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> Any:
        return await ctx.child("looper", 0, run_id="kid")

    async with engine:
        await engine.start("parent", run_id="p")
        result = await _finish(engine, "p")
    assert result.status is RunStatus.COMPLETED
    assert result.output == {"final": 2}


async def test_a_fan_of_children_that_continue_as_new_hands_the_parent_each_chains_output(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("looper")
    async def looper(ctx: durably.WorkflowContext, n: int) -> dict[str, int]:
        if n % 10 < 2:
            ctx.continue_as_new(n + 1)
        return {"final": n}

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> Any:
        return await ctx.all([ctx.child("looper", 10 * i, run_id=f"kid-{i}") for i in range(5)])

    async with engine:
        await engine.start("parent", run_id="p")
        result = await _finish(engine, "p")
    assert result.status is RunStatus.COMPLETED
    assert result.output == [{"final": 10 * i + 2} for i in range(5)]


async def test_cancelling_a_parent_mid_chain_cancels_the_live_link(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("looper")
    async def looper(ctx: durably.WorkflowContext, n: int) -> Any:
        if n < 1:
            ctx.continue_as_new(n + 1)
        return await ctx.wait_for_signal("never-sent")  # the second link waits forever

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> Any:
        return await ctx.child("looper", 0, run_id="kid")

    async with engine:
        await engine.start("parent", run_id="p")
        await _exists(engine, "kid~1")
        await engine.wait_for_run("kid~1", timeout=10)  # the second link is suspended
        await engine.cancel("p")
        parent_run = await _finish(engine, "p")
        link = await _finish(engine, "kid~1")
        first = await engine.get_run("kid")
    assert parent_run.status is RunStatus.CANCELLED
    assert link.status is RunStatus.CANCELLED
    assert first is not None and first.status is RunStatus.COMPLETED


async def test_a_parent_whose_childs_report_was_lost_follows_the_chain_on_reconcile(
    make_engine: EngineFactory,
) -> None:
    """The chain's last link ended but its report never reached the parent
    (a crash): the parent's next turn reconciles through the chain."""
    engine = make_engine(reconcile="200ms")  # the fallback wake of a waiting parent

    @engine.workflow("looper")
    async def looper(ctx: durably.WorkflowContext, n: int) -> dict[str, int]:
        if n < 2:
            ctx.continue_as_new(n + 1)
        return {"final": n}

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> Any:
        return await ctx.child("looper", 0, run_id="kid")

    store: Any = engine.store
    end_child_runs = store.end_child_runs

    async def lose_child_reports(batch: list[Any], now: int) -> Any:
        # Each child ends, but its report names a placeholder that does not
        # exist: the parent hears nothing and must find the outcome itself.
        astray = [
            dataclasses.replace(e, report=dataclasses.replace(e.report, seq=10_000)) for e in batch
        ]
        return await end_child_runs(astray, now)

    store.end_child_runs = lose_child_reports
    async with engine:
        await engine.start("parent", run_id="p")
        await _exists(engine, "kid~2")
        await _finish(engine, "kid~2")
        store.end_child_runs = end_child_runs
        result = await _finish(engine, "p")
    assert result.output == {"final": 2}


async def test_several_waiters_on_one_token_are_each_served_oldest_first(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("waiter")
    async def waiter(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("shared-token")

    async with engine:
        await engine.start("waiter", run_id="first")
        await engine.wait_for_run("first", timeout=10)  # suspended on the token
        await engine.start("waiter", run_id="second")
        await engine.wait_for_run("second", timeout=10)
        assert await engine.signal("shared-token", "one") == "first"
        assert await engine.signal("shared-token", "two") == "second"
        first = await _finish(engine, "first")
        second = await _finish(engine, "second")
        # With no waiter left, the next signal is buffered for a later wait.
        assert await engine.signal("shared-token", "three") is None
    assert (first.output, second.output) == ("one", "two")


async def test_an_execution_timeout_releases_the_runs_queue_slot(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="local://")
    engine.register_queue("single", concurrency=1, retry=0.05)
    hog_started = asyncio.Event()
    let_go = asyncio.Event()

    @engine.step("hog", queue="single")
    async def hog(data: Any) -> str:
        hog_started.set()
        await let_go.wait()  # a handler that ignores cancellation keeps running
        return "late"

    @engine.step("quick", queue="single")
    async def quick(data: Any) -> str:
        return "quick done"

    @engine.workflow("bounded", execution_timeout="300ms")
    async def bounded(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(hog)

    @engine.workflow("next")
    async def next_run(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(quick)

    async with engine:
        await engine.start("bounded", run_id="bounded")
        await asyncio.wait_for(hog_started.wait(), 10)
        await asyncio.sleep(0.4)  # past the deadline: the sweep times it out
        await engine.sweep_timeouts()
        timed_out = await _finish(engine, "bounded")
        await engine.start("next", run_id="next")
        try:
            after = await engine.wait_for_run("next", terminal=True, timeout=10)
        finally:
            let_go.set()
    assert timed_out.status is RunStatus.CANCELLED
    assert after.output == "quick done"


async def test_an_execution_timeout_reaches_the_running_handler(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="local://")
    hog_started = asyncio.Event()
    hog_cancelled = asyncio.Event()

    @engine.step("hog")
    async def hog(data: Any, log: durably.StepLogger) -> str:
        hog_started.set()
        await log.wait_cancelled()
        hog_cancelled.set()
        return "stopped"

    @engine.workflow("bounded", execution_timeout="300ms")
    async def bounded(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step(hog)

    async with engine:
        await engine.start("bounded", run_id="bounded")
        await asyncio.wait_for(hog_started.wait(), 10)
        await asyncio.sleep(0.4)
        await engine.sweep_timeouts()
        await _finish(engine, "bounded")
        await asyncio.wait_for(hog_cancelled.wait(), 10)


async def test_a_child_cancelled_while_its_turn_completes_is_reported_cancelled(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("kid")
    async def kid(ctx: durably.WorkflowContext) -> str:
        async def cancel_myself() -> str:
            await engine.cancel(ctx.run_id)  # lands while this turn is about to complete
            return "value"

        return str(await ctx.local_step("work", cancel_myself))

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> str:
        try:
            return "completed: " + str(await ctx.child("kid", run_id="kid"))
        except durably.ChildFailed as exc:
            return exc.status

    async with engine:
        await engine.start("parent", run_id="p")
        told = await _finish(engine, "p")
        kid_run = await engine.get_run("kid")
    assert kid_run is not None
    assert told.output == kid_run.status.value


async def test_a_cancel_landing_between_a_childs_report_and_its_settle_reaches_the_parent(
    make_engine: EngineFactory,
) -> None:
    """Another process cancels the child after the child's turn decided it
    completed and before that ending (with its report to the parent) is
    written: the parent must still see exactly what the child's record says."""
    engine = make_engine()
    canceller = make_engine()
    for each in (engine, canceller):

        @each.workflow("kid")
        async def kid(ctx: durably.WorkflowContext) -> str:
            return str(await ctx.local_step("work", lambda: "value"))

        @each.workflow("parent")
        async def parent(ctx: durably.WorkflowContext) -> str:
            try:
                return "completed: " + str(await ctx.child("kid", run_id="kid"))
            except durably.ChildFailed as exc:
                return exc.status

    store: Any = engine.store
    end_child_runs = store.end_child_runs
    cancelled_once = False

    async def cancel_then_end(batch: list[Any], now: int) -> Any:
        # The kid's own turn (it holds a lease) is about to write its ending.
        nonlocal cancelled_once
        if not cancelled_once and any(e.run_id == "kid" and e.owner for e in batch):
            cancelled_once = True
            await canceller.cancel("kid")
        return await end_child_runs(batch, now)

    store.end_child_runs = cancel_then_end
    await canceller.open()
    async with engine:
        await engine.start("parent", run_id="p")
        told = await _finish(engine, "p")
        kid_run = await engine.get_run("kid")
    assert cancelled_once
    assert kid_run is not None
    expected = "cancelled" if kid_run.status is RunStatus.CANCELLED else "completed: value"
    assert told.output == expected


async def test_a_parent_hears_exactly_the_final_outcome_of_each_child_cancelled_as_it_ends(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    count = 60

    @engine.workflow("kid")
    async def kid(ctx: durably.WorkflowContext, n: int) -> int:
        return int(await ctx.local_step("work", lambda: n))

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> list[str]:
        settled = await ctx.all_settled(
            [ctx.child("kid", i, run_id=f"kid-{i}") for i in range(count)]
        )
        return ["completed" if item.ok else getattr(item.error, "status", "?") for item in settled]

    async with engine:
        await engine.start("parent", run_id="p")
        # Cancel every child while the children are completing.
        for i in range(count):
            with contextlib.suppress(durably.RunNotFound):
                await engine.cancel(f"kid-{i}")
            await asyncio.sleep(0)
        result = await _finish(engine, "p", timeout=60)
        kids = [await engine.get_run(f"kid-{i}") for i in range(count)]
    assert result.status is RunStatus.COMPLETED
    told = result.output
    actual = [run.status.value if run is not None else "missing" for run in kids]
    mismatches = [(i, t, a) for i, (t, a) in enumerate(zip(told, actual, strict=True)) if t != a]
    assert not mismatches, f"parent told != child's own status: {mismatches[:10]}"


async def test_a_run_of_a_workflow_this_engine_lacks_waits_for_one_that_has_it(
    make_engine: EngineFactory,
) -> None:
    """A rolling deploy: the old release must not fail the new release's runs."""
    old = make_engine()
    new = make_engine()

    @old.workflow("kept")
    async def kept_old(ctx: durably.WorkflowContext) -> str:
        return "old"

    @new.workflow("kept", version="2")
    async def kept_new(ctx: durably.WorkflowContext) -> str:
        return "kept v2"

    @new.workflow("added")
    async def added(ctx: durably.WorkflowContext) -> str:
        return "added"

    async with old:
        producer_side = make_engine(consumers="never")
        producer_side.register("kept", kept_new, version="2")
        producer_side.register("added", added)
        await producer_side.start("added", run_id="added-run")
        await producer_side.start("kept", run_id="kept-run")
        for _ in range(5):
            await old.tick()
            await old.join()
        for run_id in ("added-run", "kept-run"):
            run = await old.get_run(run_id)
            assert run is not None and run.status not in durably.model.TERMINAL_STATUSES, run
        async with new:
            assert (await _finish(new, "added-run")).output == "added"
            assert (await _finish(new, "kept-run")).output == "kept v2"


_PRODUCER_SCRIPT = """
import asyncio, sys
import durably

engine = durably.Engine(sys.argv[1])

@engine.workflow("job")
async def job(ctx, _input=None):
    return "done"

asyncio.run(engine.start("job", run_id="job-1"))
"""


async def test_a_producer_that_never_runs_a_worker_does_not_hold_its_runs(
    make_engine: EngineFactory, store_url: str
) -> None:
    """A script imports the app's engine, calls start (no ``async with``) and exits."""
    if store_url.startswith("memory"):
        pytest.skip("a memory store does not outlive the producer process")
    worker = make_engine()

    @worker.workflow("job")
    async def job(ctx: durably.WorkflowContext, _input: Any = None) -> str:
        return "done"

    async with worker:
        producer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _PRODUCER_SCRIPT, store_url
        )
        assert await producer.wait() == 0
        # Well within the 30 s default lease the producer would have taken.
        result = await worker.wait_for_run("job-1", terminal=True, timeout=10)
        run = await worker.get_run("job-1")
    assert result.output == "done"
    assert run is not None and run.recovery_attempts == 0


async def test_an_engine_that_forgot_async_with_warns_once_that_its_runs_wait(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    forgetful = make_engine()
    producer = make_engine(drive=False)
    for each in (forgetful, producer):

        @each.workflow("job")
        async def job(ctx: durably.WorkflowContext) -> str:
            return "done"

    with caplog.at_level("WARNING", logger="durably"):
        await producer.start("job", run_id="quiet")
        await forgetful.start("job", run_id="a")
        await forgetful.start("job", run_id="b")
    warnings = [r.getMessage() for r in caplog.records if "no worker loop" in r.getMessage()]
    assert len(warnings) == 1 and "async with engine" in warnings[0] and "run a " in warnings[0]
    async with forgetful:
        for run_id in ("quiet", "a", "b"):
            assert (await _finish(forgetful, run_id)).output == "done"


def test_an_engine_used_from_a_second_event_loop_says_why_it_fails(postgres_url: str) -> None:
    engine = durably.Engine(postgres_url, consumers="never")

    @engine.workflow("job")
    async def job(ctx: durably.WorkflowContext) -> str:
        return "done"

    asyncio.run(engine.start("job", run_id="first"))
    with pytest.raises(durably.DurablyError, match="event loop"):
        asyncio.run(engine.start("job", run_id="second"))


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_an_embedded_store_engine_refuses_a_second_event_loop_the_same_way(
    kind: str, tmp_path: Any
) -> None:
    url = "memory://" if kind == "memory" else f"sqlite:///{tmp_path / 'loops.db'}"
    engine = durably.Engine(url, consumers="never")

    @engine.workflow("job")
    async def job(ctx: durably.WorkflowContext) -> str:
        return "done"

    asyncio.run(engine.start("job", run_id="first"))
    with pytest.raises(durably.WrongEventLoop, match="event loop"):
        asyncio.run(engine.start("job", run_id="second"))
