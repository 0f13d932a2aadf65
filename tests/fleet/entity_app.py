"""An engine process of the entity and update fleet tests.

``ENTITY_STORE`` (a store URL), ``ENTITY_TRANSPORT`` (default ``db://``),
``ENTITY_CALLS`` (how many concurrent ``call_entity`` this process makes once
it reads a line on stdin; 0: none, it only executes), ``ENTITY_OPS`` (the
entity's ``ops_per_run``). Prints ``ready``, then (when it calls) one line
``replies <json list>`` and keeps executing until killed.

It registers the ``counter`` entity and the ``cart`` workflow (updates), so
it can execute both for callers in other processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any

import durably


def add(state: dict[str, Any], n: int) -> tuple[dict[str, Any], int]:
    state["count"] += n
    return state, state["count"]


def register(engine: durably.Engine) -> None:
    engine.entity(
        "counter",
        initial_state={"count": 0},
        handlers={"add": add},
        ops_per_run=int(os.environ.get("ENTITY_OPS", "100")),
    )

    @engine.workflow("cart")
    async def cart(ctx: durably.WorkflowContext) -> list[str]:
        items: list[str] = []

        def put(item: str) -> int:
            items.append(item)
            return len(items)

        ctx.on_update("add", put)
        await ctx.wait_for_signal(f"checkout:{ctx.run_id}")
        return items


async def main() -> None:
    engine = durably.Engine(
        os.environ["ENTITY_STORE"],
        transport=os.environ.get("ENTITY_TRANSPORT", "db://"),
        poll_interval=0.05,
        lease="5s",
    )
    register(engine)
    calls = int(os.environ.get("ENTITY_CALLS", "0"))
    async with engine:
        print("ready", flush=True)
        if calls:
            await asyncio.to_thread(sys.stdin.readline)  # both processes start together
            replies = await asyncio.gather(
                *(engine.call_entity("counter", "hot", "add", 1, timeout=300) for _ in range(calls))
            )
            print("replies " + json.dumps(replies), flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
