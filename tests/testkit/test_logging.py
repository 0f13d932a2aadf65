"""Logging like stdlib logging: ctx.log silent during replay, ``extra=`` kept,
run/workflow/step on every engine record, StepLogger through ``logging``, and
the caller's contextvars inside synchronous steps."""

from __future__ import annotations

import contextvars
import logging

import pytest

import durably
from durably.testing import TestEnv

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


def records(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name]


async def test_ctx_log_is_silent_while_replaying_and_keeps_extra(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def register(engine: durably.Engine) -> None:
        @engine.workflow("greet")
        async def greet(ctx: durably.WorkflowContext) -> None:
            ctx.log.info("starting", extra={"tenant": "acme"})
            await ctx.local_step("hello", lambda: "hi")
            ctx.log.info("said hello")
            await ctx.sleep("1d")
            ctx.log.warning("woke up")

    caplog.set_level(logging.INFO, logger="durably")
    async with TestEnv(register) as env:
        run_id = await env.start("greet")
        await env.advance("1d")  # the second turn replays the first's code
        await env.assert_completed(run_id)
    lines = records(caplog, "durably.workflow")
    assert [r.getMessage() for r in lines] == ["starting", "said hello", "woke up"]
    first = lines[0]
    assert first.tenant == "acme"  # type: ignore[attr-defined]
    assert (first.run_id, first.workflow) == (run_id, "greet")  # type: ignore[attr-defined]


async def test_every_engine_record_carries_run_workflow_and_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def register(engine: durably.Engine) -> None:
        @engine.workflow("flaky")
        async def flaky(ctx: durably.WorkflowContext) -> None:
            await ctx.local_step("wobble", lambda: None, retries=1)
            raise ValueError("gave up")

    caplog.set_level(logging.INFO, logger="durably")
    async with TestEnv(register) as env:
        env.fail_step("wobble")
        run_id = await env.start("flaky")
        await env.advance("1m")
        await env.assert_failed(run_id, match="gave up")
    retry = next(r for r in caplog.records if "attempt 1 failed" in r.getMessage())
    assert (retry.run_id, retry.workflow) == (run_id, "flaky")  # type: ignore[attr-defined]
    failed = next(r for r in caplog.records if "failed: gave up" in r.getMessage())
    assert failed.name == "durably"
    assert (failed.run_id, failed.workflow) == (run_id, "flaky")  # type: ignore[attr-defined]
    assert failed.step is None  # type: ignore[attr-defined]
    for record in caplog.records:
        if record.name.startswith("durably"):
            assert hasattr(record, "run_id") and hasattr(record, "step"), record.getMessage()


async def test_a_sync_step_sees_the_callers_contextvars_and_logs_with_its_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[tuple[str, str | None]] = []

    app_log = logging.getLogger("app.steps")
    app_log.addFilter(durably.RunContextFilter())  # the app's own records get the run too

    def tagged(name: str) -> str:
        app_log.info("inside %s", name)
        return REQUEST_ID.get()

    def register(engine: durably.Engine) -> None:
        @engine.step("remote")
        def remote(data: str) -> str:
            return REQUEST_ID.get()

        @engine.workflow("ctxvars")
        async def ctxvars(ctx: durably.WorkflowContext) -> list[str]:
            local = await ctx.local_step("local", tagged, "local")
            return [local, await ctx.step(remote, "x")]

    caplog.set_level(logging.INFO)
    REQUEST_ID.set("req-42")
    async with TestEnv(register) as env:
        run_id = await env.start("ctxvars")
        run = await env.assert_completed(run_id)
    # The local step runs in a step thread with the turn's context (copied from
    # the caller that started the engine's work).
    assert run.output[0] == "req-42"
    inside = next(r for r in caplog.records if r.getMessage() == "inside local")
    seen.append((inside.run_id, inside.step))  # type: ignore[attr-defined]
    assert seen == [(run_id, "local")]


async def test_step_logger_goes_through_logging_and_still_records_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def register(engine: durably.Engine) -> None:
        @engine.step("import")
        def import_rows(data: int, log: durably.StepLogger) -> int:
            log.info("imported rows", rows=data)
            log.warn("slow source")
            return data

        @engine.workflow("etl")
        async def etl(ctx: durably.WorkflowContext) -> int:
            return int(await ctx.step(import_rows, 7))

    caplog.set_level(logging.INFO, logger="durably")
    async with TestEnv(register) as env:
        run_id = await env.start("etl")
        await env.assert_completed(run_id, output=7)
        history = await env.history(run_id)
    lines = records(caplog, "durably.step")
    assert [(r.levelno, r.getMessage()) for r in lines] == [
        (logging.INFO, "imported rows"),
        (logging.WARNING, "slow source"),
    ]
    assert lines[0].data == {"rows": 7}  # type: ignore[attr-defined]
    assert (lines[0].run_id, lines[0].step) == (run_id, "import")  # type: ignore[attr-defined]
    events = history[0].events or []
    assert [e["message"] for e in events] == ["imported rows", "slow source"]
