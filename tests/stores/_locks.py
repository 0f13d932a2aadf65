"""Waiting for PostgreSQL row locks, for the tests that hold one open."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from durably.stores.postgres import PostgresStore


async def until_blocked(store: PostgresStore, holder: Any) -> None:
    """Wait (bounded, as a hang guard) until a backend waits for ``holder``'s lock."""
    conn = await asyncpg.connect(store.url.partition("?")[0])
    try:
        for _ in range(3000):
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                holder.get_server_pid(),
            )
            if waiting:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("nothing ever waited for the lock")
    finally:
        await conn.close()
