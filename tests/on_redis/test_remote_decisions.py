"""Remote workflow decisions on Redis, with the test playing the worker.

The test announces a worker (a liveness key, as any worker writes), reads the
turns the engine queues, and sends decisions on ``{P}-decisions`` through
BullMQ, as a worker does. On memory, SQLite and PostgreSQL stores, with two
engine instances competing for decisions: a decision is applied once, in one
conditional write; malformed, unknown-run, stale and duplicate decisions are
logged, acked and change nothing; the next turn carries the history.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from bullmq import Queue

import durably
from durably import RunStatus
from durably.model import CheckpointKind, CheckpointStatus
from durably.testing import eventually
from durably.transports import TransportError
from durably.wire import StepResult

from .redis_fixtures import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'durably.db'}"
    else:
        isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
            "isolated_postgres"
        )
        async with isolated() as url:
            yield url


class Fleet:
    """Two engine instances on one store and one Redis prefix, and the
    test's hand as the worker."""

    def __init__(self, prefix: str, engines: list[durably.Engine]) -> None:
        self.prefix = prefix
        self.engines = engines
        self.redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        self.decisions = Queue(f"{prefix}-decisions", {"connection": REDIS_URL})

    async def announce(self, token: str) -> None:
        beat = {"ts": 1, "descriptorHash": "0"}
        await self.redis.set(
            f"{self.prefix}-worker-heartbeat:{token}:py-test-1", json.dumps(beat), ex=60
        )

    async def jobs(self, token: str) -> list[dict[str, Any]]:
        queue = f"bull:{self.prefix}-tasks-{token}"
        ids = await self.redis.lrange(f"{queue}:wait", 0, -1)
        ids += await self.redis.zrange(f"{queue}:prioritized", 0, -1)
        datas = [await self.redis.hget(f"{queue}:{job_id}", "data") for job_id in ids]
        return sorted((json.loads(d) for d in datas if d), key=lambda d: str(d.get("taskId")))

    async def turns(self, count: int) -> list[dict[str, Any]]:
        return await eventually(
            lambda: self._at_least("py.flow", count), timeout=30, what=f"{count} turn(s)"
        )

    async def _at_least(self, token: str, count: int) -> list[dict[str, Any]] | None:
        found = await self.jobs(token)
        return found if len(found) >= count else None

    async def decide(self, *bodies: Any) -> None:
        for body in bodies:
            await self.decisions.add("decision", body, {"removeOnComplete": True})

    async def close(self) -> None:
        await self.decisions.close()
        await delete_prefix(REDIS_URL, self.prefix)
        await self.redis.aclose()


@pytest.fixture
async def fleet(store_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    marker = request.node.get_closest_marker("silence")
    silence = marker.args[0] if marker else "60s"
    prefix = f"durably-decisions-{uuid.uuid4().hex[:10]}"
    shared = durably.Engine("memory://").store if store_url == "memory://" else None
    engines = []
    for _ in range(2):
        engine = durably.Engine(
            shared or store_url,
            transport=f"{REDIS_URL}?prefix={prefix}",
            poll_interval=0.05,
            remote_advance_silence=silence,
        )
        engine.remote_workflow("py.flow")
        engines.append(engine)
    for engine in engines:
        await engine.start_worker()
    crew = Fleet(prefix, engines)
    await crew.announce("py.flow")
    try:
        yield crew
    finally:
        for engine in engines:
            await engine.close()
        await crew.close()


def drops(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropping")]


async def test_a_decision_is_applied_once_and_bad_ones_change_nothing(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durably.remote")
    a = fleet.engines[0]
    run_id = (await a.start("py.flow", {"n": 1})).run_id
    [turn] = await fleet.turns(1)
    assert turn["runId"] == run_id and turn["history"] == [] and turn["input"] == {"n": 1}
    task_id = turn["taskId"]

    # Malformed, unknown run, stale task id: each dropped with one line.
    await fleet.decide(
        "not a decision",
        {"taskId": task_id, "runId": run_id, "status": "continue", "commands": "nope"},
        {"taskId": task_id, "runId": "no-such-run", "status": "continue", "commands": []},
        {"taskId": f"{run_id}:wf:stale", "runId": run_id, "status": "completed", "output": 1},
    )
    await eventually(lambda: len(drops(caplog)) >= 4, timeout=30)
    run = await a.get_run(run_id)
    assert run is not None and run.status is RunStatus.SUSPENDED
    assert await a.history(run_id) == []

    # The same decision twice, two instances competing: applied once.
    decision = {
        "taskId": task_id,
        "runId": run_id,
        "status": "continue",
        "commands": [
            {"kind": "recordStep", "seq": 0, "name": "now#0", "output": 42},
            {"kind": "call", "seq": 1, "name": "py-echo", "group": "default", "input": {"n": 1}},
        ],
    }
    await fleet.decide(decision, decision)
    calls = await eventually(lambda: fleet._at_least("py-echo", 1), timeout=30)
    await eventually(lambda: len(drops(caplog)) >= 5, timeout=30)
    assert len(calls) == 1 and calls[0]["stepId"] == f"{run_id}:1"
    history = [(cp.seq, cp.kind, cp.status) for cp in await a.history(run_id)]
    assert history == [
        (0, CheckpointKind.LOCAL, CheckpointStatus.COMPLETED),
        (1, CheckpointKind.STEP, CheckpointStatus.PENDING),
    ]

    # The step's result wakes the run: the next turn carries the history,
    # under a fresh task id. (A fleet may wake a run twice, each wake a turn
    # of its own: every one carries the same history, the last is awaited.)
    await a.transport.send_result(StepResult(run_id, 1, ok=True, output={"nPlusOne": 2}))
    later = [t for t in await fleet.turns(2) if t["taskId"] != task_id]
    assert later and all(
        t["history"]
        == [
            {"seq": 0, "kind": "step", "name": "now#0", "output": 42},
            {"seq": 1, "kind": "call", "name": "py-echo", "output": {"nPlusOne": 2}},
        ]
        for t in later
    )

    async def completed() -> durably.Run | None:
        for turn in await fleet.jobs("py.flow"):
            if turn["taskId"] != task_id:
                await fleet.decide(
                    {
                        "taskId": turn["taskId"],
                        "runId": run_id,
                        "status": "completed",
                        "output": "done",
                    }
                )
        run = await a.get_run(run_id)
        return run if run is not None and run.status is RunStatus.COMPLETED else None

    done = await eventually(completed, timeout=30, interval=0.2)
    assert done.output == "done"

    # A late decision for a finished run changes nothing.
    seen = len(drops(caplog))
    await fleet.decide({**decision, "status": "failed", "error": {"message": "late"}})
    await eventually(lambda: len(drops(caplog)) > seen, timeout=30)
    final = await a.get_run(run_id)
    assert final is not None and final.status is RunStatus.COMPLETED and final.output == "done"


@pytest.mark.silence("1s")
async def test_a_lost_turn_is_re_driven_under_a_fresh_task_id(fleet: Fleet) -> None:
    a = fleet.engines[0]
    run_id = (await a.start("py.flow", None)).run_id
    turns = await fleet.turns(2)  # nobody answered the first: it was sent again
    assert len({t["taskId"] for t in turns}) == len(turns)
    assert all(t["runId"] == run_id and t["history"] == [] for t in turns)

    async def answered() -> bool:
        # Answer every turn seen: only the one the run still awaits applies.
        for turn in await fleet.jobs("py.flow"):
            await fleet.decide(
                {"taskId": turn["taskId"], "runId": run_id, "status": "completed", "output": 7}
            )
        run = await a.get_run(run_id)
        return run is not None and run.status is RunStatus.COMPLETED

    await eventually(answered, timeout=30, interval=0.2)
    run = await a.get_run(run_id)
    assert run is not None and run.output == 7


@pytest.mark.silence("1s")
async def test_a_call_that_could_not_be_sent_goes_out_with_the_next_turn(fleet: Fleet) -> None:
    # The decision is applied, but the broker refuses its call (as a crash
    # between the two would leave it): the call must not be lost, although
    # the worker's re-emitted call is a no-op for a recorded seq.
    refused: list[int] = []
    for engine in fleet.engines:
        real = engine.transport.dispatch

        async def refuse_once(tasks: list[Any], real: Any = real) -> None:
            if not refused:
                refused.append(len(tasks))
                raise TransportError("the broker is away")
            await real(tasks)

        engine.transport.dispatch = refuse_once  # type: ignore[method-assign]
    a = fleet.engines[0]
    run_id = (await a.start("py.flow", None)).run_id
    [turn] = await fleet.turns(1)
    await fleet.decide(
        {
            "taskId": turn["taskId"],
            "runId": run_id,
            "status": "continue",
            "commands": [{"kind": "call", "seq": 0, "name": "py-echo", "input": {"n": 3}}],
        }
    )
    [task] = await eventually(lambda: fleet._at_least("py-echo", 1), timeout=30)
    assert refused == [1]
    assert task["stepId"] == f"{run_id}:0" and task["input"] == {"n": 3}

    async def stamped() -> bool:
        [cp] = await a.history(run_id)
        return cp.status is CheckpointStatus.PENDING and cp.dispatched_at is not None

    await eventually(stamped, timeout=30)
