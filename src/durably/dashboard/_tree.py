"""A run's children as a tree, read a bounded number of rows at a time."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..model import Run
from ..stores.base import RunQuery
from ._backend import DashboardStore

__all__ = ["Node", "children_tree"]

WIDTH = 200
"""Children shown under one run."""
EXPANDED = 50
"""Children whose own children are read too (one indexed query each), so a
page costs at most 51 queries however wide the fan-out; deeper generations
are a click away."""


@dataclass(slots=True)
class Node:
    """A child run and (for the first :data:`EXPANDED`) its own children."""

    run: Run
    children: list[Node] = field(default_factory=list)
    more: bool = False
    """It has more children than are shown."""


async def children_tree(store: DashboardStore, run_id: str) -> tuple[list[Node], bool]:
    """The children and grandchildren of ``run_id``, and whether more
    children exist than are shown."""
    nodes, more = await _children(store, run_id)
    grandchildren = await asyncio.gather(
        *(_children(store, n.run.run_id) for n in nodes[:EXPANDED])
    )
    for node, (kids, kids_more) in zip(nodes, grandchildren, strict=False):
        node.children, node.more = kids, kids_more
    return nodes, more


async def _children(store: DashboardStore, run_id: str) -> tuple[list[Node], bool]:
    page = await store.list_runs(RunQuery(parent_id=run_id, limit=WIDTH))
    return [Node(run) for run in page.runs], page.next_cursor is not None
