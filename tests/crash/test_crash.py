"""Crash tests: real engine processes, killed with SIGKILL at random moments.

The assertion is always the same: every run finishes with the right output,
no step whose checkpoint completed ever executes again, nothing is stranded.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import durably
from durably import RunStatus
from durably.testing import eventually

from .app import FAN_WIDTH, SAGA_STEPS, STEPS, expected_output

APP = Path(__file__).with_name("app.py")
ROOT = Path(__file__).resolve().parents[2]


def _spawn(
    db: Path,
    ledger: Path,
    instance: str,
    lease: str = "2s",
    step_delay: float = 0.004,
    concurrency: int = 256,
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        CRASH_CONCURRENCY=str(concurrency),
        CRASH_STEP_DELAY=str(step_delay),
        CRASH_DB=str(db),
        CRASH_LEDGER=str(ledger),
        CRASH_INSTANCE=instance,
        CRASH_LEASE=lease,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    # stdout carries the one "ready" line (see _wait_ready). stderr goes to a
    # file: a pipe nobody reads would block a process that logs 64 KiB.
    log = db.with_name(f"{instance or 'worker'}-{next(_SPAWNED)}.log")
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(APP)], env=env, stdout=subprocess.PIPE, stderr=err
        )
    _LOGS[proc.pid] = log
    return proc


_SPAWNED = itertools.count(1)
_LOGS: dict[int, Path] = {}


async def _wait_ready(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` has opened the store and its worker loop runs.

    It prints ``ready`` then; on a loaded machine that can take seconds, so
    a fixed sleep is no substitute. The bound only turns a process that never
    starts into a failure with its log rather than a hung test.
    """
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=60)
    except TimeoutError:
        line = b""
    if line != b"ready\n":
        log = _LOGS.get(proc.pid)
        text = log.read_text(errors="replace")[-3000:] if log is not None else ""
        raise AssertionError(f"worker pid {proc.pid} did not start ({line!r}):\n{text}")


async def _create_runs(db: Path, count: int) -> durably.Engine:
    client = durably.Engine(f"sqlite:///{db}", drive=False)

    @client.workflow("multi-step")
    async def multi_step(ctx: durably.WorkflowContext, n: int) -> int:  # never run here
        raise AssertionError("the client process must not execute runs")

    for i in range(count):
        await client.start("multi-step", i, run_id=f"run-{i:04}")
    return client


async def _wait_all_terminal(client: durably.Engine, count: int, timeout: float) -> None:
    """Wait until ``count`` runs completed; else fail listing some that did not."""

    async def all_completed() -> bool:
        return len((await client.list_runs(status="completed", limit=1000)).runs) == count

    try:
        await eventually(
            all_completed, what=f"{count} runs to complete", timeout=timeout, interval=0.25
        )
    except AssertionError as timed_out:
        live = [
            (r.run_id, r.status.value)
            for s in ("pending", "running", "suspended", "failed", "dead")
            for r in (await client.list_runs(status=s, limit=20)).runs
        ]
        raise AssertionError(f"{timed_out}; some left: {live}") from None


def _read_ledger(ledger: Path) -> tuple[Counter[tuple[str, int]], list[str], Counter[str]]:
    executions: Counter[tuple[str, int]] = Counter()
    violations: list[str] = []
    by_pid: Counter[str] = Counter()
    for line in ledger.read_text().splitlines():
        if line.startswith("VIOLATION"):
            violations.append(line)
            continue
        run_id, seq, pid = line.split()
        executions[(run_id, int(seq))] += 1
        by_pid[pid] += 1
    return executions, violations, by_pid


async def _assert_outcome(client: durably.Engine, ledger: Path, count: int) -> Counter[str]:
    executions, violations, by_pid = _read_ledger(ledger)
    assert violations == [], f"completed steps executed again: {violations[:5]}"
    positions = [s if s < 2 else s + 1 for s in range(STEPS)]
    missing = [
        (f"run-{i:04}", p)
        for i in range(count)
        for p in positions
        if executions[(f"run-{i:04}", p)] == 0
    ]
    assert missing == []
    for i in range(count):
        run = await client.get_run(f"run-{i:04}")
        assert run is not None and run.status is RunStatus.COMPLETED
        assert run.output == expected_output(i)
    return by_pid


@pytest.mark.slow
async def test_runs_survive_repeated_sigkill(tmp_path: Path) -> None:
    db, ledger = tmp_path / "crash.db", tmp_path / "ledger.txt"
    count = 400
    client = await _create_runs(db, count)
    rng = random.Random()
    kills = 0
    try:
        for round_number in range(5):
            # Alternate a stable id (reclaims its runs at once) with fresh ids
            # (their orphans are recovered only after the lease expires).
            instance = "crash-worker" if round_number % 2 == 0 else ""
            # Slow steps (up to 80 ms in 32 threads) keep hundreds of runs in flight.
            proc = _spawn(db, ledger, instance, lease="1s", step_delay=0.08)
            await asyncio.sleep(rng.uniform(0.5, 1.2))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            kills += 1
            done = len((await client.list_runs(status="completed", limit=1000)).runs)
            print(f"SIGKILL {kills}: {done}/{count} runs completed", flush=True)
            if done == count:
                break
        final = _spawn(db, ledger, "crash-worker", lease="1s")
        try:
            await _wait_all_terminal(client, count, timeout=180)
        finally:
            final.send_signal(signal.SIGTERM)
            final.wait(timeout=30)
        assert kills >= 3, "the runs finished before the processes could be killed"
        await _assert_outcome(client, ledger, count)
        executions, _, _ = _read_ledger(ledger)
        reexecuted = sum(1 for n in executions.values() if n > 1)
        print(f"{kills} SIGKILLs; {reexecuted} interrupted steps re-ran (never a completed one)")
    finally:
        await client.close()


@pytest.mark.slow
async def test_two_processes_on_one_file_never_run_a_step_twice(tmp_path: Path) -> None:
    db, ledger = tmp_path / "shared.db", tmp_path / "ledger.txt"
    count = 200
    client = await _create_runs(db, 0)
    # Each peer executes at most 16 runs at once, so neither can take all
    # 200 in its first poll: they must compete for the same pending rows.
    procs = [_spawn(db, ledger, f"peer-{i}", concurrency=16) for i in range(2)]
    try:
        # Both peers must be polling before the runs exist, so both compete.
        for proc in procs:
            await _wait_ready(proc)
        for i in range(count):
            await client.start("multi-step", i, run_id=f"run-{i:04}")
        await _wait_all_terminal(client, count, timeout=120)
        by_pid = await _assert_outcome(client, ledger, count)
        executions, _, _ = _read_ledger(ledger)
        assert max(executions.values()) == 1, "a step executed twice without any crash"
        assert len(by_pid) == 2, f"one process did all the work: {dict(by_pid)}"
        print(f"step executions per process: {dict(by_pid)}")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
        await client.close()


@pytest.mark.slow
async def test_saga_unwind_and_fan_survive_sigkill(tmp_path: Path) -> None:
    """SIGKILL lands mid-fan and mid-unwind; after restarts the fan completes
    once and every completed step is undone exactly once."""
    db, ledger = tmp_path / "saga.db", tmp_path / "ledger.txt"
    client = durably.Engine(f"sqlite:///{db}", drive=False)
    for name in ("fan-parent", "fan-leaf", "saga"):
        client.register(name, _never, version="1")
    sagas = 12
    try:
        await client.start("fan-parent", FAN_WIDTH, run_id="fan")
        for i in range(sagas):
            await client.start("saga", i, run_id=f"saga-{i:02}")
        rng = random.Random()
        kills = 0
        for round_number in range(4):
            instance = "saga-worker" if round_number % 2 == 0 else ""
            proc = _spawn(db, ledger, instance, lease="1s", step_delay=0.03)
            await asyncio.sleep(rng.uniform(0.6, 1.3))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            kills += 1
        final = _spawn(db, ledger, "saga-worker", lease="1s")
        try:

            async def none_live() -> bool:
                live = [
                    r.run_id
                    for s in ("pending", "running", "suspended")
                    for r in (await client.list_runs(status=s, limit=1000)).runs
                ]
                assert not live, f"runs still live: {live[:10]}"
                return True

            await eventually(none_live, what="every run to end", timeout=120, interval=0.25)
        finally:
            final.send_signal(signal.SIGTERM)
            final.wait(timeout=30)
        executions, violations, _ = _read_ledger(ledger)
        assert violations == [], f"completed work executed again: {violations[:5]}"
        fan = await client.get_run("fan")
        assert fan is not None and fan.status is RunStatus.COMPLETED
        assert fan.output == sum(range(FAN_WIDTH))
        for i in range(FAN_WIDTH):
            assert executions[(f"fan.child.{i}", 0)] >= 1
        for i in range(sagas):
            run = await client.get_run(f"saga-{i:02}")
            assert run is not None and run.status is RunStatus.FAILED
            assert run.error is not None and run.error["code"] == "doomed"
            history = {c.seq: c for c in await client.history(run.run_id)}
            for k in range(SAGA_STEPS):
                undo_seq = -2 - k
                assert history[undo_seq].status.value == "completed"
                assert executions[(run.run_id, undo_seq)] >= 1
        print(f"{kills} SIGKILLs during the fan and the unwinds")
    finally:
        await client.close()


async def _never(ctx: durably.WorkflowContext, n: int) -> int:
    raise AssertionError("the client process must not execute runs")
