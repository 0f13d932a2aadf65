"""Where a run meets the outside: published values, external tasks, webhooks, breakpoints."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import durably
import durably.webhooks
from durably import RunStatus
from durably.model import TERMINAL_STATUSES
from durably.testing import VirtualClock, eventually

from .conftest import EngineFactory

# -- values ---------------------------------------------------------------------------


async def test_a_published_value_is_readable_while_the_run_waits_and_after_it_ended(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("progress")
    async def progress(ctx: durably.WorkflowContext) -> str:
        ctx.set_value("stage", "reserving")
        ctx.set_value("stage", "awaiting approval")
        ctx.set_value("total", {"amount": 120, "currency": "EUR"})
        await ctx.wait_for_signal(f"go:{ctx.run_id}")
        ctx.set_value("stage", "done")
        return "ok"

    async with engine:
        await engine.start("progress", run_id="p1")
        await eventually(
            lambda: _equals(engine.get_value("p1", "stage"), "awaiting approval"),
            what="the value set before the wait",
        )
        assert await engine.get_value("p1", "total") == {"amount": 120, "currency": "EUR"}
        assert await engine.get_value("p1", "missing") is None
        assert await engine.get_value("p1", "missing", default=0) == 0
        await engine.signal("go:p1")
        result = await engine.wait_for_run("p1", terminal=True, timeout=10)
        assert result.output == "ok"
        assert await engine.get_value("p1", "stage") == "done"  # the last write wins


async def test_get_value_of_an_unknown_run_raises_run_not_found(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    async with engine:
        with pytest.raises(durably.RunNotFound):
            await engine.get_value("nobody", "stage")
        with pytest.raises(ValueError, match="non-empty key"):
            await engine.get_value("nobody", "")


async def test_a_value_that_is_not_json_fails_the_run_with_a_clear_error(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("bad-value")
    async def bad_value(ctx: durably.WorkflowContext) -> None:
        ctx.set_value("x", object())

    async with engine:
        await engine.start("bad-value", run_id="b")
        result = await engine.wait_for_run("b", terminal=True, timeout=10)
        assert result.status is RunStatus.FAILED
        assert result.error is not None and "the value of 'x'" in result.error["message"]


# -- external tasks -------------------------------------------------------------------


async def test_a_task_is_dispatched_once_and_its_completion_is_the_awaited_result(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    handed: list[str] = []

    async def send_for_review(token: str, doc: str) -> dict[str, str]:
        handed.append(token)
        return {"ticket": f"T-{doc}"}

    @engine.workflow("review")
    async def review(ctx: durably.WorkflowContext, doc: str) -> Any:
        verdict = await ctx.task("review", send_for_review, doc)
        return {"verdict": verdict}

    async with engine:
        await engine.start("review", "d1", run_id="r1")
        await eventually(lambda: len(handed) == 1, what="the dispatch")
        await eventually(
            lambda: _equals(_status(engine, "r1"), RunStatus.SUSPENDED), what="the durable wait"
        )
        token = handed[0]
        assert token.startswith("task:") and token.endswith(":r1")
        assert await engine.complete_task(token, {"approved": True}) is True
        result = await engine.wait_for_run("r1", terminal=True, timeout=10)
        assert result.output == {"verdict": {"approved": True}}
        # A duplicate completion changes nothing and buffers nothing.
        assert await engine.complete_task(token, {"approved": False}) is False
        assert await engine.store.list_buffered_signals(token) == []
        assert handed == [token]
        history = await engine.history("r1")
        assert [c.kind for c in history] == ["task", "signal"]
        assert history[0].output == {"ticket": "T-d1"}


async def test_a_failed_task_raises_fatal_error_in_the_body(make_engine: EngineFactory) -> None:
    engine = make_engine()
    tokens: list[str] = []

    @engine.workflow("failing-task")
    async def failing(ctx: durably.WorkflowContext) -> Any:
        try:
            await ctx.task("charge", tokens.append)
        except durably.FatalError as exc:
            return {"caught": str(exc), "code": exc.code}
        return "not reached"

    async with engine:
        await engine.start("failing-task", run_id="f1")
        await eventually(lambda: len(tokens) == 1, what="the dispatch")
        assert await engine.fail_task(tokens[0], "card declined", code="declined") is True
        result = await engine.wait_for_run("f1", terminal=True, timeout=10)
        assert result.output == {"caught": "card declined", "code": "declined"}
        assert await engine.complete_task(tokens[0], 1) is False


async def test_a_completion_sent_from_inside_the_dispatch_is_not_lost(
    make_engine: EngineFactory,
) -> None:
    """The dispatch runs before the wait registers: its completion is buffered for it."""
    engine = make_engine()

    @engine.workflow("instant")
    async def instant(ctx: durably.WorkflowContext) -> Any:
        async def dispatch(token: str) -> None:
            assert await engine.complete_task(token, "at once") is True

        return await ctx.task("instant", dispatch)

    async with engine:
        await engine.start("instant", run_id="i1")
        result = await engine.wait_for_run("i1", terminal=True, timeout=10)
        assert result.output == "at once"


async def test_forged_and_malformed_task_tokens_are_refused(make_engine: EngineFactory) -> None:
    engine = make_engine()
    tokens: list[str] = []

    @engine.workflow("t")
    async def t(ctx: durably.WorkflowContext) -> Any:
        return await ctx.task("t", tokens.append)

    async with engine:
        await engine.start("t", run_id="t1")
        await eventually(lambda: len(tokens) == 1, what="the dispatch")
        await eventually(
            lambda: _equals(_status(engine, "t1"), RunStatus.SUSPENDED), what="the durable wait"
        )
        kind, secret, seq, run_id = tokens[0].split(":", 3)
        forged = f"{kind}:{'A' * len(secret)}:{seq}:{run_id}"
        for bad in (forged, f"task:{secret}:{int(seq) + 5}:{run_id}", f"task:{secret}:0:other"):
            with pytest.raises(ValueError, match="unknown task token"):
                await engine.complete_task(bad, "x")
            assert await engine.store.list_buffered_signals(bad) == []
        for malformed in ("nope", "task:x:y:z", "wh:a:1:t1"):
            with pytest.raises(ValueError, match="not a task token"):
                await engine.complete_task(malformed, "x")
        assert (await engine.get_run("t1")).status is RunStatus.SUSPENDED  # type: ignore[union-attr]
        assert await engine.complete_task(tokens[0], "real") is True
        assert (await engine.wait_for_run("t1", terminal=True, timeout=10)).output == "real"


async def test_a_dispatch_that_raises_fails_the_step_and_is_not_dispatched_again(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    calls: list[str] = []

    def broken(token: str) -> None:
        calls.append(token)
        raise RuntimeError("queue unreachable")

    @engine.workflow("broken-dispatch")
    async def wf(ctx: durably.WorkflowContext) -> Any:
        try:
            await ctx.task("b", broken)
        except durably.StepFailed as exc:
            await ctx.sleep(0.01)  # a second turn replays the failed task
            return f"failed: {exc}"
        return "no"

    async with engine:
        await engine.start("broken-dispatch", run_id="bd")
        result = await engine.wait_for_run("bd", terminal=True, timeout=10)
        assert result.output is not None and "queue unreachable" in result.output
        assert len(calls) == 1


async def test_a_dispatch_interrupted_by_a_crash_runs_again_with_the_same_token(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    first = make_engine(clock=clock, drive=False)
    tokens: list[str] = []
    stuck = asyncio.Event()

    async def dispatch(token: str) -> str:
        tokens.append(token)
        if len(tokens) == 1:
            stuck.set()
            await asyncio.Event().wait()  # the process dies here
        return "sent"

    def register(engine: durably.Engine) -> None:
        @engine.workflow("crashy")
        async def crashy(ctx: durably.WorkflowContext) -> Any:
            return await ctx.task("crashy", dispatch)

    register(first)
    await first.start("crashy", run_id="c1")
    turn = asyncio.create_task(first.run_one("c1"))
    await asyncio.wait_for(stuck.wait(), 10)
    turn.cancel()  # the turn stops mid-dispatch, its lease left to run out
    with pytest.raises(asyncio.CancelledError):
        await turn

    second = make_engine(clock=clock, drive=False)
    register(second)
    clock.advance(second.lease_ms / 1000 + 1)
    assert await second.recover_incomplete() == 1
    await second.run_one("c1")
    assert len(tokens) == 2
    assert tokens[0] == tokens[1]
    assert await second.complete_task(tokens[0], "done") is True
    await second.run_one("c1")
    await eventually(lambda: _equals(_status(second, "c1"), RunStatus.COMPLETED), what="the end")


# -- webhooks -------------------------------------------------------------------------


async def test_a_webhook_receives_the_body_posted_to_its_token(make_engine: EngineFactory) -> None:
    engine = make_engine(webhook_base_url="https://api.example.com/hooks/")
    made: list[durably.Webhook] = []

    @engine.workflow("hooked")
    async def hooked(ctx: durably.WorkflowContext) -> Any:
        hook = await ctx.webhook()
        made.append(hook)
        return await hook.wait(timeout="1d")

    async with engine:
        await engine.start("hooked", run_id="h1")
        await eventually(lambda: len(made) >= 1, what="the webhook")
        hook = made[0]
        assert hook.token.startswith("wh:") and hook.token.endswith(":h1")
        assert hook.url is not None
        assert hook.url.startswith("https://api.example.com/hooks/wh%3A")
        assert hook.token not in repr(hook)
        assert await engine.deliver_webhook(hook.token, {"paid": True}) is True
        result = await engine.wait_for_run("h1", terminal=True, timeout=10)
        assert result.output == {"paid": True}
        # Every replay made the same token: one webhook, one secret.
        assert {h.token for h in made} == {hook.token}
        # The run ended: a late post is refused, not buffered.
        assert await engine.deliver_webhook(hook.token, {"late": 1}) is False


async def test_a_forged_webhook_token_delivers_and_buffers_nothing(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    made: list[durably.Webhook] = []

    @engine.workflow("hooked")
    async def hooked(ctx: durably.WorkflowContext) -> Any:
        hook = await ctx.webhook()
        made.append(hook)
        return await hook.wait()

    async with engine:
        await engine.start("hooked", run_id="h2")
        await eventually(lambda: len(made) >= 1, what="the webhook")
        _, secret, seq, run_id = made[0].token.split(":", 3)
        flipped = ("B" if secret[0] == "A" else "A") + secret[1:]
        for forged in (
            f"wh:{flipped}:{seq}:{run_id}",
            f"wh:{secret}:{int(seq) + 1}:{run_id}",
            f"wh:{secret}:{seq}:other-run",
            "wh:::",
            "",
            "x" * 300,
        ):
            assert await engine.deliver_webhook(forged, {"evil": True}) is False
            if forged:
                assert await engine.store.list_buffered_signals(forged[:255]) == []
        await eventually(
            lambda: _equals(_status(engine, "h2"), RunStatus.SUSPENDED), what="the wait"
        )
        assert await engine.deliver_webhook(made[0].token, "real") is True
        assert (await engine.wait_for_run("h2", terminal=True, timeout=10)).output == "real"


async def test_the_webhook_asgi_app_answers_by_status(make_engine: EngineFactory) -> None:
    engine = make_engine()
    made: list[durably.Webhook] = []

    @engine.workflow("hooked")
    async def hooked(ctx: durably.WorkflowContext) -> Any:
        hook = await ctx.webhook()
        made.append(hook)
        return await hook.wait()

    app = durably.webhooks.app(engine, max_body=1000)
    async with engine:
        await engine.start("hooked", run_id="h3")
        await eventually(lambda: len(made) >= 1, what="the webhook")
        quoted = "/hooks/" + made[0].token.replace(":", "%3A")
        assert await _call(app, "GET", quoted) == (405, {"error": "POST a JSON body"})
        assert (await _call(app, "POST", quoted, b"x" * 1001))[0] == 413
        assert (await _call(app, "POST", quoted, b"{not json"))[0] == 400
        assert (await _call(app, "POST", "/hooks/wh%3Aforged%3A0%3Ah3", b"{}"))[0] == 404
        assert await _call(app, "POST", quoted, b'{"n": 1}') == (202, {"delivered": True})
        result = await engine.wait_for_run("h3", terminal=True, timeout=10)
        assert result.output == {"n": 1}


# -- breakpoints ----------------------------------------------------------------------


async def test_a_breakpoint_pauses_the_run_until_resumed(make_engine: EngineFactory) -> None:
    engine = make_engine()
    charged: list[int] = []

    @engine.workflow("careful")
    async def careful(ctx: durably.WorkflowContext) -> str:
        await ctx.breakpoint("before-charge")
        charged.append(1)
        return "charged"

    async with engine:
        await engine.start("careful", run_id="k1")
        await eventually(
            lambda: _equals(_status(engine, "k1"), RunStatus.SUSPENDED), what="the pause"
        )
        history = await engine.history("k1")
        assert [(c.name, c.status) for c in history] == [("breakpoint:before-charge", "pending")]
        assert charged == []
        assert await engine.resume("k1") is True
        result = await engine.wait_for_run("k1", terminal=True, timeout=10)
        assert result.output == "charged" and charged == [1]
        assert await engine.resume("k1") is False  # an ended run is left alone
        with pytest.raises(durably.RunNotFound):
            await engine.resume("nobody")


async def test_resume_without_a_breakpoint_buffers_nothing_for_a_later_one(
    make_engine: EngineFactory,
) -> None:
    """A resume sent early must not let a breakpoint reached later pass by itself."""
    engine = make_engine()

    @engine.workflow("later")
    async def later(ctx: durably.WorkflowContext) -> str:
        await ctx.wait_for_signal(f"first:{ctx.run_id}")
        await ctx.breakpoint()
        return "passed"

    async with engine:
        await engine.start("later", run_id="l1")
        await eventually(lambda: _equals(_status(engine, "l1"), RunStatus.SUSPENDED), what="wait")
        assert await engine.resume("l1") is True
        await engine.signal("first:l1")
        await eventually(
            lambda: _equals(_names(engine, "l1"), ["signal:first:l1", "breakpoint:breakpoint"])
        )
        await eventually(lambda: _equals(_status(engine, "l1"), RunStatus.SUSPENDED), what="pause")
        # The promise is about the breakpoint, not the run's status at one instant: the
        # signal's wake may land during the turn the early resume started, and the extra
        # turn it causes replays back to the pause (RUNNING for a moment).
        paused = (await engine.history("l1"))[-1]
        assert paused.name == "breakpoint:breakpoint"
        assert paused.status is durably.CheckpointStatus.PENDING
        assert (await engine.get_run("l1")).status not in TERMINAL_STATUSES  # type: ignore[union-attr]
        await engine.resume("l1")
        assert (await engine.wait_for_run("l1", terminal=True, timeout=10)).output == "passed"


# -- helpers --------------------------------------------------------------------------


async def _equals(value: Any, expected: Any) -> bool:
    got = await value
    assert got == expected, f"{got!r}, not yet {expected!r}"
    return True


async def _status(engine: durably.Engine, run_id: str) -> RunStatus | None:
    run = await engine.get_run(run_id)
    return None if run is None else run.status


async def _names(engine: durably.Engine, run_id: str) -> list[str]:
    return [c.name for c in await engine.history(run_id)]


async def _call(app: Any, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    """One request through the ASGI app, as a server would make it."""
    sent: list[dict[str, Any]] = []
    chunks = [body[i : i + 400] for i in range(0, len(body), 400)] or [b""]

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path}, receive, send)
    status = sent[0]["status"]
    return status, json.loads(sent[1]["body"])
