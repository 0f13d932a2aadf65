"""Over-long ids and rows a sweep cannot read: refused at the API, survived by sweeps.

An ~8 KB run id once exceeded PostgreSQL's NOTIFY payload limit: the run could
not settle and, once dead, failed the recovery pass on every tick in every
process. Ids, tokens and names are bounded where they enter the API; every
NOTIFY stays bounded whatever an id already stored; and one row a sweep cannot
process is logged and passed over while the sweep handles the rest.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

import durably
from durably import RunStatus
from durably._names import MAX_NAME_LENGTH
from durably.errors import UnstorableValue
from durably.model import Run
from durably.testing import VirtualClock

LONG = "x" * 8192


async def test_over_long_or_unstorable_ids_and_names_are_refused_naming_the_field(
    store_url: str,
) -> None:
    engine = durably.Engine(store_url, poll_interval=0.05)

    @engine.workflow("wf")
    async def wf(ctx: durably.WorkflowContext, how: str) -> str:
        if how == "child":
            await ctx.child("wf", "plain", run_id=LONG)
        elif how == "signal":
            await ctx.wait_for_signal(LONG)
        elif how == "event":
            await ctx.wait_for_event(LONG)
        return "ok"

    refusals: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("run_id", lambda: engine.start("wf", "plain", run_id=LONG)),
        ("run_id", lambda: engine.start("wf", "plain", run_id="a\x00b")),
        ("run_id", lambda: engine.start("wf", "plain", run_id="caf\udce9")),
        ("tag", lambda: engine.start("wf", "plain", tags=["ok", LONG])),
        ("signal token", lambda: engine.signal(LONG, 1)),
        ("event name", lambda: engine.publish_event(LONG, 1)),
        ("schedule name", lambda: engine.add_schedule(LONG, "wf", every="1h", input="plain")),
    ]
    async with engine:
        for field, call in refusals:
            with pytest.raises(UnstorableValue, match=field) as caught:
                await call()
            assert isinstance(caught.value, ValueError) and caught.value.field == field
        with pytest.raises(UnstorableValue, match="namespace"):
            durably.Engine(store_url, namespace=LONG)
        with pytest.raises(ValueError, match="workflow name"):
            engine.workflow("w" * (MAX_NAME_LENGTH + 1))(wf)
        with pytest.raises(ValueError, match="step name"):
            engine.step(name="s" * (MAX_NAME_LENGTH + 1))(wf)
        # The bound itself is accepted.
        at_bound = "r" * MAX_NAME_LENGTH
        await engine.start("wf", "plain", run_id=at_bound)
        done = await engine.wait_for_run(at_bound, terminal=True, timeout=30)
        assert done.status is RunStatus.COMPLETED
        # Inside a body: the run fails with the field named.
        for how, field in (
            ("child", "child run_id"),
            ("signal", "signal token"),
            ("event", "event name"),
        ):
            await engine.start("wf", how, run_id=f"in-body-{how}")
            failed = await engine.wait_for_run(f"in-body-{how}", terminal=True, timeout=30)
            assert failed.status is RunStatus.FAILED
            assert field in str((failed.error or {}).get("message")), failed.error


async def _raw_sql(url: str, engine: durably.Engine, sql: str, *args: Any) -> None:
    """Write a row no API would write (the kind of damage a sweep must survive)."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            conn.execute(sql.replace("$1", "?").replace("$2", "?"), args)
            conn.commit()
        finally:
            conn.close()
        return
    store: Any = engine.store
    dsn, _, _ = store.url.partition("?")
    conn = await asyncpg.connect(dsn, server_settings={"search_path": str(store.schema)})
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()


@pytest.mark.parametrize("sweep", ["timeouts", "retention", "recovery"])
async def test_a_sweep_passes_over_a_row_it_cannot_read_and_handles_the_rest(
    store_url: str,
    sweep: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if store_url == "memory://":
        pytest.skip("a memory store holds no rows to corrupt")
    clock = VirtualClock()

    def make_engine() -> durably.Engine:
        engine = durably.Engine(
            store_url, clock=clock, poll_interval=0.05, retention="1h", max_recovery_attempts=0
        )

        @engine.workflow("slow", execution_timeout="1m")
        async def slow(ctx: durably.WorkflowContext, n: int) -> int:
            if n >= 0:
                await ctx.wait_for_signal(f"never-{n}")
            return n

        return engine

    # For recovery the bad row also has an id past NOTIFY's payload limit (as
    # stored before ids were bounded): announcing its end must not fail the pass.
    bad = "a-bad" + (LONG if sweep == "recovery" else "")
    ids = [bad, "b-good", "c-good"]
    engine = make_engine()
    if sweep == "recovery":
        # Crashed executors: leases long gone, out of recovery attempts, so
        # each goes dead (and its end is announced) in the recovery pass.
        await engine.open()
        now = clock.now_ms()
        for run_id in ids:
            run = Run(run_id, "slow", "1", RunStatus.RUNNING, input=1, locked_by="gone")
            run.locked_until, run.created_at, run.updated_at = now - 1, now - 2, now - 2
            await engine.store.create_run(run)
    else:
        async with engine:
            for n, run_id in enumerate(ids):
                await engine.start("slow", -1 if sweep == "retention" else n, run_id=run_id)
                clock.advance("1s")
            for run_id in ids:
                await engine.wait_for_run(run_id, timeout=30, terminal=sweep == "retention")
    await _raw_sql(
        store_url, engine, "UPDATE durably_runs SET input = '{corrupt' WHERE id = $1", bad
    )
    await engine.close()
    # A second process, its worker loop not running: only the sweep under test acts.
    sweeper = make_engine()
    try:
        clock.advance("2h")
        if sweep == "timeouts":
            assert await sweeper.sweep_timeouts() == 2
            assert await sweeper.sweep_timeouts() == 0
            expected: RunStatus | None = RunStatus.CANCELLED
            # The row is passed over on every pass, and logged on the first only.
            passed_over = [r for r in caplog.records if "passed over run a-bad" in r.getMessage()]
            assert len(passed_over) == 1
        elif sweep == "retention":
            assert await sweeper.sweep_retention(force=True) == 2
            expected = None
        else:
            assert await sweeper.recover_incomplete() == 3
            expected = RunStatus.DEAD
        for run_id in ("b-good", "c-good"):
            run = await sweeper.get_run(run_id)
            assert (run.status if run else None) is expected
    finally:
        await sweeper.close()
