"""A compensating cancel replays history only: a signal or event wait it reaches
for the first time parks without registering a waiter or taking a buffered message.

Taking one would hand a message meant for a live run to a run that is being
undone, and leave a pending wait recorded on a run that is about to end.
"""

from __future__ import annotations

from typing import Literal

import pytest

import durably
from durably import RunStatus

from .conftest import EngineFactory

Kind = Literal["signal", "event"]


@pytest.mark.parametrize("new_wait", ["signal", "event"])
async def test_a_compensating_cancel_takes_no_buffered_message_for_a_new_wait(
    make_engine: EngineFactory, new_wait: Kind
) -> None:
    engine = make_engine()
    sender = make_engine(drive=False)
    undone: list[str] = []
    first: Kind = "event" if new_wait == "signal" else "signal"

    async def wait(ctx: durably.WorkflowContext, kind: Kind, name: str) -> object:
        if kind == "signal":
            return await ctx.wait_for_signal(name)
        return await ctx.wait_for_event(name)

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("reserve", lambda: "R", compensate=lambda r: undone.append(r))
        await wait(ctx, first, "first")
        await wait(ctx, new_wait, "second")

    async def send(kind: Kind, name: str, payload: str) -> None:
        if kind == "signal":
            await sender.signal(name, payload)
        else:
            await sender.publish_event(name, payload)

    await engine.open()
    await engine.start("order", run_id="o")
    await engine.join()
    # Stamped only (no worker loop runs here): the run replays both on the cancel's turn.
    await send(first, "first", "one")
    await send(new_wait, "second", "two")  # nobody waits yet: buffered
    assert await engine.cancel("o", compensate=True) is RunStatus.SUSPENDED
    result = await engine.wait_for_run("o", terminal=True, timeout=10)
    history = [c.name for c in await engine.history("o") if c.seq >= 0]
    if new_wait == "signal":
        buffered = await engine.store.list_buffered_signals("second")
    else:
        buffered = await engine.store.list_buffered_events("second")

    assert result.status is RunStatus.CANCELLED and undone == ["R"]
    assert buffered == ["two"]
    assert history == ["reserve", f"{first}:first"]


@pytest.mark.parametrize("new_wait", ["signal", "event"])
async def test_a_compensating_cancel_registers_no_waiter_for_a_new_wait(
    make_engine: EngineFactory, new_wait: Kind
) -> None:
    """With nothing buffered, the new wait must not leave a waiter behind
    that would swallow a later message meant for another run."""
    engine = make_engine()
    sender = make_engine(drive=False)
    undone: list[str] = []
    first: Kind = "event" if new_wait == "signal" else "signal"

    async def wait(ctx: durably.WorkflowContext, kind: Kind, name: str) -> object:
        if kind == "signal":
            return await ctx.wait_for_signal(name)
        return await ctx.wait_for_event(name)

    @engine.workflow("order")
    async def order(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("reserve", lambda: "R", compensate=lambda r: undone.append(r))
        await wait(ctx, first, "first")
        await wait(ctx, new_wait, "second")

    await engine.open()
    await engine.start("order", run_id="o")
    await engine.join()
    if first == "signal":
        await sender.signal("first", "one")
    else:
        await sender.publish_event("first", "one")
    assert await engine.cancel("o", compensate=True) is RunStatus.SUSPENDED
    result = await engine.wait_for_run("o", terminal=True, timeout=10)
    assert result.status is RunStatus.CANCELLED and undone == ["R"]
    # Sent after the run ended: nobody waits, so the message is kept for the next waiter.
    if new_wait == "signal":
        assert await sender.signal("second", "late") is None
        assert await engine.store.list_buffered_signals("second") == ["late"]
    else:
        assert await sender.publish_event("second", "late") == 0
        assert await engine.store.list_buffered_events("second") == ["late"]
    assert [c.name for c in await engine.history("o") if c.seq >= 0] == [
        "reserve",
        f"{first}:first",
    ]
