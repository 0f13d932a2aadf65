"""Children, fan-out, sagas, cancellation cascades, retry and patching."""

from __future__ import annotations

from collections import Counter

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably.testing import VirtualClock, eventually

from .conftest import EngineFactory


async def _status(engine: durably.Engine, run_id: str) -> RunStatus | None:
    run = await engine.get_run(run_id)
    return None if run is None else run.status


def _register_children(engine: durably.Engine, log: Counter[str] | None = None) -> None:
    @engine.workflow("square")
    async def square(ctx: durably.WorkflowContext, n: int) -> int:
        if log is not None:
            log[f"square:{n}"] += 1
        if n < 0:
            raise durably.FatalError(f"negative: {n}", code="negative")
        return await ctx.local_step("mul", lambda: n * n)

    @engine.workflow("gated")
    async def gated(ctx: durably.WorkflowContext, token: str) -> str:
        return str(await ctx.wait_for_signal(token))


async def test_child_result_reaches_the_parent(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext, n: int) -> int:
        return await ctx.child("square", n) + 1

    async with engine:
        await engine.start("parent", 7, run_id="p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
        child = await engine.get_run("p.child.0")
    assert result.output == 50
    assert child is not None and child.parent_id == "p" and child.namespace == "default"


async def test_a_failed_child_raises_child_failed(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> dict[str, str]:
        try:
            await ctx.child("square", -1, run_id="kid")
        except durably.ChildFailed as exc:
            return {"run": exc.run_id, "status": exc.status, "code": exc.code}
        return {}

    async with engine:
        await engine.start("parent", run_id="p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
    assert result.output == {"run": "kid", "status": "failed", "code": "negative"}


async def test_a_child_that_cannot_start_fails_its_parent_cleanly(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> str:
        try:
            await ctx.child("not-registered", {})
        except durably.ChildFailed as exc:
            return exc.code
        return "?"

    async with engine:
        await engine.start("parent", run_id="p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
    assert result.output == "workflow_not_registered"


@pytest.mark.parametrize("ending", ["cancelled", "dead", "timed_out"])
async def test_every_way_a_child_ends_reaches_the_parent(
    make_engine: EngineFactory, clock: VirtualClock, ending: str
) -> None:
    engine = make_engine(clock=clock, max_recovery_attempts=0)
    _register_children(engine)

    @engine.workflow("slow-child", execution_timeout="1h")
    async def slow_child(ctx: durably.WorkflowContext) -> None:
        await ctx.sleep("1d")

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> str:
        try:
            await ctx.child("slow-child", run_id="kid")
        except durably.ChildFailed as exc:
            return f"{exc.status}/{exc.code}"
        return "completed"

    await engine.open()
    await engine.start("parent", run_id="p")

    async def both_suspended() -> bool:
        await engine.join()
        kid, parent = await _status(engine, "kid"), await _status(engine, "p")
        return kid is RunStatus.SUSPENDED and parent is RunStatus.SUSPENDED

    await eventually(both_suspended, what="the parent and its child to suspend")
    if ending == "cancelled":
        await engine.cancel("kid")
        expected = "cancelled/cancelled"
    elif ending == "timed_out":
        clock.advance("1h")
        assert await engine.sweep_timeouts() == 1
        expected = "cancelled/execution_timeout"
    else:
        now = clock.now_ms()
        await engine.store.update_run_if(
            "kid",
            frozenset({RunStatus.SUSPENDED}),
            {"status": "running", "locked_by": "crashed", "locked_until": now},
            now,
        )
        clock.advance("1s")
        assert await engine.recover_incomplete() == 1
        expected = "dead/max_recovery_attempts"
    result = await engine.wait_for_run("p", terminal=True, timeout=10)
    assert result.output == expected


async def test_fan_out_returns_results_in_input_order(make_engine: EngineFactory) -> None:
    engine = make_engine()
    log: Counter[str] = Counter()
    _register_children(engine, log)

    @engine.workflow("fan")
    async def fan(ctx: durably.WorkflowContext, n: int) -> list[int]:
        return await ctx.all([ctx.child("square", i) for i in range(n)])

    async with engine:
        await engine.start("fan", 40, run_id="f")
        result = await engine.wait_for_run("f", terminal=True, timeout=30)
    assert result.output == [i * i for i in range(40)]
    assert all(log[f"square:{i}"] >= 1 for i in range(40))


async def test_fan_out_mixes_children_and_steps(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("mixed")
    async def mixed(ctx: durably.WorkflowContext) -> list[object]:
        return await ctx.all(
            [ctx.child("square", 3), ctx.local_step("step", lambda: "s"), ctx.child("square", 4)]
        )

    async with engine:
        await engine.start("mixed", run_id="m")
        assert (await engine.wait_for_run("m", terminal=True, timeout=10)).output == [9, "s", 16]


async def test_gather_failed_carries_every_failure(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("fan")
    async def fan(ctx: durably.WorkflowContext) -> list[object]:
        try:
            await ctx.all([ctx.child("square", n) for n in (1, -2, 3, -4)])
        except durably.GatherFailed as exc:
            return [[i, type(e).__name__] for i, e in exc.failures]
        return []

    async with engine:
        await engine.start("fan", run_id="f")
        result = await engine.wait_for_run("f", terminal=True, timeout=10)
    assert result.output == [[1, "ChildFailed"], [3, "ChildFailed"]]


async def test_all_settled_reports_each_outcome(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("settled")
    async def settled(ctx: durably.WorkflowContext) -> list[object]:
        outcomes = await ctx.all_settled([ctx.child("square", n) for n in (2, -1)])
        return [o.value if o.ok else str(o.error) for o in outcomes]

    async with engine:
        await engine.start("settled", run_id="s")
        result = await engine.wait_for_run("s", terminal=True, timeout=10)
    assert result.output is not None
    assert result.output[0] == 4 and "negative" in result.output[1]


async def test_fail_fast_cancels_the_rest(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("fast")
    async def fast(ctx: durably.WorkflowContext) -> str:
        try:
            await ctx.all(
                [
                    ctx.child("gated", "never-1"),
                    ctx.child("square", -1),
                    ctx.child("gated", "never-2"),
                ],
                fail_fast=True,
            )
        except durably.GatherFailed as exc:
            return ",".join(str(i) for i, _ in exc.failures)
        return "?"

    async with engine:
        await engine.start("fast", run_id="ff")
        result = await engine.wait_for_run("ff", terminal=True, timeout=10)
        assert result.output == "0,1,2"
        for child in ("ff.child.0", "ff.child.2"):
            run = await engine.get_run(child)
            assert run is not None and run.status is RunStatus.CANCELLED


async def test_cancel_cascades_to_children(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("waiting-parent")
    async def waiting_parent(ctx: durably.WorkflowContext) -> None:
        await ctx.all([ctx.child("gated", f"t{i}") for i in range(3)])

    async with engine:
        await engine.start("waiting-parent", run_id="wp")

        async def all_suspended() -> bool:
            return len((await engine.list_runs(status="suspended", limit=10)).runs) == 4

        await eventually(all_suspended, what="the parent and its 3 children to suspend")
        assert await engine.cancel("wp") is RunStatus.SUSPENDED
        for i in range(3):
            kid = await engine.get_run(f"wp.child.{i}")
            assert kid is not None and kid.status is RunStatus.CANCELLED


async def test_a_late_child_cannot_revive_a_cancelled_parent(make_engine: EngineFactory) -> None:
    engine = make_engine()
    _register_children(engine)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> str:
        await ctx.child("gated", "late", run_id="late-kid")
        return "revived"

    async with engine:
        await engine.start("parent", run_id="p")
        await eventually(lambda: engine.get_run("late-kid"), what="the child to exist")
        await engine.wait_for_run("late-kid", timeout=10)
        # Cancel the parent only: the child is cancelled by the cascade.
        await engine.cancel("p")
        await engine.signal("late", "x")
        await engine.join()  # every turn the signal caused here has ended
        run = await engine.get_run("p")
    assert run is not None and run.status is RunStatus.CANCELLED and run.output is None


async def test_sagas_compensate_in_reverse_on_failure(make_engine: EngineFactory) -> None:
    engine = make_engine()
    undone: list[str] = []

    @engine.workflow("trip")
    async def trip(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step(
            "flight", lambda: "F1", compensate=lambda f: undone.append(f"cancel {f}")
        )
        await ctx.local_step(
            "hotel", lambda: "H1", compensate=lambda h: undone.append(f"cancel {h}")
        )
        await ctx.local_step("car", _no_cars, backoff_base=0)

    async with engine:
        await engine.start("trip", run_id="t")
        result = await engine.wait_for_run("t", terminal=True, timeout=10)
        history = await engine.history("t")
    assert result.status is RunStatus.FAILED
    assert undone == ["cancel H1", "cancel F1"]
    compensations = {c.seq: (c.name, c.status) for c in history if c.seq < 0}
    assert compensations == {
        -2: ("compensate:flight", CheckpointStatus.COMPLETED),
        -3: ("compensate:hotel", CheckpointStatus.COMPLETED),
    }


def _no_cars() -> None:
    raise durably.FatalError("no cars left", code="sold_out")


async def test_cancel_with_compensation_unwinds_without_new_work(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    undone: list[str] = []
    executed: list[str] = []

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step(
            "reserve",
            lambda: executed.append("reserve") or "R",
            compensate=lambda r: undone.append(r),
        )
        await ctx.wait_for_signal("pay")
        await ctx.local_step("charge", lambda: executed.append("charge") or "C")

    async with engine:
        await engine.start("order", run_id="o")
        await engine.wait_for_run("o", timeout=10)
        assert await engine.cancel("o", compensate=True) is RunStatus.SUSPENDED
        result = await engine.wait_for_run("o", terminal=True, timeout=10)
    assert result.status is RunStatus.CANCELLED
    assert result.error is not None and result.error["code"] == "cancelled"
    assert undone == ["R"]
    assert executed == ["reserve"]


async def test_retry_reruns_a_failed_run_from_the_failure(make_engine: EngineFactory) -> None:
    engine = make_engine()
    calls: Counter[str] = Counter()
    flaky = {"broken": True}

    def first() -> str:
        calls["first"] += 1
        return "one"

    def second() -> str:
        calls["second"] += 1
        if flaky["broken"]:
            raise durably.FatalError("downstream down")
        return "two"

    @engine.workflow("job")
    async def job(ctx: durably.WorkflowContext) -> list[str]:
        return [await ctx.local_step("first", first), await ctx.local_step("second", second)]

    async with engine:
        await engine.start("job", run_id="j")
        failed = await engine.wait_for_run("j", terminal=True, timeout=10)
        assert failed.status is RunStatus.FAILED
        flaky["broken"] = False
        retried = await engine.retry("j")
        assert retried.error is None
        result = await engine.wait_for_run("j", terminal=True, timeout=10)
        with pytest.raises(durably.DurablyError, match="only failed or dead"):
            await engine.retry("j")
    assert result.output == ["one", "two"]
    assert calls == Counter({"first": 1, "second": 2})


async def test_retry_cascades_to_failed_children(make_engine: EngineFactory) -> None:
    engine = make_engine()
    state = {"fail": True}

    @engine.workflow("kid")
    async def kid(ctx: durably.WorkflowContext) -> str:
        def work() -> str:
            if state["fail"]:
                raise durably.FatalError("not yet")
            return "kid ok"

        return await ctx.local_step("work", work)

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> str:
        return await ctx.child("kid", run_id="the-kid")

    async with engine:
        await engine.start("parent", run_id="p")
        assert (
            await engine.wait_for_run("p", terminal=True, timeout=10)
        ).status is RunStatus.FAILED
        state["fail"] = False
        await engine.retry("p")
        result = await engine.wait_for_run("p", terminal=True, timeout=10)
    assert result.output == "kid ok"


async def test_retry_with_input_starts_a_new_run(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("double")
    async def double(ctx: durably.WorkflowContext, n: int) -> int:
        if n < 0:
            raise durably.FatalError("bad input")
        return n * 2

    async with engine:
        await engine.start("double", -1, run_id="d", tags=["x"])
        await engine.wait_for_run("d", terminal=True, timeout=10)
        fixed = await engine.retry_with_input("d", 21)
        assert fixed.run_id.startswith("d~retry~") and fixed.run.tags == ["x"]
        assert (await engine.wait_for_run(fixed.run_id, terminal=True, timeout=10)).output == 42


async def test_patched_keeps_old_runs_on_the_old_path(make_engine: EngineFactory) -> None:
    old = make_engine()

    @old.workflow("evolving")
    async def before(ctx: durably.WorkflowContext) -> str:
        await ctx.local_step("a", lambda: "a")
        await ctx.wait_for_signal(f"go:{ctx.run_id}")
        return "old"

    async with old:
        await old.start("evolving", run_id="old-run")
        await old.wait_for_run("old-run", timeout=10)

    new = make_engine()

    @new.workflow("evolving")
    async def after(ctx: durably.WorkflowContext) -> str:
        if await ctx.patched("add-audit"):
            await ctx.local_step("audit", lambda: "audited")
        await ctx.local_step("a", lambda: "a")
        await ctx.wait_for_signal(f"go:{ctx.run_id}")
        return "new"

    async with new:
        await new.start("evolving", run_id="new-run")
        await new.wait_for_run("new-run", timeout=10)
        await new.signal("go:old-run")
        await new.signal("go:new-run")
        old_result = await new.wait_for_run("old-run", terminal=True, timeout=10)
        new_result = await new.wait_for_run("new-run", terminal=True, timeout=10)
        new_history = [c.name for c in await new.history("new-run")]
    assert old_result.output == "new" and old_result.status is RunStatus.COMPLETED
    assert new_result.output == "new"
    assert new_history == ["patch:add-audit", "audit", "a", "signal:go:new-run"]


async def test_execution_timeout_cancels_children_too(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)
    _register_children(engine)

    @engine.workflow("bounded-parent", execution_timeout="1h")
    async def bounded_parent(ctx: durably.WorkflowContext) -> None:
        await ctx.child("gated", "never", run_id="orphan-to-be")

    await engine.open()
    await engine.start("bounded-parent", run_id="bp")

    async def kid_suspended() -> bool:
        await engine.join()
        return await _status(engine, "orphan-to-be") is RunStatus.SUSPENDED

    await eventually(kid_suspended, what="the child to suspend")
    clock.advance("1h")
    assert await engine.sweep_timeouts() == 1
    kid = await engine.get_run("orphan-to-be")
    assert kid is not None and kid.status is RunStatus.CANCELLED


async def test_a_compensating_cancel_waits_on_nothing_new(make_engine: EngineFactory) -> None:
    """The unwinding turn replays history only: a wait it reaches for the
    first time (here an event wait after a signal that already arrived)
    registers nothing and records nothing.

    The engine drives turns only when told (``run_one``): a listening store
    (PostgreSQL) would otherwise hear the signal's wake and resume the run
    before the cancel, and the unwinding turn would see nothing new."""
    engine = make_engine(drive=False)
    sender = make_engine(drive=False)
    undone: list[str] = []

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("reserve", lambda: "R", compensate=lambda r: undone.append(r))
        await ctx.wait_for_signal("paid")
        await ctx.wait_for_event("shipped")

    await engine.open()
    await engine.start("order", run_id="o")
    assert await engine.run_one("o")
    assert await sender.signal("paid") == "o"  # stamped only: no turn has consumed it
    assert await engine.cancel("o", compensate=True) is RunStatus.SUSPENDED
    assert await engine.run_one("o")  # the unwinding turn
    result = await engine.wait_for_run("o", terminal=True, timeout=10)
    assert result.status is RunStatus.CANCELLED and undone == ["R"]
    assert [c.name for c in await engine.history("o") if c.seq >= 0] == ["reserve", "signal:paid"]


async def test_a_child_runs_at_its_own_priority_or_its_parents(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("leaf")
    async def leaf(ctx: durably.WorkflowContext, n: int) -> int:
        return n

    @engine.workflow("fan")
    async def fan(ctx: durably.WorkflowContext) -> list[int]:
        return await ctx.all(
            [ctx.child("leaf", 1, run_id="urgent", priority=9), ctx.child("leaf", 2, run_id="same")]
        )

    async with engine:
        await engine.start("fan", run_id="parent", priority=3)
        result = await engine.wait_for_run("parent", terminal=True, timeout=30)
        assert result.output == [1, 2]
        urgent, same = await engine.get_run("urgent"), await engine.get_run("same")
        assert urgent is not None and urgent.priority == 9
        assert same is not None and same.priority == 3

        @engine.workflow("bad-priority")
        async def bad(ctx: durably.WorkflowContext) -> None:
            await ctx.child("leaf", 1, priority=2**40)

        await engine.start("bad-priority", run_id="bad")
        failed = await engine.wait_for_run("bad", terminal=True, timeout=30)
        assert failed.status is durably.RunStatus.FAILED
        assert failed.error is not None and "child priority" in failed.error["message"]
