"""Rolling deploys (issue 12.1): a run is only taken by an engine that can execute it.

Two releases drive one store: the old one lacks a workflow, or a version, that
the new one has. Every way a run reaches an engine (the pending poll, orphan
recovery, a due timer, a wake sent from the old release) must leave such a run
untouched by the old release (never failed, its recoveries uncounted) until an
engine that registers it takes it; one that nobody takes for a lease is shown
``blocked`` with the reason. They run on every store, PostgreSQL included.
"""

from __future__ import annotations

from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.testing import VirtualClock

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(120)


async def _finish(engine: durably.Engine, run_id: str) -> durably.RunResult:
    return await engine.wait_for_run(run_id, terminal=True, timeout=30)


async def _ticks(engine: durably.Engine, count: int = 3) -> None:
    for _ in range(count):
        await engine.tick()
        await engine.join()


async def _run(engine: durably.Engine, run_id: str) -> durably.Run:
    run = await engine.get_run(run_id)
    assert run is not None
    return run


async def added(ctx: durably.WorkflowContext) -> str:
    return "added"


async def test_a_run_of_a_version_this_engine_lacks_waits_for_one_that_has_it(
    make_engine: EngineFactory,
) -> None:
    old = make_engine()
    new = make_engine()
    producer = make_engine(consumers="never")

    async def kept_v1_old(ctx: durably.WorkflowContext) -> str:
        return "v1 on old"

    async def kept_v1_new(ctx: durably.WorkflowContext) -> str:
        return "v1 on new"

    async def kept_v2(ctx: durably.WorkflowContext) -> str:
        return "v2"

    old.register("kept", kept_v1_old, version="1")
    new.register("kept", kept_v1_new, version="1")
    new.register("kept", kept_v2, version="2")
    producer.register("kept", kept_v1_new, version="1")
    producer.register("kept", kept_v2, version="2")

    async with old:
        await producer.start("kept", run_id="v2-run", version="2")
        await producer.start("kept", run_id="v1-run", version="1")
        assert (await _finish(old, "v1-run")).output == "v1 on old"
        await _ticks(old, 5)
        waiting = await _run(old, "v2-run")
        assert waiting.status is RunStatus.PENDING, waiting
        assert waiting.error is None and waiting.recovery_attempts == 0
    # A run pinned to version 1 runs on an engine that registers 1 and 2.
    await producer.start("kept", run_id="pinned", version="1")
    async with new:
        assert (await _finish(new, "v2-run")).output == "v2"
        assert (await _finish(new, "pinned")).output == "v1 on new"


async def test_an_orphan_of_a_workflow_this_engine_lacks_waits_instead_of_dying(
    make_engine: EngineFactory,
) -> None:
    clock = VirtualClock()
    # Were it to recover the orphan, this engine would make it dead at once.
    old = make_engine(clock=clock, max_recovery_attempts=0)
    new = make_engine(clock=clock)
    producer = make_engine(clock=clock, consumers="never")
    old.register("kept", added)
    new.register("added", added)
    producer.register("added", added)

    async with old:
        await producer.start("added", run_id="orphan")
        # An instance of the new release leased it, then died.
        store = producer.store
        now = clock.now_ms()
        assert await store.start_turns(
            ["orphan"], "died", now, now + 1000, frozenset({RunStatus.PENDING})
        )
        clock.advance("2s")
        await _ticks(old)
        orphan = await _run(old, "orphan")
        assert orphan.status is RunStatus.RUNNING and orphan.locked_by == "died", orphan
        assert orphan.recovery_attempts == 0
    async with new:
        assert (await _finish(new, "orphan")).output == "added"
        assert (await _run(new, "orphan")).recovery_attempts == 1


async def test_a_due_timer_of_a_workflow_this_engine_lacks_waits_then_shows_blocked(
    make_engine: EngineFactory,
) -> None:
    clock = VirtualClock()
    old = make_engine(clock=clock)
    new = make_engine(clock=clock)
    producer = make_engine(clock=clock, consumers="never")
    old.register("kept", added)
    new.register("added", added)
    producer.register("added", added)

    async with old:
        await producer.start("added", run_id="timer", start_at="1h")
        wake_at = (await _run(old, "timer")).wake_at
        clock.advance("1h")  # due now
        await _ticks(old)
        due = await _run(old, "timer")
        # Not claimed: a claim would have moved its wake time a lease ahead.
        assert due.status is RunStatus.SUSPENDED and due.wake_at == wake_at, due
        clock.advance("31s")  # due for longer than a lease, and nobody took it
        await _ticks(old, 1)
        blocked = await _run(old, "timer")
        assert blocked.status is RunStatus.BLOCKED, blocked
        assert blocked.error is not None and blocked.error["code"] == "workflow_not_registered"
    async with new:
        assert (await _finish(new, "timer")).output == "added"
        done = await _run(new, "timer")
        assert done.error is None and done.recovery_attempts == 0


async def test_a_run_nobody_can_execute_is_shown_blocked_with_the_reason(
    make_engine: EngineFactory,
) -> None:
    clock = VirtualClock()
    old = make_engine(clock=clock)
    new = make_engine(clock=clock)
    producer = make_engine(clock=clock, consumers="never")
    old.register("kept", added)
    new.register("added", added)
    producer.register("added", added)

    async with old:
        await producer.start("added", run_id="new-run")
        await _ticks(old)
        assert (await _run(old, "new-run")).status is RunStatus.PENDING
        clock.advance("31s")
        await _ticks(old, 1)
        blocked = await _run(old, "new-run")
        assert blocked.status is RunStatus.BLOCKED, blocked
        assert blocked.error is not None
        assert blocked.error["code"] == "workflow_not_registered"
        assert blocked.error["details"] == {"workflow": "added", "version": "1"}
        assert "'added'" in blocked.error["message"]
        page = await old.list_runs(status="blocked")
        assert [run.run_id for run in page.runs] == ["new-run"]
        await _ticks(old, 3)  # blocked, and still never failed
        assert (await _run(old, "new-run")).status is RunStatus.BLOCKED
    async with new:
        assert (await _finish(new, "new-run")).output == "added"
        done = await _run(new, "new-run")
        assert done.error is None and done.recovery_attempts == 0


async def test_a_wake_sent_from_an_engine_that_lacks_the_workflow_is_handed_on(
    make_engine: EngineFactory,
) -> None:
    old = make_engine()
    new = make_engine()

    async def waiter(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("go")

    old.register("kept", added)
    new.register("waiter", waiter)

    async with new:
        await new.start("waiter", run_id="waiting")
        assert (await new.wait_for_run("waiting", timeout=30)).status is RunStatus.SUSPENDED
    async with old:
        assert await old.signal("go", "payload") == "waiting"
        await _ticks(old)
        run = await _run(old, "waiting")
        assert run.status is RunStatus.SUSPENDED and run.error is None, run
    async with new:
        assert (await _finish(new, "waiting")).output == "payload"


async def test_two_releases_on_one_store_each_execute_only_their_runs(
    make_engine: EngineFactory,
) -> None:
    first = make_engine()
    second = make_engine()
    producer = make_engine(consumers="never")

    def body(release: str) -> Any:
        async def workflow(ctx: durably.WorkflowContext, n: int) -> str:
            await ctx.sleep("5ms")
            return release

        return workflow

    first.register("only-first", body("first"))
    first.register("shared", body("first"), version="1")
    second.register("only-second", body("second"))
    second.register("shared", body("second"), version="2")
    for name, version in (("only-first", "1"), ("only-second", "1")):
        producer.register(name, body("producer"), version=version)
    producer.register("shared", body("producer"), version="1")
    producer.register("shared", body("producer"), version="2")
    expected: dict[str, str] = {}
    async with first, second:
        for i in range(10):
            for name, version, release in (
                ("only-first", "1", "first"),
                ("only-second", "1", "second"),
                ("shared", "1", "first"),
                ("shared", "2", "second"),
            ):
                run_id = f"{name}-{version}-{i}"
                await producer.start(name, i, run_id=run_id, version=version)
                expected[run_id] = release
        for run_id, release in expected.items():
            result = await _finish(first, run_id)
            assert (result.status, result.output) == (RunStatus.COMPLETED, release), run_id
            assert (await _run(first, run_id)).recovery_attempts == 0


async def test_an_instance_without_workflows_marks_nothing_blocked(
    make_engine: EngineFactory,
) -> None:
    """A steps-only worker is no release of the app: it has no say in who can run what."""
    clock = VirtualClock()
    steps_only = make_engine(clock=clock)
    producer = make_engine(clock=clock, consumers="never")
    producer.register("added", added)

    async with steps_only:
        await producer.start("added", run_id="new-run")
        await _ticks(steps_only, 1)
        clock.advance("31s")
        await _ticks(steps_only)
        run = await _run(steps_only, "new-run")
    assert run.status is RunStatus.PENDING and run.error is None, run
