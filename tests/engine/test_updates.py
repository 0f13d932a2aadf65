"""Updates: ``ctx.on_update`` handlers answered synchronously from the caller's view,
recorded in history, re-applied on replay, buffered, validated, deduplicated."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably._update_calls import UpdateCalls
from durably.model import CheckpointKind

from .conftest import EngineFactory


def cart_workflow(engine: durably.Engine, *, log: list[str] | None = None) -> None:
    """A cart: items added by updates while it waits for checkout."""

    @engine.workflow("cart")
    async def cart(ctx: durably.WorkflowContext) -> dict[str, Any]:
        items: list[str] = []

        def add(item: str) -> int:
            items.append(item)
            return len(items)

        def check(item: Any) -> str | None:
            if not isinstance(item, str) or not item:
                return "an item is a non-empty string"
            if item in items:
                raise ValueError(f"{item} is in the cart already")
            return None

        def boom(_: Any) -> None:
            items.append("half-done")
            raise RuntimeError("the handler broke")

        ctx.on_update("add", add, validator=check)
        ctx.on_update("boom", boom)
        ctx.set_value("ready", True)
        await ctx.wait_for_signal(f"checkout:{ctx.run_id}")
        if log is not None:
            log.append("after checkout")
        return {"items": items}


async def _ready(engine: durably.Engine, run_id: str) -> None:
    for _ in range(400):
        if await engine.get_value(run_id, "ready"):
            run = await engine.get_run(run_id)
            if run is not None and run.status is RunStatus.SUSPENDED:
                return
        await asyncio.sleep(0.025)
    raise AssertionError(f"run {run_id} never got ready")


async def test_an_update_is_accepted_recorded_and_its_state_survives_replay(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    cart_workflow(engine)
    async with engine:
        await engine.start("cart", run_id="c1")
        await _ready(engine, "c1")

        first = await engine.update("c1", "add", "apple", timeout=30)
        second = await engine.update("c1", "add", "pear", timeout=30)

        assert first.accepted and first.result == 1 and first.outcome == "accepted"
        assert second.accepted and second.result == 2
        assert second.run_id == "c1"
        history = await engine.history("c1")
        updates = [cp for cp in history if cp.kind == CheckpointKind.UPDATE]
        assert [cp.name for cp in updates] == ["update:add", "update:add"]
        assert [cp.output for cp in updates] == [1, 2]
        assert updates[0].input["payload"] == "apple"
        # The signal's turn replays both updates before the body goes on.
        await engine.signal("checkout:c1")
        result = await engine.wait_for_run("c1", terminal=True, timeout=30)
        assert result.output == {"items": ["apple", "pear"]}


async def test_a_validator_rejects_before_anything_is_recorded(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    cart_workflow(engine)
    async with engine:
        await engine.start("cart", run_id="c2")
        await _ready(engine, "c2")
        assert (await engine.update("c2", "add", "apple", timeout=30)).accepted

        by_string = await engine.update("c2", "add", "", timeout=30)
        by_raise = await engine.update("c2", "add", "apple", timeout=30)

        assert by_string.outcome == "rejected" and not by_string.accepted
        assert by_string.reason == "an item is a non-empty string"
        assert by_raise.outcome == "rejected" and by_raise.reason == "apple is in the cart already"
        history = await engine.history("c2")
        assert len([cp for cp in history if cp.kind == CheckpointKind.UPDATE]) == 1
        await engine.signal("checkout:c2")
        result = await engine.wait_for_run("c2", terminal=True, timeout=30)
        assert result.output == {"items": ["apple"]}


async def test_a_handler_that_raises_answers_failed_and_the_run_goes_on(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    cart_workflow(engine)
    async with engine:
        await engine.start("cart", run_id="c3")
        await _ready(engine, "c3")

        failed = await engine.update("c3", "boom", None, timeout=30)
        after = await engine.update("c3", "add", "kiwi", timeout=30)

        assert failed.outcome == "failed" and failed.reason == "the handler broke"
        assert failed.error is not None and failed.error["type"] == "RuntimeError"
        assert after.accepted and after.result == 2  # the failed handler's change stays
        await engine.signal("checkout:c3")
        result = await engine.wait_for_run("c3", terminal=True, timeout=30)
        # Replayed: the failed handler is applied again at the same point.
        assert result.output == {"items": ["half-done", "kiwi"]}


async def test_an_update_sent_before_the_handler_exists_is_buffered(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("late-handler")
    async def late_handler(ctx: durably.WorkflowContext) -> list[int]:
        seen: list[int] = []
        await ctx.wait_for_signal(f"open:{ctx.run_id}")
        ctx.on_update("push", lambda n: seen.append(n) or len(seen))
        await ctx.wait_condition(lambda: len(seen) >= 2)
        return seen

    async with engine:
        await engine.start("late-handler", run_id="l1")
        early = [
            asyncio.ensure_future(engine.update("l1", "push", n, update_id=f"u{n}", timeout=30))
            for n in (1, 2)
        ]
        await asyncio.sleep(0.2)
        assert not any(f.done() for f in early)
        await engine.signal("open:l1")

        answers = await asyncio.gather(*early)

        assert sorted(a.result for a in answers) == [1, 2]
        result = await engine.wait_for_run("l1", terminal=True, timeout=30)
        assert sorted(result.output) == [1, 2]


async def test_an_update_to_an_ended_run_or_one_that_ends_first_answers_ended(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("short")
    async def short(ctx: durably.WorkflowContext) -> str:
        ctx.on_update("ping", lambda _: "pong")
        return "done"

    @engine.workflow("no-handler")
    async def no_handler(ctx: durably.WorkflowContext) -> str:
        await ctx.wait_for_signal(f"end:{ctx.run_id}")
        return "done"

    async with engine:
        await engine.start("short", run_id="s1")
        await engine.wait_for_run("s1", terminal=True, timeout=30)
        ended = await engine.update("s1", "ping", timeout=30)
        assert ended.outcome == "ended" and not ended.accepted

        await engine.start("no-handler", run_id="n1")
        waiting = asyncio.ensure_future(engine.update("n1", "ping", timeout=30))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # no handler: it stays in the inbox
        await engine.signal("end:n1")
        answer = await waiting
        assert answer.outcome == "ended" and "completed" in (answer.reason or "")


async def test_a_retried_update_id_is_handled_once_with_the_same_answer(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    cart_workflow(engine)
    async with engine:
        await engine.start("cart", run_id="c4")
        await _ready(engine, "c4")

        answers = await asyncio.gather(
            *(engine.update("c4", "add", "plum", update_id="once", timeout=30) for _ in range(5))
        )
        again = await engine.update("c4", "add", "plum", update_id="once", timeout=30)

        assert {(a.outcome, a.result) for a in [*answers, again]} == {("accepted", 1)}
        history = await engine.history("c4")
        assert len([cp for cp in history if cp.kind == CheckpointKind.UPDATE]) == 1


async def test_updates_replay_after_a_restart_in_a_new_engine(
    make_engine: EngineFactory,
) -> None:
    first = make_engine()
    cart_workflow(first)
    async with first:
        await first.start("cart", run_id="c5")
        await _ready(first, "c5")
        assert (await first.update("c5", "add", "fig", timeout=30)).accepted
        assert (await first.update("c5", "add", "date", timeout=30)).result == 2

    log: list[str] = []
    second = make_engine()
    cart_workflow(second, log=log)
    async with second:
        # A turn after the restart replays the handlers, then takes more.
        assert (await second.update("c5", "add", "lime", timeout=30)).result == 3
        await second.signal("checkout:c5")
        result = await second.wait_for_run("c5", terminal=True, timeout=30)
        assert result.output == {"items": ["fig", "date", "lime"]}
        assert log == ["after checkout"]


async def test_a_condition_lets_the_body_go_on_after_updates_and_replays(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("counter")
    async def counter(ctx: durably.WorkflowContext) -> dict[str, Any]:
        total = 0
        stamps: list[int] = []

        def add(n: int) -> int:
            nonlocal total
            total += n
            return total

        ctx.on_update("add", add)
        await ctx.wait_condition(lambda: total >= 5)
        stamps.append(total)
        await ctx.sleep(0)  # a position after the condition
        await ctx.wait_condition(lambda: total >= 10)
        stamps.append(total)
        await ctx.wait_for_signal(f"end:{ctx.run_id}")
        return {"total": total, "stamps": stamps}

    async with engine:
        await engine.start("counter", run_id="k1")
        for n in (2, 3, 4, 6):
            assert (await engine.update("k1", "add", n, timeout=30)).accepted
        await engine.signal("end:k1")
        result = await engine.wait_for_run("k1", terminal=True, timeout=30)
        assert result.output == {"total": 15, "stamps": [5, 15]}


async def test_bad_update_calls_are_refused_up_front(make_engine: EngineFactory) -> None:
    engine = make_engine()
    cart_workflow(engine)

    @engine.workflow("bad-handler")
    async def bad_handler(ctx: durably.WorkflowContext) -> None:
        ctx.on_update("x", "not callable")  # type: ignore[arg-type]

    async with engine:
        with pytest.raises(durably.RunNotFound):
            await engine.update("nobody", "add", "x")
        await engine.start("cart", run_id="c6")
        with pytest.raises(ValueError, match="update name"):
            await engine.update("c6", "", "x")
        with pytest.raises(ValueError, match="update_id"):
            await engine.update("c6", "add", "x", update_id="")
        with pytest.raises(TypeError):
            await engine.update("c6", "add", object())
        await engine.start("bad-handler", run_id="b1")
        result = await engine.wait_for_run("b1", terminal=True, timeout=30)
        assert result.status is RunStatus.FAILED
        assert "not callable" in (result.error or {}).get("message", "")


async def test_a_handler_may_not_call_ctx(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("sneaky")
    async def sneaky(ctx: durably.WorkflowContext) -> None:
        async def handler(_: Any) -> None:
            await ctx.now()

        ctx.on_update("x", handler)
        await ctx.wait_for_signal(f"end:{ctx.run_id}")

    async with engine:
        await engine.start("sneaky", run_id="s2")
        answer = await engine.update("s2", "x", timeout=30)
        assert answer.outcome == "failed"
        assert "update handler" in (answer.reason or "")


async def test_a_history_with_updates_passes_the_replay_checker(
    make_engine: EngineFactory,
) -> None:
    from durably._history import history_to_json
    from durably.testing import assert_replayable
    from durably.testing.replay import ReplayMismatch

    engine = make_engine()
    cart_workflow(engine)
    async with engine:
        await engine.start("cart", run_id="c7")
        await _ready(engine, "c7")
        assert (await engine.update("c7", "add", "apple", timeout=30)).accepted
        run = await engine.get_run("c7")
        assert run is not None
        history = history_to_json(run, await engine.history("c7"))

    def same(engine: durably.Engine) -> None:
        cart_workflow(engine)

    await assert_replayable(same, history)

    def without_handler(engine: durably.Engine) -> None:
        @engine.workflow("cart")
        async def cart(ctx: durably.WorkflowContext) -> None:
            ctx.set_value("ready", True)
            await ctx.wait_for_signal(f"checkout:{ctx.run_id}")

    with pytest.raises(ReplayMismatch, match="no handler"):
        await assert_replayable(without_handler, history)


async def test_branches_see_updates_in_the_order_they_happened_on_every_replay(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("mix")
    async def mix(ctx: durably.WorkflowContext) -> list[str]:
        log: list[str] = []
        count = 0

        def bump(_: Any) -> int:
            nonlocal count
            count += 1
            log.append(f"update {count}")
            return count

        async def waiter() -> None:
            await ctx.wait_for_signal(f"go:{ctx.run_id}")
            log.append(f"signal saw {count}")
            await ctx.sleep(0)

        async def conditioned() -> None:
            await ctx.wait_condition(lambda: count >= 1)
            log.append(f"condition saw {count}")
            await ctx.uuid()

        ctx.on_update("bump", bump)
        await asyncio.gather(waiter(), conditioned())
        await ctx.wait_for_signal(f"end:{ctx.run_id}")
        log.append("end")
        return log

    async with engine:
        await engine.start("mix", run_id="m1")
        assert (await engine.update("m1", "bump", timeout=30)).result == 1
        assert (await engine.update("m1", "bump", timeout=30)).result == 2
        await engine.signal("go:m1")
        for _ in range(400):
            history = await engine.history("m1")
            if any(cp.name == "sleep" and cp.status == "completed" for cp in history):
                break
            await asyncio.sleep(0.025)
        assert (await engine.update("m1", "bump", timeout=30)).result == 3
        await engine.signal("end:m1")
        result = await engine.wait_for_run("m1", terminal=True, timeout=30)
        assert result.status is RunStatus.COMPLETED, result.error
        assert result.output == [
            "update 1",
            "condition saw 1",
            "update 2",
            "signal saw 2",
            "update 3",
            "end",
        ]


async def test_an_update_missing_from_a_live_run_is_not_reported_as_a_deleted_run(
    make_engine: EngineFactory,
) -> None:
    """The wait's last resort tells a lost update (its run exists) from a run
    that is gone: the loss of an update in a continue-as-new move read as
    "run ... no longer exists" and pointed away from the store."""
    engine = make_engine()
    cart_workflow(engine)
    async with engine:
        await engine.start("cart", run_id="c1")
        await _ready(engine, "c1")
        calls = UpdateCalls(engine.store, engine.clock, lambda _run_id: asyncio.sleep(0))
        try:
            lost = await calls.result("c1", "never-put", timeout=30)
            gone = await calls.result("no-such-run", "never-put", timeout=30)
        finally:
            await calls.close()
    assert lost.outcome == "ended"
    assert lost.reason == "update 'never-put' is not in the inbox of run 'c1'"
    assert gone.outcome == "ended"
    assert gone.reason == "run 'no-such-run' no longer exists"
