"""Dispatched steps across real processes on PostgreSQL with the ``db`` transport.

An engine process drives runs and serves no step; worker processes serve the
steps. One worker is SIGKILLed while it holds tasks: every run still
completes (the redispatch net re-sends durable steps, the liveness window
fails over steps with a ``timeout``). A flow-control cap holds across two
engine processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import durably
from durably import RunStatus
from durably.testing import eventually

from .step_app import CAP, expected_job

APP = Path(__file__).with_name("step_app.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass
class Crew:
    url: str
    tmp: Path
    ledger: Path
    processes: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    async def spawn(self, name: str, role: str) -> asyncio.subprocess.Process:
        env = dict(os.environ)
        env.update(
            STEPS_STORE=self.url,
            STEPS_LEDGER=str(self.ledger),
            STEPS_ROLE=role,
            STEPS_INSTANCE=name,
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
        )
        log = (self.tmp / f"{name}.log").open("wb")
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(APP), env=env, stdout=asyncio.subprocess.PIPE, stderr=log
        )
        self.processes[name] = process
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=60)
        assert line == b"ready\n", self.logs()
        return process

    async def kill(self, name: str) -> None:
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        await process.wait()

    async def stop_all(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGKILL)
                await process.wait()

    def logs(self) -> str:
        parts = []
        for name in self.processes:
            path = self.tmp / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- {name} ---\n{text[-3000:]}")
        return "\n".join(parts)

    def ledger_lines(self) -> list[list[str]]:
        if not self.ledger.exists():
            return []
        return [line.split() for line in self.ledger.read_text().splitlines() if line.strip()]


@asynccontextmanager
async def crew(url: str, tmp: Path) -> AsyncIterator[Crew]:
    team = Crew(url, tmp, tmp / "ledger.txt")
    try:
        yield team
    except BaseException:
        print(team.logs())
        raise
    finally:
        await team.stop_all()


def producer(url: str) -> durably.Engine:
    """This test process: creates runs, never executes a turn or a step."""
    engine = durably.Engine(url, transport="db://", drive=False, consumers="never")

    @engine.workflow("job")
    async def job(ctx: durably.WorkflowContext, n: int) -> int:  # pragma: no cover
        raise AssertionError("the producer never executes")

    @engine.workflow("throttled")
    async def throttled(ctx: durably.WorkflowContext, n: int) -> int:  # pragma: no cover
        raise AssertionError("the producer never executes")

    return engine


async def wait_all(client: durably.Engine, run_ids: list[str], timeout: float) -> None:
    await asyncio.gather(
        *(client.wait_for_run(run_id, terminal=True, timeout=timeout) for run_id in run_ids)
    )


async def test_a_worker_killed_holding_tasks_loses_no_run(
    postgres_url: str, tmp_path: Path
) -> None:
    client = producer(postgres_url)
    await client.open()  # migrate before the processes race to
    try:
        async with crew(postgres_url, tmp_path) as team:
            await team.spawn("engine", "engine")
            await team.spawn("worker-a", "worker")
            await team.spawn("worker-b", "worker")
            runs = [await client.start("job", n, run_id=f"job-{n:03}") for n in range(40)]

            # Kill worker-a once it holds tasks (started, not ended), a step
            # with a timeout among them.
            def held_by_a() -> list[list[str]]:
                lines = team.ledger_lines()
                ended = {(row[1], row[2]) for row in lines if row[0] == "end"}
                held = [
                    row
                    for row in lines
                    if row[0] == "start" and row[3] == "worker-a" and (row[1], row[2]) not in ended
                ]
                if len(held) >= 2 and any(row[1].endswith(":1") for row in held):
                    return held
                return []

            held = await eventually(
                held_by_a,
                what="worker-a to hold 2 tasks, a step with a timeout among them",
                timeout=60,
            )
            await team.kill("worker-a")
            held_steps = [(row[1], row[2]) for row in held]
            held_ids = {step_id for step_id, _ in held_steps}

            await wait_all(client, [r.run_id for r in runs], timeout=180)
            outcomes = {r.run_id: await client.get_run(r.run_id) for r in runs}
            lines = team.ledger_lines()
    finally:
        await client.close()

    assert all(run is not None and run.status is RunStatus.COMPLETED for run in outcomes.values())
    assert {rid: run.output for rid, run in outcomes.items() if run} == {
        f"job-{n:03}": expected_job(n) for n in range(40)
    }
    # Every task worker-a held was finished by worker-b.
    finished_by_b = {row[1] for row in lines if row[0] == "end" and row[3] == "worker-b"}
    assert held_ids <= finished_by_b
    # A step with a timeout held by the dead worker was failed over by its
    # liveness window: worker-b ran a *new* attempt of it. The message lease
    # (30 s) would only have redelivered the same attempt. How fast the window
    # fires is shown on a virtual clock in tests/engine/test_dispatched.py.
    for step_id, attempt in held_steps:
        taken_over = [
            int(row[2])
            for row in lines
            if row[0] == "start" and row[1] == step_id and row[3] == "worker-b"
        ]
        assert taken_over, f"{step_id} was never taken over"
        if step_id.endswith(":1"):
            assert max(taken_over) > int(attempt), (step_id, attempt, taken_over)
    starts = defaultdict(int)
    for row in lines:
        if row[0] == "start":
            starts[row[3]] += 1
    print(f"tasks started per process: {dict(starts)}")


async def test_a_queue_cap_holds_across_two_engines(postgres_url: str, tmp_path: Path) -> None:
    client = producer(postgres_url)
    await client.open()
    try:
        async with crew(postgres_url, tmp_path) as team:
            await team.spawn("engine-1", "both")
            await team.spawn("engine-2", "both")
            runs = [await client.start("throttled", n) for n in range(16)]
            await wait_all(client, [r.run_id for r in runs], timeout=180)
            outcomes = [await client.get_run(r.run_id) for r in runs]
            lines = team.ledger_lines()
    finally:
        await client.close()
    assert all(run is not None and run.status is RunStatus.COMPLETED for run in outcomes)
    events = sorted(
        (int(row[4]), 0 if row[0] == "end" else 1, row[3])
        for row in lines
        if row[0] in ("start", "end")
    )
    running = peak = 0
    for _, kind, _ in events:
        running += 1 if kind == 1 else -1
        peak = max(peak, running)
    served_by = {row[3] for row in lines if row[0] == "start"}
    print(f"peak concurrency {peak} (cap {CAP}); served by {sorted(served_by)}")
    assert peak <= CAP
    assert len([row for row in lines if row[0] == "start"]) == 16


async def test_the_engine_killed_while_steps_are_out_loses_no_run(
    postgres_url: str, tmp_path: Path
) -> None:
    """The dispatching process dies with tasks out and turns waiting in
    memory (steps with a timeout): its runs are recovered by the restarted
    engine, results sent meanwhile settle their steps, every run completes."""
    client = producer(postgres_url)
    await client.open()
    try:
        async with crew(postgres_url, tmp_path) as team:
            await team.spawn("engine", "engine")
            await team.spawn("worker-a", "worker")
            await team.spawn("worker-b", "worker")
            runs = [await client.start("job", n, run_id=f"job-{n:03}") for n in range(30)]
            await eventually(
                lambda: len([row for row in team.ledger_lines() if row[0] == "start"]) >= 10,
                what="10 steps to start",
                timeout=60,
            )
            await team.kill("engine")
            await team.spawn("engine-again", "engine")
            await wait_all(client, [r.run_id for r in runs], timeout=180)
            outcomes = {r.run_id: await client.get_run(r.run_id) for r in runs}
    finally:
        await client.close()
    assert {rid: (run.status, run.output) for rid, run in outcomes.items() if run} == {
        f"job-{n:03}": (RunStatus.COMPLETED, expected_job(n)) for n in range(30)
    }
