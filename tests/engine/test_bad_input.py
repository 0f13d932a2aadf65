"""Bad input gets a durably error naming the field, the same on every store.

Deep nesting once raised a raw ``RecursionError``, a lone surrogate a raw
``UnicodeEncodeError`` (or a driver error), an out-of-range priority a driver
error, and NaN or infinity was stored as non-standard JSON by the SQL stores
while the memory store kept the float.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
import pytest

import durably
from durably import RunStatus, SchemaValidationError
from durably.errors import UnstorableValue


def _deep(depth: int = 100_000) -> list[Any]:
    outer: list[Any] = []
    inner = outer
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


class Reading(pydantic.BaseModel):
    value: float
    note: str | None = None


BAD_VALUES: dict[str, tuple[Any, str]] = {
    "nan": (float("nan"), "NaN"),
    "infinity": ({"total": float("inf")}, "NaN and infinity"),
    # msgspec writes NaN as null: a None beside it must not hide it.
    "nan beside null": ({"note": None, "total": float("nan")}, "NaN and infinity"),
    "nan in a model": ([Reading(value=float("-inf"))], "NaN and infinity"),
    "surrogate": (["caf\udce9.txt"], "not valid Unicode"),
    "deep": (_deep(), "nested too deeply"),
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
async def test_unstorable_values_are_refused_naming_the_field(
    store_url: str,
    kind: str,
) -> None:
    value, problem = BAD_VALUES[kind]
    engine = durably.Engine(store_url, poll_interval=0.05)

    async def give(_: int) -> Any:
        return value

    @engine.workflow("wf")
    async def wf(ctx: durably.WorkflowContext, where: str) -> Any:
        if where == "step":
            await ctx.local_step("give", give, 1)
        elif where == "output":
            return value
        return "ok"

    refusals: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("input", lambda: engine.start("wf", value)),
        ("signal payload", lambda: engine.signal("token", value)),
        ("event payload", lambda: engine.publish_event("evt", value)),
    ]
    async with engine:
        for field, call in refusals:
            with pytest.raises(SchemaValidationError) as caught:
                await call()
            assert field in str(caught.value) and problem in str(caught.value), caught.value
        for where, field in (("step", "step result"), ("output", "workflow output")):
            await engine.start("wf", where, run_id=where)
            run = await engine.wait_for_run(where, terminal=True, timeout=30)
            assert run.status is RunStatus.FAILED, (run.status, run.output)
            message = str((run.error or {}).get("message"))
            assert field in message and problem in message, message
        # Nothing unstorable reached the store: the engine still serves.
        await engine.start("wf", "plain", run_id="after")
        after = await engine.wait_for_run("after", terminal=True, timeout=30)
        assert after.status is RunStatus.COMPLETED


async def test_a_priority_beyond_what_stores_keep_is_refused(
    store_url: str,
) -> None:
    engine = durably.Engine(store_url, poll_interval=0.05)

    @engine.workflow("wf")
    async def wf(ctx: durably.WorkflowContext) -> str:
        return "ok"

    async with engine:
        for priority in (2**31, -(2**31) - 1):
            with pytest.raises(UnstorableValue, match="priority"):
                await engine.start("wf", priority=priority)
        run = await engine.start("wf", priority=2**31 - 1)
        done = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
        assert done.status is RunStatus.COMPLETED


async def test_a_duration_beyond_what_stores_keep_is_refused(
    store_url: str,
) -> None:
    engine = durably.Engine(store_url, poll_interval=0.05)

    @engine.workflow("wf")
    async def wf(ctx: durably.WorkflowContext, seconds: str) -> str:
        await ctx.sleep(float(seconds))
        return "ok"

    async with engine:
        for seconds in ("1e20", "inf"):
            with pytest.raises(ValueError, match="start_at is too long"):
                await engine.start("wf", "0", start_at=float(seconds))
            run = await engine.start("wf", seconds)
            done = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
            assert done.status is RunStatus.FAILED
            assert "sleep duration is too long" in str((done.error or {}).get("message"))
