"""durably.Client: runs started, steered and read by workflow name, with no
registrations, never executed by the client — on memory, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import Any

import pytest

import durably
from durably.testing import eventually

from .conftest import EngineFactory


@dataclasses.dataclass
class Order:
    id: str
    total: int


def client_for(store_url: str, engine: durably.Engine, **options: Any) -> durably.Client:
    # A memory store lives in one object: share the engine's, as a file would be.
    store: Any = engine.store if store_url == "memory://" else store_url
    return durably.Client(store, **options)


async def test_a_client_starts_by_name_and_an_engine_executes_it(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()

    @worker.workflow("checkout")
    async def checkout(ctx: durably.WorkflowContext, order: dict[str, Any]) -> str:
        return await ctx.local_step("charge", lambda: f"charged {order['total']}")

    client = client_for(store_url, worker)
    async with worker:
        handle = await client.start("checkout", {"id": "o1", "total": 12}, run_id="checkout:o1")
        assert handle.run_id == "checkout:o1"
        assert await handle.result(timeout=30) == "charged 12"
        assert await handle.status() is durably.RunStatus.COMPLETED
        run = await client.get_run("checkout:o1")
        history = await client.history("checkout:o1")
        page = await client.list_runs(workflow="checkout")
    await client.close()
    assert run is not None and run.recovery_attempts == 0
    assert [c.name for c in history] == ["charge"]
    assert [r.run_id for r in page.runs] == ["checkout:o1"]


async def test_a_client_never_executes_nor_leases_what_it_starts(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()

    @worker.workflow("job")
    async def job(ctx: durably.WorkflowContext) -> str:
        return "done"

    client = client_for(store_url, worker)
    handle = await client.start("job", run_id="j")
    # Nothing here executes: the run waits, unleased and unpinned, for an engine.
    for _ in range(3):
        await asyncio.sleep(0.05)
        run = await client.get_run("j")
        assert run is not None and run.status is durably.RunStatus.PENDING
        assert run.locked_by is None and run.workflow_version == ""
    assert handle.run.status is durably.RunStatus.PENDING
    async with worker:
        assert await handle.result(timeout=30) == "done"
    await client.close()
    run = await worker.get_run("j")
    assert run is not None and run.recovery_attempts == 0 and run.workflow_version == "1"


async def test_an_unversioned_run_is_pinned_by_the_first_engine_that_executes_it(
    make_engine: EngineFactory, store_url: str
) -> None:
    v3 = make_engine()

    @v3.workflow("evolving", version="3")
    async def body_v3(ctx: durably.WorkflowContext) -> str:
        await ctx.wait_for_signal("go:pinned")
        return "v3"

    client = client_for(store_url, v3)
    handle = await client.start("evolving", run_id="pinned")
    async with v3:
        assert (await handle.wait(timeout=30)).status is durably.RunStatus.SUSPENDED
    assert (await handle.get()).workflow_version == "3"

    # The next release registers version 4 as the default: the pinned run
    # still replays version 3's body, and a new unversioned run takes 4.
    v4 = make_engine()

    @v4.workflow("evolving", version="3")
    async def again_v3(ctx: durably.WorkflowContext) -> str:
        await ctx.wait_for_signal("go:pinned")
        return "v3"

    @v4.workflow("evolving", version="4")
    async def body_v4(ctx: durably.WorkflowContext) -> str:
        return "v4"

    async with v4:
        fresh = await client.start("evolving", run_id="fresh")
        assert await client.signal("go:pinned") == "pinned"
        assert await handle.result(timeout=30) == "v3"
        assert await fresh.result(timeout=30) == "v4"
        explicit = await client.start("evolving", run_id="explicit", version="3")
        await client.signal("go:pinned")
        assert await explicit.result(timeout=30) == "v3"
    await client.close()
    assert (await handle.get()).workflow_version == "3"
    assert (await fresh.get()).workflow_version == "4"


async def test_a_pinned_run_is_not_taken_by_an_engine_without_its_version(
    make_engine: EngineFactory, store_url: str
) -> None:
    only_v2 = make_engine()

    @only_v2.workflow("wf", version="2")
    async def wf(ctx: durably.WorkflowContext) -> str:
        return "v2"

    client = client_for(store_url, only_v2)
    handle = await client.start("wf", run_id="wants-v1", version="1")
    async with only_v2:
        other = await client.start("wf", run_id="any")
        assert await other.result(timeout=30) == "v2"
        run = await handle.get()
    await client.close()
    assert run.status is durably.RunStatus.PENDING and run.workflow_version == "1"


async def test_an_unknown_name_creates_the_run_another_process_may_serve(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()

    @worker.workflow("known")
    async def known(ctx: durably.WorkflowContext) -> str:
        return "ok"

    client = client_for(store_url, worker)
    async with worker:
        handle = await client.start("served-elsewhere", {"x": 1}, run_id="elsewhere")
        assert await (await client.start("known")).result(timeout=30) == "ok"
        run = await handle.get()
    await client.close()
    assert run.status is durably.RunStatus.PENDING and run.input == {"x": 1}


async def test_schemas_validate_before_anything_is_created(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()
    client = client_for(store_url, worker, schemas={"checkout": Order})
    with pytest.raises(durably.SchemaValidationError, match="checkout"):
        await client.start("checkout", {"id": "o1"}, run_id="bad")
    ok = await client.start("checkout", Order("o2", 5), run_id="good")
    unknown = await client.start("refund", {"anything": True}, run_id="loose")
    assert ok.run.input == {"id": "o2", "total": 5}
    assert unknown.run.workflow == "refund"
    assert await client.get_run("bad") is None

    strict = client_for(store_url, worker, schemas={"checkout": Order}, strict=True)
    with pytest.raises(durably.WorkflowNotRegistered, match="refund"):
        await strict.start("refund", {"anything": True}, run_id="strict-refund")
    assert await strict.get_run("strict-refund") is None
    assert (await strict.start("checkout", {"id": "o3", "total": 1})).run.input["id"] == "o3"
    with pytest.raises(ValueError, match="schemas"):
        durably.Client("memory://", strict=True)
    await strict.close()
    await client.close()


async def test_bad_input_from_a_client_is_refused_with_a_clear_error(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()
    client = client_for(store_url, worker)
    with pytest.raises(durably.SchemaValidationError, match="JSON"):
        await client.start("wf", {"when": object()})
    with pytest.raises(ValueError, match="workflow"):
        await client.start("", 1)
    with pytest.raises(ValueError, match="version"):
        await client.start("wf", 1, version="")
    with pytest.raises(durably.errors.UnstorableValue):
        await client.start("wf\x00", 1)
    with pytest.raises(ValueError, match="run_id"):
        await client.start("wf", 1, run_id="")
    assert (await client.list_runs()).runs == []
    await client.close()


async def test_handle_result_raises_typed_errors_for_runs_that_did_not_complete(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()

    @worker.workflow("fails")
    async def fails(ctx: durably.WorkflowContext) -> None:
        raise durably.FatalError("card declined", code="declined")

    @worker.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_signal("never")

    client = client_for(store_url, worker)
    async with worker:
        failing = await client.start("fails", run_id="f")
        with pytest.raises(durably.RunFailed) as failed:
            await failing.result(timeout=30)
        waiting = await client.start("waits", run_id="w")
        await waiting.wait(timeout=30)
        with pytest.raises(TimeoutError):
            await waiting.result(timeout=0.05)
        assert await waiting.cancel() is durably.RunStatus.SUSPENDED
        with pytest.raises(durably.RunCancelled) as cancelled:
            await waiting.result(timeout=30)
    await client.close()
    assert failed.value.run_id == "f" and failed.value.status == "failed"
    assert failed.value.code == "declined" and failed.value.error["message"] == "card declined"
    assert cancelled.value.run_id == "w"


async def test_a_cancel_from_a_client_stops_the_turn_running_in_an_engine(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()
    steps = 0

    @worker.workflow("busy")
    async def busy(ctx: durably.WorkflowContext) -> None:
        nonlocal steps
        for i in range(10_000):
            await ctx.local_step(f"s{i}", asyncio.sleep, 0.01)
            steps += 1

    client = client_for(store_url, worker)
    async with worker:
        handle = await client.start("busy", run_id="busy")
        await eventually(lambda: steps >= 3, what="the run is executing")
        assert await client.cancel("busy") is durably.RunStatus.RUNNING
        with pytest.raises(durably.RunCancelled):
            await handle.result(timeout=30)
        stopped_at = steps
        # Stopped for good: a few more rounds of the engine take no more steps.
        for _ in range(5):
            await asyncio.sleep(0.05)
    await client.close()
    assert steps <= stopped_at + 1


async def test_signals_events_and_retries_from_a_client(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()
    attempts: dict[str, int] = {}

    @worker.workflow("inbox")
    async def inbox(ctx: durably.WorkflowContext, n: int) -> Any:
        got = await ctx.wait_for_signal(f"feed:{ctx.run_id}")
        event = await ctx.wait_for_event("shipped", match={"n": n})
        return [got, event]

    @worker.workflow("flaky")
    async def flaky(ctx: durably.WorkflowContext, n: int) -> int:
        def once() -> int:
            attempts[ctx.run_id] = attempts.get(ctx.run_id, 0) + 1
            if n < 0 and attempts[ctx.run_id] == 1:
                raise durably.FatalError("not yet")
            return abs(n)

        return await ctx.local_step("once", once)

    client = client_for(store_url, worker)
    async with worker:
        handle = await client.signal_with_start(
            "inbox", 7, run_id="in-7", token="feed:in-7", payload={"hello": 1}
        )
        await handle.wait(timeout=30)
        # Received now, or buffered for the wait the run has not registered yet:
        # either way one publish reaches it (publishing again until "received"
        # would buffer extra copies once a buffered one was taken).
        await client.publish_event("shipped", {"n": 7})
        assert await handle.result(timeout=30) == [{"hello": 1}, {"n": 7}]

        broken = await client.start("flaky", -4, run_id="flaky", tags=["t"])
        with pytest.raises(durably.RunFailed):
            await broken.result(timeout=30)
        await client.retry("flaky")
        assert await broken.result(timeout=30) == 4
        fixed = await client.retry_with_input("flaky", 9)
        assert fixed.run_id.startswith("flaky~retry~") and fixed.run.tags == ["t"]
        assert await fixed.result(timeout=30) == 9
        assert (await client.get_handle("flaky")).run.status is durably.RunStatus.COMPLETED
    await client.close()
    with pytest.raises(durably.RunNotFound):
        await client.get_handle("nope")


async def test_engine_start_takes_the_decorated_function(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("double", version="2")
    async def double(ctx: durably.WorkflowContext, n: int) -> int:
        return 2 * n

    async def stray(ctx: durably.WorkflowContext) -> int:
        return 0

    async with engine:
        handle = await engine.start(double, 21)
        assert handle.run.workflow == "double" and handle.run.workflow_version == "2"
        assert await handle.result(timeout=30) == 42
        with pytest.raises(durably.WorkflowNotRegistered, match=r"stray.*@engine\.workflow"):
            await engine.start(stray)
        with pytest.raises(ValueError, match="version '1'"):
            await engine.start(double, 1, version="1")
        with pytest.raises(TypeError, match="workflow name"):
            await engine.start(42)  # type: ignore[call-overload]
        again = await engine.get_handle(handle.run_id)
        assert await again.result() == 42 and again.run.status is durably.RunStatus.COMPLETED
        with pytest.raises(durably.RunNotFound):
            await engine.get_handle("missing")


_CLIENT_SCRIPT = """
import asyncio, sys
import durably

async def main():
    async with durably.Client(sys.argv[1]) as client:
        await client.start("job", run_id="from-script")

asyncio.run(main())
"""


async def test_a_script_using_a_client_leaves_its_run_to_the_workers(
    make_engine: EngineFactory, store_url: str
) -> None:
    if store_url.startswith("memory"):
        pytest.skip("a memory store does not outlive the script")
    worker = make_engine()

    @worker.workflow("job")
    async def job(ctx: durably.WorkflowContext) -> str:
        return "done"

    async with worker:
        script = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CLIENT_SCRIPT, store_url
        )
        assert await script.wait() == 0
        result = await worker.wait_for_run("from-script", terminal=True, timeout=30)
        run = await worker.get_run("from-script")
    assert result.output == "done"
    assert run is not None and run.recovery_attempts == 0


@pytest.mark.parametrize("transport", ["local://", "db://"])
async def test_a_start_from_a_client_wakes_the_executing_engine(
    make_engine: EngineFactory, store_url: str, transport: str
) -> None:
    """No poll helps: the worker's would come an hour later. The start reaches
    it through the run queue (``db://``) or the store's notices (PostgreSQL)."""
    if store_url == "memory://":
        pytest.skip("a memory store has no second process to wake")
    if store_url.startswith("sqlite") and transport == "local://":
        pytest.skip("SQLite has no cross-process channel: a local:// start is polled for")
    worker = make_engine(transport=transport, poll_interval=3600)

    @worker.workflow("job")
    async def job(ctx: durably.WorkflowContext, n: int) -> int:
        return n + 1

    client = durably.Client(store_url, transport=transport)
    async with worker:
        await asyncio.sleep(0.2)  # the worker's first tick is behind it
        handles = [await client.start("job", i, run_id=f"wake-{i}") for i in range(5)]
        assert [await h.result(timeout=30) for h in handles] == [1, 2, 3, 4, 5]
    await client.close()


async def test_a_delayed_start_from_a_client_is_woken_by_the_timer_and_pinned(
    make_engine: EngineFactory, store_url: str
) -> None:
    from durably.testing import VirtualClock

    clock = VirtualClock()
    worker = make_engine(clock=clock)

    @worker.workflow("later", version="5")
    async def later(ctx: durably.WorkflowContext) -> str:
        return "woke"

    client = client_for(store_url, worker, clock=clock)
    handle = await client.start("later", run_id="later", start_at="1h")
    assert handle.run.status is durably.RunStatus.SUSPENDED
    await worker.open()
    assert await worker.resume_due_timers() == 0
    clock.advance("1h")
    assert await worker.resume_due_timers() == 1
    assert await handle.result(timeout=30) == "woke"
    assert (await handle.get()).workflow_version == "5"
    await client.close()


async def test_a_run_cancelled_before_any_engine_took_it_never_executes(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()
    executed = 0

    @worker.workflow("job")
    async def job(ctx: durably.WorkflowContext) -> str:
        nonlocal executed
        executed += 1
        return "done"

    client = client_for(store_url, worker)
    handle = await client.start("job", run_id="never")
    assert await handle.cancel() is durably.RunStatus.PENDING
    async with worker:
        with pytest.raises(durably.RunCancelled):
            await handle.result(timeout=30)
        after = await client.start("job", run_id="after")
        assert await after.result(timeout=30) == "done"
    await client.close()
    assert executed == 1  # only "after": the worker's passes never took "never"
    assert (await worker.get_run("never")).workflow_version == ""  # type: ignore[union-attr]


async def test_result_follows_a_run_that_continued_as_new_to_its_last_link(
    make_engine: EngineFactory, store_url: str
) -> None:
    worker = make_engine()

    @worker.workflow("count")
    async def count(ctx: durably.WorkflowContext, n: int) -> int:
        if n < 3:
            ctx.continue_as_new(n + 1)
        return n * 10

    @worker.workflow("look-alike")
    async def look_alike(ctx: durably.WorkflowContext) -> dict[str, str]:
        return {"continued_as": "look-alike~1"}  # not a continuation: it names no link

    client = client_for(store_url, worker)
    async with worker:
        assert await (await client.start("count", 0, run_id="c")).result(timeout=30) == 30
        assert await (await worker.start(count, 2, run_id="d")).result(timeout=30) == 30
        mimic = await client.start("look-alike", run_id="mimic")
        assert await mimic.result(timeout=30) == {"continued_as": "look-alike~1"}
    await client.close()


async def test_a_run_started_by_name_and_version_still_gets_its_execution_timeout(
    make_engine: EngineFactory, store_url: str
) -> None:
    # The client knows no registrations, so it cannot set the deadline at start:
    # the first turn of the engine that knows the workflow must, or the run
    # could wait on its signal forever.
    worker = make_engine()

    @worker.workflow("approval", version="3", execution_timeout="1s")
    async def approval(ctx: durably.WorkflowContext) -> Any:
        return await ctx.wait_for_signal("never")

    client = client_for(store_url, worker)
    handle = await client.start("approval", run_id="approval:1", version="3")
    assert handle.run.deadline_at is None
    async with worker:
        with pytest.raises((durably.RunFailed, durably.RunCancelled)):
            await handle.result(timeout=30)
        run = await client.get_run("approval:1")
    await client.close()
    assert run is not None and run.deadline_at is not None
    assert run.error is not None and run.error.get("code") == "execution_timeout"


async def test_a_start_heard_while_a_pending_poll_is_in_flight_is_not_lost(
    make_engine: EngineFactory, store_url: str
) -> None:
    """A "new run" notice arriving while the pending-run poll it would ask for
    is already running (past its read) was merged into that poll and dropped:
    the run waited for the next regular poll (an hour here). The second start
    lands right after the first poll's read, before that poll returns."""
    if not store_url.startswith("postgresql"):
        pytest.skip("needs the store's cross-process notices (PostgreSQL)")
    worker = make_engine(poll_interval=3600)

    @worker.workflow("job")
    async def job(ctx: durably.WorkflowContext, n: int) -> int:
        return n + 1

    client = durably.Client(store_url)
    store = worker.store
    list_pending = store.list_pending
    armed = [False]

    async def read_then_start(*args: Any, **kwargs: Any) -> list[str]:
        ids = await list_pending(*args, **kwargs)
        if armed[0]:
            armed[0] = False
            await client.start("job", 2, run_id="late-2")
            await asyncio.sleep(0.3)  # its notice arrives while this poll is in flight
        return ids

    store.list_pending = read_then_start  # type: ignore[method-assign]
    async with worker:
        await asyncio.sleep(0.2)  # the worker's first tick is behind it
        armed[0] = True
        first = await client.start("job", 1, run_id="late-1")
        assert await first.result(timeout=30) == 2
        result = await client.wait_for_run("late-2", terminal=True, timeout=30)
        assert result.output == 3
    await client.close()
