"""``engine.remote_workflow`` on the engine side alone (memory, SQLite, PostgreSQL).

What a remote workflow is before any worker: its registration checks, and a
clear error at registration on a transport that carries no turns. The turns
themselves are proven against Redis and the real durable-worker in
``tests/on_redis`` and ``tests/interop``.
"""

from __future__ import annotations

import pytest

from durably._remote.wire import parse_decision
from durably.wire import WireError

from .conftest import EngineFactory


async def test_a_remote_workflow_needs_a_transport_that_carries_turns(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()  # local:// carries steps, not turns
    with pytest.raises(ValueError, match="redis://"):
        engine.remote_workflow("py.order")
    assert "py.order" not in engine.workflows


async def test_remote_workflow_registration_checks(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="redis://127.0.0.1:6379/0?prefix=durably-unused")
    with pytest.raises(TypeError, match="requires"):
        engine.remote_workflow("a", requires="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        engine.remote_workflow("")
    with pytest.raises(ValueError, match="group"):
        engine.remote_workflow("a", group="x:y")
    engine.remote_workflow("a", version="1", requires=["gpu"])
    engine.remote_workflow("a", version="1", requires=["gpu"])  # the same again: fine
    with pytest.raises(ValueError, match="already registered"):
        engine.remote_workflow("a", version="1", requires=["cpu"])
    assert engine.workflows == ["a"]
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
