"""Rows, not SQL: what every store shares about its tables' columns.

For each table (runs, checkpoints, schedules) this module owns the column
list, the builder turning a model object into the parameters of an INSERT or
upsert, and the decoder turning a selected row back into the model object.
Both SQL stores select the columns in the order given here, and SQLite rows
and asyncpg records both index by position, so one decoder serves both.

Each dialect keeps its own SQL text (placeholders, ``RETURNING``, ``SKIP
LOCKED``, ``unnest`` batches, ``json_each``): those differences are where the
speed and the locking live, and they read best next to the store using them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _codec as codec
from ..model import Checkpoint, CheckpointStatus, ErrorInfo, Run, RunStatus
from .base import QueueState, ScheduleRecord

__all__ = [
    "CP_COLUMNS",
    "CP_SELECT",
    "JSON_RUN_COLUMNS",
    "RUN_COLUMNS",
    "SCHEDULE_COLUMNS",
    "UPDATABLE_RUN_COLUMNS",
    "UPDATABLE_SCHEDULE_COLUMNS",
    "check_run_changes",
    "check_schedule_changes",
    "checkpoint_from_row",
    "checkpoint_params",
    "completed_params",
    "dead_error",
    "decode_cursor",
    "dump_json",
    "encode_cursor",
    "is_row_error",
    "merge_queue_counts",
    "prefix_bound",
    "run_column_value",
    "run_from_row",
    "run_params",
    "schedule_column_value",
    "schedule_from_row",
    "schedule_params",
]

# -- runs ------------------------------------------------------------------------------

RUN_COLUMNS = (
    "id, workflow, workflow_version, status, namespace, parent_id, input, output, error, tags, "
    "priority, wake_at, wake_requested_at, locked_by, locked_until, recovery_attempts, "
    "deadline_at, created_at, updated_at, parent_seq, cancel_requested, trace_context"
)
"""The columns of ``durably_runs`` in the order :func:`run_params` writes and
:func:`run_from_row` reads them."""

UPDATABLE_RUN_COLUMNS = frozenset(
    {
        "status",
        "input",
        "output",
        "error",
        "tags",
        "priority",
        "wake_at",
        "wake_requested_at",
        "locked_by",
        "locked_until",
        "recovery_attempts",
        "deadline_at",
        "cancel_requested",
        "workflow_version",
    }
)
"""The run columns ``update_run_if`` may change; identity and timestamps are not among them."""

JSON_RUN_COLUMNS = frozenset({"input", "output", "error", "tags"})
"""Run columns stored as JSON."""


def encode_cursor(created_at: int, run_id: str) -> str:
    """An opaque cursor pointing just past ``(created_at, run_id)``."""
    raw = json.dumps([created_at, run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def merge_queue_counts(
    held: dict[str, int], waiting: dict[str, tuple[int, int | None]]
) -> list[QueueState]:
    """The SQL stores' two per-queue counts as :class:`QueueState` rows, by name."""
    return [
        QueueState(queue, held.get(queue, 0), *waiting.get(queue, (0, None)))
        for queue in sorted(set(held) | set(waiting))
    ]


def prefix_bound(prefix: str) -> str | None:
    """The least text greater than every text starting with ``prefix`` (in
    code-point order, which is UTF-8 byte order), so ``prefix <= id <
    prefix_bound(prefix)`` is an exact, indexed prefix search with no LIKE
    pattern to escape. ``None`` when no text is greater (a prefix of only
    U+10FFFF): then ``prefix <= id`` alone is the search."""
    chars = prefix
    while chars:
        following = ord(chars[-1]) + 1
        if following <= 0x10FFFF:
            if 0xD800 <= following <= 0xDFFF:  # surrogates are no text a store keeps
                following = 0xE000
            return chars[:-1] + chr(following)
        chars = chars[:-1]
    return None


def decode_cursor(cursor: str | None) -> tuple[int, str] | None:
    """The position a cursor points past; ``ValueError`` if it is malformed."""
    if not cursor:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, run_id = json.loads(raw)
        return int(created_at), str(run_id)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid cursor {cursor!r}") from exc


def is_row_error(exc: BaseException) -> bool:
    """Whether ``exc`` is about one row's values rather than the store.

    A row's own fault: JSON that does not decode, a value the driver cannot
    encode (both ``ValueError``, as is asyncpg's ``DataError``), or a
    PostgreSQL error of SQLSTATE class 22 (data exception: NUL, an
    over-long NOTIFY payload), 23 (integrity) or 54 (limit exceeded). Not a
    lost connection or a server going away: the next row would only meet
    that again, so callers give up on the batch rather than the row.
    """
    if isinstance(exc, ValueError):
        return True
    sqlstate = getattr(exc, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in {"22", "23", "54"}


def dead_error(attempts: int) -> ErrorInfo:
    """The error a run carries once recovery gives up on it."""
    return {
        "message": f"the run crashed its executor {attempts} times; gave up",
        "code": "max_recovery_attempts",
        "type": "RecoveryExhausted",
    }


def check_run_changes(changes: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if ``changes`` names a column ``update_run_if`` may not set."""
    unknown = set(changes) - UPDATABLE_RUN_COLUMNS
    if unknown:
        raise ValueError(f"cannot update run columns {sorted(unknown)}")


def dump_json(value: Any) -> str | None:
    """JSON text for a column, ``None`` staying SQL ``NULL``."""
    return None if value is None else codec.dumps(value)


def run_params(run: Run) -> tuple[Any, ...]:
    """A run as the column tuple both SQL stores insert (``RUN_COLUMNS`` order)."""
    return (
        run.run_id,
        run.workflow,
        run.workflow_version,
        run.status.value,
        run.namespace,
        run.parent_id,
        dump_json(run.input),
        dump_json(run.output),
        dump_json(run.error),
        codec.dumps(run.tags),
        run.priority,
        run.wake_at,
        run.wake_requested_at,
        run.locked_by,
        run.locked_until,
        run.recovery_attempts,
        run.deadline_at,
        run.created_at,
        run.updated_at,
        run.parent_seq,
        run.cancel_requested,
        run.trace_context,
    )


_RUN_STATUSES: dict[str, RunStatus] = {status.value: status for status in RunStatus}


def run_status(value: str) -> RunStatus:
    """The :class:`RunStatus` stored as ``value``: a dict lookup, since the
    enum's call (~1 µs) was paid per run by every status-only read of the
    waiters' safety net, thousands of runs per second on ``db://``."""
    found = _RUN_STATUSES.get(value)
    return found if found is not None else RunStatus(value)  # ValueError as before


def run_from_row(row: Sequence[Any]) -> Run:
    """A run from its columns in :data:`RUN_COLUMNS` order (``tags`` as JSON text)."""
    return Run(
        run_id=row[0],
        workflow=row[1],
        workflow_version=row[2],
        status=RunStatus(row[3]),
        namespace=row[4],
        parent_id=row[5],
        input=codec.loads(row[6]),
        output=codec.loads(row[7]),
        error=codec.loads(row[8]),
        tags=codec.loads(row[9]) or [],
        priority=row[10],
        wake_at=row[11],
        wake_requested_at=row[12],
        locked_by=row[13],
        locked_until=row[14],
        recovery_attempts=row[15],
        deadline_at=row[16],
        created_at=row[17],
        updated_at=row[18],
        parent_seq=row[19],
        cancel_requested=row[20],
        trace_context=row[21],
    )


def run_column_value(column: str, value: Any) -> Any:
    """The parameter ``update_run_if`` writes for ``column``: a status as its
    text, JSON columns as JSON text, and tags never ``NULL`` (an empty list)."""
    if column == "status":
        return RunStatus(value).value
    if column == "tags":
        return codec.dumps(value if value is not None else [])
    if column in JSON_RUN_COLUMNS:
        return dump_json(value)
    return value


# -- checkpoints -------------------------------------------------------------------------

CP_COLUMNS = (
    "run_id, seq, name, kind, status, input, output, error, attempts, wake_at, "
    "started_at, finished_at, parallel_group, dispatched_at, redispatches, queue, "
    "last_heartbeat_at, progress"
)
"""The columns a checkpoint save upserts, in :func:`checkpoint_params` order."""

# Read with the checkpoint, written only by a resolve: never in a save's upsert,
# so a save keeps the events a result stored.
CP_SELECT = f"{CP_COLUMNS}, events"
"""The columns :func:`checkpoint_from_row` reads."""


def checkpoint_params(cp: Checkpoint) -> tuple[Any, ...]:
    """A checkpoint as the column tuple both SQL stores upsert."""
    return (
        cp.run_id,
        cp.seq,
        cp.name,
        cp.kind,
        cp.status.value,
        dump_json(cp.input),
        dump_json(cp.output),
        dump_json(cp.error),
        cp.attempts,
        cp.wake_at,
        cp.started_at,
        cp.finished_at,
        cp.group,
        *_dispatch_params(cp),
    )


def _dispatch_params(cp: Checkpoint) -> tuple[Any, ...]:
    """The dispatched-step columns, last in both checkpoint tuples."""
    return (
        cp.dispatched_at,
        cp.redispatches,
        cp.queue,
        cp.last_heartbeat_at,
        dump_json(cp.progress),
    )


def completed_params(cp: Checkpoint, payload_text: str | None, now: int) -> tuple[Any, ...]:
    """``checkpoint_params`` of ``cp`` completed with JSON text ``payload_text``."""
    return (
        cp.run_id,
        cp.seq,
        cp.name,
        cp.kind,
        CheckpointStatus.COMPLETED.value,
        dump_json(cp.input),
        payload_text,
        None,
        cp.attempts,
        cp.wake_at,
        cp.started_at,
        now,
        cp.group,
        *_dispatch_params(cp),
    )


def checkpoint_from_row(row: Sequence[Any]) -> Checkpoint:
    """A checkpoint from its columns in :data:`CP_SELECT` order: the
    upserted columns (see :func:`checkpoint_params`), then ``events``."""
    return Checkpoint(
        run_id=row[0],
        seq=row[1],
        name=row[2],
        kind=row[3],
        status=CheckpointStatus(row[4]),
        input=codec.loads(row[5]),
        output=codec.loads(row[6]),
        error=codec.loads(row[7]),
        attempts=row[8],
        wake_at=row[9],
        started_at=row[10],
        finished_at=row[11],
        group=row[12],
        dispatched_at=row[13],
        redispatches=row[14],
        queue=row[15],
        last_heartbeat_at=row[16],
        progress=codec.loads(row[17]),
        events=codec.loads(row[18]),
    )


# -- schedules ---------------------------------------------------------------------------

SCHEDULE_COLUMNS = (
    "name, namespace, spec, paused, next_fire_at, last_fired_at, last_run_id, "
    "firing_run_id, revision, created_at, updated_at"
)
"""The columns of ``durably_schedules`` in the order the stores read them."""

UPDATABLE_SCHEDULE_COLUMNS = frozenset(
    {
        "spec",
        "namespace",
        "paused",
        "next_fire_at",
        "last_fired_at",
        "last_run_id",
        "firing_run_id",
    }
)
"""The columns ``update_schedule`` may set (``revision`` and ``updated_at`` move on their own)."""


def check_schedule_changes(changes: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if ``changes`` names a column ``update_schedule`` may not set."""
    unknown = set(changes) - UPDATABLE_SCHEDULE_COLUMNS
    if unknown:
        raise ValueError(f"cannot update schedule columns {sorted(unknown)}")


def schedule_params(record: ScheduleRecord) -> tuple[Any, ...]:
    """A schedule as the column tuple both SQL stores insert (:data:`SCHEDULE_COLUMNS` order)."""
    return (
        record.name,
        record.namespace,
        codec.dumps(record.spec),
        record.paused,
        record.next_fire_at,
        record.last_fired_at,
        record.last_run_id,
        record.firing_run_id,
        record.revision,
        record.created_at,
        record.updated_at,
    )


def schedule_column_value(column: str, value: Any) -> Any:
    """The parameter ``update_schedule`` writes for ``column`` (``spec`` as JSON text)."""
    if column == "spec":
        return codec.dumps(value)
    if column == "paused":
        return bool(value)
    return value


def schedule_from_row(row: Sequence[Any]) -> ScheduleRecord:
    """A schedule from its columns in :data:`SCHEDULE_COLUMNS` order."""
    return ScheduleRecord(
        name=row[0],
        namespace=row[1],
        spec=codec.loads(row[2]),
        paused=bool(row[3]),
        next_fire_at=row[4],
        last_fired_at=row[5],
        last_run_id=row[6],
        firing_run_id=row[7],
        revision=int(row[8]),
        created_at=row[9],
        updated_at=row[10],
    )
