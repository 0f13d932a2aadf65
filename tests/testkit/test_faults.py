"""Fault injection: a step that fails N times then succeeds, and a process that
"crashes" after a step and resumes in a fresh engine on the same store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

import durably
from durably.testing import InjectedFault, TestEnv

CHARGED: list[str] = []


def order_app(engine: durably.Engine) -> None:
    @engine.step("charge", retries=3, backoff="fixed", backoff_base="10s")
    def charge(order: str) -> str:
        CHARGED.append(order)
        return f"charged {order}"

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext, order_id: str) -> dict[str, str]:
        reserved = await ctx.local_step("reserve", lambda: f"reserved {order_id}")
        charged = await ctx.step(charge, order_id)
        shipped = await ctx.local_step("ship", lambda: f"shipped {order_id}", retries=2)
        return {"reserve": reserved, "charge": charged, "ship": shipped}


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'faults.db'}"
    else:
        isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
            "isolated_postgres"
        )
        async with isolated() as url:
            yield url


async def test_a_dispatched_step_fails_twice_then_succeeds_on_its_durable_retries(
    store: str,
) -> None:
    CHARGED.clear()
    async with TestEnv(order_app, store=store) as env:
        env.fail_step("charge", times=2)
        run_id = await env.start("order", "o-1")
        await env.assert_status(run_id, "suspended")  # the retry timer is durable
        await env.advance("30s")
        await env.assert_completed(
            run_id,
            output={"reserve": "reserved o-1", "charge": "charged o-1", "ship": "shipped o-1"},
        )
        assert env.step_calls("charge") == 3
        assert CHARGED == ["o-1"]  # the handler body ran once: the first two were injected
        history = {c.name: c for c in await env.history(run_id)}
        assert history["charge"].attempts == 3


async def test_a_local_step_fails_then_succeeds_within_its_backoff() -> None:
    async with TestEnv(order_app) as env:
        env.fail_step("ship", times=2, error=ConnectionError("carrier down"))
        run_id = await env.start("order", "o-2")
        await env.assert_status(run_id, "running")  # waiting on its in-process backoff
        await env.advance("1m")
        await env.assert_completed(run_id)
        assert env.step_calls("ship") == 3


async def test_a_step_failing_more_often_than_its_retries_fails_the_run() -> None:
    async with TestEnv(order_app) as env:
        env.fail_step("ship", times=3)
        run_id = await env.start("order", "o-3")
        await env.advance("1m")
        await env.assert_failed(run_id, match="injected failure 3 of 3 of step 'ship'")
    with pytest.raises(ValueError, match="positive int"):
        env.fail_step("ship", times=0)
    assert issubclass(InjectedFault, RuntimeError)


async def test_a_crash_after_a_step_resumes_in_a_fresh_engine_without_rerunning_it(
    store: str,
) -> None:
    CHARGED.clear()
    async with TestEnv(order_app, store=store) as env:
        env.crash_after("reserve")
        first = env.engine
        run_id = await env.start("order", "o-4")
        assert env.crashed == ["reserve"]
        run = await env.assert_status(run_id, "running")  # leased to the dead process
        assert run.locked_by == first.instance_id
        assert await env.steps_ran(run_id) == ["reserve"]

        fresh = await env.restart()
        assert fresh is env.engine and fresh is not first
        run = await env.assert_completed(run_id)
        assert run.recovery_attempts == 1
        assert env.step_calls("reserve") == 1  # completed before the crash: not run again
        assert env.step_calls("charge") == 1 and env.step_calls("ship") == 1
        assert await env.steps_ran(run_id) == ["reserve", "charge", "ship"]
