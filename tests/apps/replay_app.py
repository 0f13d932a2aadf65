"""The app ``durably replay-check --app replay_app:engine`` loads in the CLI tests;
``REPLAY_APP_BODY`` picks the version of the workflow's code being checked."""

from __future__ import annotations

import os

import durably

engine = durably.Engine("memory://")
BODY = os.environ.get("REPLAY_APP_BODY", "original")


@engine.workflow("order")
async def order(ctx: durably.WorkflowContext, order_id: str) -> str:
    await ctx.local_step("reserve", lambda: f"reserved {order_id}")
    if BODY == "inserted":
        await ctx.local_step("fraud-check", lambda: "ok")
    await ctx.sleep("1d")
    await ctx.local_step("charge", lambda: f"charged {order_id}")
    return "done"
