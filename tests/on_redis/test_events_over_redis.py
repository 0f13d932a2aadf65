"""Lifecycle events fan out over Redis pub/sub: a subscriber hears runs executing
in another process even when the store's notices do not cross processes (SQLite)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import durably
from durably import EventKind, LifecycleEvent

from .redis_fixtures import delete_prefix

pytestmark = pytest.mark.timeout(120)

REDIS_URL = "redis://127.0.0.1:6379/0"

# The other process: it executes one run on the SQLite file, publishing its events.
_OTHER = textwrap.dedent(
    """
    import asyncio, sys
    import durably

    async def main(store, transport, run_id):
        engine = durably.Engine(store, transport=transport, publish_events=True,
                                poll_interval=0.05)

        @engine.workflow("far")
        async def far(ctx, n):
            await ctx.local_step("one", lambda: n)
            return n + 1

        async with engine:
            await engine.start("far", 1, run_id=run_id)
            await engine.wait_for_run(run_id, terminal=True, timeout=60)

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.fixture
async def transport() -> AsyncIterator[str]:
    prefix = f"durably-events-{uuid.uuid4().hex[:10]}"
    yield f"{REDIS_URL}?prefix={prefix}"
    await delete_prefix(REDIS_URL, prefix)


async def test_a_subscriber_hears_a_run_executing_in_another_process_on_sqlite(
    tmp_path: Path, transport: str
) -> None:
    store = f"sqlite:///{tmp_path / 'events.db'}"
    watcher = durably.Engine(store, transport=transport, drive=False, consumers="never")
    try:
        await watcher.open()
        async with watcher.subscribe(run_id="far-1") as sub:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _OTHER, store, transport, "far-1"
            )
            seen: list[LifecycleEvent] = []
            async with asyncio.timeout(60):
                async for event in sub:
                    seen.append(event)
                    if event.kind is EventKind.RUN_COMPLETED:
                        break
            assert await proc.wait() == 0
    finally:
        await watcher.close()
    assert EventKind.RUN_STARTED in [e.kind for e in seen]
    assert seen[-1].kind is EventKind.RUN_COMPLETED
    assert all(not e.local and e.origin != watcher.instance_id for e in seen)
