"""The SQLite writer thread: group commit, and one failing operation failing alone."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from durably.stores._sqlite_thread import SqliteThread


async def test_a_failing_operation_fails_alone_in_its_batch(tmp_path: Path) -> None:
    db = SqliteThread(str(tmp_path / "t.db"))
    db.start()
    try:
        await db.run(lambda c: c.execute("CREATE TABLE t (k TEXT PRIMARY KEY)"))

        def insert(key: str) -> Callable[[sqlite3.Connection], int]:
            def op(conn: sqlite3.Connection) -> int:
                return conn.execute("INSERT INTO t (k) VALUES (?)", (key,)).rowcount

            return op

        # Queued together so they share a batch; the duplicate key fails.
        futures = [db.submit(insert(k)) for k in ("a", "b", "a", "c")]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert results[0] == 1 and results[1] == 1 and results[3] == 1
        assert isinstance(results[2], sqlite3.IntegrityError)
        rows = await db.run(lambda c: sorted(r[0] for r in c.execute("SELECT k FROM t")))
        assert rows == ["a", "b", "c"]
    finally:
        await db.stop()


async def test_calls_after_stop_fail_clearly(tmp_path: Path) -> None:
    db = SqliteThread(str(tmp_path / "t.db"))
    db.start()
    await db.stop()
    with pytest.raises(RuntimeError, match="closed"):
        await db.run(lambda c: None)


async def test_stores_opening_a_new_file_together_all_open(tmp_path: Path) -> None:
    """Four connections switching one new file to WAL at once: SQLite fails
    some of them with "database is locked" despite busy_timeout (about one
    round in eight before the retry); every one must open."""
    for round_number in range(40):
        path = str(tmp_path / f"new-{round_number}.db")
        threads = [SqliteThread(path) for _ in range(4)]
        try:
            await asyncio.gather(*(asyncio.to_thread(db.start) for db in threads))
            modes = await asyncio.gather(
                *(
                    db.run(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0])
                    for db in threads
                )
            )
            assert modes == ["wal"] * 4
        finally:
            for db in threads:
                await db.stop()
