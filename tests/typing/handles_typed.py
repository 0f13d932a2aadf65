"""Checked by mypy (``test_typing.py``), never imported: what the handle types promise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, assert_type

import durably

engine = durably.Engine("memory://")


@dataclass
class Receipt:
    order_id: str
    cents: int


@engine.workflow("checkout")
async def checkout(ctx: durably.WorkflowContext, order_id: str) -> Receipt:
    return Receipt(order_id, 100)


@engine.workflow("count")
async def count(ctx: durably.WorkflowContext) -> int:
    return 1


async def typed_from_the_function() -> None:
    handle = await engine.start(checkout, "o-1", run_id="checkout:o-1")
    assert_type(handle, durably.RunHandle[Receipt])
    assert_type(await handle.result(), Receipt)
    assert_type(await handle.result(timeout=5), Receipt)
    assert_type(await (await engine.start(count)).result(), int)
    assert_type(handle.run_id, str)
    assert_type(handle.run, durably.Run)
    assert_type(await handle.status(), durably.RunStatus)
    assert_type(await handle.wait(), durably.RunResult)
    assert_type(await handle.cancel(), durably.RunStatus)
    wrong: str = await handle.result()  # type: ignore[assignment]
    del wrong


async def untyped_by_name() -> None:
    handle = await engine.start("checkout", "o-2")
    assert_type(handle, durably.RunHandle[Any])
    client = durably.Client("memory://")
    assert_type(await client.start("checkout", "o-3"), durably.RunHandle[Any])
    assert_type(await client.signal("t"), str | None)


def sync_client() -> None:
    with durably.SyncClient("memory://") as client:
        handle = client.start("checkout", "o-4")
        assert_type(handle, durably.SyncRunHandle[Any])
        assert_type(handle.status(), durably.RunStatus)
        assert_type(client.get_run(handle.run_id), durably.Run | None)
