"""The data durably stores: runs, checkpoints, statuses and results."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "TERMINAL_STATUSES",
    "CancelMode",
    "Checkpoint",
    "CheckpointKind",
    "CheckpointStatus",
    "ErrorInfo",
    "Run",
    "RunResult",
    "RunStatus",
    "UpdateResult",
]

ErrorInfo = dict[str, Any]
"""A stored failure: ``{"message": str, "code": str, "type": str, "details": Any}``."""


class RunStatus(StrEnum):
    """Where a run is in its life."""

    PENDING = "pending"
    """Created, waiting for an executor to take it."""
    RUNNING = "running"
    """Leased by an executor; the body is executing a turn."""
    SUSPENDED = "suspended"
    """Waiting on a timer, a signal, a dispatched step or a child."""
    BLOCKED = "blocked"
    """No capable worker or no admission; polled again later."""
    COMPLETED = "completed"
    """The body returned; ``output`` holds its value."""
    FAILED = "failed"
    """The body raised; ``error`` holds the failure. Can be retried."""
    CANCELLED = "cancelled"
    """Cancelled by a caller or by the execution-timeout sweep."""
    DEAD = "dead"
    """Gave up after crashing ``max_recovery_attempts`` times. Can be retried."""

    @property
    def is_terminal(self) -> bool:
        """True for completed, failed, cancelled and dead."""
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD}
)


class CheckpointStatus(StrEnum):
    """The state of one recorded operation."""

    PENDING = "pending"
    """Parked: a timer, signal wait, dispatched step or child not yet settled."""
    RUNNING = "running"
    """A local step started but has not finished (re-run on replay)."""
    COMPLETED = "completed"
    """Finished; replay returns ``output`` without executing again."""
    FAILED = "failed"
    """Finished with ``error``; replay raises it again."""


class CancelMode(StrEnum):
    """How a requested cancel is carried out (``Run.cancel_requested``)."""

    COMPENSATE = "compensate"
    """One more turn replays the history, runs the saga's undos in reverse,
    and only then marks the run ``cancelled``."""


class CheckpointKind(StrEnum):
    """Which ``ctx`` operation a checkpoint records (``Checkpoint.kind``).

    Stored as its value; a checkpoint read back carries the plain string,
    which compares equal to the member.
    """

    LOCAL = "local"
    """``ctx.local_step``: a function executed in the workflow's process."""
    SIDE_EFFECT = "side_effect"
    """``ctx.side_effect``: a value recorded once."""
    STEP = "step"
    """``ctx.step``: a step dispatched to a worker over a transport."""
    NOW = "now"
    """``ctx.now``: the recorded time."""
    UUID = "uuid"
    """``ctx.uuid``: a recorded random id."""
    RANDOM = "random"
    """``ctx.random``: a recorded random number."""
    SLEEP = "sleep"
    """``ctx.sleep`` / ``ctx.sleep_until``: a durable timer."""
    SIGNAL = "signal"
    """``ctx.wait_for_signal``."""
    EVENT = "event"
    """``ctx.wait_for_event``."""
    CHILD = "child"
    """A child run started by ``ctx.child`` or a fan-out."""
    PATCH = "patch"
    """``ctx.patched``: which side of a code change this run took."""
    COMPENSATION = "compensation"
    """A saga undo run while compensating."""
    VALUE = "value"
    """``ctx.set_value``: a value readable from outside with ``engine.get_value``."""
    WEBHOOK = "webhook"
    """``ctx.webhook``: the secret token of a webhook."""
    TASK = "task"
    """``ctx.task``: an external task's token and its dispatch."""
    TRANSACTION = "transaction"
    """``ctx.transaction``: app writes committed with their checkpoint."""
    ATTRIBUTES = "attributes"
    """``ctx.upsert_attributes``: search attributes merged into the run's."""
    UPDATE = "update"
    """An update (``engine.update``) handled by a ``ctx.on_update`` handler."""


@dataclass(slots=True)
class Run:
    """One execution of a workflow, as stored."""

    run_id: str
    workflow: str
    workflow_version: str
    status: RunStatus
    input: Any = None
    output: Any = None
    error: ErrorInfo | None = None
    namespace: str = "default"
    parent_id: str | None = None
    tags: list[str] = field(default_factory=list)
    priority: int = 0
    wake_at: int | None = None
    wake_requested_at: int | None = None
    locked_by: str | None = None
    locked_until: int | None = None
    recovery_attempts: int = 0
    deadline_at: int | None = None
    parent_seq: int | None = None
    cancel_requested: str | None = None
    """A cancel recorded on the run, carried out by its next turn: a
    :class:`CancelMode` value (stored as the plain string), or ``None``."""
    created_at: int = 0
    updated_at: int = 0
    trace_context: str | None = None
    """The W3C ``traceparent`` a tracing interceptor stored when the run was
    created: every turn of the run, in any process, continues that trace."""

    def replace(self, **changes: Any) -> Run:
        """Return a copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(slots=True)
class Checkpoint:
    """The recorded outcome of one ``ctx`` operation at position ``seq``."""

    run_id: str
    seq: int
    name: str
    kind: str
    """Which operation this records: a :class:`CheckpointKind` value."""
    status: CheckpointStatus
    input: Any = None
    output: Any = None
    error: ErrorInfo | None = None
    attempts: int = 0
    wake_at: int | None = None
    started_at: int | None = None
    finished_at: int | None = None
    group: str | None = None
    """The fan-out (``ctx.all``) this operation belongs to, if any."""
    dispatched_at: int | None = None
    """A dispatched step: when its current attempt's task went out; ``None``
    while it waits for admission or for a retry's backoff."""
    redispatches: int = 0
    """A dispatched step: how often its current attempt was sent again
    because no result came within ``remote_redispatch_ms``."""
    queue: str | None = None
    """A dispatched step holding a flow-control slot: the queue it holds it in
    (released by whichever instance settles the step)."""
    last_heartbeat_at: int | None = None
    """A dispatched step: the newest heartbeat persisted for it."""
    progress: Any = None
    """A dispatched step: the progress its newest persisted heartbeat carried."""
    events: list[dict[str, Any]] | None = None
    """A dispatched step: the handler's log lines and sub-process events of the
    attempt that settled the step, in the upstream wire shape (``at``,
    ``level``, ``message``, and for a sub-process ``name`` and ``status``).
    Written only when a result settles the step; ``None`` if it sent none."""

    @property
    def step_id(self) -> str:
        """The stable id handlers can deduplicate on: ``<run_id>:<seq>``."""
        return f"{self.run_id}:{self.seq}"


@dataclass(frozen=True, slots=True)
class BulkCancel:
    """What ``cancel_where`` did."""

    matched: int
    """Live runs that matched the filter (at most the call's ``limit``)."""
    cancelled: int
    """Of those, the runs this call cancelled (the rest ended meanwhile)."""
    more: bool
    """Whether matching live runs were left beyond ``limit``: call again."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """What ``wait_for_run`` returns. It never raises for a failed run: check ``status``."""

    run_id: str
    status: RunStatus
    output: Any = None
    error: ErrorInfo | None = None

    @property
    def ok(self) -> bool:
        """True when the run completed."""
        return self.status is RunStatus.COMPLETED


@dataclass(frozen=True, slots=True)
class UpdateResult:
    """What ``engine.update`` returns: how the run answered one update.

    ``outcome`` is ``"accepted"`` (the handler ran; ``result`` is what it
    returned), ``"rejected"`` (the validator refused it, with ``reason``;
    nothing was recorded), ``"failed"`` (the handler raised: ``reason`` and
    ``error``; recorded, the workflow goes on) or ``"ended"`` (the run ended
    before handling it).
    """

    update_id: str
    outcome: str
    result: Any = None
    reason: str | None = None
    error: ErrorInfo | None = None
    run_id: str = ""
    """The run that answered (the next link, when the update followed a continue-as-new)."""

    @property
    def accepted(self) -> bool:
        """True when the handler ran and returned ``result``."""
        return self.outcome == "accepted"
