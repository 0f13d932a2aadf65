"""Sticky runs: a suspended turn's body kept in memory and resumed by the run's next turn.

The cache is on by default; these tests name its size, so they hold also when
``DURABLY_TEST_STICKY_RUNS=0`` runs the rest of the suite with it off.

Cache hits are proven by counting how often a body started from the top (a
replay starts it again; a resumed body does not), never by timing. Every test
runs on memory, SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably._options import EngineOptions
from durably._sticky import StickyRuns

from .conftest import EngineFactory


def _sticky(engine: durably.Engine) -> StickyRuns:
    sticky = engine._turns.sticky
    assert sticky is not None
    return sticky


def _signals(engine: durably.Engine, starts: list[str], count: int) -> None:
    @engine.workflow("signals")
    async def signals(ctx: durably.WorkflowContext) -> list[Any]:
        starts.append(ctx.run_id)
        got = []
        for i in range(count):
            got.append(await ctx.wait_for_signal(f"{ctx.run_id}:{i}"))
        return got


async def test_a_kept_run_resumes_without_replaying(make_engine: EngineFactory) -> None:
    engine = make_engine(sticky_runs=1000)
    starts: list[str] = []
    _signals(engine, starts, 5)
    async with engine:
        await engine.start("signals", run_id="r")
        for i in range(5):
            await _waiting(engine, "r", i + 1)
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
            await _waiting(engine, "r", i + 1)
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


async def _waiting(engine: durably.Engine, run_id: str, positions: int) -> None:
    """Wait until ``run_id`` is suspended with ``positions`` checkpoints."""
    for _ in range(2000):
        run = await engine.wait_for_run(run_id, timeout=10)
        if run.status is RunStatus.SUSPENDED and len(await engine.history(run_id)) == positions:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{run_id} never waited with {positions} positions")


async def test_a_run_another_instance_advanced_is_replayed_not_resumed(
    make_engine: EngineFactory,
) -> None:
    """A keeps the body; B takes the next turn (A's cache knows nothing of
    it); A's next turn finds a history its body did not see and replays."""
    a, b = make_engine(drive=False, sticky_runs=1000), make_engine(drive=False, sticky_runs=1000)
    starts_a: list[str] = []
    starts_b: list[str] = []
    _signals(a, starts_a, 3)
    _signals(b, starts_b, 3)
    await a.start("signals", run_id="r")
    assert await a.run_one("r")
    assert len(_sticky(a)) == 1 and starts_a == ["r"]
    await b.signal("r:0", "zero")
    assert await b.run_one("r")  # B replays (nothing kept there) and parks at r:1
    assert starts_b == ["r"]
    await a.signal("r:1", "one")
    assert await a.run_one("r")
    assert starts_a == ["r", "r"]  # replayed: the kept body stood at r:0
    assert (_sticky(a).resumed, _sticky(a).replayed) == (0, 1)
    await a.signal("r:2", "two")
    assert await a.run_one("r")
    assert starts_a == ["r", "r"]  # the replayed body was kept and resumed this time
    assert _sticky(a).resumed == 1
    result = await a.wait_for_run("r", terminal=True, timeout=10)
    assert result.output == ["zero", "one", "two"]


async def test_a_crash_loses_the_cache_and_the_next_process_replays(
    make_engine: EngineFactory,
) -> None:
    crashed, restarted = (
        make_engine(drive=False, sticky_runs=1000),
        make_engine(drive=False, sticky_runs=1000),
    )
    before: list[str] = []
    after: list[str] = []
    _signals(crashed, before, 2)
    _signals(restarted, after, 2)
    await crashed.start("signals", run_id="r")
    assert await crashed.run_one("r")
    assert len(_sticky(crashed)) == 1
    # ``crashed`` is never used again, as if its process had died.
    for i in range(2):
        await restarted.signal(f"r:{i}", i)
        assert await restarted.run_one("r")
    assert (await restarted.wait_for_run("r", terminal=True, timeout=10)).output == [0, 1]
    assert before == ["r"] and after == ["r"]  # one replay, then the kept body resumed
    assert _sticky(restarted).resumed == 1


async def test_eviction_under_pressure_cancels_bodies_as_a_suspend_does(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(sticky_runs=1)
    starts: list[str] = []
    cancelled: list[str] = []

    @engine.workflow("signals")
    async def signals(ctx: durably.WorkflowContext) -> list[Any]:
        starts.append(ctx.run_id)
        got = []
        try:
            for i in range(3):
                got.append(await ctx.wait_for_signal(f"{ctx.run_id}:{i}"))
        except asyncio.CancelledError:
            cancelled.append(ctx.run_id)
            raise
        return got

    ids = [f"r{n}" for n in range(4)]
    async with engine:
        for run_id in ids:
            await engine.start("signals", run_id=run_id)
        for i in range(3):
            for run_id in ids:
                await _waiting(engine, run_id, i + 1)
                assert len(_sticky(engine)) <= 1
            for run_id in ids:
                await engine.signal(f"{run_id}:{i}", i)
        for run_id in ids:
            result = await engine.wait_for_run(run_id, terminal=True, timeout=10)
            assert result.output == [0, 1, 2]
    for _ in range(10):
        await asyncio.sleep(0)  # let the last cancelled bodies unwind
    assert len(starts) > len(ids)  # evicted bodies were replayed
    # Every body that did not finish was cancelled exactly once (evicted,
    # dropped or let go at the drain): none leaked, none ran on.
    assert len(cancelled) == len(starts) - len(ids)
    assert len(_sticky(engine)) == 0


async def test_a_cancel_while_kept_ends_the_run_and_the_body_never_goes_on(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(sticky_runs=1000)
    went_on: list[str] = []

    @engine.workflow("wait")
    async def wait(ctx: durably.WorkflowContext) -> str:
        value = await ctx.wait_for_signal(f"{ctx.run_id}:go")
        went_on.append(value)
        return str(value)

    async with engine:
        await engine.start("wait", run_id="w")
        await _waiting(engine, "w", 1)
        assert len(_sticky(engine)) == 1
        await engine.cancel("w")
        await engine.signal("w:go", "late")
        result = await engine.wait_for_run("w", terminal=True, timeout=10)
        assert result.status is RunStatus.CANCELLED
        await engine.join()
    assert went_on == []


async def test_a_compensating_cancel_while_kept_replays_and_undoes_once(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(sticky_runs=1000)
    starts: list[str] = []
    undone: list[Any] = []

    @engine.workflow("saga")
    async def saga(ctx: durably.WorkflowContext) -> str:
        starts.append(ctx.run_id)
        await ctx.local_step("book", lambda: "booked", compensate=undone.append)
        await ctx.wait_for_signal(f"{ctx.run_id}:go")
        return "done"

    async with engine:
        await engine.start("saga", run_id="s")
        await _waiting(engine, "s", 2)
        assert len(_sticky(engine)) == 1
        await engine.cancel("s", compensate=True)
        result = await engine.wait_for_run("s", terminal=True, timeout=10)
    assert result.status is RunStatus.CANCELLED
    assert undone == ["booked"]
    assert starts == ["s", "s"]  # the cancel's turn replayed, unwinding
    assert _sticky(engine).replayed == 1


async def test_a_body_with_update_handlers_is_not_kept(make_engine: EngineFactory) -> None:
    engine = make_engine(sticky_runs=1000)
    starts: list[str] = []

    @engine.workflow("counter")
    async def counter(ctx: durably.WorkflowContext) -> int:
        starts.append(ctx.run_id)
        state = {"n": 0}

        def bump(by: int) -> int:
            state["n"] += by
            return state["n"]

        ctx.on_update("bump", bump)
        await ctx.wait_condition(lambda: state["n"] >= 3)
        await ctx.wait_for_signal(f"{ctx.run_id}:go")
        return state["n"]

    async with engine:
        await engine.start("counter", run_id="c")
        await _waiting(engine, "c", 0)
        assert len(_sticky(engine)) == 0
        assert (await engine.update("c", "bump", 1)).result == 1
        assert (await engine.update("c", "bump", 2)).result == 3
        await _waiting(engine, "c", 3)
        assert len(_sticky(engine)) == 0
        await engine.signal("c:go", None)
        result = await engine.wait_for_run("c", terminal=True, timeout=10)
    assert result.output == 3
    assert len(starts) >= 3  # every turn replayed the recorded updates


async def test_a_turn_interceptor_turns_the_cache_off(make_engine: EngineFactory) -> None:
    engine = make_engine(sticky_runs=1000)
    starts: list[str] = []
    _signals(engine, starts, 2)

    class Count(durably.Interceptor):
        turns = 0

        async def intercept_turn(self, info: Any, call_next: Any) -> Any:
            Count.turns += 1
            return await call_next()

    engine.use(Count())
    async with engine:
        await engine.start("signals", run_id="r")
        for i in range(2):
            await _waiting(engine, "r", i + 1)
            await engine.signal(f"r:{i}", i)
        assert (await engine.wait_for_run("r", terminal=True, timeout=10)).output == [0, 1]
    assert starts == ["r"] * 3 and Count.turns == 3


@pytest.mark.filterwarnings("ignore:coroutine 'local_step' was never awaited")
async def test_an_operation_not_yet_started_is_never_run_on_a_stale_history(
    make_engine: EngineFactory,
) -> None:
    """The kept body of A holds a local step it took a position for but has
    not started; B's turn runs that step. Resuming A's body would run it a
    second time: A must see the history moved on and replay."""
    a, b = make_engine(drive=False, sticky_runs=1000), make_engine(drive=False, sticky_runs=1000)
    effects: list[str] = []
    starts: list[str] = []

    for engine in (a, b):

        @engine.workflow("lazy")
        async def lazy(ctx: durably.WorkflowContext) -> str:
            starts.append(ctx.run_id)
            later = ctx.local_step("effect", lambda: effects.append("ran") or "value")
            await ctx.wait_for_signal(f"{ctx.run_id}:go")
            value = await later
            await ctx.wait_for_signal(f"{ctx.run_id}:again")
            return value

    await a.start("lazy", run_id="l")
    assert await a.run_one("l")
    assert len(_sticky(a)) == 1
    await b.signal("l:go", None)
    assert await b.run_one("l")
    assert effects == ["ran"]
    await a.signal("l:again", None)
    assert await a.run_one("l")
    assert (await a.wait_for_run("l", terminal=True, timeout=10)).output == "value"
    assert effects == ["ran"]  # once: A replayed, its stale body was let go
    assert _sticky(a).replayed == 1


def test_continues_allows_only_the_parked_positions_to_move() -> None:
    from durably._sticky import continues
    from durably.model import Checkpoint, CheckpointStatus

    def cp(seq: int, status: CheckpointStatus, **fields: Any) -> Checkpoint:
        return Checkpoint("r", seq, f"op{seq}", "signal", status, **fields)

    done, pending = CheckpointStatus.COMPLETED, CheckpointStatus.PENDING
    seen: dict[int, Checkpoint | None] = {0: cp(0, done), 1: cp(1, pending), 2: None}
    parked = frozenset({1})
    same = {0: cp(0, done), 1: cp(1, pending), 2: cp(2, done)}
    assert continues(seen, parked, same)
    assert continues(seen, parked, {**same, 1: cp(1, done, output="x")})  # what it waited for
    assert not continues(seen, parked, {**same, 3: cp(3, pending)})  # a position added
    assert not continues(seen, parked, {0: same[0], 1: same[1]})  # one gone
    assert not continues(seen, parked, {**same, 0: cp(0, done, attempts=2)})  # rewritten
    assert not continues(seen, parked, {**same, 2: cp(2, pending)})  # a settled write unsettled
    assert not continues(seen, frozenset(), {**same, 1: cp(1, done)})  # not parked: no change
    # a tail's positions only (the rest is the very checkpoints seen)
    assert continues(seen, parked, {**same, 1: cp(1, done)}, [1, 2])
    assert not continues(seen, parked, {**same, 2: cp(2, pending)}, [1, 2])
    assert not continues(seen, parked, {0: same[0], 1: same[1], 3: cp(3, done)}, [1, 3])


def test_the_cache_is_on_by_default_and_its_size_is_checked() -> None:
    assert EngineOptions().sticky_runs == 1000
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="sticky_runs"):
            EngineOptions(sticky_runs=bad)  # type: ignore[arg-type]


async def test_an_event_batch_resumes_position_by_position(make_engine: EngineFactory) -> None:
    engine = make_engine(sticky_runs=1000)
    starts: list[str] = []

    @engine.workflow("batch")
    async def batch(ctx: durably.WorkflowContext) -> list[Any]:
        starts.append(ctx.run_id)
        items = await ctx.wait_for_events("tick", max_items=3, window="1h")
        return [*items, await ctx.wait_for_event("done")]

    async with engine:
        await engine.start("batch", run_id="b")
        # first, window, two more: the batch takes all its positions at the call
        await _waiting(engine, "b", 1)
        for i, positions in ((0, 3), (1, 4), (2, 5)):
            await engine.publish_event("tick", i)
            await _waiting(engine, "b", positions)
        await engine.publish_event("done", "end")
        result = await engine.wait_for_run("b", terminal=True, timeout=10)
    assert result.output == [0, 1, 2, "end"]
    assert starts == ["b"]


async def test_a_kept_body_that_moved_on_its_own_is_replayed(make_engine: EngineFactory) -> None:
    """A body timing out a wait with asyncio (not ctx) moves while kept: its
    next turn must not resume it (it stands elsewhere now) but replay."""
    engine = make_engine(sticky_runs=1000, drive=False)
    starts: list[str] = []
    stuck = asyncio.Event()
    timeouts: list[asyncio.Timeout] = []
    moved = asyncio.Event()

    @engine.workflow("impatient")
    async def impatient(ctx: durably.WorkflowContext) -> str:
        starts.append(ctx.run_id)
        if len(starts) > 1:
            # A replay waits as a park should: a timer of its own could fire
            # inside a slow turn (a loaded PostgreSQL) and strand that turn.
            return str(await ctx.wait_for_signal("i:go"))
        try:
            # The kept body's own asyncio timeout, fired by the test once the
            # turn has ended (not a wall-clock guess that the turn is over).
            async with asyncio.timeout(None) as timeout:
                timeouts.append(timeout)
                return str(await ctx.wait_for_signal("i:go"))
        except TimeoutError:
            moved.set()
            await stuck.wait()  # not a ctx call: nothing tells the turn
            return "timed out"

    await engine.start("impatient", run_id="i")
    assert await engine.run_one("i")
    assert len(_sticky(engine)) == 1
    timeouts[0].reschedule(asyncio.get_running_loop().time())  # the kept body's own timeout fires
    await asyncio.wait_for(moved.wait(), timeout=30)
    # A turn with the same history (a reconcile wake): resuming would wait
    # forever on a body that no longer stands at a park.
    assert await asyncio.wait_for(engine.run_one("i"), timeout=30)
    assert starts == ["i", "i"]
    assert _sticky(engine).replayed == 1
    await engine.signal("i:go", "went")
    assert await engine.run_one("i")
    assert (await engine.wait_for_run("i", terminal=True, timeout=10)).output == "went"
    stuck.set()


def _count_reads(engine: durably.Engine, run_id: str) -> list[int]:
    """The number of checkpoints each turn start of ``run_id`` read (the
    real store's answers, counted on their way to the engine)."""
    reads: list[int] = []
    store: Any = engine.store
    start_turns = store.start_turns

    async def counted(*args: Any, **kwargs: Any) -> Any:
        leased = await start_turns(*args, **kwargs)
        reads.extend(len(history) for rid, (_, history) in leased.items() if rid == run_id)
        return leased

    store.start_turns = counted
    return reads


async def test_a_resumed_turn_reads_only_what_changed(make_engine: EngineFactory) -> None:
    """Each turn of a kept body reads the history from the position it
    waits on, not the whole history (which grows by one a turn)."""
    engine = make_engine(sticky_runs=1000)
    starts: list[str] = []
    _signals(engine, starts, 12)
    reads = _count_reads(engine, "r")
    async with engine:
        await engine.start("signals", run_id="r")
        for i in range(12):
            await _waiting(engine, "r", i + 1)
            await engine.signal(f"r:{i}", i)
        result = await engine.wait_for_run("r", terminal=True, timeout=10)
    assert result.output == list(range(12))
    assert starts == ["r"] and _sticky(engine).resumed == 12
    # one read per resumed turn (the first turn's run was leased as started):
    # the signal just delivered, nothing below it
    assert reads == [1] * 12
    assert engine._turns.tails_reread == 0


async def test_without_the_cache_every_turn_reads_the_whole_history(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(sticky_runs=0)
    starts: list[str] = []
    _signals(engine, starts, 4)
    reads = _count_reads(engine, "r")
    async with engine:
        await engine.start("signals", run_id="r")
        for i in range(4):
            await _waiting(engine, "r", i + 1)
            await engine.signal(f"r:{i}", i)
        await engine.wait_for_run("r", terminal=True, timeout=10)
    assert reads == [1, 2, 3, 4]


async def test_a_tail_whose_kept_body_is_gone_is_read_again_in_full(
    make_engine: EngineFactory,
) -> None:
    """The cache is never what a turn's history depends on: a history read
    from a kept body's position, whose body was let go before the turn
    began, is read again whole."""
    from durably.stores.base import HistoryTail

    engine = make_engine(drive=False, sticky_runs=1000)
    _signals(engine, [], 3)
    await engine.start("signals", run_id="r")
    assert await engine.run_one("r")
    await engine.signal("r:0", "zero")
    assert await engine.run_one("r")
    sticky = _sticky(engine)
    assert sticky.read_from("r") == 1
    whole = await engine.store.load_checkpoints("r")
    tail = await engine.store.load_checkpoints("r", sticky.read_from("r"))
    assert isinstance(tail, HistoryTail) and list(tail) == [1]
    assert await engine._turns._whole("r", tail) == whole  # completed from the body
    sticky.drop("r")
    assert await engine._turns._whole("r", tail) == whole  # read again
    assert engine._turns.tails_reread == 1
