"""The exceptions durably raises, and the ones workflow authors raise themselves.

Two families live here. *Errors* (subclasses of :class:`DurablyError`) are real
failures a caller may catch. *Control flow* (subclasses of :class:`_ControlFlow`)
is how the engine stops a workflow body; it derives from ``BaseException`` so a
body's ``except Exception:`` cannot swallow it and keep running on a turn that
has already ended.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ChildFailed",
    "DurablyError",
    "EntityError",
    "EventTimeout",
    "FatalError",
    "GatherFailed",
    "NondeterminismError",
    "RunCancelled",
    "RunFailed",
    "SchemaValidationError",
    "SignalTimeout",
    "SingletonQueueFull",
    "StepFailed",
    "UnstorableValue",
    "WorkflowNotRegistered",
    "WrongEventLoop",
    "is_control_flow",
]


class DurablyError(Exception):
    """Base class of every error durably raises."""

    code: str = "error"


class FatalError(DurablyError):
    """Raise from a step to fail it without further retries.

    Use it for business failures that no retry can fix (a declined card, an
    invalid address). ``code`` and ``details`` travel with the failure and are
    stored on the run, so callers and dashboards can route on them.
    """

    def __init__(self, message: str, code: str | None = None, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or "fatal"
        self.details = details


class EntityError(FatalError):
    """An entity operation did not succeed: its handler raised (``outcome``
    ``"failed"``; the entity's state is unchanged), it was refused
    (``"rejected"``: the entity has no such operation), or the entity's run
    ended (``"ended"``: cancelled, say). ``details`` holds the handler's
    stored error when there is one."""

    def __init__(
        self,
        entity: str,
        key: str,
        op: str,
        outcome: str,
        reason: str,
        details: Any = None,
    ) -> None:
        super().__init__(
            f"entity {entity!r} key {key!r} op {op!r} {outcome}: {reason}",
            code=f"entity_{outcome}",
            details=details,
        )
        self.entity = entity
        self.key = key
        self.op = op
        self.outcome = outcome
        self.reason = reason


class StepFailed(DurablyError):
    """A step ran out of attempts (or raised :class:`FatalError`).

    Raised inside the workflow body at the ``await`` of the step, so the body
    may catch it and decide what to do next.
    """

    def __init__(
        self,
        step: str,
        message: str,
        code: str | None = None,
        details: Any = None,
        attempts: int = 0,
    ) -> None:
        super().__init__(f"step {step!r} failed: {message}")
        self.step = step
        self.message = message
        self.code = code or "step_failed"
        self.details = details
        self.attempts = attempts

    @classmethod
    def from_error(cls, step: str, error: dict[str, Any] | None, attempts: int) -> StepFailed:
        """The exception for a failure as stored on a checkpoint."""
        error = error or {}
        return cls(
            step,
            str(error.get("message", "failed")),
            code=error.get("code"),
            details=error.get("details"),
            attempts=attempts,
        )


class ChildFailed(StepFailed):
    """A child run (``ctx.child`` / ``ctx.all``) failed, was cancelled, went
    dead, or could not be started. ``status`` is the child's final status."""

    def __init__(
        self,
        run_id: str,
        status: str,
        message: str,
        code: str | None = None,
        details: Any = None,
    ) -> None:
        super().__init__(
            f"child {run_id}", message, code=code or f"child_{status}", details=details
        )
        self.run_id = run_id
        self.status = status


class GatherFailed(DurablyError):
    """One or more branches of ``ctx.all`` failed; ``failures`` lists every one."""

    code = "gather_failed"

    def __init__(self, failures: list[tuple[int, BaseException]]) -> None:
        summary = "; ".join(f"[{i}] {e}" for i, e in failures)
        super().__init__(f"{len(failures)} branch(es) failed: {summary}")
        self.failures = failures


class SignalTimeout(DurablyError):
    """``ctx.wait_for_signal`` (or ``wait_for_event``) reached its timeout."""

    code = "signal_timeout"

    def __init__(self, token: str) -> None:
        super().__init__(f"timed out waiting for signal {token!r}")
        self.token = token


class EventTimeout(SignalTimeout):
    """``ctx.wait_for_event`` reached its timeout; ``event`` names the event.

    A subclass of :class:`SignalTimeout`, so one ``except SignalTimeout``
    covers both kinds of wait.
    """

    code = "event_timeout"

    def __init__(self, event: str) -> None:
        DurablyError.__init__(self, f"timed out waiting for event {event!r}")
        self.token = event
        self.event = event


class NondeterminismError(DurablyError):
    """Replay found a different operation at a position than history recorded.

    The workflow body changed (or depends on something outside ``ctx``) in a way
    that makes its recorded history unusable. Register the new body under a new
    version, or guard the change with ``ctx.patched``.

    The run fails with it (code ``nondeterminism``) whatever the body does: the
    body is stopped by a signal its ``except Exception`` cannot catch, so it
    executes nothing more against a history that is not its own.
    """

    code = "nondeterminism"

    def __init__(
        self,
        message: str,
        *,
        seq: int | None = None,
        history: tuple[str, str] | None = None,
        found: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.seq = seq
        """The first position where the body and its history differ."""
        self.history = history
        """``(kind, name)`` recorded at :attr:`seq`."""
        self.found = found
        """``(kind, name)`` the body now calls there (``None``: it calls nothing)."""
        self.details = (
            None
            if seq is None
            else {
                "seq": seq,
                "history": None if history is None else {"kind": history[0], "name": history[1]},
                "found": None if found is None else {"kind": found[0], "name": found[1]},
            }
        )


class RunCancelled(DurablyError):
    """The run was cancelled: raised by ``await handle.result()`` (with the
    ``run_id`` and the stored ``error``), and recorded when a body was stopped."""

    code = "cancelled"

    def __init__(
        self,
        message: str = "cancelled",
        *,
        run_id: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.error = error


class RunFailed(DurablyError):
    """``await handle.result()`` of a run that failed or went dead.

    ``status`` is ``"failed"`` or ``"dead"``; ``error`` the stored failure
    (``message``, ``code``, ``type``, ``details``), whose ``code`` this
    exception carries too.
    """

    def __init__(self, run_id: str, status: str, error: dict[str, Any] | None) -> None:
        self.run_id = run_id
        self.status = status
        self.error = error or {}
        message = self.error.get("message") or status
        super().__init__(f"run {run_id!r} {status}: {message}")
        self.code = str(self.error.get("code") or status)


class WorkflowNotRegistered(DurablyError):
    """``start`` named a workflow (or version) this engine does not know."""

    code = "workflow_not_registered"


class SingletonQueueFull(DurablyError):
    """``start`` of a singleton workflow whose key already has ``limit`` live runs
    and ``max_queue`` waiting: refused before the run is created."""

    code = "singleton_queue_full"

    def __init__(self, workflow: str, key: str, live: int) -> None:
        super().__init__(
            f"workflow {workflow!r}: key {key!r} already has {live} live or queued runs"
        )
        self.workflow = workflow
        self.key = key
        self.live = live


class WrongEventLoop(DurablyError, RuntimeError):
    """An :class:`~durably.Engine` was called from an event loop other than
    the one it was opened on (e.g. ``asyncio.run(engine.start(...))`` per
    request). Its connections, tasks and futures belong to that first loop.
    Use one loop (``async with engine`` in the app's lifespan), or one engine
    per loop; ``close()`` it on its loop before opening it on another."""

    code = "wrong_event_loop"


class SchemaValidationError(DurablyError):
    """A workflow's input failed its declared ``input=`` model or validator."""

    code = "schema_validation"

    def __init__(self, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.details = details


class UnstorableValue(DurablyError, ValueError):
    """A value or name no store can keep, refused before it reaches one.

    Raised for an over-long or malformed id, token or name, and for a value
    that has no faithful JSON form (NaN or infinity, a string that is not
    valid Unicode, nesting too deep to encode, a type JSON has no form for).
    ``field`` says what was refused ("run_id", "the result of step 'x'",
    "signal payload", ...). Every store refuses the same values, so a run
    behaves the same on memory, SQLite and PostgreSQL.
    """

    code = "unstorable_value"

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class _ControlFlow(BaseException):
    """Stops a workflow body; never a failure of the run."""


class _TurnClosed(_ControlFlow):
    """The turn ended (suspended, fenced or cancelled); the body must stop."""


class _ContinueAsNew(_ControlFlow):
    """The body asked to continue as a new run with ``input``."""

    def __init__(self, input: Any) -> None:
        super().__init__("continue as new")
        self.input = input


def is_control_flow(exc: BaseException) -> bool:
    """Tell the engine's suspend/continue signals apart from real failures.

    A body that wraps steps in a broad ``try/except BaseException`` must
    re-raise when this returns ``True``.
    """
    import asyncio

    return isinstance(exc, _ControlFlow | asyncio.CancelledError)
