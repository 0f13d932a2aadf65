"""Counting what PostgreSQL's executed plans read, for the plan tests here.

The store's own connections load ``auto_explain`` (a connection setting: nothing
is installed on the server), and every statement's executed plan comes back as
a NOTICE; :func:`capture_plans` collects them. Counted, never timed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import asyncpg.connection
import asyncpg.exceptions
import pytest

from durably.stores.postgres import PostgresStore

AUTO_EXPLAIN = {
    "session_preload_libraries": "auto_explain",
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_timing": "off",
    "auto_explain.log_format": "json",
    "auto_explain.log_level": "notice",
    "client_min_messages": "notice",
}
"""Server settings for a store whose every statement's plan is reported."""

GENERIC = {**AUTO_EXPLAIN, "plan_cache_mode": "force_generic_plan"}
""":data:`AUTO_EXPLAIN` under the generic plan, the one a long-lived engine's
pool keeps after five runs of a prepared statement: taken from the first."""

SCANS = frozenset({"Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan"})
SCANS_AND_BITMAPS = SCANS | {"Bitmap Index Scan"}
"""With a bitmap scan's index half: where a filtered call's rows are looked at."""

Call = tuple[str, Callable[[], Awaitable[object]], int]
"""``(name, call, rows of durably_runs the call has to look at)``."""


def finished_runs(count: int) -> str:
    """SQL inserting ``count`` finished runs (``old-000001``…)."""
    return f"""
    INSERT INTO durably_runs (id, workflow, workflow_version, status, tags, created_at,
        updated_at)
    SELECT 'old-' || lpad(i::text, 6, '0'), 'order', '1', 'completed', '[]'::jsonb, i, i
    FROM generate_series(1, {count}) AS i
"""


def examined(node: dict[str, Any], scans: frozenset[str] = SCANS) -> list[tuple[str, int]]:
    """``(index or scan, rows looked at over every loop)`` for each scan of ``durably_runs``."""
    found: list[tuple[str, int]] = []
    if node.get("Node Type") in scans and node.get("Relation Name") == "durably_runs":
        per_loop = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        per_loop += node.get("Rows Removed by Index Recheck", 0)
        where = node.get("Index Name") or node["Node Type"]
        found.append((where, round(per_loop * node.get("Actual Loops", 1))))
    for child in node.get("Plans", []):
        found.extend(examined(child, scans))
    return found


def capture_plans(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The executed plans of every statement from now on, as they arrive."""
    plans: list[dict[str, Any]] = []
    original = asyncpg.connection.Connection._process_log_message

    def heard(conn: Any, fields: Any, last_query: Any) -> None:
        text = asyncpg.exceptions.PostgresLogMessage.new(fields, query=last_query).message
        if "plan:" in text and "{" in text:
            plans.append(json.loads(text[text.index("{") :]))
        original(conn, fields, last_query)

    # the pool drops listeners added with add_log_listener each time it takes a connection back
    monkeypatch.setattr(asyncpg.connection.Connection, "_process_log_message", heard)
    return plans


async def seed_unseen(postgres_url: str, seed: str, unseen: str) -> None:
    """Create the store's schema, run ``seed``, ``ANALYZE``, then ``unseen``:
    rows the statistics know nothing of."""
    store = PostgresStore(postgres_url)
    await store.open()
    conn = await asyncpg.connect(postgres_url.split("?")[0])
    try:
        await conn.execute(f'SET search_path TO "{store.schema}"')
        await conn.execute(seed)
        await conn.execute("ANALYZE durably_runs")
        await conn.execute(unseen)
    finally:
        await conn.close()
        await store.close()


async def calls_astray(
    plans: list[dict[str, Any]], calls: list[Call]
) -> tuple[list[str], dict[str, object]]:
    """Make each call in turn, ``plans`` being :func:`capture_plans`' list:
    one line for each call that looked at more rows of ``durably_runs`` than
    it has to (plus two), with its scans; and every call's answer by name."""
    looked: dict[str, list[tuple[str, int]]] = {}
    answers: dict[str, object] = {}
    for name, call, _ in calls:
        plans.clear()
        answers[name] = await call()
        explained = [p for p in plans if "durably_runs" in p["Query Text"]]
        assert explained, f"{name}: no plan explained"
        looked[name] = [scan for p in explained for scan in examined(p["Plan"], SCANS_AND_BITMAPS)]
    astray = [
        f"{name}: {looked[name]}"
        for name, _, needed in calls
        if sum(rows for _, rows in looked[name]) > needed + 2
    ]
    return astray, answers
