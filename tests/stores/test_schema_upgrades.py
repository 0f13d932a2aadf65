"""Schema upgrades, one test per dialect: an older schema's rows still read
after the store migrates them (what is dialect-specific here is how the old
schema is built, so these live apart from the conformance suite)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from durably.model import Checkpoint, CheckpointStatus
from durably.stores import StateStore
from durably.stores.base import Resolution
from durably.testing.conformance.stores._helpers import OWNER, leased, signal_cp
from durably.testing.conformance.stores.steps import EVENTS, NOW, ask

from ._old_schema import create_at

COMPLETED = CheckpointStatus.COMPLETED


def _old_checkpoint_sql() -> str:
    return (
        "INSERT INTO durably_checkpoints (run_id, seq, name, kind, status, attempts, "
        "parallel_group) VALUES ('old', 0, 'step-0', 'step', 'pending', 1, NULL)"
    )


async def _read_upgraded(store: StateStore) -> None:
    """An upgraded database reads the old row with the new columns empty, then writes them."""
    old = Checkpoint(
        run_id="old", seq=0, name="step-0", kind="step", status=CheckpointStatus.PENDING, attempts=1
    )
    assert await store.get_checkpoint("old", 0) == old
    assert (await store.load_checkpoints("old"))[0].events is None
    assert await store.try_admit(ask("old:0", concurrency=1), NOW) is None
    assert await store.resolve_checkpoints(
        [Resolution("old", 0, COMPLETED, output=1, events=EVENTS)], NOW
    ) == [0]
    found = await store.get_checkpoint("old", 0)
    assert found is not None and found.events == EVENTS


# from 3: before dispatched steps; from 4: before their events
UPGRADED_FROM = pytest.mark.parametrize("version", [3, 4], ids=["from-v3", "from-v4"])


@UPGRADED_FROM
async def test_sqlite_upgrades_checkpoints_written_by_older_schemas(
    tmp_path: Path, version: int
) -> None:
    from durably.stores import SqliteStore
    from durably.stores._sqlite_schema import MIGRATIONS

    path = tmp_path / f"v{version}.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE durably_meta (key TEXT PRIMARY KEY, value TEXT)")
    for script in MIGRATIONS[:version]:
        conn.executescript(script)
    conn.execute("INSERT INTO durably_meta VALUES ('schema_version', ?)", (str(version),))
    conn.execute(_old_checkpoint_sql())
    conn.commit()
    conn.close()

    store = SqliteStore(f"sqlite:///{path}")
    await store.open()
    try:
        await _read_upgraded(store)
    finally:
        await store.close()


@UPGRADED_FROM
async def test_postgres_upgrades_checkpoints_written_by_older_schemas(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]], version: int
) -> None:
    import asyncpg

    from durably.stores.postgres import PostgresStore

    async with isolated_postgres() as url:
        store = PostgresStore(url)
        conn = await asyncpg.connect(url.split("?")[0])
        try:
            await create_at(conn, store.schema, version)
            await conn.execute(_old_checkpoint_sql())
        finally:
            await conn.close()
        await store.open()
        try:
            await _read_upgraded(store)
        finally:
            await store.close()


# -- 6: several waiters per signal token --------------------------------------------------

_OLD_WAIT_SQL = (
    "INSERT INTO durably_runs (id, workflow, workflow_version, status, created_at, updated_at) "
    "VALUES ('parked', 'wf', '1', 'suspended', 1, 1)",
    "INSERT INTO durably_checkpoints (run_id, seq, name, kind, status, attempts) "
    "VALUES ('parked', 2, 'signal:tok', 'signal', 'pending', 0)",
    "INSERT INTO durably_signal_waiters (token, run_id, seq) VALUES ('tok', 'parked', 2)",
)


async def _serve_upgraded_wait(store: StateStore) -> None:
    """A wait registered before the upgrade is still served, and first in line."""
    await leased(store, "later")
    await store.wait_signal(signal_cp("later", 0, "tok"), "tok", OWNER, NOW)
    assert await store.send_signal("tok", "one", NOW) == "parked"
    assert await store.send_signal("tok", "two", NOW) == "later"
    assert await store.send_signal("tok", "three", NOW) is None
    assert (await store.load_checkpoints("parked"))[2].output == "one"


async def test_sqlite_upgrade_keeps_live_signal_waits(tmp_path: Path) -> None:
    from durably.stores import SqliteStore
    from durably.stores._sqlite_schema import MIGRATIONS

    path = tmp_path / "v5.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE durably_meta (key TEXT PRIMARY KEY, value TEXT)")
    for script in MIGRATIONS[:5]:
        conn.executescript(script)
    conn.execute("INSERT INTO durably_meta VALUES ('schema_version', '5')")
    for statement in _OLD_WAIT_SQL:
        conn.execute(statement)
    conn.commit()
    conn.close()

    store = SqliteStore(f"sqlite:///{path}")
    await store.open()
    try:
        await _serve_upgraded_wait(store)
    finally:
        await store.close()


async def test_postgres_upgrade_keeps_live_signal_waits(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> None:
    import asyncpg

    from durably.stores.postgres import PostgresStore

    async with isolated_postgres() as url:
        store = PostgresStore(url)
        conn = await asyncpg.connect(url.split("?")[0])
        try:
            await create_at(conn, store.schema, 5)
            for statement in _OLD_WAIT_SQL:
                await conn.execute(statement)
        finally:
            await conn.close()
        await store.open()
        try:
            await _serve_upgraded_wait(store)
        finally:
            await store.close()
