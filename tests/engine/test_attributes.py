"""Search attributes: set at start and by ``ctx.upsert_attributes``, read with
``get_attributes``, filtered in ``list_runs``, on every store."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.testing import eventually

from .conftest import EngineFactory

DUE = datetime(2026, 5, 1, 9, 0, tzinfo=timezone(timedelta(hours=2)))


def _ids(page: durably.RunPage) -> list[str]:
    return [run.run_id for run in page.runs]


async def test_attributes_set_at_start_and_in_the_body_are_merged_and_searchable(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext, total: int) -> str:
        ctx.upsert_attributes({"stage": "reserving", "total": total})
        await ctx.wait_for_signal(f"go:{ctx.run_id}")
        ctx.upsert_attributes({"stage": "shipped", "shipped": True})
        return "ok"

    async with engine:
        await engine.start(
            "order", 150, run_id="o1", attributes={"customer": "c-1", "due": DUE, "total": 0}
        )
        await engine.start("order", 40, run_id="o2", attributes={"customer": "c-1"})
        await engine.start("order", 500, run_id="o3", attributes={"customer": "c-2"})

        async def reserving() -> bool:
            page = await engine.list_runs(attributes=[("stage", "eq", "reserving")])
            return len(page.runs) == 3

        await eventually(reserving, what="the three runs' stage")
        assert await engine.get_attributes("o1") == {
            "customer": "c-1",
            "due": DUE.astimezone(UTC),
            "stage": "reserving",
            "total": 150,  # the body's value replaced the start's
        }
        assert (await engine.get_attributes("o1"))["due"].tzinfo is UTC
        big_for_c1 = [("customer", "eq", "c-1"), ("total", "gte", 100)]
        assert _ids(await engine.list_runs(attributes=big_for_c1)) == ["o1"]
        due_soon = [("due", "lt", datetime(2026, 5, 2, tzinfo=UTC))]
        assert _ids(await engine.list_runs(attributes=due_soon)) == ["o1"]
        # A run without the key never matches, not even ne.
        assert _ids(await engine.list_runs(attributes=[("due", "ne", DUE)])) == []

        await engine.signal("go:o1")
        assert (await engine.wait_for_run("o1", terminal=True, timeout=10)).output == "ok"
        assert _ids(await engine.list_runs(attributes={"shipped": True})) == ["o1"]
        assert (await engine.get_attributes("o1"))["stage"] == "shipped"
        history = await engine.history("o1")
        assert [cp.output for cp in history if cp.kind == "attributes"] == [
            {"stage": ["str", "reserving"], "total": ["int", 150]},
            {"stage": ["str", "shipped"], "shipped": ["bool", True]},
        ]


async def test_a_replay_does_not_write_the_attributes_again(make_engine: EngineFactory) -> None:
    engine = make_engine()
    writes: list[dict[str, Any]] = []
    upsert = engine.store.upsert_attributes

    async def counted(checkpoint: Any, attributes: dict[str, Any], owner: str) -> bool:
        writes.append(attributes)
        return await upsert(checkpoint, attributes, owner)

    engine.store.upsert_attributes = counted  # type: ignore[method-assign]

    @engine.workflow("turns")
    async def turns(ctx: durably.WorkflowContext) -> None:
        ctx.upsert_attributes({"n": 1})
        for i in range(3):
            await ctx.wait_for_signal(f"t:{i}")  # each signal is a new turn replaying the first

    async with engine:
        await engine.start("turns", run_id="t")
        for i in range(3):
            await eventually(lambda i=i: _waiting(engine, "t", i), what=f"wait {i}")
            await engine.signal(f"t:{i}")
        await engine.wait_for_run("t", terminal=True, timeout=10)

    assert writes == [{"n": 1}]


async def _waiting(engine: durably.Engine, run_id: str, n: int) -> bool:
    history = await engine.history(run_id)
    return sum(cp.kind == "signal" for cp in history) == n + 1


async def test_a_deleted_run_leaves_no_attributes_behind(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("quick")
    async def quick(ctx: durably.WorkflowContext) -> None:
        ctx.upsert_attributes({"batch": "b-7"})

    async with engine:
        await engine.start("quick", run_id="q", attributes={"customer": "c-9"})
        await engine.wait_for_run("q", terminal=True, timeout=10)
        assert _ids(await engine.list_runs(attributes={"batch": "b-7"})) == ["q"]
        assert await engine.delete_run("q")
        assert _ids(await engine.list_runs(attributes={"batch": "b-7"})) == []
        assert _ids(await engine.list_runs(attributes={"customer": "c-9"})) == []
        with pytest.raises(durably.RunNotFound):
            await engine.get_attributes("q")


@pytest.mark.parametrize(
    ("attributes", "error", "match"),
    [
        pytest.param({"x": object()}, TypeError, "str, int, float, bool or datetime", id="type"),
        pytest.param({"x": [1]}, TypeError, "not list", id="list"),
        pytest.param({"x": None}, TypeError, "not NoneType", id="none"),
        pytest.param({"": 1}, ValueError, "non-empty", id="empty-key"),
        pytest.param({"k" * 300: 1}, ValueError, "characters long", id="long-key"),
        pytest.param({"x": "v" * 300}, ValueError, "characters long", id="long-value"),
        pytest.param({"x": datetime(2026, 1, 1)}, ValueError, "timezone-aware", id="naive"),
        pytest.param({"x": 2**60}, ValueError, "out of range", id="huge-int"),
        pytest.param({"x": float("nan")}, ValueError, "finite", id="nan"),
        pytest.param(["x"], TypeError, "dict of key", id="not-a-dict"),
    ],
)
async def test_bad_attributes_are_refused_before_anything_is_stored(
    make_engine: EngineFactory, attributes: Any, error: type[Exception], match: str
) -> None:
    engine = make_engine()

    @engine.workflow("any")
    async def anything(ctx: durably.WorkflowContext) -> None:
        return None

    async with engine:
        with pytest.raises(error, match=match):
            await engine.start("any", run_id="bad", attributes=attributes)
        assert await engine.get_run("bad") is None


async def test_a_bad_upsert_in_the_body_fails_the_run_with_a_clear_error(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("bad-upsert")
    async def bad_upsert(ctx: durably.WorkflowContext) -> None:
        ctx.upsert_attributes({"when": {"day": 1}})

    async with engine:
        await engine.start("bad-upsert", run_id="b")
        result = await engine.wait_for_run("b", terminal=True, timeout=10)
        assert result.status is RunStatus.FAILED
        assert result.error is not None and "'when'" in result.error["message"]
        assert await engine.get_attributes("b") == {}


@pytest.mark.parametrize(
    ("filters", "match"),
    [
        pytest.param([("vip", "gt", True)], "only with eq or ne", id="bool-order"),
        pytest.param([("x", "like", "a")], "op must be one of", id="op"),
        pytest.param([("x", "eq")], "tuple", id="shape"),
        pytest.param([("x", "eq", [1])], "not list", id="value"),
    ],
)
async def test_bad_filters_are_refused(
    make_engine: EngineFactory, filters: Any, match: str
) -> None:
    engine = make_engine()
    async with engine:
        with pytest.raises((TypeError, ValueError), match=match):
            await engine.list_runs(attributes=filters)


async def test_list_runs_filters_by_several_statuses_and_by_parent(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("child")
    async def child(ctx: durably.WorkflowContext, n: int) -> int:
        if n == 1:
            raise durably.FatalError("no")
        return n

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext) -> None:
        await ctx.child("child", 0, run_id="c0")
        with contextlib.suppress(durably.ChildFailed):
            await ctx.child("child", 1, run_id="c1")

    async with engine:
        await engine.start("child", 5, run_id="alone")
        await engine.start("parent", run_id="p")
        await engine.wait_for_run("p", terminal=True, timeout=10)
        await engine.wait_for_run("alone", terminal=True, timeout=10)
        assert sorted(_ids(await engine.list_runs(parent_id="p"))) == ["c0", "c1"]
        ended = await engine.list_runs(status=["failed", RunStatus.COMPLETED], parent_id="p")
        assert sorted(_ids(ended)) == ["c0", "c1"]
        assert _ids(await engine.list_runs(status=["failed"])) == ["c1"]
        assert _ids(await engine.list_runs(status=[])) == []


async def test_static_tags_are_merged_with_the_start_tags(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("billing", tags=["billing", "team-a"])
    async def billing(ctx: durably.WorkflowContext) -> None:
        return None

    async with engine:
        handle = await engine.start("billing", run_id="b1", tags=["vip", "billing"])
        await engine.start("billing", run_id="b2")
        assert handle.run.tags == ["billing", "team-a", "vip"]
        stored = await engine.get_run("b2")
        assert stored is not None and stored.tags == ["billing", "team-a"]
        assert sorted(_ids(await engine.list_runs(tag="team-a"))) == ["b1", "b2"]
        assert _ids(await engine.list_runs(tag="vip")) == ["b1"]


@pytest.mark.parametrize("tags", [["ok", ""], "billing", ["x" * 300]])
def test_bad_static_tags_are_refused_at_registration(tags: Any) -> None:
    engine = durably.Engine("memory://")

    with pytest.raises(ValueError, match="tag"):

        @engine.workflow("w", tags=tags)
        async def w(ctx: durably.WorkflowContext) -> None:
            return None


async def test_continue_as_new_carries_the_attributes_to_the_next_link(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("counter")
    async def counter(ctx: durably.WorkflowContext, n: int) -> int:
        ctx.upsert_attributes({"round": n})
        if n < 2:
            ctx.continue_as_new(n + 1)
        return n

    async with engine:
        await engine.start("counter", 0, run_id="c", attributes={"customer": "c-5"})

        async def last_link_done() -> bool:
            page = await engine.list_runs(attributes={"customer": "c-5", "round": 2})
            return [run.status for run in page.runs] == [RunStatus.COMPLETED]

        await eventually(last_link_done, what="the last link, found by its attributes")
        assert len((await engine.list_runs(attributes={"customer": "c-5"})).runs) == 3
        rounds = await engine.list_runs(attributes=[("round", "lt", 2)])
        assert len(rounds.runs) == 2


async def test_cancel_where_takes_attribute_filters(make_engine: EngineFactory) -> None:
    engine = make_engine()

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> None:
        await ctx.wait_for_signal(f"go:{ctx.run_id}")

    async with engine:
        for n in range(4):
            await engine.start("waits", run_id=f"w{n}", attributes={"batch": n % 2})
        for n in range(4):
            await engine.wait_for_run(f"w{n}", timeout=30)

        done = await engine.cancel_where(attributes={"batch": 1})

        assert (done.matched, done.cancelled, done.more) == (2, 2, False)
        statuses = {run.run_id: run.status for run in (await engine.list_runs()).runs}
        assert statuses == {
            "w0": RunStatus.SUSPENDED,
            "w1": RunStatus.CANCELLED,
            "w2": RunStatus.SUSPENDED,
            "w3": RunStatus.CANCELLED,
        }
