"""The wire's JSON, byte for byte, after the upstream golden fixtures
(``task.step.json``, ``result.json``, ``heartbeat.json``): compact, keys in
the upstream emit order, absent optionals omitted."""

from __future__ import annotations

import json
from typing import Any

import pytest

from durably.wire import Heartbeat, StepEvent, StepResult, StepTask, WireError, routing_token

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def compact(wire: dict[str, Any]) -> str:
    return json.dumps(wire, separators=(",", ":"), ensure_ascii=False)


TASK_STEP = (
    '{"runId":"run-abc","seq":3,"name":"payments.charge-card","stepId":"run-abc:3",'
    '"group":"payments.charge-card","input":{"amount":4200,"currency":"EUR"},'
    f'"traceparent":"{TRACEPARENT}","context":{{"tenant":"acme","requestId":"req-1"}},'
    '"transport":"pool-1","priority":5,"attempt":1}'
)
RESULT = (
    '{"runId":"run-abc","seq":3,"stepId":"run-abc:3","startedAt":1718000000000,'
    '"status":"completed","output":{"chargeId":"ch_1","ok":true},'
    '"events":[{"at":1718000000050,"level":"info","message":"charging card"}]}'
)
HEARTBEAT = '{"runId":"run-abc","seq":3,"stepId":"run-abc:3","group":"payments.charge-card"}'


def test_a_step_task_serialises_as_the_fixture() -> None:
    task = StepTask(
        run_id="run-abc",
        seq=3,
        name="payments.charge-card",
        group="payments.charge-card",
        input={"amount": 4200, "currency": "EUR"},
        attempt=1,
        priority=5,
        traceparent=TRACEPARENT,
        context={"tenant": "acme", "requestId": "req-1"},
        transport="pool-1",
    )
    assert compact(task.to_wire()) == TASK_STEP
    assert StepTask.from_wire(json.loads(TASK_STEP)) == task


def test_a_minimal_task_omits_its_optionals_but_keeps_a_null_input() -> None:
    task = StepTask(run_id="r", seq=0, name="a:b", group=routing_token("a:b"))
    assert compact(task.to_wire()) == (
        '{"runId":"r","seq":0,"name":"a:b","stepId":"r:0","group":"a-b","input":null,"attempt":1}'
    )
    assert StepTask.from_wire(task.to_wire()) == task


def test_the_task_fixture_keeps_its_transport_key() -> None:
    task = StepTask.from_wire(json.loads(TASK_STEP))
    assert (task.run_id, task.seq, task.priority, task.attempt) == ("run-abc", 3, 5, 1)
    assert task.transport == "pool-1"
    assert task.to_wire()["transport"] == "pool-1"


def test_a_result_serialises_as_the_fixture() -> None:
    result = StepResult(
        run_id="run-abc",
        seq=3,
        ok=True,
        output={"chargeId": "ch_1", "ok": True},
        started_at=1718000000000,
        events=[StepEvent(1718000000050, "info", "charging card")],
    )
    assert compact(result.to_wire()) == RESULT
    assert StepResult.from_wire(json.loads(RESULT)) == result


def test_a_failed_result_carries_its_error_and_no_output() -> None:
    result = StepResult(
        "r", 1, ok=False, error={"message": "declined", "code": None, "retryable": False}
    )
    assert compact(result.to_wire()) == (
        '{"runId":"r","seq":1,"stepId":"r:1","status":"failed",'
        '"error":{"message":"declined","code":null,"retryable":false}}'
    )
    parsed = StepResult.from_wire(result.to_wire())
    assert parsed == result and not parsed.retryable
    assert StepResult.from_wire(
        {"runId": "r", "seq": 1, "status": "failed", "error": "boom"}
    ).error == {"message": "boom"}


def test_a_completed_result_keeps_a_null_output() -> None:
    result = StepResult("r", 1, ok=True)
    assert compact(result.to_wire()) == (
        '{"runId":"r","seq":1,"stepId":"r:1","status":"completed","output":null}'
    )


def test_event_extras_follow_the_standard_keys() -> None:
    event = StepEvent(5, "warn", "retrying", {"name": "charge", "phase": "running", "subId": "x"})
    assert compact(event.to_wire()) == (
        '{"at":5,"level":"warn","message":"retrying","name":"charge","phase":"running","subId":"x"}'
    )
    assert StepEvent.from_wire(event.to_wire()) == event


def test_a_heartbeat_serialises_as_the_fixture() -> None:
    beat = Heartbeat("run-abc", 3, "payments.charge-card")
    assert compact(beat.to_wire()) == HEARTBEAT
    assert Heartbeat.from_wire(json.loads(HEARTBEAT)) == beat
    full = Heartbeat("r", 2, "g", at=1718000000000, progress={"done": 3, "of": 10})
    assert compact(full.to_wire()) == (
        '{"runId":"r","seq":2,"stepId":"r:2","group":"g","at":1718000000000,'
        '"progress":{"done":3,"of":10}}'
    )
    assert Heartbeat.from_wire(full.to_wire()) == full


def test_a_heartbeat_time_below_1e12_is_in_seconds() -> None:
    beat = Heartbeat.from_wire({"runId": "r", "seq": 1, "at": 1718000000.5})
    assert beat.at == 1718000000500


def test_non_ascii_text_round_trips() -> None:
    task = StepTask("r", 1, "n", "g", input={"name": "Zoë", "emoji": "🚀"})
    assert StepTask.from_wire(json.loads(compact(task.to_wire()))) == task


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (StepTask.from_wire, {"seq": 1, "name": "n"}),
        (StepTask.from_wire, {"runId": "r", "name": "n"}),
        (StepTask.from_wire, {"runId": "r", "seq": "1", "name": "n"}),
        (StepTask.from_wire, {"runId": "r", "seq": True, "name": "n"}),
        (StepTask.from_wire, {"runId": "r", "seq": 1}),
        (StepTask.from_wire, ["not", "an", "object"]),
        (StepResult.from_wire, {"runId": "r", "seq": 1}),
        (StepResult.from_wire, {"runId": "r", "seq": 1, "status": "running"}),
        (StepResult.from_wire, {"seq": 1, "status": "completed"}),
        (StepResult.from_wire, None),
        (Heartbeat.from_wire, {"runId": "r"}),
        (Heartbeat.from_wire, {"seq": 1}),
        (Heartbeat.from_wire, "r:1"),
    ],
)
def test_a_message_missing_a_required_field_is_a_wire_error(parse: Any, body: Any) -> None:
    with pytest.raises(WireError):
        parse(body)


def test_an_integral_float_seq_is_accepted() -> None:
    assert StepTask.from_wire({"runId": "r", "seq": 3.0, "name": "n"}).seq == 3
