"""Redis failing under an engine, on a ``redis-server`` of the test's own
(never the shared one): down at start (one clear line, then a retry loop),
and killed (``SIGKILL``, no persistence: every queue and job is gone) and
restarted mid-load: every run still finishes, nothing is lost, and no step
handler runs again after its checkpoint was written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.testing import eventually

from .redis_fixtures import OwnRedis, own_redis

__all__ = ["own_redis"]

pytestmark = [pytest.mark.timeout(300)]

WAIT = 120.0


def opening_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "cannot reach Redis" in r.getMessage()]


async def test_redis_down_at_start_is_one_line_then_a_retry_loop(
    own_redis: OwnRedis, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    own_redis.kill()
    engine = durably.Engine(
        f"sqlite:///{tmp_path / 'e.db'}", transport=own_redis.url, poll_interval=0.05
    )

    @engine.workflow("hello")
    async def hello(ctx: durably.WorkflowContext, name: str) -> str:
        return await ctx.local_step("greet", lambda: f"hello {name}")

    opening = asyncio.create_task(engine.start_worker())
    await eventually(lambda: bool(opening_errors(caplog)), what="the line", timeout=WAIT)
    # Several retries go by (0.25 s, 0.5 s, 1 s, 2 s apart).
    await asyncio.sleep(4.0)
    assert not opening.done()
    errors = opening_errors(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].exc_info is None  # a line, not a traceback
    assert all(r.exc_info is None for r in caplog.records if r.levelno >= logging.ERROR)
    own_redis.start()
    await asyncio.wait_for(opening, WAIT)
    try:
        run = await engine.start("hello", "fleet")
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=WAIT)
        assert result.output == "hello fleet"
    finally:
        await engine.close()
    assert len(opening_errors(caplog)) == 1
    assert any("answers" in r.getMessage() for r in caplog.records)


def build(store: str, url: str, calls: list[tuple[str, int, int]]) -> durably.Engine:
    engine = durably.Engine(
        store,
        transport=url,
        poll_interval=0.05,
        remote_redispatch="2s",
        remote_redispatch_max=1000,
    )

    @engine.step("work", retries=5)
    async def work(at: list[Any]) -> int:
        run_id, i = str(at[0]), int(at[1])
        calls.append((run_id, i, int(time.time() * 1000)))
        await asyncio.sleep(0.02)
        return i * 10

    @engine.workflow("chain")
    async def chain(ctx: durably.WorkflowContext, n: int) -> int:
        total = 0
        for i in range(4):
            total += int(await ctx.step("work", [ctx.run_id, i]))
        return total + n

    return engine


async def test_a_redis_restart_mid_load_loses_nothing_and_reruns_no_checkpointed_step(
    own_redis: OwnRedis, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    calls: list[tuple[str, int, int]] = []
    engines = [build(postgres_url, own_redis.url, calls) for _ in range(2)]
    n = 60
    async with engines[0], engines[1]:
        for engine in engines:
            await engine.start_worker()
        ids = [(await engines[i % 2].start("chain", i, run_id=f"c{i:02}")).run_id for i in range(n)]
        await eventually(lambda: len(calls) >= n, what="a quarter of the steps ran", timeout=WAIT)
        killed_at = int(time.time() * 1000)
        own_redis.kill()  # every queue, job and lock is gone
        # Starts while Redis is down stay pending (their enqueue fails).
        late = [
            (await engines[i % 2].start("chain", i, run_id=f"late{i}")).run_id for i in range(5)
        ]
        await asyncio.sleep(1.0)
        own_redis.start()
        results = await asyncio.gather(
            *(engines[0].wait_for_run(r, terminal=True, timeout=240) for r in ids + late)
        )
        bad = [
            (r.run_id, r.status, r.error) for r in results if r.status is not RunStatus.COMPLETED
        ]
        assert not bad, bad[:5]
        assert [r.output for r in results] == [60 + i for i in range(n)] + [
            60 + i for i in range(5)
        ]
        # No handler ran again, after the restart, for a step whose checkpoint
        # was written before it: a restart costs redeliveries, never replays.
        rerun = []
        for run_id in ids + late:
            for checkpoint in await engines[0].history(run_id):
                i = int(checkpoint.output) // 10
                done_at = checkpoint.finished_at
                assert done_at is not None
                if done_at < killed_at:
                    again = [t for r, j, t in calls if (r, j) == (run_id, i) and t > done_at]
                    if again:
                        rerun.append((run_id, i, done_at, again))
        assert not rerun, rerun[:5]
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info is not None]
    assert not tracebacks, tracebacks[:5]
