"""On SQLite the due-timer poll stops at its page, as on PostgreSQL
(``test_postgres_due_index``): the work of one ``list_due`` page must not grow
with the number of runs due, or a backlog of timers (a restart after an
outage, a schedule fanning out) slows every poll while it drains.

Work is counted in SQLite virtual-machine steps (a progress handler), which
is deterministic for the same data and plan, unlike a clock."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from durably.stores.sqlite import SqliteStore, list_due_sql

NOW = 10_000_000
LIMIT = 500


async def _database(tmp_path: Path, name: str, due: int) -> sqlite3.Connection:
    path = tmp_path / name
    store = SqliteStore(f"sqlite:///{path}")
    await store.open()
    await store.close()
    conn = sqlite3.connect(path)
    # ``due`` runs past their timer, 5,000 not yet, a few with a wake requested.
    conn.executemany(
        "INSERT INTO durably_runs (id, workflow, workflow_version, status, wake_at, "
        "wake_requested_at, tags, created_at, updated_at) "
        "VALUES (?, 'sleeper', '1', 'suspended', ?, ?, '[]', ?, ?)",
        [
            (f"run-{i:06d}", NOW - due + i, i if i % 1000 == 0 else None, i, i)
            for i in range(1, due + 5_001)
        ],
    )
    conn.commit()
    conn.execute("ANALYZE")
    return conn


def _steps(conn: sqlite3.Connection, sql: str, params: tuple[object, ...]) -> tuple[int, int]:
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    conn.set_progress_handler(count, 100)
    try:
        rows = conn.execute(sql, params).fetchall()
    finally:
        conn.set_progress_handler(None, 0)
    return steps, len(rows)


async def test_a_due_page_costs_the_same_with_ten_times_the_backlog(tmp_path: Path) -> None:
    sql, params = list_due_sql(NOW, LIMIT, namespace=None, workflows=frozenset({("sleeper", "1")}))
    small = await _database(tmp_path, "small.db", 2_000)
    large = await _database(tmp_path, "large.db", 20_000)
    try:
        small_steps, small_rows = _steps(small, sql, params)
        large_steps, large_rows = _steps(large, sql, params)
    finally:
        small.close()
        large.close()
    assert small_rows == large_rows == LIMIT
    # Ten times the due rows: a statement that groups them all does ~10x the work.
    assert large_steps < 2 * small_steps, (small_steps, large_steps)
