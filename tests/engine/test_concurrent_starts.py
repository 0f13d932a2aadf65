"""Many ``start`` calls at once (which the store may insert as one statement):
each returns its own run, repeated ids converge on one run, and every run
executes once, on one engine or on two racing for the same ids."""

from __future__ import annotations

import asyncio
from collections import Counter

import durably

from .conftest import EngineFactory


def _counting(engine: durably.Engine, executed: Counter[str]) -> None:
    @engine.workflow("count")
    async def count(ctx: durably.WorkflowContext, n: int) -> int:
        def bump() -> int:
            executed[ctx.run_id] += 1
            return n * 2

        return await ctx.local_step("bump", bump)


async def test_many_concurrent_starts_with_repeated_ids_each_run_once(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(max_concurrent_runs=50)
    executed: Counter[str] = Counter()
    _counting(engine, executed)

    async with engine:
        await engine.start("count", 0, run_id="existing")
        calls = [(f"r{n:03}", n) for n in range(200)]
        # The same id three times in one burst, and an id started before it.
        calls += [("twice", 1), ("existing", 5), ("twice", 2), ("twice", 3)]
        handles = await asyncio.gather(
            *(engine.start("count", n, run_id=run_id) for run_id, n in calls)
        )
        assert [h.run_id for h in handles] == [run_id for run_id, _ in calls]
        results = await asyncio.gather(*(h.result(timeout=60) for h in handles))

    assert results[:200] == [n * 2 for n in range(200)]
    twice = {results[i] for i, (run_id, _) in enumerate(calls) if run_id == "twice"}
    assert len(twice) == 1  # one run, whichever start created it
    assert results[201] == 0  # the run that existed, not the later input
    assert set(executed) == {*(run_id for run_id, _ in calls)}
    assert set(executed.values()) == {1}


async def test_two_engines_starting_the_same_ids_at_once_run_each_once(
    make_engine: EngineFactory,
) -> None:
    first, second = make_engine(instance_id="first"), make_engine(instance_id="second")
    executed: Counter[str] = Counter()
    _counting(first, executed)
    _counting(second, executed)
    ids = [f"race-{n:03}" for n in range(120)]

    async with first, second:
        a, b = await asyncio.gather(
            asyncio.gather(*(first.start("count", n, run_id=i) for n, i in enumerate(ids))),
            asyncio.gather(
                *(second.start("count", n, run_id=i) for n, i in reversed(list(enumerate(ids))))
            ),
        )
        assert [h.run_id for h in a] == ids and [h.run_id for h in b] == ids[::-1]
        results = await asyncio.gather(*(h.result(timeout=60) for h in [*a, *b]))

    assert results == [n * 2 for n in range(120)] + [n * 2 for n in reversed(range(120))]
    assert executed == Counter(dict.fromkeys(ids, 1))
