"""On SQLite an attribute filter reads the attributes table through its
``(key, value)`` indexes: the plan of ``list_runs``' own statement searches
them and never scans the table (nor walks every run to probe each)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from durably._attributes import check_filters
from durably.stores import RunQuery
from durably.stores.sqlite import SqliteStore, list_runs_sql

RUNS = 20_000


@pytest.mark.parametrize(
    ("filters", "index"),
    [
        ([("customer", "eq", "c-42")], "durably_run_attributes_str"),
        ([("total", "gte", RUNS - 50)], "durably_run_attributes_num"),
        ([("customer", "eq", "c-42"), ("total", "lt", 5_000)], "durably_run_attributes_num"),
    ],
)
async def test_an_attribute_filter_searches_the_index(
    tmp_path: Path, filters: list[tuple[str, str, object]], index: str
) -> None:
    path = tmp_path / "attrs.db"
    store = SqliteStore(f"sqlite:///{path}")
    await store.open()
    await store.close()
    conn = sqlite3.connect(path)
    try:
        conn.executemany(
            "INSERT INTO durably_runs (id, workflow, workflow_version, status, tags, "
            "created_at, updated_at) VALUES (?, 'order', '1', 'pending', '[]', ?, ?)",
            [(f"run-{i:06d}", i, i) for i in range(1, RUNS + 1)],
        )
        conn.executemany(
            "INSERT INTO durably_run_attributes VALUES (?, ?, ?, ?, ?)",
            [(f"run-{i:06d}", "customer", "str", f"c-{i % 1000}", None) for i in range(1, RUNS + 1)]
            + [(f"run-{i:06d}", "total", "int", None, float(i)) for i in range(1, RUNS + 1)],
        )
        conn.commit()
        conn.execute("ANALYZE")
        sql, params = list_runs_sql(RunQuery(attributes=check_filters(filters)))
        plan = [row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
    finally:
        conn.close()

    assert any(f"USING INDEX {index}" in step for step in plan), plan
    assert not any(step.startswith("SCAN") for step in plan), plan
