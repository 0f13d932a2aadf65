"""An engine process that is SIGKILLed inside ``ctx.transaction``.

``TX_STORE`` is the store URL, ``TX_MARKER`` a file written once the app's
INSERT has executed inside the transaction; the process then hangs there
until the test kills it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import durably

STORE = os.environ.get("TX_STORE", "")
MARKER = Path(os.environ.get("TX_MARKER", "/nonexistent"))


def _mark_inside() -> None:
    MARKER.write_text("inside")


def _hang_after_insert() -> None:
    _mark_inside()
    time.sleep(3600)


def insert_sqlite(conn: Any, order: str) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
    conn.execute("INSERT INTO orders (id) VALUES (?)", (order,))
    if os.environ.get("TX_HANG"):
        _hang_after_insert()
    return 1


async def insert_postgres(conn: Any, order: str) -> int:
    await conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
    await conn.execute("INSERT INTO orders (id) VALUES ($1)", order)
    if os.environ.get("TX_HANG"):
        _mark_inside()
        await asyncio.sleep(3600)
    return 1


def build(store: str, **options: Any) -> durably.Engine:
    """The engine of this app (also built by the test to finish the run)."""
    engine = durably.Engine(store, **options)
    insert = insert_postgres if store.startswith("postgres") else insert_sqlite

    @engine.workflow("place-order")
    async def place_order(ctx: durably.WorkflowContext, order: str) -> int:
        return await ctx.transaction("insert-order", insert, order)  # type: ignore[no-any-return]

    return engine


async def main() -> None:
    engine = build(STORE, lease="1s", instance_id="doomed")
    async with engine:
        await engine.start("place-order", "o-1", run_id="order:o-1")
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
