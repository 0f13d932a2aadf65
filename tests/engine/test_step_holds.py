"""Holding the turn across a dispatched step (``Engine(step_hold=...)``).

A step without ``timeout`` holds its turn in memory for a short window: a
result heard within it continues the same turn; otherwise the run parks as
it always did. These tests take the adversary's side: results that arrive
just as the hold lets go, a result the store already holds another answer
for, another instance settling the step, a run that needs the held slot, a
drain, a cancel, a lost lease. Nothing is timed: outcomes, counts of turns
and of handler calls are asserted; the windows only bound how long a test
may wait before the run parks.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import durably
from durably import CheckpointStatus, EventKind, RunStatus
from durably.stores.base import Resolution
from durably.testing import eventually

from .conftest import EngineFactory

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["local://", "db://"]


def transport_for(engine_url: str, transport: str) -> None:
    if transport == "db://" and engine_url == "memory://":
        pytest.skip("db:// needs a SQL store")


def holds(engine: durably.Engine) -> Any:
    return engine._steps.holds


async def finish(engine: durably.Engine, run_id: str) -> durably.RunResult:
    return await engine.wait_for_run(run_id, terminal=True, timeout=20)


async def turns_until_done(engine: durably.Engine, run_id: str) -> int:
    """How many turns ``run_id`` takes from now until it ends."""
    started = 0
    sub = engine.subscribe()
    async with asyncio.timeout(20):
        async for event in sub:
            if event.run_id != run_id:
                continue
            if event.kind is EventKind.RUN_STARTED:
                started += 1
            if event.kind in (EventKind.RUN_COMPLETED, EventKind.RUN_FAILED):
                return started
    raise AssertionError("the subscription ended first")


@dataclass
class Rig:
    """An engine with this file's steps and workflows, and what they record."""

    engine: durably.Engine
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    """What ``slow`` waits for before it answers."""
    calls: Counter[tuple[str, Any]] = field(default_factory=Counter)
    """Each step's calls by ``(step, input)``."""
    continued: list[str] = field(default_factory=list)
    """The runs whose workflow went on past its step, in order."""


RigFactory = Callable[..., Rig]


@pytest.fixture
def rig(make_engine: EngineFactory, store_url: str) -> RigFactory:
    """``rig(transport="local://", answer=..., timeout=None, **engine options)``:
    an engine on the test's store (skipped where the transport needs a SQL
    store) serving

    - ``inc`` (``n -> n + 1``), and the workflows ``chain(k)`` (``k`` incs)
      and ``then_sleep(k)`` (``k`` incs, then a 10 ms sleep);
    - ``slow``, which waits for the rig's ``gate`` and returns ``answer(x)``,
      and the workflow ``one(x)``, which returns its output (awaited with
      ``timeout`` when given) and notes its run in ``continued``.
    """

    def make(
        *,
        transport: str = "local://",
        answer: Callable[[Any], Any] = lambda x: x,
        timeout: str | None = None,
        **options: Any,
    ) -> Rig:
        transport_for(store_url, transport)
        made = Rig(make_engine(transport=transport, **options))
        engine = made.engine

        @engine.step("inc")
        async def inc(n: int) -> int:
            made.calls["inc", n] += 1
            return n + 1

        @engine.step("slow")
        async def slow(x: Any) -> Any:
            made.calls["slow", x] += 1
            await made.gate.wait()
            return answer(x)

        @engine.workflow("chain")
        async def chain(ctx: durably.WorkflowContext, k: int) -> int:
            n = 0
            for _ in range(k):
                n = await ctx.step(inc, n)
            return n

        @engine.workflow("then_sleep")
        async def then_sleep(ctx: durably.WorkflowContext, k: int) -> int:
            n = 0
            for _ in range(k):
                n = await ctx.step(inc, n)
            await ctx.sleep("10ms")
            return n

        @engine.workflow("one")
        async def one(ctx: durably.WorkflowContext, x: Any) -> Any:
            out = await ctx.step(slow, x, timeout=timeout)
            made.continued.append(ctx.run_id)
            return out

        return made

    return make


@pytest.mark.parametrize("transport", ["memory://", *TRANSPORTS])
async def test_a_fast_result_continues_the_same_turn(rig: RigFactory, transport: str) -> None:
    made = rig(transport=transport, step_hold="5s")
    engine = made.engine

    async with engine:
        counted = asyncio.ensure_future(turns_until_done(engine, "c"))
        await asyncio.sleep(0)
        await engine.start("chain", 4, run_id="c")
        result = await finish(engine, "c")
        turns = await counted
    assert result.status is RunStatus.COMPLETED and result.output == 4
    assert made.calls == Counter({("inc", n): 1 for n in range(4)})
    # Four results, one turn: no park, wake or lease per step. A result
    # slower than its window (a loaded machine) costs exactly one turn more.
    lets_go = holds(engine)
    assert lets_go.hits + lets_go.misses == 4 and lets_go.hits >= 1
    assert turns == 1 + lets_go.misses
    history = await engine.history("c")
    assert [(cp.status, cp.output) for cp in history] == [
        (CheckpointStatus.COMPLETED, n) for n in (1, 2, 3, 4)
    ]


@pytest.mark.parametrize("transport", ["memory://", *TRANSPORTS])
async def test_results_handed_to_a_held_turn_stamp_no_wake(rig: RigFactory, transport: str) -> None:
    """A result the held turn takes itself stamps no wake: three steps then a
    sleep park once (a stamp per step made the park take one more short turn)."""
    engine = rig(transport=transport, step_hold="5s").engine

    async with engine:
        counted = asyncio.ensure_future(turns_until_done(engine, "s"))
        await asyncio.sleep(0)
        await engine.start("then_sleep", 3, run_id="s")
        result = await finish(engine, "s")
        turns = await counted
    assert result.status is RunStatus.COMPLETED and result.output == 3
    lets_go = holds(engine)
    assert lets_go.hits + lets_go.misses == 3 and lets_go.hits >= 1
    # One turn to the sleep, one after it (and one more per missed window).
    assert turns == 2 + lets_go.misses


def release_holds_after_each_settle(engine: durably.Engine) -> list[int]:
    """Make every settle that took a held turn's result let that hold go
    between the settle's commit and its hand-over (the worst moment); returns
    the list of releases done."""
    store: Any = engine._steps.store
    done: list[int] = []

    async def let_go(resolutions: list[Resolution]) -> None:
        if any(r.held_by is not None for r in resolutions):
            done.append(holds(engine).holding)
            holds(engine).release()
            for _ in range(5):  # the held turn runs its loop now, before the hand-over
                await asyncio.sleep(0)

    def wrap(name: str) -> None:
        original = getattr(store, name)

        async def settle(resolutions: list[Resolution], *args: Any) -> Any:
            got = await original(resolutions, *args)
            await let_go(resolutions)
            return got

        setattr(store, name, settle)

    wrap("resolve_checkpoints")
    wrap("resolve_and_lease")
    if hasattr(store, "claim_and_resolve"):
        original = store.claim_and_resolve

        async def claim_and_resolve(
            topics: Any, limit: Any, visible_at: Any, decode: Any, *args: Any, **kw: Any
        ) -> Any:
            seen: list[Resolution] = []

            def decoding(messages: Any) -> Any:
                decoded, resolutions = decode(messages)
                seen.extend(resolutions)
                return decoded, resolutions

            got = await original(topics, limit, visible_at, decoding, *args, **kw)
            await let_go(seen)
            return got

        store.claim_and_resolve = claim_and_resolve
    return done


@pytest.mark.parametrize("transport", TRANSPORTS)  # memory:// answers within the send
@pytest.mark.parametrize("waits", [True, False], ids=["waits", "lets-go-anyway"])
async def test_a_hold_let_go_as_its_result_settles_still_takes_it(
    rig: RigFactory, transport: str, waits: bool
) -> None:
    """The hold is told to let go between the settle (no wake stamped: the
    turn holds the lease) and the hand-over: it must not park (nothing would
    wake it), it waits for the hand-over and continues the turn. A turn that
    lets go anyway (as one cancelled or fenced there does) fails the
    hand-over, and the receiver stamps the wake: the run still finishes."""
    engine = rig(transport=transport, step_hold="5s").engine
    if not waits:

        def let_go(waiter: Any) -> bool:
            waiter.gone = True
            return True

        engine._steps.let_go = let_go  # type: ignore[method-assign]

    async with engine:
        released = release_holds_after_each_settle(engine)
        await engine.start("then_sleep", 2, run_id="r")
        result = await finish(engine, "r")
    assert result.status is RunStatus.COMPLETED and result.output == 2
    assert released and holds(engine).released == len(released)
    # Waiting, each hold took its result (no park); letting go, none did.
    assert holds(engine).hits == (2 if waits else 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_without_a_hold_each_result_takes_a_turn(rig: RigFactory, transport: str) -> None:
    engine = rig(transport=transport, step_hold=0).engine

    async with engine:
        counted = asyncio.ensure_future(turns_until_done(engine, "c"))
        await asyncio.sleep(0)
        await engine.start("chain", 3, run_id="c")
        result = await finish(engine, "c")
        turns = await counted
    assert result.output == 3 and turns == 4
    assert holds(engine).hits == 0 and holds(engine).misses == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_result_right_after_the_hold_let_go_wakes_the_parked_run(
    rig: RigFactory, transport: str
) -> None:
    """The worker answers the moment the hold gives up (before the turn's
    park is settled): the result is never lost, the step runs once."""
    made = rig(transport=transport, step_hold="50ms", answer=lambda x: x * 10)
    engine = made.engine
    lets_go = holds(engine)
    missed = lets_go.missed

    def open_gate(name: str, window_ms: float) -> None:
        missed(name, window_ms)
        made.gate.set()  # synchronously, as the hold unregisters and parks

    lets_go.missed = open_gate

    async with engine:
        await engine.start("one", 4, run_id="late")
        result = await finish(engine, "late")
    assert result.status is RunStatus.COMPLETED and result.output == 40
    assert made.calls == Counter({("slow", 4): 1})
    assert lets_go.misses == 1 and lets_go.hits == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_result_long_after_the_hold_let_go_wakes_the_parked_run(
    rig: RigFactory, transport: str
) -> None:
    made = rig(transport=transport, step_hold="20ms")
    engine = made.engine

    async with engine:
        await engine.start("one", 7, run_id="parked")

        async def suspended() -> bool:
            run = await engine.get_run("parked")
            return run is not None and run.status is RunStatus.SUSPENDED

        await eventually(suspended, what="the run to park after its hold")
        made.gate.set()
        result = await finish(engine, "parked")
    assert result.output == 7 and holds(engine).misses == 1


async def test_a_result_that_settles_nothing_yields_to_the_stored_one(rig: RigFactory) -> None:
    """Another instance's receiver settled the step first (with another
    output): the result heard here settles nothing, and the held turn
    continues with what the store holds, not with what it heard."""
    made = rig(step_hold="10s", answer=lambda x: "heard here")
    engine = made.engine

    async with engine:
        await engine.start("one", 1, run_id="truth")
        await eventually(lambda: holds(engine).holding == 1, what="the turn to hold")
        # What another instance's receiver does: settle the pending step.
        answers = await engine.store.resolve_checkpoints(
            [Resolution("truth", 0, CheckpointStatus.COMPLETED, "stored elsewhere")],
            engine.clock.now_ms(),
        )
        assert answers == [0]
        made.gate.set()
        result = await finish(engine, "truth")
    assert result.output == "stored elsewhere"
    assert holds(engine).hits == 1


async def test_a_step_settled_by_another_instance_alone_reaches_the_run(
    rig: RigFactory, store_url: str
) -> None:
    """No result reaches this process (another instance took it, settled
    the step and stamped a wake). On PostgreSQL the wake's notice reaches the
    holder, which reads the settled step and continues the same turn long
    before its window (here 7.5 s, a quarter of the lease) would run out.
    Elsewhere nothing tells this process: the hold runs out, the run's park
    sees the stamp, and the next turn reads the settled step."""
    notified = store_url.startswith("postgres")
    # its gate stays shut: this process never answers
    made = rig(step_hold="10s" if notified else "50ms")
    engine = made.engine

    async with engine:
        assert engine.listening is notified
        await engine.start("one", 1, run_id="other")
        await eventually(lambda: holds(engine).holding == 1, what="the turn to hold")
        now = engine.clock.now_ms()
        await engine.store.resolve_checkpoints(
            [Resolution("other", 0, CheckpointStatus.COMPLETED, "from B")], now
        )
        await engine.store.request_wake("other", now)
        result = await finish(engine, "other")
        made.gate.set()
    assert result.output == "from B" and made.calls == Counter({("slow", 1): 1})
    if notified:
        assert holds(engine).hits == 1 and holds(engine).misses == 0
        assert holds(engine).rechecks >= 1
    else:
        assert holds(engine).hits == 0 and holds(engine).misses == 1


async def test_a_holding_turn_lends_its_slot_to_a_waiting_run(rig: RigFactory) -> None:
    """One slot: while a turn holds, another run takes the slot and completes;
    the hold is not released and still hears its result."""
    made = rig(step_hold="10s", max_concurrent_runs=1)
    engine = made.engine

    @engine.workflow("quick")
    async def quick(ctx: durably.WorkflowContext) -> str:
        made.continued.append(ctx.run_id)
        return "done"

    async with engine:
        await engine.start("one", 3, run_id="h")
        await eventually(lambda: holds(engine).holding == 1, what="the turn to hold")
        await engine.start("quick", run_id="q")
        assert (await finish(engine, "q")).output == "done"
        assert holds(engine).holding == 1 and made.continued == ["q"]
        made.gate.set()
        assert (await finish(engine, "h")).output == 3
    assert made.continued == ["q", "h"]
    assert holds(engine).released == 0 and holds(engine).hits == 1
    assert holds(engine).misses == 0 and made.calls == Counter({("slow", 3): 1})


async def test_a_held_result_waits_for_a_slot_before_the_body_goes_on(rig: RigFactory) -> None:
    """One slot, lent by a holding turn to a run whose turn stays busy (a
    local step that waits): the hold hears its result but its body goes on
    only once that turn ended and gave the slot back."""
    made = rig(step_hold="10s", max_concurrent_runs=1)
    engine = made.engine
    busy_gate = asyncio.Event()

    async def wait_for_gate() -> str:
        await busy_gate.wait()
        return "busy done"

    @engine.workflow("busy")
    async def busy(ctx: durably.WorkflowContext) -> str:
        out = str(await ctx.local_step("wait", wait_for_gate))
        made.continued.append(ctx.run_id)
        return out

    async with engine:
        executor = engine._router.executor
        assert executor is not None
        await engine.start("one", 5, run_id="h")
        await eventually(lambda: holds(engine).holding == 1, what="the turn to hold")
        await engine.start("busy", run_id="b")
        await eventually(lambda: executor.working == 1, what="the busy turn to take the slot")
        assert executor.lent == 1
        made.gate.set()
        await eventually(lambda: holds(engine).hits == 1, what="the hold to hear its result")
        await eventually(lambda: executor.reclaiming == 1, what="the held turn to want its slot")
        assert made.continued == [] and executor.working == 1
        busy_gate.set()
        assert (await finish(engine, "h")).output == 5
        assert (await finish(engine, "b")).output == "busy done"
        await engine.join()
        assert executor.lent == 0 and executor.reclaiming == 0 and executor.working == 0
    assert made.continued == ["b", "h"]
    assert holds(engine).released == 0 and holds(engine).misses == 0


async def test_a_cancel_while_a_held_turn_waits_for_its_slot(rig: RigFactory) -> None:
    """The held turn heard its result but waits to take a slot back when its
    run is cancelled: it settles the cancel once it has a slot, and no slot
    stays lent."""
    made = rig(step_hold="10s", max_concurrent_runs=1)
    engine = made.engine
    busy_gate = asyncio.Event()

    async def wait_for_gate() -> str:
        await busy_gate.wait()
        return "busy done"

    @engine.workflow("busy")
    async def busy(ctx: durably.WorkflowContext) -> str:
        return str(await ctx.local_step("wait", wait_for_gate))

    async with engine:
        executor = engine._router.executor
        assert executor is not None
        await engine.start("one", 1, run_id="h")
        await eventually(lambda: holds(engine).holding == 1, what="the turn to hold")
        await engine.start("busy", run_id="b")
        await eventually(lambda: executor.working == 1, what="the busy turn to take the slot")
        made.gate.set()
        await eventually(lambda: executor.reclaiming == 1, what="the held turn to want its slot")
        await engine.cancel("h")
        busy_gate.set()
        cancelled = await finish(engine, "h")
        assert (await finish(engine, "b")).output == "busy done"
        await engine.join()
        assert (executor.lent, executor.reclaiming, executor.working) == (0, 0, 0)
    assert cancelled.status is RunStatus.CANCELLED and made.continued == []


async def test_holds_past_their_bound_park_their_runs(rig: RigFactory) -> None:
    """Holds are bounded by max(max_concurrent_runs, sticky_runs): past it a
    step parks its run as without holds, and every run completes."""
    made = rig(step_hold="10s", max_concurrent_runs=2, sticky_runs=0)
    engine = made.engine

    async with engine:
        for i in range(3):
            await engine.start("one", i, run_id=f"p{i}")
        await eventually(lambda: holds(engine).holding == 2, what="two turns to hold")

        async def one_suspended() -> bool:
            runs = [await engine.get_run(f"p{i}") for i in range(3)]
            statuses = [r.status for r in runs if r is not None]
            assert statuses.count(RunStatus.SUSPENDED) == 1, statuses
            return True

        await eventually(one_suspended, what="the third run to park")
        assert holds(engine).holding == 2
        made.gate.set()
        results = [await finish(engine, f"p{i}") for i in range(3)]
    assert [r.output for r in results] == [0, 1, 2]
    assert holds(engine).hits == 2 and holds(engine).misses == 0 and holds(engine).released == 0
    assert made.calls == Counter({("slow", 0): 1, ("slow", 1): 1, ("slow", 2): 1})


async def test_a_drain_releases_holds_and_another_engine_finishes_the_run(
    make_engine: EngineFactory, store_url: str
) -> None:
    if store_url == "memory://":
        pytest.skip("the second engine needs the first one's store and transport rows")
    first = make_engine(transport="db://", step_hold="10s", serve_steps=[])
    second = make_engine(transport="db://", step_hold=0)
    calls = 0

    @second.step("work")
    async def work(x: int) -> int:
        nonlocal calls
        calls += 1
        return x + 1

    for engine in (first, second):

        @engine.workflow("one")
        async def one(ctx: durably.WorkflowContext) -> int:
            return int(await ctx.step("work", 1))

    async with first:
        await first.start("one", run_id="d")
        await eventually(lambda: holds(first).holding == 1, what="the turn to hold")
    # Closed promptly (the hold let go at once) and the run is not lost.
    assert holds(first).released == 1
    async with second:
        result = await finish(second, "d")
    assert result.output == 2 and calls == 1


async def test_a_cancel_stops_a_held_turn(rig: RigFactory) -> None:
    made = rig(step_hold="10s")
    engine = made.engine

    async with engine:
        await engine.start("one", 1, run_id="x")
        await eventually(lambda: holds(engine).holding == 1, what="the turn to hold")
        await engine.cancel("x")
        result = await finish(engine, "x")
        made.gate.set()
        await engine.join()
    assert result.status is RunStatus.CANCELLED and made.continued == []
    assert holds(engine).holding == 0


async def test_a_held_turn_whose_lease_was_taken_writes_nothing_more(rig: RigFactory) -> None:
    """The lease is taken over while the turn holds (a long pause here):
    the result still settles the step in the store (the truth for whoever
    holds the run now), but the held turn's next write is fenced."""
    made = rig(step_hold="10s")
    engine = made.engine

    @engine.workflow("two")
    async def two(ctx: durably.WorkflowContext) -> int:
        a = int(await ctx.step("slow", 1))
        return a + int(await ctx.step("inc", 2))

    async with engine:
        await engine.start("two", run_id="t")
        await eventually(lambda: holds(engine).holding == 1, what="the turn to hold")
        now = engine.clock.now_ms()
        assert await engine.store.update_run_if(
            "t",
            frozenset({RunStatus.RUNNING}),
            {"locked_by": "usurper", "locked_until": now + 600_000},
            now,
        )
        made.gate.set()
        await eventually(lambda: holds(engine).hits == 1, what="the held turn to hear it")
        await engine.join()
    run = await engine.get_run("t")
    assert run is not None and run.status is RunStatus.RUNNING and run.locked_by == "usurper"
    # Settled while another owner held the lease: stamped for that owner's turn.
    assert run.wake_requested_at is not None
    history = {cp.seq: cp for cp in await engine.history("t")}
    assert history[0].status is CheckpointStatus.COMPLETED and history[0].output == 1
    assert 1 not in history and made.calls == Counter({("slow", 1): 1})


async def test_many_runs_hold_at_once(rig: RigFactory) -> None:
    made = rig(step_hold="10s", answer=lambda x: 2 * x)
    engine = made.engine

    async with engine:
        ids = [(await engine.start("one", i, run_id=f"m{i}")).run_id for i in range(40)]
        await eventually(lambda: holds(engine).holding == 40, what="every turn to hold")
        made.gate.set()
        results = [await finish(engine, run_id) for run_id in ids]
    assert [r.output for r in results] == [2 * i for i in range(40)]
    lets_go = holds(engine)
    assert lets_go.hits + lets_go.misses == 40 and lets_go.hits >= 1 and lets_go.holding == 0


async def test_a_timeout_steps_waiter_also_yields_to_the_stored_result(rig: RigFactory) -> None:
    """The same for a step with ``timeout`` (awaited in memory before holds
    existed): a result that settled nothing is not what the run continues
    with. Failed before the waiter re-read the store: the run returned the
    output it heard, not the one stored."""
    made = rig(step_hold=0, answer=lambda x: "heard here", timeout="30s")
    engine = made.engine

    async with engine:
        await engine.start("one", 1, run_id="truth")

        async def out() -> bool:
            history = await engine.history("truth")
            return bool(history) and history[0].dispatched_at is not None

        await eventually(out, what="the step to go out")
        answers = await engine.store.resolve_checkpoints(
            [Resolution("truth", 0, CheckpointStatus.COMPLETED, "stored elsewhere")],
            engine.clock.now_ms(),
        )
        assert answers == [0]
        made.gate.set()
        result = await finish(engine, "truth")
    assert result.output == "stored elsewhere"


async def test_two_instances_holding_and_settling_each_others_results(
    make_engine: EngineFactory, store_url: str
) -> None:
    """Two engines on ``db://`` both drive runs, serve the step and settle
    results: a held turn's result is as likely to be settled by the other
    one. Every run completes with its output, every step runs once."""
    if store_url == "memory://":
        pytest.skip("db:// needs a SQL store")
    engines = [make_engine(transport="db://", step_hold="200ms") for _ in range(2)]
    executed: Counter[tuple[int, int]] = Counter()
    for engine in engines:

        @engine.step("inc")
        async def inc(data: list[int]) -> int:
            executed[(data[0], data[1])] += 1
            return data[2] + 1

        @engine.workflow("chain")
        async def chain(ctx: durably.WorkflowContext, n: int) -> int:
            total = n
            for seq in range(4):
                total = int(await ctx.step("inc", [n, seq, total]))
            return total

    async with engines[0], engines[1]:
        for n in range(30):
            await engines[n % 2].start("chain", n, run_id=f"r{n}")
        results = [await finish(engines[0], f"r{n}") for n in range(30)]
    assert [r.output for r in results] == [n + 4 for n in range(30)]
    assert sorted(executed) == [(n, s) for n in range(30) for s in range(4)]
    assert set(executed.values()) == {1}
