"""Engines whose dispatched steps travel over ``redis://`` (the store stays SQL).

A workflow's ``ctx.step`` goes out as a BullMQ task, a step served by an
engine comes back as a result, and two engine instances sharing a PostgreSQL
schema and a Redis prefix compete for the results: each is settled once, by
whichever instance took it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.wire import StepResult

from .redis_fixtures import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
async def redis_target() -> AsyncIterator[str]:
    """A ``redis://`` URL with a prefix of the test's own; its keys are deleted after."""
    prefix = f"durably-engine-{uuid.uuid4().hex[:10]}"
    yield f"{REDIS_URL}?prefix={prefix}"
    await delete_prefix(REDIS_URL, prefix)


def build(store: str, transport: str, **options: Any) -> durably.Engine:
    engine = durably.Engine(store, transport=transport, poll_interval=0.05, **options)

    @engine.step("times2")
    async def times2(n: int) -> int:
        await asyncio.sleep(0.01)
        return n * 2

    @engine.step("explode", retries=1)
    async def explode(n: int) -> int:
        raise durably.FatalError("no", code="nope")

    @engine.workflow("double")
    async def double(ctx: durably.WorkflowContext, n: int) -> int:
        return int(await ctx.step("times2", n)) + 1

    @engine.workflow("fails")
    async def fails(ctx: durably.WorkflowContext, n: int) -> Any:
        try:
            return await ctx.step("explode", n)
        except durably.StepFailed as failed:
            return {"code": failed.code, "attempts": failed.attempts}

    return engine


async def test_a_workflow_on_sqlite_dispatches_its_steps_over_redis(
    tmp_path: Path, redis_target: str
) -> None:
    async with build(f"sqlite:///{tmp_path / 'e.db'}", redis_target) as engine:
        await engine.start_worker()
        ok = await engine.start("double", 20)
        bad = await engine.start("fails", 1)
        assert (await engine.wait_for_run(ok.run_id, terminal=True, timeout=30)).output == 41
        failed = await engine.wait_for_run(bad.run_id, terminal=True, timeout=30)
        assert failed.status is RunStatus.COMPLETED
        assert failed.output == {"code": "nope", "attempts": 1}


async def test_two_engines_compete_for_results_and_settle_each_once(
    postgres_url: str, redis_target: str
) -> None:
    engines = [build(postgres_url, redis_target, instance_id=f"i{i}") for i in range(2)]
    taken: list[Counter[str]] = [Counter(), Counter()]
    for engine, mine in zip(engines, taken, strict=True):
        settle = engine._steps.on_results

        async def counted(
            batch: list[StepResult],
            settle: Any = settle,
            mine: Counter[str] = mine,
        ) -> None:
            await settle(batch)
            # Counted once settled: a batch whose settling raised (the store
            # said no) is delivered again, and that is not a second settle.
            mine.update(result.step_id for result in batch)

        engine._steps.on_results = counted  # type: ignore[method-assign]
    try:
        for engine in engines:
            await engine.start_worker()
        runs = [await engines[i % 2].start("double", i) for i in range(60)]
        done = await asyncio.gather(
            *(engines[0].wait_for_run(run.run_id, terminal=True, timeout=60) for run in runs)
        )
        assert [r.output for r in done] == [2 * i + 1 for i in range(60)]
        both = taken[0] + taken[1]
        assert len(both) == 60
        dup = [k for k, v in both.items() if v > 1]
        assert not dup, f"settled twice: {dup}"
        assert not set(taken[0]) & set(taken[1])
        assert all(taken), f"one instance took every result: {[len(t) for t in taken]}"
    finally:
        for engine in engines:
            await engine.close()


async def test_a_client_start_reaches_an_engine_on_postgresql_and_redis(
    postgres_url: str, redis_target: str
) -> None:
    """The store's notices wake the engine (its poll would come an hour later);
    the run's step goes over Redis."""
    engine = build(postgres_url, redis_target)
    engine.poll_interval = 3600
    client = durably.Client(postgres_url, transport=redis_target)
    try:
        await engine.start_worker()
        await asyncio.sleep(0.2)  # the worker's first tick is behind it
        handle = await client.start("double", 20)
        assert await handle.result(timeout=30) == 41
    finally:
        await client.close()
        await engine.close()
