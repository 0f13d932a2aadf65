"""The app the CLI tests serve with ``durably worker --app cli_app:engine``.

The tests start the worker with this directory as its working directory (the
CLI puts the cwd on ``sys.path``) and the store in ``--store``, which the CLI
exports as ``DURABLY_DATABASE_URL`` before importing this module, so the
default ``Engine()`` below opens the test's database.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import durably

NOT_AN_ENGINE = 42
"""For the test of ``--app`` naming something that is not an engine."""


async def _nap(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "rested"


def _nap_blocking(seconds: float) -> str:
    time.sleep(seconds)  # a synchronous step: runs in a thread that cannot be interrupted
    return "rested"


def _fetch(order_id: str) -> dict[str, Any]:
    return {"order": order_id, "items": 3}


def _store(data: dict[str, Any]) -> str:
    return f"stored {data['order']}"


def register(engine: durably.Engine) -> durably.Engine:
    """Register the test workflows on ``engine`` and return it."""

    @engine.workflow("approval")
    async def approval(ctx: durably.WorkflowContext, order_id: str) -> dict[str, Any]:
        decision = await ctx.wait_for_signal(f"approve:{order_id}")
        return {"order": order_id, "decision": decision}

    @engine.workflow("slow")
    async def slow(ctx: durably.WorkflowContext, seconds: float) -> str:
        return await ctx.local_step("nap", _nap, seconds)

    @engine.workflow("slow-sync")
    async def slow_sync(ctx: durably.WorkflowContext, seconds: float) -> str:
        return await ctx.local_step("nap", _nap_blocking, seconds)

    @engine.workflow("pipeline")
    async def pipeline(ctx: durably.WorkflowContext, order_id: str) -> str:
        data = await ctx.local_step("fetch", _fetch, order_id)
        await ctx.sleep(0.05)
        return await ctx.local_step("store", _store, data)

    @engine.step("greet", group="front")
    def greet(name: str) -> str:
        return f"hello {name}"

    @engine.step("complain", retries=0)
    def complain(text: str) -> str:
        raise RuntimeError(f"complaint: {text}")

    @engine.workflow("complaint")
    async def complaint(ctx: durably.WorkflowContext, text: str) -> str:
        return str(await ctx.step("complain", text))

    @engine.workflow("greeting")
    async def greeting(ctx: durably.WorkflowContext, name: str) -> str:
        return str(await ctx.step("greet", name))

    @engine.workflow("await-event")
    async def await_event(ctx: durably.WorkflowContext, order_id: str) -> Any:
        return await ctx.wait_for_event("order.paid", match={"order": order_id})

    return engine


engine = register(durably.Engine(poll_interval=0.1))
