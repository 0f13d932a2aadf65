"""``requires=`` on steps, checked against a real ``durable-worker``'s descriptor.

The durable-worker step worker advertises the protocol-v1 capability set
(``signals``, ``saga``…, never ``gpu``). A step requiring ``signals`` is sent
and served; one requiring ``gpu`` is never sent into a queue only incapable
workers drain: its run is parked ``blocked`` with the reason, and no task
reaches that queue.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import durably
from durably import RunStatus
from durably.testing import eventually

from .conftest import REDIS_URL, step_worker

pytestmark = [pytest.mark.timeout(120)]


async def test_a_step_no_live_worker_is_capable_of_parks_its_run_blocked(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    engine = durably.Engine(
        f"sqlite:///{tmp_path / f'engine-{uuid.uuid4().hex[:6]}.db'}",
        transport=f"{REDIS_URL}?prefix={prefix}",
        poll_interval=0.05,
        serve_steps=[],  # the durable-worker serves them, not this engine
    )

    @engine.step("py-echo", requires=["signals"])
    def echo(data: Any) -> Any:  # pragma: no cover - served by durable-worker
        raise AssertionError

    @engine.step("payments:charge", requires=["gpu", "signals"])
    def charge(data: Any) -> Any:  # pragma: no cover - never sent
        raise AssertionError

    @engine.workflow("capable")
    async def capable(ctx: durably.WorkflowContext, n: int) -> Any:
        return await ctx.step("py-echo", {"n": n})

    @engine.workflow("incapable")
    async def incapable(ctx: durably.WorkflowContext, n: int) -> Any:
        return await ctx.step("payments:charge", {"amount": n})

    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        async with step_worker(interop_python, prefix):
            await engine.start_worker()

            async def announced() -> bool:
                # Its descriptors are written as it starts, not necessarily
                # before READY; without them no step would be guarded.
                health = await engine.worker_health()
                return any(w["steps"] for w in health["workers"])

            await eventually(announced, timeout=30)
            ok = (await engine.start("capable", 1)).run_id
            stuck = (await engine.start("incapable", 5)).run_id
            done = await engine.wait_for_run(ok, terminal=True, timeout=30)
            assert done.status is RunStatus.COMPLETED and done.output["nPlusOne"] == 2

            async def blocked() -> durably.Run | None:
                run = await engine.get_run(stuck)
                return run if run is not None and run.status is RunStatus.BLOCKED else None

            run = await eventually(blocked, timeout=30)
            assert run.error is not None
            assert run.error["message"] == "blocked: no compatible worker (requires gpu, signals)"
            assert run.error["code"] == "capability_unavailable"
            assert await engine.history(stuck) == []  # no checkpoint for a blocked dispatch
            queue = f"bull:{prefix}-tasks-payments-charge"
            assert await client.exists(f"{queue}:id") == 0  # nothing was ever queued there
    finally:
        await engine.close()
        await client.aclose()
