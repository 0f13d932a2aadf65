"""durably drives, ``durable-worker`` 0.26.1 (the upstream's Python SDK) serves.

A real durable-worker process, in its own virtualenv (bullmq 2.17), consumes
the step queues a durably engine dispatches to over ``redis://``; its results
come back on ``{P}-results`` and settle the runs. Covered: results (with the
handler's events), ``FatalError`` (never retried; code and details kept), a
plain exception (retried, then completed), namespaces and partitions,
priorities (inverted for BullMQ, honoured by the 2.17 worker), and
cancellation (the worker hears the cancel on ``{P}-control`` and its handler
stops; the late result does not resurrect the run). durable-worker sends no
per-step heartbeat, so no step here uses a ``timeout``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.transports.redis import RedisTransport
from durably.wire import Heartbeat, StepResult, StepTask

from .conftest import REDIS_URL, step_worker

pytestmark = [pytest.mark.timeout(180)]


@asynccontextmanager
async def engine_on_redis(
    tmp_path: Path, prefix: str, *, namespace: str | None = None, redis_ns: str | None = None
) -> AsyncIterator[durably.Engine]:
    query = f"?prefix={prefix}" + (f"&namespace={redis_ns}" if redis_ns else "")
    engine = durably.Engine(
        f"sqlite:///{tmp_path / f'engine-{uuid.uuid4().hex[:6]}.db'}",
        transport=REDIS_URL + query,
        namespace=namespace,
        poll_interval=0.05,
    )

    @engine.workflow("echo")
    async def echo(ctx: durably.WorkflowContext, n: int) -> Any:
        return await ctx.step("py-echo", {"n": n})

    @engine.workflow("charge")
    async def charge(ctx: durably.WorkflowContext, amount: int) -> Any:
        try:
            return await ctx.step("payments:charge", {"amount": amount}, retries=3)
        except durably.StepFailed as failed:
            return {"code": failed.code, "details": failed.details, "attempts": failed.attempts}

    @engine.workflow("flaky")
    async def flaky(ctx: durably.WorkflowContext, failures: int) -> Any:
        return await ctx.step(
            "flaky",
            {"key": ctx.run_id, "failures": failures},
            retries=5,
            backoff_base=0.05,
            jitter=False,
        )

    @engine.workflow("slow")
    async def slow(ctx: durably.WorkflowContext, _: Any) -> Any:
        return await ctx.step("slow", {"key": ctx.run_id})

    await engine.start_worker()
    try:
        yield engine
    finally:
        await engine.close()


async def finish(engine: durably.Engine, run_id: str, timeout: float = 30) -> durably.RunResult:
    return await engine.wait_for_run(run_id, terminal=True, timeout=timeout)


async def test_a_durable_worker_step_returns_its_result(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with (
        step_worker(interop_python, prefix) as worker,
        engine_on_redis(tmp_path, prefix) as engine,
    ):
        runs = [await engine.start("echo", n) for n in (41, 1, 2)]
        results = [await finish(engine, run.run_id) for run in runs]
        assert [r.status for r in results] == [RunStatus.COMPLETED] * 3, worker.errors()
        assert results[0].output == {"echoed": {"n": 41}, "runtime": "python", "nPlusOne": 42}
        history = await engine.history(runs[0].run_id)
        step = next(cp for cp in history if cp.name == "py-echo")
        # the handler's ctx.info line rides back on the result
        assert [(e["level"], e["message"]) for e in step.events or []] == [("info", "echoing")]


async def test_fatal_error_is_not_retried_and_keeps_code_and_details(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with (
        step_worker(interop_python, prefix),
        engine_on_redis(tmp_path, prefix) as engine,
    ):
        run = await engine.start("charge", 10)
        result = await finish(engine, run.run_id)
        assert result.status is RunStatus.COMPLETED
        assert result.output == {"code": "declined", "details": {"last4": "4242"}, "attempts": 1}


async def test_a_plain_exception_is_retried_until_it_succeeds(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with (
        step_worker(interop_python, prefix),
        engine_on_redis(tmp_path, prefix) as engine,
    ):
        run = await engine.start("flaky", 2)
        result = await finish(engine, run.run_id)
        assert result.status is RunStatus.COMPLETED
        assert result.output == {"calls": 3}
        [step] = [cp for cp in await engine.history(run.run_id) if cp.name == "flaky"]
        assert step.attempts == 3


async def test_namespace_and_partition_route_as_upstream(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    # durably's namespace= is the upstream partition (the @acme token suffix);
    # ?namespace= in the URL is the upstream namespace (folded into the prefix).
    async with (
        step_worker(interop_python, prefix, namespace="dev", partition="acme"),
        engine_on_redis(tmp_path, prefix, namespace="acme", redis_ns="dev") as engine,
    ):
        run = await engine.start("echo", 7)
        result = await finish(engine, run.run_id)
        assert result.status is RunStatus.COMPLETED
        assert result.output["nPlusOne"] == 8


async def test_cancel_reaches_the_python_handler_and_the_late_result_is_dropped(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with (
        step_worker(interop_python, prefix) as worker,
        engine_on_redis(tmp_path, prefix) as engine,
    ):
        run = await engine.start("slow", None)
        deadline = time.monotonic() + 30
        while f"started slow {run.run_id}" not in worker.lines:
            assert time.monotonic() < deadline, worker.errors()
            await asyncio.sleep(0.05)
        await engine.cancel(run.run_id)
        while not any(line.startswith(f"stopped slow {run.run_id}") for line in worker.lines):
            assert time.monotonic() < deadline, "the handler never saw the cancel"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # its (completed) result arrives now
        result = await finish(engine, run.run_id)
        assert result.status is RunStatus.CANCELLED


async def test_the_python_worker_takes_higher_priorities_first(
    interop_python: Path, prefix: str
) -> None:
    transport = RedisTransport(REDIS_URL, prefix=prefix)
    await transport.open()
    results: list[StepResult] = []

    async def on_results(batch: list[StepResult]) -> None:
        results.extend(batch)

    async def on_beat(beat: Heartbeat) -> None:
        return None

    try:
        await transport.consume_results(on_results, on_beat)
        order = [("low", None), ("high", 9), ("mid", 3), ("none", None), ("neg", -4)]
        await transport.dispatch(
            [
                StepTask(run, 1, "py-echo", "py-echo", {"n": i}, priority=p)
                for i, (run, p) in enumerate(order)
            ]
        )
        async with step_worker(interop_python, prefix, concurrency=1) as worker:
            deadline = time.monotonic() + 30
            while len(results) < len(order):
                assert time.monotonic() < deadline, worker.errors()
                await asyncio.sleep(0.05)
        assert all(r.ok and r.started_at for r in results)
        taken = [r.run_id for r in sorted(results, key=lambda r: r.started_at or 0)]
        assert taken == ["high", "mid", "low", "none", "neg"]
    finally:
        await transport.close()
