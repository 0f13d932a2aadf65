"""Rows and pages per idle poll: stale statistics, and dead index entries before VACUUM.

    python poll_plans.py --finished 1000000 --asleep 20000        # stale statistics
    python poll_plans.py --finished 1000000 --churn 12000         # dead entries, then VACUUM

Run with the ``durably`` to measure on the path (``PYTHONPATH=<tree>/src``). Each poll runs
through the store with ``auto_explain`` under the generic plan (``plan_cache_mode =
force_generic_plan``: the plan a long-lived engine polls with), and its executed plan gives the
rows its scans of ``durably_runs`` looked at and its shared buffers (hit + read). Counts, not
times: the same on every run of the same database.

``--asleep``: after ``ANALYZE`` of the finished runs, that many runs are put to sleep (half due),
so the statistics know of none (a burst between two analyzes).

``--churn``: after ``ANALYZE``, that many runs go pending and then finish (as an engine's claims
would leave them), leaving their dead entries in the indexes; the polls are counted, then
``VACUUM (VERBOSE) durably_runs`` (its buffer usage as it reports it; ``--index-cleanup``: with
``INDEX_CLEANUP ON``), then the polls again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from typing import Any

import asyncpg
import asyncpg.connection
import asyncpg.exceptions

from durably.stores.postgres import PostgresStore

NOW = 10_000_000
PAGE = 50
SETTINGS = {
    "session_preload_libraries": "auto_explain",
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_buffers": "on",
    "auto_explain.log_timing": "off",
    "auto_explain.log_format": "json",
    "auto_explain.log_level": "notice",
    "client_min_messages": "notice",
    "plan_cache_mode": "force_generic_plan",
}
SCANS = {"Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Bitmap Index Scan"}
PLANS: list[dict[str, Any]] = []


def _heard(original: Any) -> Any:
    def heard(conn: Any, fields: Any, last_query: Any) -> None:
        text = asyncpg.exceptions.PostgresLogMessage.new(fields, query=last_query).message
        if "plan:" in text and "{" in text:
            PLANS.append(json.loads(text[text.index("{") :]))
        original(conn, fields, last_query)

    return heard


def _rows(node: dict[str, Any]) -> tuple[int, set[str]]:
    """Rows the scans of ``durably_runs`` looked at, and the indexes they used."""
    rows, used = 0, set()
    if node.get("Node Type") in SCANS and node.get("Relation Name") == "durably_runs":
        per = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        rows += round(per * node.get("Actual Loops", 1))
        used.add(node.get("Index Name") or node["Node Type"])
    for child in node.get("Plans", []):
        more, names = _rows(child)
        rows, used = rows + more, used | names
    return rows, used


async def _polls(store: PostgresStore) -> list[tuple[str, int, int, str]]:
    mine, theirs = frozenset({("order", "1")}), frozenset({("other", "1")})
    due = NOW - 10_000
    calls: list[tuple[str, Any]] = [
        ("list_due (a page due)", lambda: store.list_due(NOW, PAGE)),
        ("list_due (none due)", lambda: store.list_due(due, PAGE)),
        ("next_wake_at", lambda: store.next_wake_at(NOW)),
        ("list_pending", lambda: store.list_pending(NOW, PAGE)),
        ("count_pending", lambda: store.count_pending()),
        ("list_orphans", lambda: store.list_orphans(NOW, PAGE)),
        ("list_blocked", lambda: store.list_blocked(PAGE, workflows=mine)),
        ("list_unclaimed", lambda: store.list_unclaimed(due, PAGE, workflows=theirs)),
    ]
    out = []
    for name, call in calls:
        PLANS.clear()
        await call()
        rows = pages = 0
        used: set[str] = set()
        for plan in PLANS:
            if "durably_runs" not in plan["Query Text"]:
                continue
            top = plan["Plan"]
            pages += top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
            more, names = _rows(top)
            rows, used = rows + more, used | names
        out.append((name, rows, pages, ", ".join(sorted(used))))
    return out


def _print(title: str, found: list[tuple[str, int, int, str]]) -> None:
    print(f"\n{title}\n| poll | rows examined | pages | indexes |\n| --- | --- | --- | --- |")
    for name, rows, pages, used in found:
        print(f"| {name} | {rows:,} | {pages:,} | {used} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    )
    parser.add_argument("--schema", default="bench_poll_plans")
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--asleep", type=int, default=0)
    parser.add_argument("--churn", type=int, default=0)
    parser.add_argument(
        "--index-cleanup",
        action="store_true",
        help="VACUUM (INDEX_CLEANUP ON): what vacuum_index_cleanup = on makes autovacuum do",
    )
    args = parser.parse_args()
    asyncpg.connection.Connection._process_log_message = _heard(  # type: ignore[method-assign]
        asyncpg.connection.Connection._process_log_message
    )
    conn = await asyncpg.connect(args.url)
    await conn.execute(f'DROP SCHEMA IF EXISTS "{args.schema}" CASCADE')
    url = f"{args.url}?schema={args.schema}"
    seeding = PostgresStore(url)
    await seeding.open()
    await seeding.close()
    await conn.execute(f'SET search_path TO "{args.schema}"')
    await conn.execute(
        "INSERT INTO durably_runs (id, workflow, workflow_version, status, tags, created_at,"
        " updated_at) SELECT 'old-' || lpad(i::text, 8, '0'), 'order', '1', 'completed',"
        f" '[]'::jsonb, i, i FROM generate_series(1, {args.finished}) AS i"
    )
    await conn.execute("VACUUM ANALYZE durably_runs")
    if args.asleep:
        await conn.execute(
            "INSERT INTO durably_runs (id, workflow, workflow_version, status, wake_at, tags,"
            " created_at, updated_at) SELECT 'nap-' || lpad(i::text, 8, '0'), 'order', '1',"
            f" 'suspended', {NOW} - {args.asleep // 2} + i, '[]'::jsonb, i, i"
            f" FROM generate_series(1, {args.asleep}) AS i"
        )
    if args.churn:
        # each run as the engine leaves it: started pending, then claimed, then finished
        await conn.execute(
            "INSERT INTO durably_runs (id, workflow, workflow_version, status, tags,"
            " created_at, updated_at) SELECT 'new-' || lpad(i::text, 8, '0'), 'order', '1',"
            f" 'pending', '[]'::jsonb, {NOW} + i, {NOW} + i"
            f" FROM generate_series(1, {args.churn}) AS i"
        )
        await conn.execute("UPDATE durably_runs SET status = 'running' WHERE id LIKE 'new-%'")
        await conn.execute("UPDATE durably_runs SET status = 'completed' WHERE id LIKE 'new-%'")
    store = PostgresStore(url, server_settings=SETTINGS)
    await store.open()
    try:
        await _polls(store)  # warm: the first call of each also reads the catalog
        what = f"{args.finished:,} finished"
        what += f", {args.asleep:,} asleep unseen by ANALYZE" if args.asleep else ""
        what += f", {args.churn:,} runs pending then finished" if args.churn else ""
        _print(what, await _polls(store))
        if args.churn:
            said: list[str] = []
            conn.add_log_listener(lambda _c, m: said.append(m.message))
            cleanup = ", INDEX_CLEANUP ON" if args.index_cleanup else ""
            await conn.execute(f"VACUUM (VERBOSE{cleanup}) durably_runs")
            for line in (m for m in said if "buffer usage" in m):
                flat = re.sub(r"\s+", " ", line)
                kept = re.findall(r"(index scan needed: [^:]*?removed|buffer usage: [^W]*)", flat)
                print("\nVACUUM durably_runs:", "; ".join(kept))
            _print(f"{what}, after VACUUM", await _polls(store))
    finally:
        await store.close()
        await conn.execute(f'DROP SCHEMA IF EXISTS "{args.schema}" CASCADE')
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
