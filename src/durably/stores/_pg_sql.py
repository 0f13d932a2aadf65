"""SQL fragments the PostgreSQL store and its batchers share: one
checkpoint row's typed parameters and the upsert rule (the column list itself
is :data:`._rows.CP_COLUMNS`), and many runs' rows as one ``unnest``."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CP_PARAMS",
    "CP_UPSERT_TAIL",
    "NOTICE_ARGUMENT_BYTES",
    "RUNNING",
    "RUNS_UNNEST",
    "SUSPENDED",
    "notice_argument",
    "only_checked",
    "status_match",
]

NOTICE_ARGUMENT_BYTES = 1024
"""The longest id (in UTF-8 bytes) a notice names; ids bounded at the API
(255 characters) always fit."""


def notice_argument(expr: str) -> str:
    """SQL for ``expr`` as the argument of a ``NOTIFY`` (``'<kind>:' || ...``).

    PostgreSQL refuses a payload of 8,000 bytes or more, failing the whole
    statement it is part of: a settle, a recovery pass over many runs. An id
    stored before ids were bounded (or written around the API) is therefore
    announced with an empty argument, which listeners treat as "something
    changed" and which their polling covers.
    """
    return f"(CASE WHEN octet_length({expr}) <= {NOTICE_ARGUMENT_BYTES} THEN {expr} ELSE '' END)"


def only_checked(predicate: str) -> str:
    """SQL for ``predicate`` as a check of rows found otherwise, never a way to find them.

    A statement that names its runs (``id = $1``, ``id = ANY(...)``) must reach
    them through the primary key. But with many finished runs, ``ANALYZE``
    finds no run ``running`` or ``suspended`` (too few to sample), and the
    generic plan then prefers a ``status = 'running'`` condition, answered by
    the range of ``durably_runs_updated (status, updated_at)`` (dropped by
    migration 14, which leaves no index over every run led by status), over
    the key: every live run, and the dead entries of recently finished ones,
    read once per settle (tests/stores/test_postgres_run_probes.py). In a
    ``WHERE`` clause ``(...) IS TRUE`` keeps exactly the rows ``...`` keeps,
    and no index answers it.
    """
    return f"({predicate}) IS TRUE"


RUNNING = only_checked("status = 'running'")
"""``status = 'running'`` in a statement that names its runs (see :func:`only_checked`)."""
SUSPENDED = only_checked("status = 'suspended'")
"""``status = 'suspended'`` in a statement that names its runs (see :func:`only_checked`)."""


def polled(predicate: str) -> str:
    """SQL for ``predicate`` in a poll, matching its partial index and no other.

    A poll (``list_due``, ``list_pending``...) finds its runs through the
    partial index for its status (migration 13), whose predicate is written
    the same way, so the planner proves it by equality. Written as a plain
    ``status = 'suspended'`` it was also an index condition on every index
    led by ``status`` (``durably_runs_updated``, ``durably_runs_status_listing``,
    both over every run until migration 14),
    and when the statistics have not seen the runs a burst put to sleep ("one
    row"), the generic plan took one of those: every sleeping run read and
    sorted per poll (tests/stores/test_postgres_poll_plans.py). ``IS NOT FALSE``
    keeps the rows ``...`` keeps (``status`` is ``NOT NULL``), no index answers
    it, and it differs from :func:`only_checked`'s ``IS TRUE``, so a statement
    naming its runs is not offered the partial indexes either.
    """
    return f"({predicate}) IS NOT FALSE"


POLL_PENDING = polled("status = 'pending'")
"""``status = 'pending'`` in a poll (see :func:`polled`; index ``durably_runs_pending``)."""
POLL_RUNNING = polled("status = 'running'")
"""``status = 'running'`` in a poll (see :func:`polled`; index ``durably_runs_orphans``)."""
POLL_SUSPENDED = polled("status = 'suspended'")
"""``status = 'suspended'`` in a poll (see :func:`polled`; index ``durably_runs_due``)."""

_FINISHED = ("cancelled", "completed", "dead", "failed")
_POLLED = {"pending": POLL_PENDING, "running": POLL_RUNNING, "suspended": POLL_SUSPENDED}


def status_match(statuses: Iterable[str]) -> str:
    """SQL keeping the runs in any of ``statuses``, each written as its partial index's predicate.

    Since migration 14 no index over every run leads with ``status``: a
    finished status is found through ``durably_runs_completed`` (migration
    16) or ``durably_runs_unsuccessful`` (and ``durably_runs_workflow_finished``),
    whose predicates the planner proves from a literal ``status = 'failed'``; a live one
    through its poll's index (the :func:`polled` form) or, for ``blocked``,
    ``durably_runs_blocked``. A parameter (``status = $1``) proves no
    predicate under the generic plan, so the values are written into the
    SQL; they are :class:`~durably.model.RunStatus` values, never caller text.
    A live status's index holds the live runs alone: listing or counting
    them costs the same with 1,000,000 finished runs as with none.
    """
    forms = []
    for status in dict.fromkeys(statuses):
        if status in _POLLED:
            forms.append(_POLLED[status])
        elif status in _FINISHED or status == "blocked":
            forms.append(f"status = '{status}'")
        else:
            raise ValueError(f"not a run status: {status!r}")
    if not forms:
        return "false"
    return forms[0] if len(forms) == 1 else f"({' OR '.join(forms)})"


CP_PARAMS = (
    "$1::text, $2::integer, $3::text, $4::text, $5::text, $6::text, $7::text, $8::text, "
    "$9::integer, $10::bigint, $11::bigint, $12::bigint, $13::text, $14::bigint, "
    "$15::integer, $16::text, $17::bigint, $18::text"
)
# A heartbeat recorded meanwhile (by any instance) is never lost to a save.
CP_UPSERT_TAIL = """
    ON CONFLICT (run_id, seq) DO UPDATE SET
        name = excluded.name, kind = excluded.kind, status = excluded.status,
        input = excluded.input, output = excluded.output, error = excluded.error,
        attempts = excluded.attempts, wake_at = excluded.wake_at,
        started_at = excluded.started_at, finished_at = excluded.finished_at,
        parallel_group = excluded.parallel_group, dispatched_at = excluded.dispatched_at,
        redispatches = excluded.redispatches, queue = excluded.queue,
        last_heartbeat_at = greatest(
            excluded.last_heartbeat_at, durably_checkpoints.last_heartbeat_at),
        progress = coalesce(excluded.progress, durably_checkpoints.progress)
    WHERE durably_checkpoints.status <> 'completed'
"""

# Many runs as rows: one array per column of ``RUN_COLUMNS`` ($1..$22), in
# that order (see ``_rows.run_params``).
RUNS_UNNEST = (
    "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], "
    "$5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::jsonb[], "
    "$11::integer[], $12::bigint[], $13::bigint[], $14::text[], $15::bigint[], "
    "$16::integer[], $17::bigint[], $18::bigint[], $19::bigint[], "
    "$20::integer[], $21::text[], $22::text[])"
)
