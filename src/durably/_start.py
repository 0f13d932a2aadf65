"""Starting runs: the ``StartRun`` callable collaborators are handed, and the
checks ``Engine.start`` and ``Engine.signal`` make before anything is stored."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable
from datetime import datetime
from typing import Any, Protocol, cast

from . import _codec as codec
from ._names import check_name, check_names, check_priority, check_token
from .durations import Duration, to_ms
from .errors import SchemaValidationError
from .model import Run, RunStatus

__all__ = [
    "StartRun",
    "check_signal",
    "check_start",
    "check_tags",
    "new_run",
    "new_run_id",
    "start_time",
]


class StartRun(Protocol):
    """Starts a run idempotently by id (``Engine.start``): what schedules,
    event triggers and failure handlers are handed instead of the engine."""

    def __call__(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        tags: list[str] | None = None,
        start_at: datetime | None = None,
    ) -> Awaitable[Any]: ...


_MS_MASK = (1 << 48) - 1  # 12 hex digits of milliseconds: until the year 10889


def new_run_id(now_ms: int | None = None) -> str:
    """A fresh run id: 32 lowercase hex characters, the first 12 the start
    time in epoch milliseconds (``now_ms``, else the wall clock), the other 20
    random bits (80 of them). Nothing may be read from it: a caller's own
    ``run_id`` can be any text, and the time is only where the id sorts.

    Time first so that a new run, and its checkpoints keyed by its id, land at
    the right end of the indexes on the id (the primary keys, the id prefix
    index), where PostgreSQL inserts without a descent from the root and a new
    run touches the pages the previous one touched; a random id sends each new
    entry down to a random leaf (bench/RESULTS.md, "Time-ordered run ids").
    Ties and a clock that goes back, in one process or across a fleet, only
    cost that locality: the random bits keep ids unique (and not guessable
    from one another), and nothing depends on how ids order.

    Not ``uuid4``/``uuid7``: on the VMs we measured, ``os.urandom`` costs
    ~0.3 ms a call, a third of a short run's latency; ``random`` is seeded
    from it once (and again after ``fork``)."""
    if now_ms is None:
        now_ms = time.time_ns() // 1_000_000
    return f"{now_ms & _MS_MASK:012x}{random.getrandbits(80):020x}"


def check_tags(tags: list[str] | None) -> list[str]:
    """The tags to store, deduplicated in order; refuses anything but non-empty strings."""
    if tags is None:
        return []
    if isinstance(cast(object, tags), str) or not all(isinstance(t, str) and t for t in tags):
        raise ValueError("tags must be a list of non-empty strings")
    check_names(tags, "tag")
    return list(dict.fromkeys(tags))


def start_time(start_at: datetime | Duration | None, now: int) -> int | None:
    """When a run started with ``start_at`` should first wake (epoch ms), or ``None``."""
    if start_at is None:
        return None
    if isinstance(start_at, datetime):
        if start_at.tzinfo is None:
            raise ValueError("start_at must be a timezone-aware datetime")
        return int(start_at.timestamp() * 1000)
    return now + to_ms(start_at, name="start_at")


def check_signal(token: str, payload: Any) -> None:
    """Refuse a signal before anything is stored: a bad token, or a payload
    that cannot be stored as JSON."""
    check_token(token)
    try:
        codec.dumps(payload, "signal payload")
    except (TypeError, ValueError) as exc:
        raise SchemaValidationError(f"signal payload cannot be stored as JSON: {exc}") from exc


def check_start(run_id: str | None, priority: int) -> None:
    """Refuse ``start``'s ``run_id`` and ``priority`` before anything is stored."""
    if run_id is not None:
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id must be a non-empty string")
        check_name(run_id, "run_id")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError("priority must be an int")
    check_priority(priority)


def new_run(
    workflow: str,
    version: str,
    stored_input: Any,
    *,
    execution_timeout_ms: int | None,
    run_id: str | None,
    namespace: str,
    tags: list[str],
    priority: int,
    start_at: datetime | Duration | None,
    now: int,
) -> Run:
    """A new run of ``workflow`` at ``version``: ``pending``, or ``suspended``
    until ``start_at``. An empty ``version`` leaves the run unpinned: the first
    engine that executes it pins it to its current version."""
    wake_at = start_time(start_at, now)
    status = RunStatus.SUSPENDED if wake_at is not None and wake_at > now else RunStatus.PENDING
    return Run(
        run_id=run_id or new_run_id(now),
        workflow=workflow,
        workflow_version=version,
        status=status,
        input=stored_input,
        namespace=namespace,
        tags=tags,
        priority=priority,
        wake_at=wake_at if status is RunStatus.SUSPENDED else None,
        deadline_at=None if execution_timeout_ms is None else now + execution_timeout_ms,
        created_at=now,
        updated_at=now,
    )
