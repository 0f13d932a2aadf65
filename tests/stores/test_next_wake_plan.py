"""``next_wake_at`` is one step along the ``(status, wake_at)`` index on both
SQL stores: the worker reads it after every tick, so its cost must not grow
with the number of runs asleep (100,000 suspended runs cost one index probe).

SQLite: the query plan searches the index and sorts nothing, and the work
(virtual-machine steps, deterministic unlike a clock) stays flat when the
table holds ten times the sleepers. PostgreSQL: the plan of the very
statement the store sends (generic plan, as its pool uses) reads no table
sequentially and no node returns more than one row.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import asyncpg

from durably.stores.postgres import NEXT_WAKE, PostgresStore
from durably.stores.sqlite import SqliteStore, next_wake_sql

NOW = 10_000_000


def _fill(conn: sqlite3.Connection, sleepers: int) -> None:
    # Half the sleepers are due (the poll's), half wake later.
    conn.executemany(
        "INSERT INTO durably_runs (id, workflow, workflow_version, status, wake_at, "
        "tags, created_at, updated_at) VALUES (?, 'sleeper', '1', 'suspended', ?, '[]', 0, 0)",
        [(f"run-{i:06d}", NOW - sleepers // 2 + i) for i in range(sleepers)],
    )
    conn.commit()
    conn.execute("ANALYZE")


async def _sqlite(tmp_path: Path, name: str, sleepers: int) -> sqlite3.Connection:
    store = SqliteStore(f"sqlite:///{tmp_path / name}")
    await store.open()
    await store.close()
    conn = sqlite3.connect(tmp_path / name)
    _fill(conn, sleepers)
    return conn


def _steps(conn: sqlite3.Connection, sql: str, params: tuple[object, ...]) -> tuple[int, object]:
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    conn.set_progress_handler(count, 10)
    try:
        row = conn.execute(sql, params).fetchone()
    finally:
        conn.set_progress_handler(None, 0)
    return steps, row[0]


async def test_sqlite_reads_the_next_wake_from_the_index(tmp_path: Path) -> None:
    sql, params = next_wake_sql(NOW, namespace="default", workflows=frozenset({("sleeper", "1")}))
    small = await _sqlite(tmp_path, "small.db", 2_000)
    large = await _sqlite(tmp_path, "large.db", 20_000)
    try:
        plan = " | ".join(row[-1] for row in large.execute(f"EXPLAIN QUERY PLAN {sql}", params))
        small_steps, small_next = _steps(small, sql, params)
        large_steps, large_next = _steps(large, sql, params)
    finally:
        small.close()
        large.close()
    assert "durably_runs_due" in plan, plan
    assert "TEMP B-TREE" not in plan, plan
    assert small_next == large_next == NOW + 1
    assert large_steps < 2 * small_steps + 10, (small_steps, large_steps)


def _nodes(plan: dict[str, object]) -> list[dict[str, object]]:
    found = [plan]
    for child in plan.get("Plans", []):  # type: ignore[attr-defined]
        found.extend(_nodes(child))
    return found


async def test_postgres_reads_the_next_wake_from_the_index(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    await store.open()
    conn = await asyncpg.connect(postgres_url.split("?")[0])
    try:
        await conn.execute(f'SET search_path TO "{store.schema}"')
        await conn.execute(
            "INSERT INTO durably_runs (id, workflow, workflow_version, status, wake_at, "
            "tags, created_at, updated_at) "
            f"SELECT 'run-' || lpad(i::text, 6, '0'), 'sleeper', '1', 'suspended', "
            f"{NOW} - 50000 + i, '[]'::jsonb, 0, 0 FROM generate_series(0, 99999) AS i"
        )
        await conn.execute("ANALYZE durably_runs")
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE next_wake AS {NEXT_WAKE}")
        explained = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE next_wake"
            f"({NOW}, 'default', ARRAY[('sleeper' || chr(31) || '1')])"
        )
        nodes = _nodes(json.loads(explained)[0]["Plan"])
        scans = [(n["Node Type"], n.get("Index Name")) for n in nodes]
        assert not any("Seq Scan" in str(kind) for kind, _ in scans), scans
        assert any(index == "durably_runs_due" for _, index in scans), scans
        assert max(int(n["Actual Rows"]) for n in nodes) <= 1, scans  # type: ignore[call-overload]

        assert await store.next_wake_at(NOW, workflows=frozenset({("sleeper", "1")})) == NOW + 1
    finally:
        await conn.close()
        await store.close()
