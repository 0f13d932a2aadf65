"""The engine process the crash tests start, kill with SIGKILL and restart.

Configured by environment variables so the test and the process agree:
``CRASH_DB`` (SQLite file), ``CRASH_LEDGER`` (effects file), ``CRASH_INSTANCE``
(lease owner id; empty for a fresh one per process), ``CRASH_LEASE`` (e.g. ``2s``).

Every step appends ``run_id seq pid`` to the ledger *before* returning, and
first checks the store: if the checkpoint of the step it is about to execute
is already completed, it appends ``VIOLATION`` — a completed step executed again.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import sys
import threading
import time

import durably

DB = os.environ.get("CRASH_DB", "")
LEDGER = os.environ.get("CRASH_LEDGER", "")
STEPS = 5
STEP_DELAY = float(os.environ.get("CRASH_STEP_DELAY", "0.004"))

_local = threading.local()


def _completed_already(run_id: str, seq: int) -> bool:
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = sqlite3.connect(DB, timeout=30)
    row = conn.execute(
        "SELECT status FROM durably_checkpoints WHERE run_id = ? AND seq = ?", (run_id, seq)
    ).fetchone()
    return row is not None and row[0] == "completed"


def effect(run_id: str, seq: int, value: int) -> int:
    """A side effect: recorded in the ledger, outside the engine."""
    line = f"{run_id} {seq} {os.getpid()}\n"
    if _completed_already(run_id, seq):
        line = f"VIOLATION {line}"
    time.sleep(random.uniform(0, STEP_DELAY))
    fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return value + seq


async def multi_step(ctx: durably.WorkflowContext, n: int) -> int:
    total = n
    for seq in range(STEPS):
        if seq == 2:
            await ctx.sleep(0.1)  # a durable timer in the middle: seq 2 is the sleep
        position = seq if seq < 2 else seq + 1
        total = await ctx.local_step(f"step{seq}", effect, ctx.run_id, position, total)
    return total


FAN_WIDTH = 150
SAGA_STEPS = 6


async def fan_leaf(ctx: durably.WorkflowContext, i: int) -> int:
    """One child of the fan: a single effect."""
    return await ctx.local_step("leaf", effect, ctx.run_id, 0, i)


async def fan_parent(ctx: durably.WorkflowContext, width: int) -> int:
    """Fans out to ``width`` children and sums what they return."""
    results = await ctx.all([ctx.child("fan-leaf", i) for i in range(width)])
    return sum(results)


def undo(run_id: str, index: int, _output: int) -> None:
    """A compensation: recorded in the ledger like any effect (seq -2 - index)."""
    effect(run_id, -2 - index, 0)
    time.sleep(0.05)  # slow enough that kills land mid-unwind


def _doomed() -> None:
    raise durably.FatalError("the last step always fails", code="doomed")


async def saga(ctx: durably.WorkflowContext, n: int) -> None:
    """Completes SAGA_STEPS steps with undos, then fails: the unwind runs them all."""
    for k in range(SAGA_STEPS):
        await ctx.local_step(
            f"book{k}",
            effect,
            ctx.run_id,
            k,
            n,
            compensate=lambda out, rid=ctx.run_id, k=k: undo(rid, k, out),
        )
    await ctx.local_step("doomed", _doomed)


def expected_output(n: int) -> int:
    """What ``multi_step(n)`` returns."""
    return n + sum(s if s < 2 else s + 1 for s in range(STEPS))


async def _serve() -> None:
    engine = durably.Engine(
        f"sqlite:///{DB}",
        instance_id=os.environ.get("CRASH_INSTANCE") or None,
        lease=os.environ.get("CRASH_LEASE", "2s"),
        max_recovery_attempts=50,
        poll_interval=0.05,
        max_concurrent_runs=int(os.environ.get("CRASH_CONCURRENCY", "256")),
    )
    engine.register("multi-step", multi_step)
    engine.register("fan-leaf", fan_leaf)
    engine.register("fan-parent", fan_parent)
    engine.register("saga", saga)
    async with engine:
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(_serve())
    except KeyboardInterrupt:
        sys.exit(0)
