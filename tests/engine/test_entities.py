"""Entities: one durable run per key, operations serialized and exactly once,
state and reply recorded together, a raising handler answered, history bounded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.model import CheckpointKind

from .conftest import EngineFactory


def add(state: dict[str, Any], n: int) -> tuple[dict[str, Any], int]:
    state["count"] += n
    return state, state["count"]


def explode(state: dict[str, Any], _: Any) -> tuple[dict[str, Any], None]:
    state["count"] = -999  # changed, then raised: the entity keeps its state
    raise ValueError("cannot do that")


def counter(engine: durably.Engine, ops_per_run: int = 100) -> None:
    engine.entity(
        "counter",
        initial_state={"count": 0},
        handlers={"add": add, "explode": explode},
        ops_per_run=ops_per_run,
    )


async def test_calls_apply_in_order_and_the_state_is_readable(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    counter(engine)
    async with engine:
        assert await engine.get_entity_state("counter", "a") == {"count": 0}
        assert await engine.get_run("entity:counter:a") is None  # reading creates nothing

        assert await engine.call_entity("counter", "a", "add", 2, timeout=30) == 2
        assert await engine.call_entity("counter", "a", "add", 3, timeout=30) == 5
        assert await engine.call_entity("counter", "b", "add", 7, timeout=30) == 7

        assert await engine.get_entity_state("counter", "a") == {"count": 5}
        assert await engine.get_entity_state("counter", "b") == {"count": 7}
        history = await engine.history("entity:counter:a")
        entries = [cp for cp in history if cp.kind == CheckpointKind.UPDATE]
        # State and reply recorded together.
        assert [cp.output for cp in entries] == [
            {"state": {"count": 2}, "reply": 2},
            {"state": {"count": 5}, "reply": 5},
        ]


async def test_a_raising_handler_answers_its_caller_and_later_calls_work(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    counter(engine)
    async with engine:
        assert await engine.call_entity("counter", "x", "add", 1, timeout=30) == 1
        with pytest.raises(durably.EntityError, match="cannot do that") as caught:
            await engine.call_entity("counter", "x", "explode", timeout=30)
        assert caught.value.outcome == "failed" and caught.value.op == "explode"
        assert await engine.get_entity_state("counter", "x") == {"count": 1}
        assert await engine.call_entity("counter", "x", "add", 1, timeout=30) == 2


async def test_continue_as_new_every_n_ops_keeps_the_state_and_loses_no_call(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    counter(engine, ops_per_run=3)
    async with engine:
        replies = await asyncio.gather(
            *(engine.call_entity("counter", "k", "add", 1, timeout=60) for _ in range(20))
        )
        assert sorted(replies) == list(range(1, 21))
        assert await engine.get_entity_state("counter", "k") == {"count": 20}
        first = await engine.get_run("entity:counter:k")
        assert first is not None and first.status is RunStatus.COMPLETED
        # Bounded history: no link holds more than ops_per_run operations.
        link, links = "entity:counter:k", 0
        while True:
            run = await engine.get_run(link)
            if run is None:
                break
            links += 1
            history = await engine.history(link)
            assert len([cp for cp in history if cp.kind == CheckpointKind.UPDATE]) <= 3
            link = f"entity:counter:k~{links}"
        assert links >= 7
        assert await engine.call_entity("counter", "k", "add", 1, timeout=30) == 21


async def test_signal_entity_is_applied_once_per_update_id(make_engine: EngineFactory) -> None:
    engine = make_engine()
    counter(engine)
    async with engine:
        for _ in range(3):
            await engine.signal_entity("counter", "s", "add", 5, update_id="deposit-1")
        assert await engine.call_entity("counter", "s", "add", 0, timeout=30) == 5
        again = await engine.call_entity("counter", "s", "add", 0, update_id="probe", timeout=30)
        assert again == 5
        # A retried call returns the first reply, applying nothing.
        assert await engine.call_entity("counter", "s", "add", 9, update_id="probe") == 5
        assert await engine.get_entity_state("counter", "s") == {"count": 5}


async def test_a_workflow_calls_an_entity_once_even_when_replayed(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    counter(engine)

    @engine.workflow("uses-counter")
    async def uses(ctx: durably.WorkflowContext) -> list[Any]:
        first = await ctx.call_entity("counter", "w", "add", 10)
        await ctx.sleep(0.01)  # another turn: the call replays from history
        second = await ctx.call_entity("counter", "w", "add", 1)
        try:
            await ctx.call_entity("counter", "w", "explode")
        except durably.StepFailed as exc:
            failed = exc.message if hasattr(exc, "message") else str(exc)
        return [first, second, "cannot do that" in str(failed)]

    async with engine:
        await engine.start("uses-counter", run_id="u1")
        result = await engine.wait_for_run("u1", terminal=True, timeout=30)
        assert result.output == [10, 11, True], result
        assert await engine.get_entity_state("counter", "w") == {"count": 11}


async def test_bad_entity_input_is_refused_with_clear_errors(make_engine: EngineFactory) -> None:
    engine = make_engine()
    counter(engine)
    with pytest.raises(ValueError, match="may not contain"):
        engine.entity("a:b", handlers={"x": add})
    with pytest.raises(ValueError, match="non-empty mapping"):
        engine.entity("empty", handlers={})
    with pytest.raises(TypeError, match="not callable"):
        engine.entity("bad", handlers={"x": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="ops_per_run"):
        engine.entity("bad", handlers={"x": add}, ops_per_run=0)
    with pytest.raises(TypeError):
        engine.entity("bad", handlers={"x": add}, initial_state=object())
    async with engine:
        with pytest.raises(ValueError, match="no operation 'nope'"):
            await engine.call_entity("counter", "a", "nope")
        with pytest.raises(ValueError, match="key"):
            await engine.call_entity("counter", "", "add", 1)
        with pytest.raises(ValueError, match="digits"):
            await engine.call_entity("counter", "k~2", "add", 1)
        with pytest.raises(ValueError, match="entity name"):
            await engine.call_entity("", "k", "add", 1)
        assert await engine.get_run("entity:counter:a") is None  # nothing half-made


async def test_a_client_reaches_an_entity_by_name_and_an_unknown_op_is_refused(
    make_engine: EngineFactory, store_url: str
) -> None:
    engine = make_engine()
    counter(engine)
    async with engine:
        store: Any = engine.store if store_url == "memory://" else store_url
        async with durably.Client(store=store) as client:
            assert await client.call_entity("counter", "c", "add", 4, timeout=30) == 4
            with pytest.raises(durably.EntityError, match="no such operation") as caught:
                await client.call_entity("counter", "c", "nope", timeout=30)
            assert caught.value.outcome == "rejected"
            await client.signal_entity("counter", "c", "add", 1, update_id="one")
            assert await engine.call_entity("counter", "c", "add", 0, timeout=30) == 5
            assert await client.get_entity_state("counter", "c") == {"count": 5}


async def test_a_workflow_signals_an_entity_once(make_engine: EngineFactory) -> None:
    engine = make_engine()
    counter(engine)

    @engine.workflow("feeds-counter")
    async def feeds(ctx: durably.WorkflowContext) -> str:
        sent = await ctx.signal_entity("counter", "f", "add", 3)
        await ctx.sleep(0.01)  # another turn: the signal replays from history
        return sent

    async with engine:
        await engine.start("feeds-counter", run_id="f1")
        result = await engine.wait_for_run("f1", terminal=True, timeout=30)
        assert result.status is RunStatus.COMPLETED and isinstance(result.output, str)
        assert await engine.call_entity("counter", "f", "add", 0, timeout=30) == 3


async def test_a_call_to_a_cancelled_entity_answers_ended(make_engine: EngineFactory) -> None:
    engine = make_engine()
    counter(engine)
    async with engine:
        assert await engine.call_entity("counter", "gone", "add", 1, timeout=30) == 1
        await engine.cancel("entity:counter:gone")
        with pytest.raises(durably.EntityError) as caught:
            await engine.call_entity("counter", "gone", "add", 1, timeout=30)
        assert caught.value.outcome == "ended"
        assert await engine.get_entity_state("counter", "gone") == {"count": 1}
