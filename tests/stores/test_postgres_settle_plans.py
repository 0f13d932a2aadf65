"""A results batch settles by index probes, however many checkpoints the
table holds: counted from the executed plans (``auto_explain``), not timed.

Sent as one JSON parameter, the batch's rows came from ``json_array_elements``,
which the planner guesses at 100 rows; at that guess it hashed them against a
sequential scan of every checkpoint (13,600 rows read to settle 40: 7.8 ms
against 0.6 ms). Under the generic plan a long-lived pool keeps, each statement
of ``claim_and_resolve`` must look at no more rows of ``durably_runs`` and
``durably_checkpoints`` than a few per result.
"""

from __future__ import annotations

from typing import Any

import pytest

from durably._queue import Message, OutMessage
from durably.model import CheckpointStatus
from durably.stores.base import Resolution
from durably.stores.postgres import PostgresStore
from durably.testing.conformance.stores.steps import _make_cp, dispatched_cp, lease_to, parked

from ._explained import GENERIC, capture_plans, finished_runs, seed_unseen

FINISHED = 20_000
BATCH = 10
TABLES = ("durably_runs", "durably_checkpoints")

# Every finished run has two settled checkpoints: 40,000 rows a scan could read.
CHECKPOINTS = f"""
    INSERT INTO durably_checkpoints (run_id, seq, name, kind, status, output)
    SELECT 'old-' || lpad(i::text, 6, '0'), s, 'step', 'step', 'completed', '1'
    FROM generate_series(1, {FINISHED}) AS i, generate_series(1, 2) AS s
"""


def looked_at(node: dict[str, Any]) -> list[tuple[str, str, int]]:
    """``(table, index or scan, rows looked at over every loop)`` for each scan
    of :data:`TABLES` in the plan ``node``."""
    found: list[tuple[str, str, int]] = []
    if node.get("Relation Name") in TABLES and "Scan" in node.get("Node Type", ""):
        per_loop = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        per_loop += node.get("Rows Removed by Index Recheck", 0)
        where = node.get("Index Name") or node["Node Type"]
        loops = node.get("Actual Loops", 1)
        found.append((node["Relation Name"], where, round(per_loop * loops)))
    for child in node.get("Plans", []):
        found.extend(looked_at(child))
    return found


def _decode(messages: list[Message]) -> tuple[None, list[Resolution]]:
    out = []
    for m in messages:
        run_id, seq = m.body.rsplit(":", 1)
        out.append(Resolution(run_id, int(seq), CheckpointStatus.COMPLETED, output=m.body))
    return None, out


async def test_a_results_batch_settles_by_index_probes(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = capture_plans(monkeypatch)
    await seed_unseen(postgres_url, finished_runs(FINISHED), CHECKPOINTS)

    store = PostgresStore(postgres_url, server_settings=GENERIC)
    await store.open()
    try:
        await store.messages().depth([])
        runs = [f"run-{n:02}" for n in range(BATCH)]
        for run_id in runs:
            step = dispatched_cp(run_id, 1, queue=None)
            await parked(store, _make_cp(run_id, 0, CheckpointStatus.COMPLETED), step)
        await store.messages().push([OutMessage("results", f"{r}:1") for r in runs])
        plans.clear()

        got = await store.claim_and_resolve(
            ["results"], 256, 2**62, _decode, 1_700_000_000_100, lease_to()
        )
    finally:
        await store.close()

    assert sorted(got.leased) == runs and got.answers == [0] * BATCH
    settling = [p for p in plans if "durably_checkpoints" in p["Query Text"]]
    assert settling, "no plan explained"
    scans = {p["Query Text"]: looked_at(p["Plan"]) for p in settling}
    astray = [
        f"{text[:80]!r}: {found}"
        for text, found in scans.items()
        # each result: its run, its checkpoints (the history read with the lease)
        if sum(rows for *_, rows in found) > 8 * BATCH
    ]
    assert not astray, "\n".join(astray)
