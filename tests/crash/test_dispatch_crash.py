"""Dispatched steps on ``db://`` across a SIGKILL of the engine process.

The engine (``dispatch_app.py``) kills itself at a chosen moment; a fresh
one (another instance id, so the runs come back through lease recovery)
takes over. The test process serves the steps and keeps a ledger. Always:
every run completes with the right output, every step executed exactly once
(its worker never died, so its task was never delivered twice), and no
completed step executed again. With ``born`` the dying engine serves the
step too and dies holding a born claimed task whose handler never ran: that
task is delivered twice (born, then claimed by the test after the lease)
and still executed once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import durably
from durably import RunStatus
from durably.stores import SqliteStore
from durably.testing import eventually
from durably.transports.db import DbTransport
from durably.wire import StepResult, StepTask, routing_token

APP = Path(__file__).with_name("dispatch_app.py")
ROOT = Path(__file__).resolve().parents[2]
RUNS = 12
STEPS = 3


def _spawn(db: Path, instance: str, kill_at: str = "") -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        CRASH_DB=str(db),
        CRASH_INSTANCE=instance,
        CRASH_LEASE="1s",
        CRASH_KILL_AT=kill_at,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    log = db.with_name(f"{instance}.log")
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, str(APP)], env=env, stdout=subprocess.PIPE, stderr=err
        )


def _completed_already(db: Path, run_id: str, seq: int) -> bool:
    with sqlite3.connect(db, timeout=30) as conn:
        row = conn.execute(
            "SELECT status FROM durably_checkpoints WHERE run_id = ? AND seq = ?", (run_id, seq)
        ).fetchone()
    return row is not None and row[0] == "completed"


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["checkpoint", "settle", "held", "born"])
async def test_a_sigkill_loses_no_dispatched_step_and_runs_none_twice(
    tmp_path: Path, kill_at: str
) -> None:
    db = tmp_path / "dispatch.db"
    url = f"sqlite:///{db}"
    executed: Counter[tuple[str, int]] = Counter()
    violations: list[str] = []
    # The client starts and reads runs; the steps are served on the bare
    # transport, so only the engine processes settle results.
    client = durably.Engine(url, drive=False, consumers="never")
    store = SqliteStore(url)
    await store.open()
    steps = DbTransport(store, poll_interval=0.05)
    await steps.open()

    async def work(task: StepTask) -> None:
        run_id, seq, total = str(task.input[0]), int(task.input[1]), int(task.input[2])
        if await asyncio.to_thread(_completed_already, db, run_id, seq):
            violations.append(f"{run_id}:{seq}")
        executed[(run_id, seq)] += 1
        await steps.send_result(StepResult(task.run_id, task.seq, ok=True, output=total + 1))

    @client.workflow("pipeline")
    async def pipeline(ctx: durably.WorkflowContext, n: int) -> int:  # never run here
        raise AssertionError("the test process drives no run")

    first = second = None
    try:
        await steps.serve([routing_token("work")], work, concurrency=8)
        first = _spawn(db, "doomed", kill_at)
        for i in range(RUNS):
            await client.start("pipeline", i, run_id=f"run-{i:02}")
        assert await asyncio.to_thread(first.wait, 60) == -signal.SIGKILL
        if kill_at == "born":  # it died holding a born claimed task, not a claimed one
            assert first.stdout is not None
            assert b"born" in first.stdout.read().split()
        second = _spawn(db, "heir")

        async def all_completed() -> bool:
            done = await client.list_runs(status="completed", limit=100)
            return len(done.runs) == RUNS

        await eventually(all_completed, what=f"{RUNS} runs to complete", timeout=60)
        for i in range(RUNS):
            run = await client.get_run(f"run-{i:02}")
            assert run is not None and run.status is RunStatus.COMPLETED
            assert run.output == i + STEPS
        assert violations == []
        assert sorted(executed) == [(f"run-{i:02}", s) for i in range(RUNS) for s in range(STEPS)]
        assert set(executed.values()) == {1}
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(proc.wait, 30)
        await steps.close()
        await store.close()
        await client.close()
