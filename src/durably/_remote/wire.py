"""The remote-turn messages and their JSON: WorkflowTask (engine → worker),
WorkflowDecision and its commands, run-scoped heartbeats and step events
(worker → engine), and the history a turn carries.

Shapes follow the upstream wire (camelCase, epoch ms, absent optionals
omitted). Parsing is strict about what the engine acts on (ids, seqs, kinds)
and lenient about the rest: a worker that adds fields is not refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model import Checkpoint, CheckpointKind, CheckpointStatus, ErrorInfo
from ..wire import WireError

__all__ = [
    "Call",
    "Command",
    "Decision",
    "RecordStep",
    "RunBeat",
    "Sleep",
    "StartChild",
    "WaitSignal",
    "WorkflowTask",
    "history",
    "parse_decision",
    "parse_run_beat",
]

_LOCAL_KINDS = frozenset(
    {
        CheckpointKind.LOCAL,
        CheckpointKind.SIDE_EFFECT,
        CheckpointKind.NOW,
        CheckpointKind.UUID,
        CheckpointKind.RANDOM,
    }
)
_SETTLED = frozenset({CheckpointStatus.COMPLETED, CheckpointStatus.FAILED})
DECISION_STATUSES = frozenset({"continue", "completed", "failed", "cancelled"})


@dataclass(slots=True)
class WorkflowTask:
    """One turn of a remote run, sent to the worker serving its workflow."""

    task_id: str
    run_id: str
    workflow: str
    workflow_version: str
    input: Any
    history: list[dict[str, Any]]
    group: str
    attempt: int = 1
    priority: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """The turn as upstream JSON. ``history`` is always a list: a worker
        tells a turn from a step task by it (without one the job is lost)."""
        wire: dict[str, Any] = {
            "taskId": self.task_id,
            "runId": self.run_id,
            "workflow": self.workflow,
            "workflowVersion": self.workflow_version,
            "input": self.input,
            "history": list(self.history),
            "group": self.group,
            "attempt": self.attempt,
        }
        if self.priority is not None:
            wire["priority"] = self.priority
        return wire


def history(checkpoints: dict[int, Checkpoint]) -> list[dict[str, Any]]:
    """The HistoryEvents of a remote run's settled checkpoints, by seq."""
    events: list[dict[str, Any]] = []
    for seq in sorted(checkpoints):
        cp = checkpoints[seq]
        if cp.status not in _SETTLED:
            continue
        failed = cp.status is CheckpointStatus.FAILED
        kind = cp.kind
        event: dict[str, Any]
        if kind == CheckpointKind.STEP:
            event = {"seq": seq, "kind": "call", "name": cp.name}
        elif kind in _LOCAL_KINDS:
            event = {"seq": seq, "kind": "step", "name": cp.name}
        elif kind == CheckpointKind.SLEEP:
            events.append({"seq": seq, "kind": "timer", "name": f"sleep:{seq}"})
            continue
        elif kind == CheckpointKind.SIGNAL:
            # The SDK compares a name only when one is sent; ours is
            # "signal:<token>", theirs the bare signal name: omit it.
            event = {"seq": seq, "kind": "signal"}
        elif kind == CheckpointKind.CHILD:
            event = {"seq": seq, "kind": "child"}
        else:
            continue
        if failed:
            event["error"] = cp.error or {"message": "failed"}
        else:
            event["output"] = cp.output
        events.append(event)
    return events


# -- decisions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """Dispatch the step ``name`` (a no-op if ``seq`` has a checkpoint)."""

    seq: int
    name: str
    group: str | None
    input: Any
    parallel_group: str | None = None


@dataclass(frozen=True, slots=True)
class RecordStep:
    """A local step the worker ran inline this turn."""

    seq: int
    name: str
    output: Any = None
    error: ErrorInfo | None = None
    started_at: int | None = None
    finished_at: int | None = None
    parallel_group: str | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """A durable timer of ``ms`` from now (the engine fixes the deadline)."""

    seq: int
    ms: int


@dataclass(frozen=True, slots=True)
class WaitSignal:
    """Wait for ``engine.signal(signal, payload)``."""

    seq: int
    signal: str


@dataclass(frozen=True, slots=True)
class StartChild:
    """Start the child run ``<runId>.child.<seq>`` of ``workflow``."""

    seq: int
    workflow: str
    input: Any
    parallel_group: str | None = None


Command = Call | RecordStep | Sleep | WaitSignal | StartChild


@dataclass(frozen=True, slots=True)
class Decision:
    """A worker's answer to one turn."""

    task_id: str
    run_id: str
    status: str
    commands: list[Command] = field(default_factory=list)
    output: Any = None
    error: ErrorInfo | None = None


def parse_decision(data: Any) -> Decision:
    """Parse a WorkflowDecision; :class:`WireError` if it is not one. A
    decision whose envelope is sound but whose commands are not (an unknown
    kind, a bad seq) is returned as a failure of its run."""
    body = _object(data, "decision")
    task_id, run_id = _text(body, "taskId"), _text(body, "runId")
    status = body.get("status")
    if status not in DECISION_STATUSES:
        raise WireError(f"unknown decision status {status!r}")
    raw = body.get("commands", [])
    if not isinstance(raw, list):
        raise WireError("field 'commands' must be a list")
    try:
        commands = [_command(item) for item in raw]
        seqs = [command.seq for command in commands]
        if len(set(seqs)) != len(seqs):
            raise WireError("two commands of one decision share a seq")
    except WireError as exc:
        # The turn is answered, but with what this engine cannot carry out
        # (an unknown command kind…): sending the turn again would get the
        # same answer forever, so the run fails, saying why.
        bad: ErrorInfo = {
            "message": f"the worker's decision cannot be applied: {exc}",
            "code": "bad_decision",
            "type": "WireError",
        }
        return Decision(task_id, run_id, "failed", [], None, bad)
    error = body.get("error")
    if error is not None and not isinstance(error, dict):
        error = {"message": str(error)}
    if status == "failed" and error is None:
        error = {"message": "the remote workflow failed"}
    return Decision(task_id, run_id, status, commands, body.get("output"), error)


def _command(data: Any) -> Command:
    body = _object(data, "command")
    kind, seq = body.get("kind"), _seq(body)
    group = body.get("parallelGroup")
    parallel = group if isinstance(group, str) else None
    if kind == "call":
        call_group = body.get("group")
        return Call(
            seq,
            _text(body, "name"),
            call_group if isinstance(call_group, str) and call_group else None,
            body.get("input"),
            parallel,
        )
    if kind == "recordStep":
        error = body.get("error")
        if error is not None and not isinstance(error, dict):
            error = {"message": str(error)}
        return RecordStep(
            seq,
            _text(body, "name"),
            body.get("output"),
            error,
            _optional_int(body, "startedAt"),
            _optional_int(body, "finishedAt"),
            parallel,
        )
    if kind == "sleep":
        ms = body.get("ms")
        if isinstance(ms, bool) or not isinstance(ms, int | float) or ms < 0:
            raise WireError(f"a sleep needs a non-negative 'ms', got {ms!r}")
        return Sleep(seq, round(ms))
    if kind == "waitSignal":
        return WaitSignal(seq, _text(body, "signal"))
    if kind == "startChild":
        return StartChild(seq, _text(body, "workflow"), body.get("input"), parallel)
    raise WireError(f"unknown command kind {kind!r}")


@dataclass(frozen=True, slots=True)
class RunBeat:
    """A run-scoped heartbeat: a worker is executing a turn of ``run_id``."""

    run_id: str
    group: str | None


def parse_run_beat(data: Any) -> RunBeat | None:
    """A run-scoped beat (one without ``stepId``), or ``None`` for anything else."""
    if not isinstance(data, dict) or "stepId" in data:
        return None
    run_id = data.get("runId")
    if not isinstance(run_id, str) or not run_id:
        return None
    group = data.get("group")
    return RunBeat(run_id, group if isinstance(group, str) else None)


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise WireError(f"a {what} must be a JSON object, not {type(data).__name__}")
    return data


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise WireError(f"field {key!r} must be a non-empty string, got {value!r}")
    return value


def _seq(body: dict[str, Any]) -> int:
    value = body.get("seq")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError(f"field 'seq' must be a non-negative integer, got {value!r}")
    return value


def _optional_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)
