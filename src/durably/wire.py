"""The messages a transport carries for dispatched steps, and their JSON shape.

The JSON is the upstream durable-execution wire (camelCase keys, epoch-ms
times, absent optionals omitted, no envelope), so a worker written against it
in another language, or the Redis transport later, speaks to a durably engine
unchanged. Results are correlated by ``(runId, seq)``; a result carries no
step name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .model import ErrorInfo

__all__ = ["Heartbeat", "StepEvent", "StepResult", "StepTask", "WireError", "routing_token"]


class WireError(ValueError):
    """A message did not have the shape the wire requires."""


def routing_token(name: str, namespace: str = "default") -> str:
    """The queue token a step named ``name`` is routed by.

    ``:`` is the one character the upstream sanitises (it separates key parts
    in Redis), and a namespace other than ``default`` is appended so pools
    sharing a broker or a database never take each other's tasks.
    """
    token = name.replace(":", "-")
    return token if namespace == "default" else f"{token}@{namespace}"


@dataclass(slots=True)
class StepTask:
    """One attempt of a dispatched step, sent to whichever worker serves ``group``."""

    run_id: str
    seq: int
    name: str
    group: str
    input: Any = None
    attempt: int = 1
    priority: int | None = None
    traceparent: str | None = None
    context: Any = None
    transport: str | None = None
    """The transport pool the task was sent through (upstream pools; carried verbatim)."""
    sent_at: int | None = None
    """When the engine sent this attempt (epoch ms), so the worker can tell how
    long it queued. Wire key ``sentAt``: an extra key, which workers that do
    not know it ignore."""

    @property
    def step_id(self) -> str:
        """``<run_id>:<seq>``: stable across attempts, for handlers to deduplicate on."""
        return f"{self.run_id}:{self.seq}"

    def to_wire(self) -> dict[str, Any]:
        """The task as upstream JSON."""
        wire: dict[str, Any] = {
            "runId": self.run_id,
            "seq": self.seq,
            "name": self.name,
            "stepId": self.step_id,
            "group": self.group,
            "input": self.input,
        }
        if self.traceparent is not None:
            wire["traceparent"] = self.traceparent
        if self.context is not None:
            wire["context"] = self.context
        if self.transport is not None:
            wire["transport"] = self.transport
        if self.priority is not None:
            wire["priority"] = self.priority
        if self.sent_at is not None:
            wire["sentAt"] = self.sent_at
        wire["attempt"] = self.attempt
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> StepTask:
        """Parse upstream JSON; :class:`WireError` if a required field is missing."""
        body = _object(data, "task")
        return cls(
            run_id=_field(body, "runId", str),
            seq=_field(body, "seq", int),
            name=_field(body, "name", str),
            group=str(body.get("group") or _field(body, "name", str)),
            input=body.get("input"),
            attempt=int(body.get("attempt") or 1),
            priority=body.get("priority"),
            traceparent=body.get("traceparent"),
            context=body.get("context"),
            transport=body.get("transport"),
            sent_at=sent if isinstance(sent := body.get("sentAt"), int) else None,
        )


@dataclass(slots=True)
class StepEvent:
    """A log line or sub-process event a handler emitted while it ran."""

    at: int
    level: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    """Extra upstream keys: ``name``, ``status``, ``phase``, ``subId``, ``data``…"""

    def to_wire(self) -> dict[str, Any]:
        """The event as upstream JSON."""
        return {"at": self.at, "level": self.level, "message": self.message, **self.data}

    @classmethod
    def from_wire(cls, data: Any) -> StepEvent:
        """Parse upstream JSON."""
        body = dict(_object(data, "event"))
        at = body.pop("at", 0)
        level = body.pop("level", "info")
        message = body.pop("message", "")
        return cls(int(at or 0), str(level), str(message), body)


@dataclass(slots=True)
class StepResult:
    """The outcome of one attempt of a dispatched step, sent back to the engine."""

    run_id: str
    seq: int
    ok: bool
    output: Any = None
    error: ErrorInfo | None = None
    started_at: int | None = None
    events: list[StepEvent] = field(default_factory=list)

    @property
    def step_id(self) -> str:
        """``<run_id>:<seq>``."""
        return f"{self.run_id}:{self.seq}"

    @classmethod
    def no_handler(cls, task: StepTask) -> StepResult:
        """The failure sent for a task nobody here serves (never retried)."""
        return cls(
            task.run_id,
            task.seq,
            ok=False,
            error={"message": f"no handler for {task.name}", "retryable": False},
        )

    @property
    def retryable(self) -> bool:
        """False only when the worker said so (a ``FatalError``, a missing handler)."""
        return self.ok or (self.error or {}).get("retryable") is not False

    def to_wire(self) -> dict[str, Any]:
        """The result as upstream JSON."""
        wire: dict[str, Any] = {"runId": self.run_id, "seq": self.seq, "stepId": self.step_id}
        if self.started_at is not None:
            wire["startedAt"] = self.started_at
        if self.ok:
            wire["status"] = "completed"
            wire["output"] = self.output
        else:
            wire["status"] = "failed"
            wire["error"] = self.error or {"message": "step failed"}
        if self.events:
            wire["events"] = [event.to_wire() for event in self.events]
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> StepResult:
        """Parse upstream JSON; :class:`WireError` if a required field is missing."""
        body = _object(data, "result")
        status = _field(body, "status", str)
        if status not in ("completed", "failed"):
            raise WireError(f"result status must be completed or failed, not {status!r}")
        error = body.get("error")
        if status == "failed" and not isinstance(error, dict):
            error = {"message": str(error or "step failed")}
        started = body.get("startedAt")
        return cls(
            run_id=_field(body, "runId", str),
            seq=_field(body, "seq", int),
            ok=status == "completed",
            output=body.get("output") if status == "completed" else None,
            error=error if status == "failed" else None,
            started_at=int(started) if isinstance(started, int | float) else None,
            events=[StepEvent.from_wire(e) for e in body.get("events") or []],
        )


@dataclass(slots=True)
class Heartbeat:
    """A sign of life from the worker running a step, optionally with progress."""

    run_id: str
    seq: int
    group: str
    at: int | None = None
    progress: Any = None

    @property
    def step_id(self) -> str:
        """``<run_id>:<seq>``."""
        return f"{self.run_id}:{self.seq}"

    def to_wire(self) -> dict[str, Any]:
        """The heartbeat as upstream JSON."""
        wire: dict[str, Any] = {
            "runId": self.run_id,
            "seq": self.seq,
            "stepId": self.step_id,
            "group": self.group,
        }
        if self.at is not None:
            wire["at"] = self.at
        if self.progress is not None:
            wire["progress"] = self.progress
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> Heartbeat:
        """Parse upstream JSON. ``at`` below 1e12 is in seconds (as upstream)."""
        body = _object(data, "heartbeat")
        at = body.get("at")
        if isinstance(at, int | float):
            at = int(at * 1000) if at < 1e12 else int(at)
        else:
            at = None
        return cls(
            run_id=_field(body, "runId", str),
            seq=_field(body, "seq", int),
            group=str(body.get("group") or ""),
            at=at,
            progress=body.get("progress"),
        )


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise WireError(f"a {what} must be a JSON object, not {type(data).__name__}")
    return data


def _field(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WireError(f"field {key!r} must be {kind.__name__}, got {value!r}")
    return value
