"""The statement that settles a batch of step outcomes on PostgreSQL.

One round trip locks the outcomes' runs (in id order) and writes the
outcomes onto their checkpoints. The batch goes to the server as one JSON
parameter (a row per outcome) rather than six asyncpg arrays: asyncpg checks
every array element against abstract base classes while encoding, which cost
more client CPU per outcome than one ``json.dumps`` of the batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .._notices import StoreNotice
from ._pg_sql import notice_argument
from ._rows import dump_json
from .base import Resolution

# Rows through ``unnest(ARRAY(...))``, not straight from json_array_elements:
# the planner guesses 100 rows for that function, and at that guess it hashes
# the batch against a sequential scan of the checkpoints (measured 7.8 ms on a
# 13,600-row table against 0.6 ms) where a non-constant array's guess keeps
# the index probes the per-column arrays got.
_OUTCOMES = (
    "SELECT e->>0 AS run_id, (e->>1)::integer AS seq, e->>2 AS status, "
    "e->>3 AS output, e->>4 AS error, e->>5 AS events, e->>6 AS held_by "
    "FROM unnest(ARRAY(SELECT json_array_elements($1::json))) AS e"
)

_SETTLE = (
    "UPDATE durably_checkpoints c SET status = v.status, output = v.output, "
    "error = v.error, events = v.events, finished_at = $2 "
    f"FROM ({_OUTCOMES}) AS v, durably_checkpoints old "
    "WHERE {gate}c.run_id = v.run_id AND c.seq = v.seq "
    "AND old.run_id = c.run_id AND old.seq = c.seq "
    "AND c.status NOT IN ('completed', 'failed') "
    "RETURNING c.run_id, c.seq, c.parallel_group, c.queue, old.status AS was"
)

SETTLE_LOCKED = _SETTLE.format(gate="")
"""Settle the outcomes ``$1`` (:func:`outcomes_json`) at ``$2``, their runs'
rows held by the caller already; one row per checkpoint settled (an outcome
for a checkpoint settled already, or none, has no row)."""

LOCK_AND_SETTLE = (
    # Serialise siblings settling at once: under READ COMMITTED each would
    # otherwise count the other as pending and none would wake the parent.
    # Locked in id order, so batches never deadlock. The lock is a one-time
    # filter the executor evaluates before it touches any checkpoint, so no
    # checkpoint row is written (and locked) before every run row is held.
    "WITH locked AS (SELECT id FROM durably_runs "
    "WHERE id = ANY(ARRAY(SELECT e->>0 FROM json_array_elements($1::json) AS e)) "
    "ORDER BY id FOR UPDATE) " + _SETTLE.format(gate="(SELECT count(*) FROM locked) >= 0 AND ")
)
""":data:`SETTLE_LOCKED` that first locks the outcomes' runs itself."""

_LOCKED = (  # as in LOCK_AND_SETTLE
    "locked AS (SELECT id FROM durably_runs "
    "WHERE id = ANY(ARRAY(SELECT e->>0 FROM json_array_elements($1::json) AS e)) "
    "ORDER BY id FOR UPDATE)"
)
_WOKEN = "s.held_by IS NOT NULL AND (s.parallel_group IS NULL OR s.outcome = 'failed')"
LOCK_SETTLE_DELETE_AND_WAKE_HELD = (
    "WITH gone AS (DELETE FROM durably_messages WHERE id = ANY($3::bigint[])), "
    f"{_LOCKED}, "
    "s AS ("
    + _SETTLE.format(gate="(SELECT count(*) FROM locked) >= 0 AND ")
    + ", c.status AS outcome, v.held_by), "
    # The runs these outcomes wake whose turns are held (a held turn takes its
    # result in memory): stamped as _WAKE_RUNS stamps them, unless their
    # holder still holds the lease. Their rows are locked by ``locked``; one
    # a concurrent transaction changed before that lock is re-read by the
    # update (READ COMMITTED), so the lease test sees the row as locked.
    "w AS (UPDATE durably_runs x SET wake_requested_at = $2 "
    f"FROM (SELECT DISTINCT s.run_id, s.held_by FROM s WHERE {_WOKEN}) AS h "
    "WHERE x.id = h.run_id AND x.status <> ALL($4::text[]) "
    "AND NOT coalesce(x.locked_by = h.held_by AND x.locked_until > $2, false) "
    f"RETURNING (SELECT pg_notify($5, '{StoreNotice.WAKE}:' || {notice_argument('x.id')})) "
    "IS NULL) "
    f"SELECT s.run_id, s.seq, s.parallel_group, s.queue, s.was, {_WOKEN} AS woken FROM s "
    # As in _LEASE_AND_WAKE: the one-time filter has ``w`` run in full first.
    "WHERE (SELECT count(*) FROM w) >= 0"
)
""":data:`LOCK_AND_SETTLE` that also deletes the messages ``$3`` (the served
tasks of the outcomes, ``claim_and_resolve`` taking nothing: one round trip
where a take of nothing and the settle were two; a data-modifying CTE runs
whether or not the statement reads it) and wakes the runs of outcomes named
with a held turn's owner ($1's seventh column, :func:`outcomes_json`'s
``held``) settled outside a parallel group or failed (``woken``): $4 the
terminal statuses, $5 the channel. Every such run is one the settle wakes
anyway; on a batch of held turns' results (all of them, under load) the
lease-and-wake statement after the settle, which leased none of them, is
one round trip fewer."""


def outcomes_json(entries: Sequence[Resolution], held: Mapping[str, str] | None = None) -> str:
    """The ``$1`` of :data:`SETTLE_LOCKED` / :data:`LOCK_AND_SETTLE`: a JSON
    array of ``[run_id, seq, status, output, error, events, held_by]`` rows,
    output, error and events the columns' JSON text (``null``: SQL ``NULL``),
    ``held_by`` the run's entry in ``held`` (``null`` if none)."""
    owners = held or {}
    return json.dumps(
        [
            (
                r.run_id,
                r.seq,
                r.status.value,
                dump_json(r.output),
                dump_json(r.error),
                dump_json(r.events),
                owners.get(r.run_id),
            )
            for r in entries
        ],
        ensure_ascii=False,
        separators=(",", ":"),
    )
