"""PostgreSQL connections terminated under load fail no run (issue 13 item 2)."""

from __future__ import annotations

import uuid
from collections import Counter
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import durably
from durably import RunStatus
from durably._faults import is_infrastructure_error
from durably.stores.postgres import PostgresStore
from durably.testing import eventually

_RUNS = 300


async def _outcome(engine: durably.Engine, run_id: str) -> durably.RunResult:
    """The run's terminal result; the test's own reads retry a connection
    the test itself terminated (the client API reports outages to its caller)."""
    for _ in range(20):
        try:
            return await engine.wait_for_run(run_id, terminal=True, timeout=120)
        except Exception as exc:
            if not is_infrastructure_error(exc):
                raise
    raise AssertionError(f"could not read {run_id}")


@pytest.mark.slow
async def test_terminating_the_engines_connections_mid_load_fails_no_run(
    postgres_url: str,
) -> None:
    # A name of our own, so only this engine's connections are terminated
    # (other tests share the server).
    application = f"durably-faults-{uuid.uuid4().hex[:12]}"
    store = PostgresStore(postgres_url, server_settings={"application_name": application})
    engine = durably.Engine(store, poll_interval=0.05)
    executed: Counter[str] = Counter()

    def step(name: str, n: int) -> int:
        executed[name] += 1
        return n + 1

    @engine.workflow("work")
    async def work(ctx: durably.WorkflowContext, n: int) -> int:
        a = await ctx.local_step("a", step, "a", n)
        b = await ctx.local_step("b", step, "b", a)
        c = await ctx.local_step("c", step, "c", b)
        return c

    # The server of the test's URL, without its ?schema= (not a server setting).
    killer = await asyncpg.connect(urlunsplit(urlsplit(postgres_url)._replace(query="")))
    terminated = 0
    try:
        async with engine:
            for i in range(_RUNS):
                await engine.start("work", i, run_id=f"w{i}")
            for threshold in (30, 150, 300, 450, 600):
                await eventually(
                    lambda t=threshold: sum(executed.values()) >= t,
                    what=f"{threshold} steps executed",
                    timeout=60,
                )
                terminated += await killer.fetchval(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM "
                    "pg_stat_activity WHERE application_name = $1) AS killed",
                    application,
                )
            results = [await _outcome(engine, f"w{i}") for i in range(_RUNS)]
    finally:
        await killer.close()
    assert terminated > 0
    statuses = Counter(result.status for result in results)
    assert statuses == {RunStatus.COMPLETED: _RUNS}, [
        (r.run_id, r.error and r.error.get("message")) for r in results if not r.ok
    ][:5]
    assert [r.output for r in results] == [i + 3 for i in range(_RUNS)]
