"""``engine.remote_workflow`` on the engine side alone (memory, SQLite, PostgreSQL).

What a remote workflow does without a worker: its registration checks, a
start like any workflow's, and a clear failure (not a hang) on a transport
that carries no turns. The turns themselves are proven against Redis and the
real durable-worker in ``tests/on_redis`` and ``tests/interop``.
"""

from __future__ import annotations

import pytest

from durably import RunStatus
from durably._remote.wire import parse_decision
from durably.wire import WireError

from .conftest import EngineFactory


async def test_a_remote_workflow_on_a_transport_without_turns_fails_clearly(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    engine.remote_workflow("py.order")
    assert "py.order" in engine.workflows
    await engine.start_worker()
    run = await engine.start("py.order", {"n": 1})
    result = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
    assert result.status is RunStatus.FAILED
    assert result.error is not None and result.error["code"] == "remote_transport"
    assert "redis://" in result.error["message"]


async def test_remote_workflow_registration_checks(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(TypeError, match="requires"):
        engine.remote_workflow("a", requires="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        engine.remote_workflow("")
    engine.remote_workflow("a", version="1", requires=["gpu"])
    engine.remote_workflow("a", version="1", requires=["gpu"])  # the same again: fine
    with pytest.raises(ValueError, match="already registered"):
        engine.remote_workflow("a", version="1", requires=["cpu"])
    with pytest.raises(TypeError, match="requires"):
        engine.step("s", requires="gpu")(lambda data: data)  # type: ignore[arg-type]


def test_a_sound_decision_with_an_unknown_command_fails_its_run() -> None:
    decision = parse_decision(
        {
            "taskId": "t",
            "runId": "r",
            "status": "continue",
            "commands": [{"kind": "continueAsNew", "seq": 0}],
        }
    )
    assert decision.status == "failed" and decision.commands == []
    assert decision.error is not None and decision.error["code"] == "bad_decision"
    for broken in ("x", {"taskId": "t", "runId": "r", "status": "maybe"}, {"runId": "r"}):
        with pytest.raises(WireError):
            parse_decision(broken)
