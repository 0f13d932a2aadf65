"""Small pieces every store implementation shares."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .. import codec
from ..model import Checkpoint, CheckpointStatus, ErrorInfo, Run

__all__ = [
    "JSON_RUN_COLUMNS",
    "UPDATABLE_RUN_COLUMNS",
    "check_run_changes",
    "checkpoint_params",
    "completed_params",
    "dead_error",
    "decode_cursor",
    "dump_json",
    "encode_cursor",
    "run_params",
]

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
    )


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
    """A checkpoint from its columns in the order both SQL stores select them:
    the upserted columns (see :func:`checkpoint_params`), then ``events``."""
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
