"""A PostgreSQL schema left at an older version, for the upgrade tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from durably.stores._postgres_schema import MIGRATIONS
from durably.stores.postgres import PostgresStore

T = TypeVar("T")


async def create_at(conn: Any, schema: str, version: int) -> None:
    """Create ``schema`` holding the tables of the first ``version`` migrations and record that
    version, as a store of that version left it; ``conn``'s search path is left on it."""
    await conn.execute(f'CREATE SCHEMA "{schema}"')
    await conn.execute(f'SET search_path TO "{schema}"')
    await conn.execute("CREATE TABLE durably_meta (key TEXT PRIMARY KEY, value TEXT)")
    for script in MIGRATIONS[:version]:
        await conn.execute(script)
    await conn.execute("INSERT INTO durably_meta VALUES ('schema_version', $1)", str(version))


async def seeded_at(url: str, version: int, seed: str, read: Callable[[Any], Awaitable[T]]) -> T:
    """The store URL's schema at ``version``, filled by ``seed`` and analyzed, and what ``read``
    (that version's statements) answers on it before any upgrade."""
    conn = await asyncpg.connect(url.split("?")[0])
    try:
        await create_at(conn, PostgresStore(url).schema, version)
        await conn.execute(seed)
        await conn.execute("ANALYZE durably_runs")
        return await read(conn)
    finally:
        await conn.close()


async def read_upgraded(url: str, read: Callable[[Any], Awaitable[T]]) -> T:
    """What ``read`` (an older version's statements, run beside the new store) answers on the
    store URL's schema, once it is at the newest version."""
    conn = await asyncpg.connect(url.split("?")[0])
    try:
        await conn.execute(f'SET search_path TO "{PostgresStore(url).schema}"')
        version = await conn.fetchval("SELECT value FROM durably_meta WHERE key = 'schema_version'")
        assert version == str(len(MIGRATIONS))
        return await read(conn)
    finally:
        await conn.close()
