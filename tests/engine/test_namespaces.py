"""Pools sharing one database never execute each other's runs."""

from __future__ import annotations

import os

import durably
from durably import RunStatus

from .conftest import EngineFactory


def _register(engine: durably.Engine) -> None:
    @engine.workflow("where")
    async def where(ctx: durably.WorkflowContext) -> str:
        await ctx.wait_for_signal(f"go:{ctx.run_id}")
        return await ctx.local_step("who", lambda: f"{engine.namespace}:{os.getpid()}")


async def test_pools_keep_to_their_own_runs(make_engine: EngineFactory) -> None:
    billing = make_engine(namespace="billing")
    search = make_engine(namespace="search")
    for engine in (billing, search):
        _register(engine)
    await billing.open()
    await search.open()
    engine_billing = durably.Engine(billing.store, namespace="billing", drive=False)
    _register(engine_billing)
    await engine_billing.start("where", run_id="b1")
    # A poll in the wrong pool finds nothing to do.
    assert await search.run_pending() == 0
    await search.join()
    assert (await search.get_run("b1")).status is RunStatus.PENDING  # type: ignore[union-attr]
    await billing.run_pending()
    await billing.join()
    run = await billing.get_run("b1")
    assert run is not None and run.status is RunStatus.SUSPENDED and run.namespace == "billing"
    # A signal sent through the other pool wakes the run in its own pool only.
    await search.signal("go:b1")
    await search.join()
    assert (await search.get_run("b1")).status is not RunStatus.COMPLETED  # type: ignore[union-attr]
    await billing.resume_due_timers()
    await billing.run_pending()
    result = await billing.wait_for_run("b1", terminal=True, timeout=10)
    assert result.output.startswith("billing:")


async def test_an_engine_without_namespace_drives_every_pool(make_engine: EngineFactory) -> None:
    producer = make_engine(namespace="reports", drive=False)
    operator = make_engine()
    _register(producer)
    _register(operator)
    await producer.open()
    await producer.start("where", run_id="r1")
    assert (await producer.get_run("r1")).namespace == "reports"  # type: ignore[union-attr]
    await operator.open()
    await operator.run_pending()
    await operator.join()
    await operator.signal("go:r1")
    assert (await operator.wait_for_run("r1", terminal=True, timeout=10)).ok
