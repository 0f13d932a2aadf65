"""``durably runs show`` lists a handled update in the run's timeline, through
the real command in a subprocess."""

from __future__ import annotations

import asyncio
import json

import durably
from durably import RunStatus
from test_cli import acli
from test_cli import db as db  # the fixture (an explicit re-export)


async def test_runs_show_lists_a_handled_update(db: str) -> None:
    engine = durably.Engine(db, poll_interval=0.05)

    @engine.workflow("cart")
    async def cart(ctx: durably.WorkflowContext) -> list[str]:
        items: list[str] = []
        ctx.on_update("add", lambda item: items.append(item) or len(items))
        await ctx.wait_for_signal(f"checkout:{ctx.run_id}")
        return items

    async with engine:
        await engine.start("cart", run_id="cart-1")
        for _ in range(400):
            run = await engine.get_run("cart-1")
            if run is not None and run.status is RunStatus.SUSPENDED:
                break
            await asyncio.sleep(0.025)
        assert (await engine.update("cart-1", "add", "apple", timeout=30)).result == 1

    shown = await acli("runs", "show", "cart-1", "--store", db)
    assert shown.returncode == 0, shown.stderr
    assert "update:add" in shown.stdout and "update" in shown.stdout

    data = json.loads((await acli("runs", "show", "cart-1", "--store", db, "--json")).stdout)
    entries = [cp for cp in data["checkpoints"] if cp["kind"] == "update"]
    assert [(cp["name"], cp["status"], cp["output"]) for cp in entries] == [
        ("update:add", "completed", 1)
    ]
