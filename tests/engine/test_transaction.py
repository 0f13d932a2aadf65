"""``ctx.transaction``: the app's writes and the step's checkpoint commit together."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

import durably
from durably import RunStatus


@pytest.fixture(params=["sqlite", "postgresql"])
async def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tx.db'}"
        return
    isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
        "isolated_postgres"
    )
    async with isolated() as url:
        yield url


def _writer(store: str, fail_times: int, calls: list[int], exc: Exception) -> Any:
    """An INSERT that raises ``exc`` after writing, the first ``fail_times`` calls."""
    if store.startswith("sqlite"):

        def insert(conn: sqlite3.Connection, order: str) -> str:
            calls.append(1)
            conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
            conn.execute("INSERT INTO orders (id) VALUES (?)", (order,))
            if len(calls) <= fail_times:
                raise exc
            return order

        return insert

    async def insert_pg(conn: Any, order: str) -> str:
        calls.append(1)
        await conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
        await conn.execute("INSERT INTO orders (id) VALUES ($1)", order)
        if len(calls) <= fail_times:
            raise exc
        return order

    return insert_pg


async def _orders(engine: durably.Engine, store: str) -> list[str]:
    if store.startswith("sqlite"):
        path = store.removeprefix("sqlite:///")

        def read() -> list[str]:
            with sqlite3.connect(path) as conn:
                try:
                    return [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]
                except sqlite3.OperationalError:
                    return []

        return await asyncio.to_thread(read)
    async with engine.store._db.pool().acquire() as conn:  # type: ignore[attr-defined]
        if not await conn.fetchval("SELECT to_regclass('orders') IS NOT NULL"):
            return []
        return [r["id"] for r in await conn.fetch("SELECT id FROM orders ORDER BY id")]


async def test_a_failed_attempt_is_rolled_back_and_the_retry_commits_once(sql_store: str) -> None:
    engine = durably.Engine(sql_store, poll_interval=0.05)
    calls: list[int] = []
    insert = _writer(sql_store, 2, calls, RuntimeError("deadlock detected"))

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext, order_id: str) -> Any:
        first = await ctx.transaction("insert", insert, order_id, retries=3, backoff_base=0.01)
        return {"inserted": first}

    async with engine:
        await engine.start("order", "o-7", run_id="o7")
        result = await engine.wait_for_run("o7", terminal=True, timeout=30)
        assert result.output == {"inserted": "o-7"}
        assert len(calls) == 3
        # The two failed attempts' INSERTs went with their rollback: one row.
        assert await _orders(engine, sql_store) == ["o-7"]
        [checkpoint] = await engine.history("o7")
        assert (checkpoint.kind, checkpoint.status, checkpoint.attempts) == (
            "transaction",
            "completed",
            3,
        )


async def test_a_fatal_error_is_not_retried_and_keeps_no_row(sql_store: str) -> None:
    engine = durably.Engine(sql_store, poll_interval=0.05)
    calls: list[int] = []
    insert = _writer(sql_store, 99, calls, durably.FatalError("out of stock", code="stock"))

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext, order_id: str) -> Any:
        try:
            await ctx.transaction("insert", insert, order_id, retries=5)
        except durably.StepFailed as exc:
            return {"failed": exc.code}
        return "no"

    async with engine:
        await engine.start("order", "o-8", run_id="o8")
        result = await engine.wait_for_run("o8", terminal=True, timeout=30)
        assert result.output == {"failed": "stock"}
        assert len(calls) == 1
        assert await _orders(engine, sql_store) == []


async def test_the_other_writes_of_a_batch_survive_a_failing_transaction(sql_store: str) -> None:
    """SQLite commits concurrent writes in one batch: a transaction's failure
    must roll back its own writes only."""
    engine = durably.Engine(sql_store, poll_interval=0.05)
    calls: list[int] = []
    insert = _writer(sql_store, 99, calls, RuntimeError("boom"))

    @engine.workflow("busy")
    async def busy(ctx: durably.WorkflowContext) -> Any:
        async def quick(i: int) -> int:
            return i

        outcomes = await asyncio.gather(
            ctx.transaction("insert", insert, "x"),
            *(ctx.local_step(f"s{i}", quick, i) for i in range(5)),
            return_exceptions=True,
        )
        return [type(o).__name__ if isinstance(o, BaseException) else o for o in outcomes]

    async with engine:
        await engine.start("busy", run_id="b")
        result = await engine.wait_for_run("b", terminal=True, timeout=30)
        assert result.output == ["StepFailed", 0, 1, 2, 3, 4]
        statuses = [(c.name, c.status) for c in await engine.history("b")]
        assert statuses == [("insert", "failed")] + [(f"s{i}", "completed") for i in range(5)]
        assert await _orders(engine, sql_store) == []


async def test_a_transaction_without_the_lease_runs_nothing(sql_store: str) -> None:
    engine = durably.Engine(sql_store, poll_interval=0.05)
    calls: list[int] = []
    insert = _writer(sql_store, 0, calls, RuntimeError())
    store: Any = engine.store
    await engine.open()
    try:
        held, output = await store.transact(
            "no-such-run", "someone", lambda conn: insert(conn, "x"), lambda v: None
        )
        assert (held, output) == (False, None)
        assert calls == []
    finally:
        await engine.close()


async def test_the_wrong_kind_of_function_is_refused_clearly(sql_store: str) -> None:
    engine = durably.Engine(sql_store, poll_interval=0.05)

    async def async_fn(conn: Any) -> None:
        return None

    def sync_fn(conn: Any) -> None:
        return None

    wrong = sync_fn if sql_store.startswith("postgres") else async_fn

    @engine.workflow("wrong")
    async def wrong_kind(ctx: durably.WorkflowContext) -> None:
        await ctx.transaction("t", wrong)

    async with engine:
        await engine.start("wrong", run_id="w")
        result = await engine.wait_for_run("w", terminal=True, timeout=30)
        assert result.status is RunStatus.FAILED
        assert result.error is not None and "fn must be" in result.error["message"]


async def test_memory_store_refuses_a_transaction() -> None:
    engine = durably.Engine("memory://")

    @engine.workflow("tx")
    async def tx(ctx: durably.WorkflowContext) -> None:
        await ctx.transaction("t", lambda conn: None)

    async with engine:
        await engine.start("tx", run_id="m")
        result = await engine.wait_for_run("m", terminal=True, timeout=30)
        assert result.status is RunStatus.FAILED
        assert result.error is not None
        assert "needs a SQL store" in result.error["message"]


async def test_each_attempt_is_told_and_intercepted_like_a_steps(sql_store: str) -> None:
    # Operators watching step events (dashboards, Prometheus, OpenTelemetry)
    # must see a transaction's attempts, failures included, as they see a
    # local step's: otherwise the strongest step kind is the invisible one.
    engine = durably.Engine(sql_store, poll_interval=0.05)
    calls: list[int] = []
    insert = _writer(sql_store, 1, calls, RuntimeError("serialization failure"))
    seen: list[str] = []

    async def spy(info: durably.StepInfo, call_next: Any) -> Any:
        seen.append(f"{info.step}:{info.kind}:{info.attempt}")
        return await call_next()

    engine.use(spy)

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext, order_id: str) -> Any:
        return await ctx.transaction("insert", insert, order_id, retries=2, backoff_base=0.01)

    steps = ["step.started", "step.failed", "step.completed"]
    async with engine, engine.subscribe(kinds=steps) as sub:
        await engine.start("order", "o-9", run_id="o9")
        assert (await engine.wait_for_run("o9", terminal=True, timeout=30)).output == "o-9"
        events = [await asyncio.wait_for(sub.__anext__(), 10) for _ in range(4)]
    assert [(e.kind, e.step, e.attempt) for e in events] == [
        ("step.started", "insert", 1),
        ("step.failed", "insert", 1),
        ("step.started", "insert", 2),
        ("step.completed", "insert", 2),
    ]
    assert events[1].error is not None and events[1].final is False
    assert seen == ["insert:transaction:1", "insert:transaction:2"]
