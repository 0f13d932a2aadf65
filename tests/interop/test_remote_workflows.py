"""durably drives remote workflows whose bodies run in ``durable-worker`` 0.26.1.

The engine registers ``py.order`` / ``py.child`` / ``py.slowturn`` with
``engine.remote_workflow`` (no Python body here); a real durable-worker
process (``dw_workflows.py``, its own virtualenv) replays each turn from the
history the engine sends and answers with a decision. Covered: a whole
workflow (a recorded ``now``, a step, a sleep, a signal, a child, a gather)
driven turn by turn to completion; a worker SIGKILLed mid-turn, the turn
re-driven under a fresh task id; run-scoped heartbeats keeping a turn that
outlasts the silence window alive (no re-drive).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.model import CheckpointKind, CheckpointStatus
from durably.testing import eventually
from durably.wire import StepTask

from .conftest import REDIS_URL, workflow_worker

pytestmark = [pytest.mark.timeout(180)]


@asynccontextmanager
async def remote_engine(
    tmp_path: Path, prefix: str, *, silence: str = "30s", namespace: str | None = None
) -> AsyncIterator[durably.Engine]:
    engine = durably.Engine(
        f"sqlite:///{tmp_path / f'engine-{uuid.uuid4().hex[:6]}.db'}",
        transport=f"{REDIS_URL}?prefix={prefix}",
        poll_interval=0.05,
        remote_advance_silence=silence,
        namespace=namespace,
    )
    for name in ("py.order", "py.child", "py.slowturn", "py.declined"):
        engine.remote_workflow(name)
    await engine.start_worker()
    try:
        yield engine
    finally:
        await engine.close()


async def finish(engine: durably.Engine, run_id: str, timeout: float = 60) -> durably.RunResult:
    return await engine.wait_for_run(run_id, terminal=True, timeout=timeout)


def turns(worker: Any, workflow: str, run_id: str) -> int:
    return worker.lines.count(f"turn {workflow} {run_id}")


async def test_a_remote_workflow_is_driven_turn_by_turn_to_completion(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine, workflow_worker(interop_python, prefix):
        run_id = (await engine.start("py.order", {"n": 1})).run_id

        async def waits_for_its_signal() -> bool:
            return any(
                cp.kind == CheckpointKind.SIGNAL and cp.status is CheckpointStatus.PENDING
                for cp in await engine.history(run_id)
            )

        await eventually(waits_for_its_signal, timeout=60)
        await engine.signal(f"approve-{run_id}", {"ok": True})
        result = await finish(engine, run_id)
        assert result.status is RunStatus.COMPLETED, result.error
        assert result.output == {
            "first": 2,
            "approval": {"ok": True},
            "child": 3,
            "pair": [11, 21],
            "startedIsMs": True,
        }
        kinds = [(cp.seq, cp.kind, cp.status) for cp in await engine.history(run_id)]
        assert kinds == [
            (0, CheckpointKind.LOCAL, CheckpointStatus.COMPLETED),  # ctx.now()
            (1, CheckpointKind.STEP, CheckpointStatus.COMPLETED),
            (2, CheckpointKind.SLEEP, CheckpointStatus.COMPLETED),
            (3, CheckpointKind.SIGNAL, CheckpointStatus.COMPLETED),
            (4, CheckpointKind.CHILD, CheckpointStatus.COMPLETED),
            (5, CheckpointKind.STEP, CheckpointStatus.COMPLETED),
            (6, CheckpointKind.STEP, CheckpointStatus.COMPLETED),
        ]
        child = await engine.get_run(f"{run_id}.child.4")
        assert child is not None and child.status is RunStatus.COMPLETED
        assert child.parent_id == run_id and child.output == 3


async def test_a_signal_sent_before_the_wait_is_taken_by_the_decision(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine, workflow_worker(interop_python, prefix):
        run_id = (await engine.start("py.order", {"n": 5})).run_id
        await engine.signal(f"approve-{run_id}", "early")  # buffered: nobody waits yet
        result = await finish(engine, run_id)
        assert result.status is RunStatus.COMPLETED, result.error
        assert result.output["approval"] == "early"
        assert result.output["child"] == 7


async def test_a_worker_killed_mid_turn_has_its_turn_re_driven(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix, silence="4s") as engine:
        async with workflow_worker(interop_python, prefix) as doomed:
            run_id = (await engine.start("py.slowturn", {"n": 5, "seconds": 2})).run_id
            await eventually(lambda: turns(doomed, "py.slowturn", run_id) == 1, timeout=60)
            doomed.process.send_signal(signal.SIGKILL)
            await doomed.process.wait()
        first = await engine.get_run(run_id)
        assert first is not None and first.status is RunStatus.SUSPENDED
        async with workflow_worker(interop_python, prefix) as rescuer:
            result = await finish(engine, run_id)
            assert result.status is RunStatus.COMPLETED, result.error
            assert result.output == 6
            assert turns(rescuer, "py.slowturn", run_id) >= 1


async def test_run_heartbeats_keep_a_long_turn_alive(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    # The turn's local step takes 9 s, the silence window is 6 s: only the
    # worker's run-scoped beats (t=0 s, t=5 s) keep it from being re-driven.
    async with (
        remote_engine(tmp_path, prefix, silence="6s") as engine,
        workflow_worker(interop_python, prefix) as worker,
    ):
        run_id = (await engine.start("py.slowturn", {"n": 1, "seconds": 9})).run_id
        result = await finish(engine, run_id)
        assert result.status is RunStatus.COMPLETED, result.error
        assert result.output == 2
        # Turn 1 runs the local step and calls py-echo; turn 2 (after the
        # result) replays it and completes. A re-drive would add a third.
        await asyncio.sleep(0)
        assert turns(worker, "py.slowturn", run_id) == 2


async def test_a_remote_workflow_with_no_live_worker_is_blocked_then_runs(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine:
        run_id = (await engine.start("py.child", {"n": 40})).run_id

        async def blocked() -> durably.Run | None:
            run = await engine.get_run(run_id)
            return run if run is not None and run.status is RunStatus.BLOCKED else None

        parked = await eventually(blocked, timeout=30)
        assert parked.error is not None and parked.error["code"] == "no_live_worker"
        listed = await engine.list_runs(status=RunStatus.BLOCKED)
        assert run_id in [run.run_id for run in listed.runs]
        async with workflow_worker(interop_python, prefix):
            result = await finish(engine, run_id)
            assert result.status is RunStatus.COMPLETED, result.error
            assert result.output == 41


async def test_a_remote_workflow_requiring_a_capability_nobody_offers_is_blocked(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine, workflow_worker(interop_python, prefix):
        engine.remote_workflow("py.child", version="2", requires=["gpu", "signals"])
        run_id = (await engine.start("py.child", {"n": 1})).run_id
        run = await eventually(
            lambda: _blocked(engine, run_id), timeout=30, what="the run to be blocked"
        )
        assert run.error is not None
        assert run.error["message"] == "blocked: no compatible worker (requires gpu, signals)"
        assert run.error["code"] == "capability_unavailable"


async def _blocked(engine: durably.Engine, run_id: str) -> durably.Run | None:
    # Blocked for want of the capability (before the worker's keys are
    # written, it is blocked for want of any worker, and polled again).
    run = await engine.get_run(run_id)
    if run is None or run.status is not RunStatus.BLOCKED or run.error is None:
        return None
    return run if run.error["code"] == "capability_unavailable" else None


async def test_worker_health_lists_the_live_durable_worker_and_checks_its_descriptor_hash(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine, workflow_worker(interop_python, prefix):

        async def announced() -> dict[str, Any] | None:
            # The worker writes its keys as it starts, not necessarily before READY,
            # and its liveness key and its descriptor in two writes: wait for both.
            health = await engine.worker_health()
            workers = health["workers"]
            return health if len(workers) == 1 and workers[0]["runtime"] is not None else None

        health = await eventually(announced, timeout=30)
        [worker] = health["workers"]
        assert worker["instance_id"].startswith("py-")
        assert worker["runtime"] == "python"
        assert worker["sdk"] == {"name": "durable-worker", "version": "0.26.1"}
        assert worker["workflows"] == ["py.child", "py.declined", "py.order", "py.slowturn"]
        assert worker["steps"] == ["py-decline", "py-echo", "py-slow"]
        # The hash the real SDK put on its beat equals ours, bit for bit.
        assert worker["descriptor_hash_ok"] is True
        assert sorted(worker["tokens"]) == sorted(worker["workflows"] + worker["steps"])
        assert health["starving"] == {}
        # The same through `durably workers --json` (a process of its own).
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "durably",
            "workers",
            "--json",
            "--transport",
            f"{REDIS_URL}?prefix={prefix}",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await cli.communicate()
        assert cli.returncode == 0
        listed = json.loads(out)
        assert [w["instance_id"] for w in listed["workers"]] == [worker["instance_id"]]
        assert listed["workers"][0]["descriptor_hash_ok"] is True


async def test_worker_health_shows_a_queue_starving_for_a_worker(
    prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine:
        await engine.transport.dispatch(
            [StepTask(run_id="r-1", seq=0, name="nobody:serves", group="nobody-serves")]
        )
        health = await engine.worker_health()
        assert health["workers"] == []
        assert health["starving"] == {"nobody-serves": 1}


async def test_a_run_cancelled_mid_turn_stays_cancelled(
    interop_python: Path, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durably.remote")
    async with (
        remote_engine(tmp_path, prefix) as engine,
        workflow_worker(interop_python, prefix) as worker,
    ):
        run_id = (await engine.start("py.slowturn", {"n": 1, "seconds": 2})).run_id
        await eventually(lambda: turns(worker, "py.slowturn", run_id) == 1, timeout=60)
        assert await engine.cancel(run_id) is RunStatus.SUSPENDED  # its status before

        def dropped() -> bool:
            return any(
                r.getMessage().startswith("dropping") and run_id in r.getMessage()
                for r in caplog.records
            )

        # The worker hears the cancel (or finishes its turn): its decision,
        # whatever it says, does not bring the run back.
        await eventually(dropped, timeout=60)
        run = await engine.get_run(run_id)
        assert run is not None and run.status is RunStatus.CANCELLED
        assert await engine.history(run_id) == []


async def test_an_engine_pool_drives_the_workflows_of_a_worker_partition(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    # The engine's namespace is the upstream partition: turns go to
    # `py.child@acme`, the child's call to `py-echo@acme`.
    async with (
        remote_engine(tmp_path, prefix, namespace="acme") as engine,
        workflow_worker(interop_python, prefix, partition="acme"),
    ):
        run_id = (await engine.start("py.order", {"n": 30})).run_id
        await engine.signal(f"approve-{run_id}", "yes")
        result = await finish(engine, run_id)
        assert result.status is RunStatus.COMPLETED, result.error
        assert result.output["first"] == 31 and result.output["child"] == 32


async def test_a_step_failure_the_workflow_does_not_catch_fails_the_run_verbatim(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine, workflow_worker(interop_python, prefix):
        run_id = (await engine.start("py.declined", {"amount": 5})).run_id
        result = await finish(engine, run_id)
        assert result.status is RunStatus.FAILED
        assert result.error is not None
        assert result.error["message"] == "card declined"
        assert result.error["code"] == "declined"
        assert result.error["details"] == {"last4": "4242"}
        [call] = await engine.history(run_id)
        assert call.status is CheckpointStatus.FAILED and call.error["code"] == "declined"


async def test_a_split_workflow_worker_serves_turns_by_group(
    interop_python: Path, prefix: str, tmp_path: Path
) -> None:
    async with remote_engine(tmp_path, prefix) as engine:
        engine.remote_workflow("py.child", version="2", group="py-workflows")
        async with workflow_worker(interop_python, prefix, partition="split:py-workflows"):
            run_id = (await engine.start("py.child", {"n": 8})).run_id
            result = await finish(engine, run_id)
            assert result.status is RunStatus.COMPLETED, result.error
            assert result.output == 9
