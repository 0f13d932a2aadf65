"""The fleet store: PostgreSQL through an asyncpg connection pool.

Every process of a fleet opens its own ``PostgresStore`` on the same database;
the methods the protocol calls *atomic* hold across all of them:

- leases, settles, recoveries and timer claims are single conditional
  ``UPDATE … RETURNING`` statements, so the row lock decides the race;
- a checkpoint write takes a share lock on its run row in the same statement
  that checks the lease, so it cannot slip in after another owner took over;
- ``wait_signal``, ``send_signal`` and ``cancel_signal_wait`` run in one
  transaction holding ``pg_advisory_xact_lock`` on the token's hash. Under READ
  COMMITTED a waiter registering while a sender buffers would otherwise miss
  each other and lose the signal; the lock serialises the two.

Writes that must see rows committed by others while they waited for a lock
(deleting a run's waiters after a terminal update) are separate statements in
one transaction, so each takes a fresh snapshot.

``PostgresStore("postgresql://host/db?schema=name")`` (or ``schema=``) keeps
every table in that schema, creating it if needed; tests use it to isolate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .. import _attributes as attrcodec
from .. import _codec as codec
from .._notices import StoreNotice
from .._queue import Message, OutMessage, SettledMessages
from ..model import (
    TERMINAL_STATUSES,
    Checkpoint,
    CheckpointKind,
    CheckpointStatus,
    ErrorInfo,
    Run,
    RunStatus,
)
from ._match import match_index, project
from ._pg_batch import PgWriteBatcher, settle_params
from ._pg_connection import PgConnection
from ._pg_messages import PgMessageQueue
from ._pg_settle import (
    LOCK_AND_SETTLE,
    LOCK_SETTLE_DELETE_AND_WAKE_HELD,
    SETTLE_LOCKED,
    outcomes_json,
)
from ._pg_sql import CP_PARAMS as _CP_PARAMS
from ._pg_sql import CP_UPSERT_TAIL as _CP_UPSERT_TAIL
from ._pg_sql import (
    POLL_PENDING,
    POLL_RUNNING,
    POLL_SUSPENDED,
    RUNNING,
    SUSPENDED,
    notice_argument,
    only_checked,
    status_match,
)
from ._pg_sql import RUNS_UNNEST as _RUNS_UNNEST
from ._pg_starts import PgStartBatcher
from ._rows import (
    CP_COLUMNS,
    CP_SELECT,
    RUN_COLUMNS,
    SCHEDULE_COLUMNS,
    check_run_changes,
    check_schedule_changes,
    checkpoint_from_row,
    checkpoint_params,
    completed_params,
    dead_error,
    decode_cursor,
    dump_json,
    encode_cursor,
    is_row_error,
    merge_queue_counts,
    prefix_bound,
    run_column_value,
    run_from_row,
    run_params,
    run_status,
    schedule_column_value,
    schedule_from_row,
    schedule_params,
)
from .base import (
    Admission,
    BeatRecord,
    ChildEnd,
    EventDelivery,
    Executable,
    QueueState,
    ReadFrom,
    Resolution,
    RunChanges,
    RunPage,
    RunQuery,
    ScheduleRecord,
    SettleResult,
    SignalWait,
    TurnLease,
    UpdateRecord,
    read_tail,
)

__all__ = ["PostgresStore"]


# The run columns read as text: asyncpg would decode jsonb itself, and
# run_from_row decodes every JSON column the same way on both dialects.
_SELECT_RUN = RUN_COLUMNS.replace(" tags,", " tags::text AS tags,")
_INSERT_RUN = (
    f"INSERT INTO durably_runs ({RUN_COLUMNS}) VALUES "
    "($1,$2,$3,$4,$5,$6,$7,$8,$9,$10::jsonb,$11,$12,$13,$14,$15,$16,$17,$18,$19,$20,$21,$22) "
    "ON CONFLICT (id) DO NOTHING RETURNING true"
)
# A pending run is announced, so an idle instance polls for it at once.
_INSERT_PENDING_RUN = (
    f"WITH ins AS ({_INSERT_RUN.removesuffix('RETURNING true')}RETURNING id) "
    f"SELECT (SELECT pg_notify($23, '{StoreNotice.PENDING}:' || {notice_argument('id')})) "
    "IS NULL FROM ins"
)


def _history_from(since: str) -> str:
    """A run's history from the position ``since`` (an SQL expression; the
    negative positions too, see :data:`~durably.stores.base.ReadFrom`) as one
    JSON text, for the turn-starting statements. Two ranges of the primary
    key: the rows below ``since`` are neither read nor encoded."""
    return (
        "(SELECT coalesce(json_agg(json_build_array(c.seq, c.name, c.kind, "
        "c.status, c.input, c.output, c.error, c.attempts, c.wake_at, c.started_at, "
        "c.finished_at, c.parallel_group, c.dispatched_at, c.redispatches, c.queue, "
        "c.last_heartbeat_at, c.progress, c.events) ORDER BY c.seq), '[]')::text "
        "FROM (SELECT * FROM durably_checkpoints WHERE run_id = r.id AND seq < 0 "
        "UNION ALL SELECT * FROM durably_checkpoints WHERE run_id = r.id "
        f"AND seq >= greatest({since}, 0)) c)"
    )


# A batch's positions come as an array parallel to its ids ($4), $7: NULL
# (or a missing entry) reads everything.
_HISTORY = _history_from("coalesce(($7::integer[])[array_position($4::text[], r.id)], 0)")
"""The history of each run of a batch statement leasing the runs ``$4``."""
# Lease the run and read its history in one round trip.
# A run's (workflow, version) as one key, compared with ``= ANY`` against the
# one array parameter an engine passes (see ``_keys``); NULL: every run.
_KEY = "(workflow || chr(31) || workflow_version)"
_START_TURN = (
    "WITH r AS (UPDATE durably_runs SET status = 'running', locked_by = $1, "
    "locked_until = $2, wake_requested_at = NULL, wake_at = NULL, updated_at = $3 "
    "WHERE id = $4 AND status = ANY($5::text[]) "
    "AND (locked_by IS NULL OR locked_until IS NULL OR locked_until < $3) "
    f"AND ($6::text[] IS NULL OR {_KEY} = ANY($6::text[])) "
    f"RETURNING {_SELECT_RUN}) "
    f"SELECT r.*, {_history_from('$7::integer')} AS history FROM r"
)
_UPSERT_ATTRIBUTE = (
    "INSERT INTO durably_run_attributes (run_id, key, type, str_value, num_value) "
    "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (run_id, key) DO UPDATE SET "
    "type = excluded.type, str_value = excluded.str_value, num_value = excluded.num_value"
)
_INSERT_CHECKPOINT = (
    f"INSERT INTO durably_checkpoints ({CP_COLUMNS}) VALUES ({_CP_PARAMS}) "
    "ON CONFLICT (run_id, seq) DO NOTHING"
)
_UPSERT_CHECKPOINT = (
    f"INSERT INTO durably_checkpoints ({CP_COLUMNS}) VALUES ({_CP_PARAMS}) {_CP_UPSERT_TAIL}"
)
# One statement: lock the run row against a concurrent takeover, check the
# lease, and upsert only if it is held; the result says whether it was.
_SAVE_CHECKPOINT_FENCED = f"""
    WITH lease AS (
        SELECT id FROM durably_runs WHERE id = $1::text AND locked_by = $19::text FOR SHARE
    ), saved AS (
        INSERT INTO durably_checkpoints ({CP_COLUMNS})
        SELECT {_CP_PARAMS} FROM lease
        {_CP_UPSERT_TAIL}
        RETURNING 1
    )
    SELECT count(*) FROM lease
"""
# The stranded signature (StateStore.list_stalled): $1 before, $2 limit, $3
# namespace or NULL. The wait branch reads progress from the checkpoints, not
# from updated_at, which every reconcile turn bumps without progressing. The
# live runs are read through the due and orphan indexes (the polls' forms),
# which hold them alone (migration 14): no finished run is looked at.
_STALLED = f"""
    SELECT r.id FROM durably_runs r
    WHERE ({POLL_SUSPENDED} OR {POLL_RUNNING})
    AND ($3::text IS NULL OR r.namespace = $3::text) AND (
        EXISTS (
            SELECT 1 FROM durably_checkpoints c
            WHERE c.run_id = r.id AND c.status = 'pending' AND c.dispatched_at < $1::bigint
                AND COALESCE(c.last_heartbeat_at, 0) < $1::bigint
        )
        OR (
            r.status = 'suspended'
            AND NOT EXISTS (
                SELECT 1 FROM durably_checkpoints c
                WHERE c.run_id = r.id AND (
                    (c.status = 'pending'
                        AND NOT (c.kind IN ('signal', 'event') AND c.wake_at IS NULL))
                    OR c.started_at >= $1::bigint OR c.finished_at >= $1::bigint
                )
            )
            AND (
                (r.wake_at IS NULL AND r.updated_at < $1::bigint)
                OR EXISTS (
                    SELECT 1 FROM durably_checkpoints c
                    WHERE c.run_id = r.id AND c.status = 'pending'
                        AND c.kind IN ('signal', 'event')
                )
            )
        )
    )
    ORDER BY r.updated_at, r.id LIMIT $2::bigint
"""
_TAKE_OLDEST_WAITER = """
    WITH picked AS (
        SELECT id FROM durably_signal_waiters WHERE token = $1 ORDER BY id LIMIT 1
    ), taken AS (
        DELETE FROM durably_signal_waiters w USING picked WHERE w.id = picked.id
        RETURNING w.run_id, w.seq
    )
    SELECT EXISTS (SELECT 1 FROM picked) AS picked, taken.run_id, taken.seq
    FROM (SELECT 1) AS one LEFT JOIN taken ON true
"""
_UPDATE_COLUMNS = "run_id, update_id, name, payload, created_at, answer, answered_at"
_SELECT_UPDATE = (
    f"SELECT {_UPDATE_COLUMNS} FROM durably_updates WHERE run_id = $1 AND update_id = $2"
)

# watch_runs: mark the runs live and unwatched as read (``live``, fixed once),
# locking them in id order as every write locking several runs does; a mark
# that waited for a settle returns the run as settled (RETURNING reads the row
# it locked). The other runs are returned as read: terminal, or watched
# already (so any later settle of theirs is announced).
_WATCH_RUNS = f"""
    WITH live AS MATERIALIZED (
        SELECT id FROM durably_runs
        WHERE id = ANY($1::text[]) AND NOT watched AND status <> ALL($2::text[])
    ), marked AS (
        UPDATE durably_runs SET watched = true
        WHERE id IN (
            SELECT id FROM durably_runs WHERE id IN (SELECT id FROM live)
            ORDER BY id FOR NO KEY UPDATE
        )
        RETURNING {_SELECT_RUN}
    )
    SELECT * FROM marked
    UNION ALL
    SELECT {_SELECT_RUN} FROM durably_runs
    WHERE id = ANY($1::text[]) AND id NOT IN (SELECT id FROM live)
"""
_HOLD_LEASE = "SELECT 1 FROM durably_runs WHERE id = $1 AND locked_by = $2 FOR SHARE"
_LOCK_TOKEN = "SELECT pg_advisory_xact_lock(hashtextextended($1::text, 0))"
_DELETE_WAITERS = (
    "WITH events AS (DELETE FROM durably_event_waiters WHERE run_id = $1) "
    "DELETE FROM durably_signal_waiters WHERE run_id = $1"
)
_TERMINAL = [s.value for s in sorted(TERMINAL_STATUSES)]

# Child runs ending (see ``end_child_runs``): a turn's settle while its lease
# is held (notified as settled), or an ending from outside a turn while the
# status is one of those given (notified as ended, which closes a turn of the
# run executing elsewhere).
_END_CHILDREN = f"""
    WITH v AS (
        SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                             $6::text[], $7::bigint[])
            AS v(id, owner, allowed, status, output, error, wake_at)
    ), ended AS (
        UPDATE durably_runs r SET status = v.status, output = v.output, error = v.error,
            wake_at = v.wake_at, locked_by = NULL, locked_until = NULL, updated_at = $8
        FROM v
        WHERE r.id = v.id AND CASE WHEN v.owner IS NOT NULL
            THEN r.status = 'running' AND r.locked_by = v.owner
            ELSE r.status = ANY(string_to_array(v.allowed, ',')) END
        RETURNING r.id, v.owner IS NOT NULL AS settled
    ), cleared AS (
        DELETE FROM durably_signal_waiters WHERE run_id IN (SELECT id FROM ended)
    ), cleared_events AS (
        DELETE FROM durably_event_waiters WHERE run_id IN (SELECT id FROM ended)
    )
    SELECT id, (SELECT pg_notify(
        $9,
        CASE WHEN settled THEN '{StoreNotice.SETTLED}:' ELSE '{StoreNotice.ENDED}:' END
            || {notice_argument("id")}
    )) IS NULL AS notified
    FROM ended
"""


# list_due: suspended runs whose timer is due or whose wake was requested, most
# overdue first. Each branch takes its own page in index order (the partial
# (wake_at, id) and wake_requested_at indexes) before the two are merged:
# grouping every due row first made a backlog of 25,000 due timers cost a
# parallel sequential scan and a sort of all of them for each page of 500
# (bench/big.py; tests/stores/test_postgres_due_index.py). A run in both pages
# counts once, at its earlier time: the page is the one grouping everything gave.
LIST_DUE = (
    "SELECT id FROM ("
    " (SELECT id, wake_at AS due FROM durably_runs"
    f"  WHERE {POLL_SUSPENDED} AND wake_at <= $1"
    "  AND ($3::text IS NULL OR namespace = $3)"
    f"  AND ($4::text[] IS NULL OR {_KEY} = ANY($4::text[]))"
    "  ORDER BY wake_at, id LIMIT $2)"
    " UNION ALL"
    " (SELECT id, wake_requested_at AS due FROM durably_runs"
    f"  WHERE wake_requested_at IS NOT NULL AND {SUSPENDED}"
    "  AND ($3::text IS NULL OR namespace = $3)"
    f"  AND ($4::text[] IS NULL OR {_KEY} = ANY($4::text[]))"
    "  ORDER BY wake_requested_at, id LIMIT $2)"
    ") AS due_runs GROUP BY id ORDER BY min(due), id LIMIT $2"
)


# next_wake_at: the first suspended run's timer past $1, one step along the
# partial (wake_at, id) index (ORDER BY ... LIMIT 1, not min() over every row).
NEXT_WAKE = (
    f"SELECT wake_at FROM durably_runs WHERE {POLL_SUSPENDED} AND wake_at > $1"
    " AND ($2::text IS NULL OR namespace = $2)"
    f" AND ($3::text[] IS NULL OR {_KEY} = ANY($3::text[]))"
    " ORDER BY wake_at LIMIT 1"
)


# list_expired: live runs past their execution deadline, on the partial deadline index
LIST_EXPIRED = (
    "SELECT id FROM durably_runs WHERE deadline_at IS NOT NULL AND deadline_at <= $1 "
    "AND status <> ALL($2::text[]) AND ($4::text IS NULL OR namespace = $4) "
    "ORDER BY deadline_at, id LIMIT $3"
)


class PostgresStore:
    """A :class:`~durably.stores.base.StateStore` on PostgreSQL (asyncpg, pooled).

    ``schema`` (or ``?schema=`` in the URL) keeps the tables in that schema;
    ``min_size`` / ``max_size`` size the connection pool; any other keyword
    goes to :func:`asyncpg.create_pool` (``ssl=``, ``command_timeout=`` …).
    Pooled connections use generic plans (``plan_cache_mode``
    ``force_generic_plan``) and no parallel workers
    (``max_parallel_workers_per_gather`` 0); ``server_settings=`` with
    either key restores PostgreSQL's default.
    """

    def __init__(
        self,
        url: str = "postgresql://127.0.0.1:5432/durably",
        *,
        schema: str | None = None,
        min_size: int = 1,
        max_size: int = 10,
        **connect_kwargs: Any,
    ) -> None:
        self.url = url
        self.ordered_writes = True  # one batching writer commits writes in call order
        self._db = PgConnection(
            url,
            schema=schema,
            min_size=min_size,
            max_size=max_size,
            connect_kwargs=connect_kwargs,
        )
        self.schema = self._db.schema
        """The schema holding this store's tables (``None``: the server's ``search_path``)."""
        self.channel = self._db.channel
        """The LISTEN/NOTIFY channel of this store's schema."""
        self._messages: PgMessageQueue | None = None
        self._batcher: PgWriteBatcher | None = None
        self._starts = PgStartBatcher(
            self._db.connection,
            self.channel,
            self._create_one,
            f"SELECT {_SELECT_RUN} FROM durably_runs WHERE id = ANY($1::text[])",
        )

    async def open(self) -> None:
        """Connect the pool and create or upgrade the schema."""
        await self._db.open()

    async def subscribe(self, on_event: Callable[[str, str], None]) -> bool:
        """LISTEN on this schema's channel; ``on_event(kind, run_id)`` for each
        notification. The listening connection is re-opened if it drops."""
        await self._db.subscribe(on_event)
        return True

    async def listen(self, listener: Callable[[str, str], None]) -> Callable[[], None]:
        """Also call ``listener(kind, argument)`` for each notification on the
        channel (LISTENing from now on); returns its removal."""
        return await self._db.listen(listener)

    def messages(self) -> PgMessageQueue:
        """The message queue in this schema (the ``db`` transport's), made on first use."""
        if self._messages is None:
            self._messages = PgMessageQueue(self._db.pool, self.channel, self._db.listen)
        return self._messages

    async def close(self) -> None:
        """Commit queued writes and close the pool."""
        await self._db.stop_listening()
        await self._starts.drain()
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            await batcher.close()
        await self._db.close()

    def _writes(self) -> PgWriteBatcher:
        self._db.pool()  # not open: RuntimeError here, not in the batch task
        if self._batcher is None:
            self._batcher = PgWriteBatcher(self._db.connection, self.channel)
        return self._batcher

    # -- runs --------------------------------------------------------------------

    async def create_run(
        self, run: Run, attributes: dict[str, Any] | None = None
    ) -> tuple[Run, bool]:
        """Insert unless the id exists (with its search attributes). Concurrent
        calls share statements: a lone one goes out at once, those made
        meanwhile as one multi-row insert; a run with attributes goes alone,
        in a transaction with its attribute rows."""
        if attributes:
            return await self._create_one(run, attributes)
        return await self._starts.create(run)

    async def _create_one(
        self, run: Run, attributes: dict[str, Any] | None = None
    ) -> tuple[Run, bool]:
        """Insert one run in a statement of its own, unless the id exists."""
        rows = _attribute_rows(run.run_id, attributes)
        while True:
            # A transaction only when there are attributes to write with the
            # run: the common start stays one statement.
            connect = self._db.transaction if rows else self._db.connection
            async with connect() as conn:
                if run.status is RunStatus.PENDING:
                    inserted = await conn.fetchval(
                        _INSERT_PENDING_RUN, *run_params(run), self.channel
                    )
                else:
                    # Leased to its creator or suspended until a time: no
                    # other process has anything to do with it yet.
                    inserted = await conn.fetchval(_INSERT_RUN, *run_params(run))
                if inserted is not None and rows:
                    await conn.executemany(_UPSERT_ATTRIBUTE, rows)
            if inserted is not None:
                return run, True
            existing = await self.get_run(run.run_id)
            if existing is not None:
                return existing, False
            # deleted between our insert and our read: try again

    async def create_runs(self, runs: list[Run]) -> list[str]:
        """Insert the runs whose ids are new: one multi-row insert per 500."""
        created: list[str] = []
        # In id order: two instances inserting the same new ids in different
        # orders would each wait on the other's uncommitted key (a deadlock).
        runs = sorted(runs, key=lambda run: run.run_id)
        async with self._db.pool().acquire() as conn:
            for start in range(0, len(runs), 500):
                chunk = runs[start : start + 500]
                columns = list(zip(*(run_params(run) for run in chunk), strict=True))
                rows = await conn.fetch(
                    f"INSERT INTO durably_runs ({RUN_COLUMNS}) {_RUNS_UNNEST} "
                    "ON CONFLICT (id) DO NOTHING RETURNING id",
                    *[list(column) for column in columns],
                )
                created.extend(row["id"] for row in rows)
            if created:
                await conn.execute(f"SELECT pg_notify($1, '{StoreNotice.PENDING}:')", self.channel)
        return created

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        row = await self._db.pool().fetchrow(
            f"SELECT {_SELECT_RUN} FROM durably_runs WHERE id = $1", run_id
        )
        return run_from_row(row) if row is not None else None

    async def get_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs that exist among ``run_ids``."""
        ids = list(dict.fromkeys(run_ids))
        if not ids:
            return []
        rows = await self._db.pool().fetch(
            f"SELECT {_SELECT_RUN} FROM durably_runs WHERE id = ANY($1::text[])", ids
        )
        return [run_from_row(row) for row in rows]

    async def get_run_statuses(self, run_ids: list[str]) -> dict[str, RunStatus]:
        """The status of each run that exists among ``run_ids`` (``RunStatusStore``)."""
        if not run_ids:
            return {}
        rows = await self._db.pool().fetch(
            "SELECT id, status FROM durably_runs WHERE id = ANY($1::text[])",
            list(dict.fromkeys(run_ids)),
        )
        return {row[0]: run_status(row[1]) for row in rows}

    async def watch_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs, marking the live ones watched: their settles are announced
        from now on. A run settling meanwhile either waits for the mark (its
        settle sees it and announces) or is read here as it settled: the mark
        waits for the row and returns the row as it then is."""
        if not run_ids:
            return []
        rows = await self._db.pool().fetch(_WATCH_RUNS, list(dict.fromkeys(run_ids)), _TERMINAL)
        return [run_from_row(row) for row in rows]

    async def list_runs(self, query: RunQuery) -> RunPage:
        """Runs matching ``query``, newest first."""
        sql, params = list_runs_sql(query)
        runs = [run_from_row(row) for row in await self._fetch_planned(sql, params)]
        if len(runs) <= query.limit:
            return RunPage(runs, None)
        runs = runs[: query.limit]
        return RunPage(runs, encode_cursor(runs[-1].created_at, runs[-1].run_id))

    async def count_runs(self, query: RunQuery, cap: int) -> dict[str, int]:
        """Runs matching ``query`` per status, each count at most ``cap``."""
        params: list[Any] = [cap]
        filters = _run_filter(dataclasses.replace(query, status=None, statuses=None), params)
        # One probe per status, each stopping at the cap: the cost is bounded
        # whatever the table holds (a GROUP BY reads every matching row). Each
        # status in its index's form (status_match): a live one counts its
        # partial index alone, however many runs have finished.
        probes = " UNION ALL ".join(
            f"SELECT '{st.value}'::text AS status, (SELECT count(*) FROM (SELECT 1 "
            f"FROM durably_runs WHERE {' AND '.join([status_match([st.value]), *filters])} "
            "LIMIT $1) AS hits) AS n"
            for st in RunStatus
        )
        rows = await self._fetch_planned(probes, params)
        return {row["status"]: row["n"] for row in rows if row["n"]}

    async def _fetch_planned(self, sql: str, params: list[Any]) -> list[Any]:
        """``sql``'s rows under a plan made for these very values.

        For the listings and counts, whose filters' shares vary by value: a
        generic plan cannot tell a status held by 2% of the runs from one held
        by 70%, nor a workflow of 20 runs from one of a million (worse, one the
        statistics have not seen yet is taken for every run), and walked the
        whole creation order for the rare one. Planning each call costs a
        fraction of a millisecond; these are not per-run statements.
        """
        async with self._db.transaction() as conn:
            await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            return list(await conn.fetch(sql, *params))

    async def list_queues(self) -> list[QueueState]:
        """Flow-control queues holding slots or waiters, by name."""
        pool = self._db.pool()
        held = await pool.fetch(
            "SELECT queue, count(*) AS n FROM durably_flow_slots "
            "WHERE released_at IS NULL GROUP BY queue"
        )
        waiting = await pool.fetch(
            "SELECT queue, count(*) AS n, min(enqueued_at) AS oldest "
            "FROM durably_flow_waiters GROUP BY queue"
        )
        return merge_queue_counts(
            {r["queue"]: r["n"] for r in held},
            {r["queue"]: (r["n"], r["oldest"]) for r in waiting},
        )

    async def list_changed(self, after: int, limit: int) -> list[Run]:
        """Runs updated after ``after``, oldest change first."""
        rows = await self._db.pool().fetch(
            f"SELECT {_SELECT_RUN} FROM durably_runs WHERE updated_at > $1 "
            "ORDER BY updated_at, id LIMIT $2",
            after,
            limit,
        )
        return [run_from_row(row) for row in rows]

    async def get_attributes(self, run_id: str) -> dict[str, Any]:
        """The run's search attributes."""
        rows = await self._db.pool().fetch(
            "SELECT key, type, str_value, num_value FROM durably_run_attributes "
            "WHERE run_id = $1 ORDER BY key",
            run_id,
        )
        return {
            row["key"]: attrcodec.decode(row["type"], row["str_value"], row["num_value"])
            for row in rows
        }

    async def upsert_attributes(
        self, checkpoint: Checkpoint, attributes: dict[str, Any], owner: str
    ) -> bool:
        """Write the checkpoint and merge the attributes, under the lease."""
        async with self._db.transaction() as conn:
            if not await conn.fetchval(_HOLD_LEASE, checkpoint.run_id, owner):
                return False
            await conn.execute(_UPSERT_CHECKPOINT, *checkpoint_params(checkpoint))
            await conn.executemany(
                _UPSERT_ATTRIBUTE, _attribute_rows(checkpoint.run_id, attributes)
            )
        return True

    # -- updates -----------------------------------------------------------------------

    async def put_update(self, record: UpdateRecord) -> UpdateRecord:
        """Add the update unless its id is there; return the stored one."""
        async with self._db.transaction() as conn:
            await conn.execute(
                "INSERT INTO durably_updates (run_id, update_id, name, payload, created_at) "
                "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (run_id, update_id) DO NOTHING",
                record.run_id,
                record.update_id,
                record.name,
                dump_json(record.payload),
                record.created_at,
            )
            row = await conn.fetchrow(_SELECT_UPDATE, record.run_id, record.update_id)
        return _update_from_row(row)

    async def get_update(self, run_id: str, update_id: str) -> UpdateRecord | None:
        """The update, or ``None``."""
        row = await self._db.pool().fetchrow(_SELECT_UPDATE, run_id, update_id)
        return None if row is None else _update_from_row(row)

    async def pending_updates(self, run_id: str, limit: int) -> list[UpdateRecord]:
        """Unanswered updates, oldest first."""
        rows = await self._db.pool().fetch(
            f"SELECT {_UPDATE_COLUMNS} FROM durably_updates "
            "WHERE run_id = $1 AND answer IS NULL ORDER BY id LIMIT $2",
            run_id,
            limit,
        )
        return [_update_from_row(row) for row in rows]

    async def answer_update(
        self,
        run_id: str,
        update_id: str,
        answer: dict[str, Any],
        now: int,
        *,
        checkpoint: Checkpoint | None = None,
        owner: str | None = None,
    ) -> bool:
        """Answer an unanswered update (with ``owner``: under the lease, with
        ``checkpoint``), in one transaction."""
        async with self._db.transaction() as conn:
            if owner is not None and not await conn.fetchval(_HOLD_LEASE, run_id, owner):
                return False
            status = await conn.execute(
                "UPDATE durably_updates SET answer = $1, answered_at = $2 "
                "WHERE run_id = $3 AND update_id = $4 AND answer IS NULL",
                dump_json(answer),
                now,
                run_id,
                update_id,
            )
            if checkpoint is not None:
                await conn.execute(_UPSERT_CHECKPOINT, *checkpoint_params(checkpoint))
        return owner is not None or status.endswith(" 1")

    async def move_updates(self, from_run: str, to_run: str, now: int) -> int:
        """Hand the unanswered updates to ``to_run`` in one statement: the
        updates answered ``moved`` are exactly those copied (under READ
        COMMITTED two statements would each see their own set, and an update
        put in between would be answered ``moved`` without being moved)."""
        async with self._db.connection() as conn:
            moved = await conn.fetchval(
                "WITH moved AS (UPDATE durably_updates SET answer = $1, answered_at = $2 "
                "WHERE run_id = $3 AND answer IS NULL "
                "RETURNING id, update_id, name, payload, created_at), "
                "copied AS (INSERT INTO durably_updates "
                "(run_id, update_id, name, payload, created_at) "
                "SELECT $4, update_id, name, payload, created_at FROM moved ORDER BY id "
                "ON CONFLICT (run_id, update_id) DO NOTHING) "
                "SELECT count(*) FROM moved",
                dump_json({"outcome": "moved", "run_id": to_run}),
                now,
                from_run,
                to_run,
            )
        return int(moved)

    async def delete_run(self, run_id: str) -> bool:
        """Delete a run with its history."""
        async with self._db.transaction() as conn:
            found = await conn.fetchval(
                "DELETE FROM durably_runs WHERE id = $1 RETURNING true", run_id
            )
            await conn.execute("DELETE FROM durably_checkpoints WHERE run_id = $1", run_id)
            await conn.execute("DELETE FROM durably_run_attributes WHERE run_id = $1", run_id)
            await conn.execute("DELETE FROM durably_updates WHERE run_id = $1", run_id)
            await conn.execute(_DELETE_WAITERS, run_id)
            await conn.execute(
                "WITH slots AS (DELETE FROM durably_flow_slots "
                "WHERE run_id = $1 AND released_at IS NULL) "
                "DELETE FROM durably_flow_waiters WHERE run_id = $1",
                run_id,
            )
        return bool(found)

    # -- leases and turns ------------------------------------------------------------

    async def _start_turn(
        self,
        run_id: str,
        owner: str,
        now: int,
        lease_until: int,
        statuses: frozenset[RunStatus],
        keys: list[str] | None,
        since: int,
    ) -> tuple[Run, dict[int, Checkpoint]] | None:
        """Lease one run and load its history, in one statement that waits
        for the run's row lock (the batch passes locked rows over)."""
        values = [s.value for s in statuses]
        async with self._db.connection() as conn:
            row = await conn.fetchrow(
                _START_TURN, owner, lease_until, now, run_id, values, keys, since
            )
        if row is None:
            return None
        return run_from_row(row), _history(run_id, row["history"], since)

    async def start_turns(
        self,
        run_ids: list[str],
        owner: str,
        now: int,
        lease_until: int,
        statuses: frozenset[RunStatus],
        *,
        workflows: Executable | None = None,
        read_from: ReadFrom | None = None,
    ) -> dict[str, tuple[Run, dict[int, Checkpoint]]]:
        """Lease the free runs and load their histories in one statement; a
        run whose row another transaction holds is retried alone."""
        if not run_ids:
            return {}
        values = [s.value for s in statuses]
        keys = _keys(workflows)
        since, froms = _positions(read_from, run_ids)
        # SKIP LOCKED: the batch never waits on a row lock, so it cannot
        # deadlock with another multi-row write locking in another order.
        rows = await self._db.pool().fetch(
            "WITH r AS (UPDATE durably_runs SET status = 'running', locked_by = $1, "
            "locked_until = $2, wake_requested_at = NULL, wake_at = NULL, updated_at = $3 "
            "WHERE id IN (SELECT id FROM durably_runs WHERE id = ANY($4::text[]) "
            "AND status = ANY($5::text[]) "
            "AND (locked_by IS NULL OR locked_until IS NULL OR locked_until < $3) "
            f"AND ($6::text[] IS NULL OR {_KEY} = ANY($6::text[])) "
            "FOR UPDATE SKIP LOCKED) "
            f"RETURNING {_SELECT_RUN}) "
            f"SELECT r.*, {_HISTORY} AS history FROM r",
            owner,
            lease_until,
            now,
            run_ids,
            values,
            keys,
            froms,
        )
        leased = {
            row["id"]: (run_from_row(row), _history(row["id"], row["history"], since(row["id"])))
            for row in rows
        }
        # A run passed over because its row was being written gets the one-row
        # statement, which waits for the lock and re-checks: the batch decides
        # each run as leasing it alone would. Which ones: those still leasable
        # as last committed (a row locked by a transaction in progress reads as
        # its committed version). One read, not one statement per run: in a
        # fleet every instance lists the same pending runs, and each run
        # another instance has just leased used to cost a transaction of its
        # own here (bench/fleet.py: 204 statements per 1,000 steps with two
        # processes instead of 1.3).
        rest = [run_id for run_id in dict.fromkeys(run_ids) if run_id not in leased]
        if rest:
            still = set(
                await self._ids(
                    "SELECT id FROM durably_runs WHERE id = ANY($1::text[]) "
                    "AND status = ANY($2::text[]) "
                    "AND (locked_by IS NULL OR locked_until IS NULL OR locked_until < $3) "
                    f"AND ($4::text[] IS NULL OR {_KEY} = ANY($4::text[]))",
                    rest,
                    values,
                    now,
                    keys,
                )
            )
            rest = [run_id for run_id in rest if run_id in still]
        if rest:
            again = await asyncio.gather(
                *(
                    self._start_turn(run_id, owner, now, lease_until, statuses, keys, since(run_id))
                    for run_id in rest
                )
            )
            leased.update((run_id, got) for run_id, got in zip(rest, again, strict=True) if got)
        return leased

    async def continue_turn(self, run_id: str, owner: str, lease_until: int) -> Run | None:
        """Keep the lease for one more turn."""
        row = await self._db.pool().fetchrow(
            "UPDATE durably_runs SET wake_requested_at = NULL, locked_until = $1 "
            f"WHERE id = $2 AND {RUNNING} AND locked_by = $3 "
            f"RETURNING {_SELECT_RUN}",
            lease_until,
            run_id,
            owner,
        )
        return run_from_row(row) if row is not None else None

    async def renew_lease(self, run_id: str, owner: str, lease_until: int) -> bool:
        """Extend our lease."""
        done = await self._db.pool().fetchval(
            "UPDATE durably_runs SET locked_until = $1 "
            f"WHERE id = $2 AND {RUNNING} AND locked_by = $3 RETURNING true",
            lease_until,
            run_id,
            owner,
        )
        return bool(done)

    def settle_run(
        self, run_id: str, owner: str, status: RunStatus, changes: RunChanges, now: int
    ) -> Awaitable[SettleResult]:
        """End a turn by compare-and-set, committed with other turns' writes."""
        return self._writes().settle(
            settle_params(
                run_id,
                owner,
                status,
                dump_json(changes.output),
                dump_json(changes.error),
                changes.wake_at,
                now,
                waiters=changes.waiters,
            )
        )

    async def _settle_run_alone(
        self, run_id: str, owner: str, status: RunStatus, changes: RunChanges, now: int
    ) -> SettleResult:
        """End a turn by compare-and-set, in a statement of its own."""
        terminal = status in TERMINAL_STATUSES
        guard = "" if terminal else " AND wake_requested_at IS NULL"
        sql = (
            "UPDATE durably_runs SET status = $1, output = $2, error = $3, wake_at = $4, "
            "locked_by = NULL, locked_until = NULL, updated_at = $5 "
            f"WHERE id = $6 AND {RUNNING} AND locked_by = $7{guard} RETURNING true"
        )
        params = (
            status.value,
            dump_json(changes.output),
            dump_json(changes.error),
            changes.wake_at,
            now,
            run_id,
            owner,
        )
        if terminal:
            async with self._db.transaction() as conn:
                if await conn.fetchval(sql, *params):
                    # a separate statement, so it sees a waiter registered by a
                    # transaction our UPDATE waited for
                    await conn.execute(_DELETE_WAITERS, run_id)
                    return SettleResult.SETTLED
            return SettleResult.LOST
        pool = self._db.pool()
        if await pool.fetchval(sql, *params):
            return SettleResult.SETTLED
        held = await pool.fetchval(
            f"SELECT true FROM durably_runs WHERE id = $1 AND {RUNNING} AND locked_by = $2",
            run_id,
            owner,
        )
        return SettleResult.WAKE_REQUESTED if held else SettleResult.LOST

    async def end_child_runs(self, ends: list[ChildEnd], now: int) -> list[tuple[bool, int | None]]:
        """End each child still as expected and settle its parent's
        placeholder, in one transaction of a few statements."""
        if not ends:
            return []
        firsts: dict[str, int] = {}
        for index, end in enumerate(ends):
            firsts.setdefault(end.run_id, index)  # a run named twice is ended by its first
        entries = [ends[i] for i in firsts.values()]
        async with self._db.transaction() as conn:
            # Children and parents locked together in id order, as every
            # batch that locks runs does, so two batches never deadlock; a
            # separate statement, so the update below sees what the
            # transactions it waited for committed (a waiter registered).
            await conn.execute(
                "SELECT 1 FROM durably_runs WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE",
                sorted({e.run_id for e in entries} | {e.report.run_id for e in entries}),
            )
            rows = await conn.fetch(
                _END_CHILDREN,
                [e.run_id for e in entries],
                [e.owner for e in entries],
                [",".join(sorted(s.value for s in e.statuses)) for e in entries],
                [e.status.value for e in entries],
                [dump_json(e.changes.output) for e in entries],
                [dump_json(e.changes.error) for e in entries],
                [e.changes.wake_at for e in entries],
                now,
                self.channel,
            )
            ended = {row["id"] for row in rows}
            reported = [i for i in firsts.values() if ends[i].run_id in ended]
            lefts, waiter_runs = await self._resolve_in(
                conn, [ends[i].report for i in reported], now, locked=True
            )
        await self._wake_waiters(waiter_runs, now)
        answers: list[tuple[bool, int | None]] = [(False, None)] * len(ends)
        for index, left in zip(reported, lefts, strict=True):
            answers[index] = (True, left)
        return answers

    async def release_run(self, run_id: str, owner: str, now: int) -> bool:
        """Hand the run back as pending."""
        done = await self._db.pool().fetchval(
            "UPDATE durably_runs SET status = 'pending', locked_by = NULL, "
            "locked_until = NULL, updated_at = $1 "
            f"WHERE id = $2 AND {RUNNING} AND locked_by = $3 "
            f"RETURNING (SELECT pg_notify($4, '{StoreNotice.PENDING}:')) IS NULL",
            now,
            run_id,
            owner,
            self.channel,
        )
        return done is not None

    async def request_wake(self, run_id: str, now: int) -> bool:
        """Stamp a wake request on a live run."""
        done = await self._db.pool().fetchval(
            "UPDATE durably_runs SET wake_requested_at = $1 "
            "WHERE id = $2 AND status <> ALL($3::text[]) "
            f"RETURNING (SELECT pg_notify($4, '{StoreNotice.WAKE}:' || {notice_argument('id')})) "
            "IS NULL",
            now,
            run_id,
            _TERMINAL,
            self.channel,
        )
        return done is not None

    # -- remote workflow turns --------------------------------------------------------

    async def mark_awaiting(self, run_id: str, owner: str, task_id: str | None) -> bool:
        """Record (or clear) the turn a run leased by ``owner`` awaits."""
        done = await self._db.pool().fetchval(
            "UPDATE durably_runs SET awaiting_decision_task_id = $1 "
            f"WHERE id = $2 AND {RUNNING} AND locked_by = $3 RETURNING true",
            task_id,
            run_id,
            owner,
        )
        return bool(done)

    async def take_decision(
        self,
        run_id: str,
        task_id: str,
        owner: str,
        lease_until: int,
        now: int,
        checkpoints: list[Checkpoint],
    ) -> Run | None:
        """Lease a run awaiting ``task_id`` and insert the decision's
        checkpoints, in one transaction."""
        async with self._db.transaction() as conn:
            row = await conn.fetchrow(
                "UPDATE durably_runs SET status = 'running', locked_by = $1, locked_until = $2, "
                "wake_at = NULL, wake_requested_at = NULL, awaiting_decision_task_id = NULL, "
                f"updated_at = $3 WHERE id = $4 AND {SUSPENDED} "
                f"AND awaiting_decision_task_id = $5 RETURNING {_SELECT_RUN}",
                owner,
                lease_until,
                now,
                run_id,
                task_id,
            )
            if row is None:
                return None
            if checkpoints:
                await conn.executemany(
                    _INSERT_CHECKPOINT, [checkpoint_params(cp) for cp in checkpoints]
                )
            return run_from_row(row)

    async def mark_dispatched(self, run_id: str, seqs: list[int], at: int) -> None:
        """Stamp the pending, unstamped checkpoints at ``seqs`` as sent."""
        await self._db.pool().execute(
            "UPDATE durably_checkpoints SET dispatched_at = $1 WHERE run_id = $2 "
            "AND seq = ANY($3::integer[]) AND status = 'pending' AND dispatched_at IS NULL",
            at,
            run_id,
            seqs,
        )

    async def extend_decision_wait(self, run_id: str, wake_at: int, now: int) -> bool:
        """Push back the re-drive time of a run awaiting a decision."""
        done = await self._db.pool().fetchval(
            "UPDATE durably_runs SET wake_at = greatest(coalesce(wake_at, 0), $1), "
            f"updated_at = $2 WHERE id = $3 AND {SUSPENDED} "
            "AND awaiting_decision_task_id IS NOT NULL RETURNING true",
            wake_at,
            now,
            run_id,
        )
        return bool(done)

    async def update_run_if(
        self, run_id: str, statuses: frozenset[RunStatus], changes: dict[str, Any], now: int
    ) -> bool:
        """Apply ``changes`` while the status is one of ``statuses``."""
        check_run_changes(changes)
        changes = dict(changes)
        new_status = changes.get("status")
        terminal = new_status is not None and RunStatus(new_status) in TERMINAL_STATUSES
        if terminal:
            changes.update(locked_by=None, locked_until=None)
        params: list[Any] = []
        sets: list[str] = []
        for column, value in changes.items():
            params.append(run_column_value(column, value))
            cast = "::jsonb" if column == "tags" else ""
            sets.append(f"{column} = ${len(params)}{cast}")
        params.extend([now, run_id, [s.value for s in statuses]])
        n = len(params)
        sets.append(f"updated_at = ${n - 2}")
        sql = (
            f"UPDATE durably_runs SET {', '.join(sets)} "
            f"WHERE id = ${n - 1} AND status = ANY(${n}::text[]) RETURNING true"
        )
        if not terminal:
            return bool(await self._db.pool().fetchval(sql, *params))
        async with self._db.transaction() as conn:
            if not await conn.fetchval(sql, *params):
                return False
            await conn.execute(_DELETE_WAITERS, run_id)
            await conn.execute(
                f"SELECT pg_notify($1, '{StoreNotice.ENDED}:' || {notice_argument('$2::text')})",
                self.channel,
                run_id,
            )
            return True

    # -- the worker loop ---------------------------------------------------------------

    async def list_pending(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Pending runs, most urgent first, then oldest."""
        return await self._ids(
            f"SELECT id FROM durably_runs WHERE {POLL_PENDING} "
            "AND ($2::text IS NULL OR namespace = $2) "
            f"AND ($3::text[] IS NULL OR {_KEY} = ANY($3::text[])) "
            "ORDER BY priority DESC, created_at, id LIMIT $1",
            limit,
            namespace,
            _keys(workflows),
        )

    async def list_orphans(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Running runs whose lease expired."""
        return await self._ids(
            f"SELECT id FROM durably_runs WHERE {POLL_RUNNING} "
            "AND (locked_until IS NULL OR locked_until < $1) "
            "AND ($3::text IS NULL OR namespace = $3) "
            f"AND ($4::text[] IS NULL OR {_KEY} = ANY($4::text[])) "
            "ORDER BY locked_until NULLS FIRST, id LIMIT $2",
            now,
            limit,
            namespace,
            _keys(workflows),
        )

    async def recover_orphans(
        self, run_ids: list[str], now: int, max_attempts: int
    ) -> dict[str, RunStatus]:
        """Count a recovery of each run still orphaned; pending again, or dead
        past ``max_attempts``: one conditional UPDATE for the whole batch."""
        if not run_ids:
            return {}
        async with self._db.transaction() as conn:
            # The rows are locked by the inner SELECT with the orphan conditions
            # checked on their latest version, so two instances recovering the
            # same ids never both count a run. SKIP LOCKED: a row another
            # transaction is writing is left for the next pass rather than
            # waited on, so batches locking in different orders cannot deadlock.
            rows = await conn.fetch(
                "UPDATE durably_runs SET recovery_attempts = recovery_attempts + 1, "
                "locked_by = NULL, locked_until = NULL, updated_at = $1, "
                "status = CASE WHEN recovery_attempts + 1 > $2 THEN 'dead' ELSE 'pending' END "
                "WHERE id IN (SELECT id FROM durably_runs WHERE id = ANY($3::text[]) "
                f"AND {RUNNING} AND (locked_until IS NULL OR locked_until < $1) "
                "FOR UPDATE SKIP LOCKED) "
                "RETURNING id, status, recovery_attempts",
                now,
                max_attempts,
                run_ids,
            )
            recovered = {row["id"]: RunStatus(row["status"]) for row in rows}
            dead = [row for row in rows if recovered[row["id"]] is RunStatus.DEAD]
            if dead:
                ids = [row["id"] for row in dead]
                await conn.execute(
                    "UPDATE durably_runs r SET error = v.error "
                    "FROM unnest($1::text[], $2::text[]) AS v(id, error) WHERE r.id = v.id",
                    ids,
                    [codec.dumps(dead_error(row["recovery_attempts"])) for row in dead],
                )
                await conn.execute(
                    "WITH events AS (DELETE FROM durably_event_waiters "
                    "WHERE run_id = ANY($1::text[])) "
                    "DELETE FROM durably_signal_waiters WHERE run_id = ANY($1::text[])",
                    ids,
                )
                await conn.execute(
                    f"SELECT pg_notify($1, '{StoreNotice.ENDED}:' || {notice_argument('id')}) "
                    "FROM unnest($2::text[]) AS id",
                    self.channel,
                    ids,
                )
            return recovered

    async def list_due(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Suspended runs whose timer is due or whose wake was requested."""
        return await self._ids(
            LIST_DUE,
            now,
            limit,
            namespace,
            _keys(workflows),
        )

    async def next_wake_at(
        self,
        after: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> int | None:
        """The earliest timer of a suspended run later than ``after``."""
        found = await self._db.pool().fetchval(NEXT_WAKE, after, namespace, _keys(workflows))
        return None if found is None else int(found)

    async def list_unclaimed(
        self,
        before: int,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Runs outside ``workflows`` nobody took since ``before``, oldest first."""
        outside = f"AND NOT ({_KEY} = ANY($3::text[])) AND ($4::text IS NULL OR namespace = $4)"
        return await self._ids(
            "SELECT id FROM ("
            " SELECT id, updated_at AS since FROM durably_runs"
            f"  WHERE {POLL_PENDING} AND updated_at < $1 {outside}"
            " UNION ALL"
            " SELECT id, wake_at AS since FROM durably_runs"
            f"  WHERE {POLL_SUSPENDED} AND wake_at < $1 {outside}"
            " UNION ALL"
            " SELECT id, wake_requested_at AS since FROM durably_runs"
            f"  WHERE wake_requested_at < $1 AND {SUSPENDED} {outside}"
            ") AS unclaimed GROUP BY id ORDER BY min(since), id LIMIT $2",
            before,
            limit,
            _keys(workflows) or [],
            namespace,
        )

    async def list_blocked(
        self,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Blocked runs of ``workflows``, most urgent first, then oldest."""
        return await self._ids(
            "SELECT id FROM durably_runs WHERE status = 'blocked' "
            "AND ($2::text IS NULL OR namespace = $2) "
            f"AND {_KEY} = ANY($3::text[]) "
            "ORDER BY priority DESC, created_at, id LIMIT $1",
            limit,
            namespace,
            _keys(workflows) or [],
        )

    async def claim_due_batch(self, run_ids: list[str], now: int, next_wake_at: int) -> list[str]:
        """Move each due run's wake time ahead so no other poll takes it: one
        conditional UPDATE for the whole batch."""
        if not run_ids:
            return []
        # As in recover_orphans: conditions checked on the locked latest row
        # version (one claimant per run); rows being written elsewhere skipped.
        return await self._ids(
            "UPDATE durably_runs SET wake_at = $1, wake_requested_at = NULL "
            "WHERE id IN (SELECT id FROM durably_runs WHERE id = ANY($2::text[]) "
            f"AND {SUSPENDED} AND (wake_at <= $3 OR wake_requested_at IS NOT NULL) "
            "AND (locked_by IS NULL OR locked_until IS NULL OR locked_until < $3) "
            "FOR UPDATE SKIP LOCKED) "
            "RETURNING id",
            next_wake_at,
            run_ids,
            now,
        )

    async def list_finished_before(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Terminal runs last updated before ``before``, oldest first."""
        rows = await self._db.pool().fetch(
            # Oldest change first along durably_runs_updated_at; the status
            # only checked (no index led by it may answer: the finished index
            # would be read whole and sorted). Live runs this old are skipped.
            "SELECT id FROM durably_runs WHERE updated_at < $2 "
            f"AND {only_checked('status = ANY($1::text[])')} "
            "AND ($4::text IS NULL OR namespace = $4) ORDER BY updated_at, id LIMIT $3",
            _TERMINAL,
            before,
            limit,
            namespace,
        )
        return [row["id"] for row in rows]

    async def list_stalled(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Live runs showing the stranded signature since ``before``."""
        return await self._ids(_STALLED, before, limit, namespace)

    async def list_expired(
        self, now: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Live runs past their execution deadline."""
        return await self._ids(
            LIST_EXPIRED,
            now,
            _TERMINAL,
            limit,
            namespace,
        )

    # -- checkpoints -------------------------------------------------------------------

    async def load_checkpoints(self, run_id: str, since: int = 0) -> dict[int, Checkpoint]:
        """Every checkpoint of the run (from ``since``, and the negative ones)."""
        if since <= 0:
            rows = await self._db.pool().fetch(
                f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = $1 ORDER BY seq",
                run_id,
            )
            return {row["seq"]: checkpoint_from_row(row) for row in rows}
        rows = await self._db.pool().fetch(
            f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = $1 AND seq < 0 "
            f"UNION ALL SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = $1 "
            "AND seq >= $2 ORDER BY seq",
            run_id,
            since,
        )
        return read_tail(since, ((row["seq"], checkpoint_from_row(row)) for row in rows))

    def save_checkpoint(self, checkpoint: Checkpoint, owner: str) -> asyncio.Future[bool]:
        """Upsert under the lease (never replacing a completed checkpoint),
        committed together with other turns' writes."""
        return self._writes().save_checkpoint(checkpoint_params(checkpoint), owner)

    def save_checkpoint_sending(
        self, checkpoint: Checkpoint, owner: str, messages: list[OutMessage]
    ) -> asyncio.Future[bool]:
        """:meth:`save_checkpoint` that pushes ``messages`` into the message
        queue in its transaction, if the lease held (``OutboxStore``)."""
        return self._writes().save_checkpoint(checkpoint_params(checkpoint), owner, messages)

    def save_checkpoint_claiming(
        self, checkpoint: Checkpoint, owner: str, messages: list[OutMessage]
    ) -> asyncio.Future[list[int] | None]:
        """:meth:`save_checkpoint_sending` answering the ids of the messages
        born claimed, or ``None`` if the lease was lost (``OutboxStore``)."""
        born: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()
        params = checkpoint_params(checkpoint)
        if any(m.claimed_by is not None for m in messages):
            self._writes().save_checkpoint_claiming(params, owner, messages, born)
            return born

        def written(held: asyncio.Future[bool]) -> None:  # nothing born: the plain answer
            if born.done():
                return
            if held.cancelled():
                born.cancel()
            elif (error := held.exception()) is not None:
                born.set_exception(error)
            else:
                born.set_result([] if held.result() else None)

        self._writes().save_checkpoint(params, owner, messages).add_done_callback(written)
        return born

    async def _save_checkpoint_alone(self, checkpoint: Checkpoint, owner: str) -> bool:
        """Upsert under the lease, in a statement of its own."""
        held = await self._db.pool().fetchval(
            _SAVE_CHECKPOINT_FENCED, *checkpoint_params(checkpoint), owner
        )
        return bool(held)

    async def save_checkpoints(self, checkpoints: list[Checkpoint], owner: str) -> bool:
        """Upsert many checkpoints under the lease, in one transaction."""
        async with self._db.transaction() as conn:
            # In id order, as every write locking several runs does (no deadlock).
            for run_id in sorted({cp.run_id for cp in checkpoints}):
                if not await conn.fetchval(_HOLD_LEASE, run_id, owner):
                    return False
            await conn.executemany(
                _UPSERT_CHECKPOINT, [checkpoint_params(cp) for cp in checkpoints]
            )
        return True

    async_transactions = True
    """``ctx.transaction`` functions here are async (asyncpg)."""

    async def transact(
        self,
        run_id: str,
        owner: str,
        fn: Callable[[Any], Any],
        checkpoint_for: Callable[[Any], Checkpoint],
    ) -> tuple[bool, Any]:
        """``ctx.transaction`` on PostgreSQL: ``await fn(asyncpg connection)`` inside
        the transaction that writes the checkpoint."""
        async with self._db.transaction() as conn:
            # FOR SHARE holds off a takeover until the commit: the lease is
            # still ours when the app's writes and the checkpoint land.
            if not await conn.fetchval(_HOLD_LEASE, run_id, owner):
                return False, None
            value = fn(conn)
            if not inspect.isawaitable(value):
                raise TypeError(
                    "on PostgreSQL, ctx.transaction's function is an async function "
                    "taking an asyncpg connection"
                )
            checkpoint = checkpoint_for(await value)
            await conn.execute(_UPSERT_CHECKPOINT, *checkpoint_params(checkpoint))
        return True, checkpoint.output

    async def delete_checkpoints(self, run_id: str, seqs: list[int]) -> None:
        """Forget the given checkpoints."""
        await self._db.pool().execute(
            "DELETE FROM durably_checkpoints WHERE run_id = $1 AND seq = ANY($2::integer[])",
            run_id,
            seqs,
        )

    async def resolve_checkpoints(
        self, resolutions: list[Resolution], now: int
    ) -> list[int | None]:
        """Settle the outcomes in one transaction of a few statements,
        whatever their number."""
        if not resolutions:
            return []
        async with self._db.transaction() as conn:
            answers, waiter_runs = await self._resolve_in(conn, resolutions, now)
        await self._wake_waiters(waiter_runs, now)
        return answers

    async def resolve_and_lease(
        self, resolutions: list[Resolution], now: int, lease: TurnLease
    ) -> tuple[list[int | None], dict[str, tuple[Run, dict[int, Checkpoint]]]]:
        """Settle the outcomes and lease the runs they wake, in one transaction."""
        leased: dict[str, tuple[Run, dict[int, Checkpoint]]] = {}
        if not resolutions:
            return [], leased
        async with self._db.transaction() as conn:
            answers, waiter_runs = await self._resolve_in(
                conn, resolutions, now, lease=(lease, leased)
            )
        await self._wake_waiters(waiter_runs, now)
        return answers, leased

    async def claim_and_resolve(
        self,
        topics: list[str],
        limit: int,
        visible_at: int,
        decode: Callable[[list[Message]], tuple[Any, list[Resolution]]],
        now: int,
        lease: TurnLease | None,
        delete: Sequence[int] = (),
    ) -> SettledMessages:
        """Take step results off the message queue and settle them, in one
        transaction (``ResultSettlingStore``)."""
        leased: dict[str, tuple[Run, dict[int, Checkpoint]]] = {}
        async with self._db.transaction() as conn:
            messages: list[Message] = []
            gone: list[int] | None = None
            if limit > 0:
                rows = await conn.fetch(_TAKE_MESSAGES, topics, visible_at, limit, list(delete))
                messages = sorted(
                    (
                        Message(r["id"], r["topic"], r["body"], r["priority"], r["deliveries"])
                        for r in rows
                        if not r["deleted"]
                    ),
                    key=lambda m: (-m.priority, m.id),
                )
            else:  # nothing to take: the served tasks go with the settle
                gone = list(delete)
            decoded, resolutions = decode(messages)
            answers, waiter_runs = await self._resolve_in(
                conn,
                resolutions,
                now,
                lease=None if lease is None else (lease, leased),
                delete=gone,
            )
        await self._wake_waiters(waiter_runs, now)
        return SettledMessages(messages, decoded, answers, leased)

    async def _resolve_in(
        self,
        conn: Any,
        resolutions: list[Resolution],
        now: int,
        *,
        locked: bool = False,
        lease: tuple[TurnLease, dict[str, tuple[Run, dict[int, Checkpoint]]]] | None = None,
        delete: list[int] | None = None,
    ) -> tuple[list[int | None], list[str]]:
        """:meth:`resolve_checkpoints` inside the caller's transaction; also
        returns the runs to wake once it committed (see :meth:`_wake_waiters`).
        ``locked``: the caller holds the rows of the resolutions' runs already.
        ``lease``: lease the woken runs as it says, into its dict, rather
        than stamp their wakes (:meth:`resolve_and_lease`). ``delete``: also
        delete these messages (not with ``locked``)."""
        if not resolutions:
            if delete:
                await conn.execute(_DELETE_MESSAGES, delete)
            return [], []
        # A position named twice is settled by its first entry; the second finds it settled.
        firsts: dict[tuple[str, int], int] = {}
        for index, r in enumerate(resolutions):
            firsts.setdefault((r.run_id, r.seq), index)
        entries = [resolutions[i] for i in firsts.values()]
        waiter_runs: list[str] = []
        woken_here: set[str] = set()
        if delete:
            if locked:
                raise ValueError("delete goes with a settle that locks its runs")
            # The runs of held turns are woken (stamped, unless their holder
            # still holds them) by the settle statement itself: under load
            # every result of a batch is a held turn's, and the lease offered
            # after took none of them.
            held = _agreed_holders(entries)
            rows = await conn.fetch(
                LOCK_SETTLE_DELETE_AND_WAKE_HELD,
                outcomes_json(entries, held),
                now,
                delete,
                _TERMINAL,
                self.channel,
            )
            woken_here = {row["run_id"] for row in rows if row["woken"]}
        else:
            rows = await conn.fetch(
                SETTLE_LOCKED if locked else LOCK_AND_SETTLE, outcomes_json(entries), now
            )
        settled = {(row["run_id"], row["seq"]): row for row in rows}
        grouped = list(
            {
                (row["run_id"], row["parallel_group"])
                for row in rows
                if row["parallel_group"] is not None
            }
        )
        pending: dict[tuple[str, str], int] = {}
        if grouped:
            counted = await conn.fetch(
                "SELECT run_id, parallel_group, count(*) AS left FROM durably_checkpoints "
                "WHERE (run_id, parallel_group) IN "
                "(SELECT * FROM unnest($1::text[], $2::text[])) AND status = 'pending' "
                "GROUP BY run_id, parallel_group",
                [g[0] for g in grouped],
                [g[1] for g in grouped],
            )
            pending = {(c["run_id"], c["parallel_group"]): c["left"] for c in counted}
        # Entry by entry, in order: the siblings still pending once it settled
        # are those pending now plus those pending ones later entries settled.
        later: dict[tuple[str, str], int] = {}
        answers: dict[int, int] = {}
        wake: set[str] = set()
        for index in reversed(firsts.values()):
            r = resolutions[index]
            row = settled.get((r.run_id, r.seq))
            if row is None:
                continue
            group = row["parallel_group"]
            left = 0
            if group is not None:
                left = pending.get((r.run_id, group), 0) + later.get((r.run_id, group), 0)
                if row["was"] == CheckpointStatus.PENDING.value:
                    later[(r.run_id, group)] = later.get((r.run_id, group), 0) + 1
            answers[index] = left
            if left == 0 or r.status is CheckpointStatus.FAILED:
                wake.add(r.run_id)
        wake -= woken_here
        if wake and lease is not None and lease[0].limit > 0:
            # The rows are locked by this transaction already: no SKIP
            # LOCKED, every run start_turns would take is taken.
            terms, leased = lease
            woken = sorted(wake)
            offered = woken[: terms.limit]
            since, froms = _positions(terms.read_from, offered)
            taken = await conn.fetch(
                _LEASE_AND_WAKE,
                terms.owner,
                terms.lease_until,
                now,
                offered,
                [status.value for status in terms.statuses],
                _keys(terms.workflows),
                froms,
                woken,
                _held_owners(entries, woken),
                _TERMINAL,
                self.channel,
            )
            for row in taken:
                history = _history(row["id"], row["history"], since(row["id"]))
                leased[row["id"]] = (run_from_row(row), history)
        elif wake:
            # One statement for every run to wake (its row is locked already,
            # by this transaction or the caller's), not a round trip each.
            woken = sorted(wake)
            owners = _held_owners(entries, woken)
            await conn.execute(_WAKE_RUNS, now, woken, _TERMINAL, self.channel, owners)
        holding = [row for row in rows if row["queue"] is not None]
        if holding:
            await _lock_queues(conn, {row["queue"] for row in holding})
            freed = await conn.fetch(
                "UPDATE durably_flow_slots s SET released_at = $3 "
                "FROM unnest($1::text[], $2::text[]) AS v(queue, step_id) "
                "WHERE s.queue = v.queue AND s.step_id = v.step_id "
                "AND s.released_at IS NULL RETURNING s.queue",
                [row["queue"] for row in holding],
                [f"{row['run_id']}:{row['seq']}" for row in holding],
                now,
            )
            waiter_runs = await _first_waiters(conn, {row["queue"] for row in freed})
        return [answers.get(index) for index in range(len(resolutions))], waiter_runs

    # -- dispatched steps --------------------------------------------------------------

    async def get_checkpoint(self, run_id: str, seq: int) -> Checkpoint | None:
        """One checkpoint, or ``None``."""
        row = await self._db.pool().fetchrow(
            f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = $1 AND seq = $2",
            run_id,
            seq,
        )
        return checkpoint_from_row(row) if row is not None else None

    async def record_heartbeat(self, run_id: str, seq: int, at: int, progress: Any) -> bool:
        """Keep the later heartbeat (and its progress) on a pending checkpoint."""
        done = await self._db.pool().fetchval(_RECORD_BEAT, at, dump_json(progress), run_id, seq)
        return bool(done)

    async def record_heartbeats(self, beats: list[BeatRecord]) -> list[bool]:
        """Many beats in one statement; a beat PostgreSQL refuses answers
        ``False`` alone (the rest are then written one statement each)."""
        merged: dict[tuple[str, int], tuple[int, str | None]] = {}
        refused: set[int] = set()
        for index, b in enumerate(beats):
            try:
                progress = dump_json(b.progress)
            except Exception:
                refused.add(index)
                continue
            key = (b.run_id, b.seq)
            earlier = merged.get(key)
            if earlier is not None:
                # The same step twice: the later time, the last progress sent.
                progress = progress if progress is not None else earlier[1]
                merged[key] = (max(earlier[0], b.at), progress)
            else:
                merged[key] = (b.at, progress)
        written: set[tuple[str, int]] = set()
        keys = sorted(merged)
        if len(keys) > 1:
            try:
                rows = await self._db.pool().fetch(
                    _RECORD_BEATS,
                    [k[0] for k in keys],
                    [k[1] for k in keys],
                    [merged[k][0] for k in keys],
                    [merged[k][1] for k in keys],
                )
                written = {(row["run_id"], row["seq"]) for row in rows}
                keys = [key for key in keys if key not in written]
                if keys:
                    # Skipped (locked) or not pending: only the pending ones
                    # are written again, one row each (so never a deadlock).
                    still = await self._db.pool().fetch(
                        "SELECT c.run_id, c.seq FROM durably_checkpoints c "
                        "JOIN unnest($1::text[], $2::integer[]) AS v(run_id, seq) "
                        "ON c.run_id = v.run_id AND c.seq = v.seq WHERE c.status = 'pending'",
                        [k[0] for k in keys],
                        [k[1] for k in keys],
                    )
                    keys = sorted((row["run_id"], row["seq"]) for row in still)
            except Exception as exc:
                if not is_row_error(exc):
                    raise
                # One row refused (an id PostgreSQL cannot store) undid the
                # statement: write each alone, so only that beat is lost.
        for run_id, seq in keys:
            at, progress = merged[(run_id, seq)]
            try:
                if await self._db.pool().fetchval(_RECORD_BEAT, at, progress, run_id, seq):
                    written.add((run_id, seq))
            except Exception as exc:
                if not is_row_error(exc):
                    raise
        return [
            index not in refused and (b.run_id, b.seq) in written for index, b in enumerate(beats)
        ]

    async def try_admit(self, request: Admission, now: int) -> int | None:
        """A slot for the step, or when to ask again: one transaction holding
        the queue's advisory lock, so racing askers fleet-wide are serialised."""
        queue, step_id = request.queue, request.step_id
        key = request.fairness_key if request.fairness_key is not None else request.run_id
        window = now - request.rate_period_ms
        async with self._db.transaction() as conn:
            await conn.execute(_LOCK_TOKEN, _flow_lock(queue))
            # Free the slots of runs that ended without freeing them (their
            # process died between the terminal write and the release).
            await conn.execute(_FREE_ENDED_SLOTS, queue, now, _TERMINAL)
            row = await conn.fetchrow(
                _ASK_FOR_SLOT,
                queue,
                step_id,
                now - 3 * request.retry_ms,
                window,
                request.run_id,
                request.priority,
                key,
                now,
                now if request.enqueued_at is None else request.enqueued_at,
            )
            if row["mine"]:
                return None
            free: int | None = None
            if request.concurrency is not None:
                free = request.concurrency - row["held"]
            if request.rate_limit is not None:
                by_rate = request.rate_limit - row["recent"]
                free = by_rate if free is None else min(free, by_rate)
            admitted = free is None
            ahead: list[str] = []
            if free is not None and free > 0:
                first = await conn.fetch(_WAITERS_IN_ORDER, queue, free)
                admitted = any(waiter["step_id"] == step_id for waiter in first)
                ahead = [waiter["run_id"] for waiter in first]
            if admitted:
                await conn.execute(_TAKE_SLOT, queue, step_id, request.run_id, key, now)
                return None
        if ahead:
            # Room, but for waiters ahead of this one: wake them, in case the
            # release that made the room woke nobody (it found its slot freed).
            await self._wake_waiters(ahead, now)
        return now + request.retry_ms

    async def release_slots(self, run_id: str, now: int) -> int:
        """Free the run's slots, drop its waiters, wake each queue's next waiter."""
        async with self._db.transaction() as conn:
            touched = await conn.fetch(
                "SELECT queue FROM durably_flow_slots WHERE run_id = $1 AND released_at IS NULL "
                "UNION SELECT queue FROM durably_flow_waiters WHERE run_id = $1",
                run_id,
            )
            await _lock_queues(conn, {row["queue"] for row in touched})
            rows = await conn.fetch(
                "WITH freed AS (UPDATE durably_flow_slots SET released_at = $2 "
                "WHERE run_id = $1 AND released_at IS NULL RETURNING queue), "
                "dropped AS (DELETE FROM durably_flow_waiters WHERE run_id = $1 RETURNING queue) "
                "SELECT queue, true AS freed FROM freed "
                "UNION ALL SELECT queue, false FROM dropped",
                run_id,
                now,
            )
            waiter_runs = await _first_waiters(conn, {row["queue"] for row in rows})
        await self._wake_waiters(waiter_runs, now)
        return sum(1 for row in rows if row["freed"])

    async def _wake_waiters(self, run_ids: list[str], now: int) -> None:
        """Stamp the wakes of the runs first in line for freed slots. After the
        commit, one statement each: holding our runs' locks while taking others'
        could deadlock against a settle of those runs waking ours. A wake lost
        to a crash just here costs the waiter its ``retry_ms``."""
        pool = self._db.pool()
        for run_id in sorted(set(run_ids)):
            await pool.execute(_WAKE_RUN, now, run_id, _TERMINAL, self.channel)

    # -- signals -------------------------------------------------------------------------

    async def wait_signal(
        self, checkpoint: Checkpoint, token: str, owner: str, now: int
    ) -> SignalWait | None:
        """Consume a buffered signal or register the waiter."""
        async with self._db.transaction() as conn:
            await conn.execute(_LOCK_TOKEN, token)
            if not await conn.fetchval(_HOLD_LEASE, checkpoint.run_id, owner):
                return None
            row = await conn.fetchrow(
                "DELETE FROM durably_buffered_signals WHERE id = ("
                " SELECT id FROM durably_buffered_signals WHERE token = $1 ORDER BY id LIMIT 1"
                ") RETURNING payload",
                token,
            )
            if row is not None:
                await conn.execute(_UPSERT_CHECKPOINT, *completed_params(checkpoint, row[0], now))
                return SignalWait(True, codec.loads(row[0]))
            await conn.execute(
                # A wait registered again keeps its place in line.
                "INSERT INTO durably_signal_waiters (token, run_id, seq) VALUES ($1, $2, $3) "
                "ON CONFLICT (run_id, seq, token) DO NOTHING",
                token,
                checkpoint.run_id,
                checkpoint.seq,
            )
            await conn.execute(_UPSERT_CHECKPOINT, *checkpoint_params(checkpoint))
            return SignalWait(False)

    async def send_signal(self, token: str, payload: Any, now: int) -> str | None:
        """Deliver to the oldest waiter, or buffer."""
        text = codec.dumps(payload)
        async with self._db.transaction() as conn:
            await conn.execute(_LOCK_TOKEN, token)
            waiter = await _take_oldest_waiter(conn, token)
            if waiter is None:
                await conn.execute(
                    "INSERT INTO durably_buffered_signals (token, payload, created_at) "
                    "VALUES ($1, $2, $3)",
                    token,
                    text,
                    now,
                )
                return None
            run_id, seq = str(waiter["run_id"]), int(waiter["seq"])
            status = await conn.execute(
                "UPDATE durably_checkpoints SET status = 'completed', output = $1, "
                "finished_at = $2 WHERE run_id = $3 AND seq = $4 AND status <> 'completed'",
                text,
                now,
                run_id,
                seq,
            )
            if _row_count(status) == 0:
                base = Checkpoint(
                    run_id, seq, f"signal:{token}", CheckpointKind.SIGNAL, CheckpointStatus.PENDING
                )
                await conn.execute(_UPSERT_CHECKPOINT, *completed_params(base, text, now))
            return run_id

    async def cancel_signal_wait(
        self, run_id: str, seq: int, token: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """Time a wait out unless a signal won the race."""
        async with self._db.transaction() as conn:
            await conn.execute(_LOCK_TOKEN, token)
            return await _time_out_wait(
                conn,
                run_id,
                seq,
                error,
                now,
                "DELETE FROM durably_signal_waiters WHERE token = $1 AND run_id = $2 AND seq = $3",
                (token, run_id, seq),
            )

    async def list_buffered_signals(self, token: str) -> list[Any]:
        """Buffered payloads for ``token``."""
        rows = await self._db.pool().fetch(
            "SELECT payload FROM durably_buffered_signals WHERE token = $1 ORDER BY id", token
        )
        return [codec.loads(row[0]) for row in rows]

    # -- events --------------------------------------------------------------------------
    # wait_event, publish_event and cancel_event_wait hold the advisory lock of
    # the event name (salted apart from signal tokens) for their transaction.

    async def wait_event(
        self,
        checkpoint: Checkpoint,
        name: str,
        match: dict[str, Any] | None,
        owner: str,
        now: int,
    ) -> SignalWait | None:
        """Consume the oldest matching buffered event or register the waiter."""
        keys, text = match_index(match)
        async with self._db.transaction() as conn:
            await conn.execute(_LOCK_TOKEN, _event_lock(name))
            if not await conn.fetchval(_HOLD_LEASE, checkpoint.run_id, owner):
                return None
            found = await _take_buffered_event(conn, name, keys, text)
            if found is not None:
                await conn.execute(_UPSERT_CHECKPOINT, *completed_params(checkpoint, found, now))
                return SignalWait(True, codec.loads(found))
            await conn.execute(
                "INSERT INTO durably_event_waiters "
                "(run_id, seq, name, match_keys, match, created_at) "
                "VALUES ($1, $2, $3, $4, $5, $6) "
                "ON CONFLICT (run_id, seq) DO UPDATE SET name = excluded.name, "
                "match_keys = excluded.match_keys, match = excluded.match",
                checkpoint.run_id,
                checkpoint.seq,
                name,
                keys,
                text,
                now,
            )
            await conn.execute(_UPSERT_CHECKPOINT, *checkpoint_params(checkpoint))
            return SignalWait(False)

    async def publish_event(
        self,
        name: str,
        payload: Any,
        now: int,
        *,
        event_id: str | None = None,
        buffer: bool = True,
        triggered: int = 0,
    ) -> EventDelivery:
        """Deliver to every matching waiter, or buffer one copy."""
        text = codec.dumps(payload)
        value = codec.loads(text)
        async with self._db.transaction() as conn:
            await conn.execute(_LOCK_TOKEN, _event_lock(name))
            if event_id is not None:
                # the row lock of a racing publish with this id (any name) decides
                fresh = await conn.fetchval(
                    "INSERT INTO durably_published_events (id, name, recipients, published_at) "
                    "VALUES ($1, $2, 0, $3) ON CONFLICT (id) DO NOTHING RETURNING true",
                    event_id,
                    name,
                    now,
                )
                if not fresh:
                    seen = await conn.fetchval(
                        "SELECT recipients FROM durably_published_events WHERE id = $1", event_id
                    )
                    return EventDelivery([], int(seen or 0), duplicate=True)
            key_sets = await conn.fetch(
                "SELECT DISTINCT match_keys FROM durably_event_waiters WHERE name = $1", name
            )
            delivered: list[str] = []
            for row in key_sets:
                keys = str(row[0])
                projection = project(value, keys)
                if projection is None:
                    continue
                rows = await conn.fetch(
                    _DELIVER_EVENT, name, keys, projection, text, now, _TERMINAL
                )
                for got in sorted(str(r[0]) for r in rows):
                    if got not in delivered:
                        delivered.append(got)
            buffered = buffer and not delivered and not triggered
            if buffered:
                await conn.execute(
                    "INSERT INTO durably_buffered_events (name, event_id, payload, created_at) "
                    "VALUES ($1, $2, $3, $4)",
                    name,
                    event_id,
                    text,
                    now,
                )
            recipients = len(delivered) + triggered
            if event_id is not None:
                await conn.execute(
                    "UPDATE durably_published_events SET recipients = $1 WHERE id = $2",
                    recipients,
                    event_id,
                )
            return EventDelivery(delivered, recipients, buffered=buffered)

    async def cancel_event_wait(
        self, run_id: str, seq: int, name: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """Time an event wait out unless an event won the race."""
        async with self._db.transaction() as conn:
            await conn.execute(_LOCK_TOKEN, _event_lock(name))
            return await _time_out_wait(
                conn,
                run_id,
                seq,
                error,
                now,
                "DELETE FROM durably_event_waiters WHERE run_id = $1 AND seq = $2 AND name = $3",
                (run_id, seq, name),
            )

    async def list_buffered_events(self, name: str) -> list[Any]:
        """Buffered payloads on event ``name``."""
        rows = await self._db.pool().fetch(
            "SELECT payload FROM durably_buffered_events WHERE name = $1 ORDER BY id", name
        )
        return [codec.loads(row[0]) for row in rows]

    async def count_pending(self, namespace: str | None = None) -> int:
        """Pending runs (in ``namespace``)."""
        found = await self._db.pool().fetchval(
            f"SELECT count(*) FROM durably_runs WHERE {POLL_PENDING} "
            "AND ($1::text IS NULL OR namespace = $1)",
            namespace,
        )
        return int(found)

    async def count_flow_waiters(self) -> dict[str, int]:
        """Steps waiting for admission, by queue."""
        rows = await self._db.pool().fetch(
            "SELECT queue, count(*) AS n FROM durably_flow_waiters GROUP BY queue"
        )
        return {row["queue"]: int(row["n"]) for row in rows}

    async def expire_buffered(self, before: int, limit: int) -> int:
        """Delete up to ``limit`` buffered signals and events created before ``before``."""
        pool = self._db.pool()
        expired = 0
        for table in ("durably_buffered_signals", "durably_buffered_events"):
            rows = await pool.fetch(
                f"DELETE FROM {table} WHERE id IN ("  # one of two fixed table names
                f" SELECT id FROM {table} WHERE created_at < $1 ORDER BY id LIMIT $2"
                ") RETURNING id",
                before,
                limit - expired,
            )
            expired += len(rows)
        return expired

    # -- schedules -----------------------------------------------------------------------

    async def create_schedule(self, record: ScheduleRecord) -> tuple[ScheduleRecord, bool]:
        """Insert unless the name exists."""
        while True:
            inserted = await self._db.pool().fetchval(
                f"INSERT INTO durably_schedules ({SCHEDULE_COLUMNS}) "
                "VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11) "
                "ON CONFLICT (name) DO NOTHING RETURNING true",
                *schedule_params(record),
            )
            if inserted:
                return record, True
            existing = await self.get_schedule(record.name)
            if existing is not None:
                return existing, False
            # deleted between our insert and our read: try again

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        """The schedule, or ``None``."""
        row = await self._db.pool().fetchrow(
            f"SELECT {SCHEDULE_COLUMNS} FROM durably_schedules WHERE name = $1", name
        )
        return schedule_from_row(row) if row is not None else None

    async def list_schedules(self, namespace: str | None = None) -> list[ScheduleRecord]:
        """Schedules by name."""
        rows = await self._db.pool().fetch(
            f"SELECT {SCHEDULE_COLUMNS} FROM durably_schedules "
            "WHERE $1::text IS NULL OR namespace = $1 ORDER BY name",
            namespace,
        )
        return [schedule_from_row(row) for row in rows]

    async def list_due_schedules(
        self, namespace: str, now: int, limit: int, workflows: list[str] | None = None
    ) -> list[ScheduleRecord]:
        """Schedules with a window due or a start to confirm."""
        rows = await self._db.pool().fetch(
            f"SELECT {SCHEDULE_COLUMNS} FROM durably_schedules WHERE namespace = $1 AND "
            "((NOT paused AND next_fire_at <= $2) OR firing_run_id IS NOT NULL) "
            "AND ($4::text[] IS NULL OR (spec::jsonb ->> 'workflow') = ANY($4::text[])) "
            "ORDER BY next_fire_at NULLS FIRST, name LIMIT $3",
            namespace,
            now,
            limit,
            workflows,
        )
        return [schedule_from_row(row) for row in rows]

    async def update_schedule(
        self, name: str, changes: dict[str, Any], now: int, *, revision: int | None = None
    ) -> ScheduleRecord | None:
        """Apply ``changes`` (compare-and-set on ``revision`` when given)."""
        check_schedule_changes(changes)
        params: list[Any] = []
        sets: list[str] = []
        for column, value in changes.items():
            params.append(schedule_column_value(column, value))
            sets.append(f"{column} = ${len(params)}")
        params.extend([now, name])
        sets.append(f"revision = revision + 1, updated_at = ${len(params) - 1}")
        guard = ""
        if revision is not None:
            params.append(revision)
            guard = f" AND revision = ${len(params)}"
        row = await self._db.pool().fetchrow(
            f"UPDATE durably_schedules SET {', '.join(sets)} "
            f"WHERE name = ${len(params) - (1 if revision is not None else 0)}{guard} "
            f"RETURNING {SCHEDULE_COLUMNS}",
            *params,
        )
        return schedule_from_row(row) if row is not None else None

    async def delete_schedule(self, name: str) -> bool:
        """Delete a schedule."""
        done = await self._db.pool().fetchval(
            "DELETE FROM durably_schedules WHERE name = $1 RETURNING true", name
        )
        return bool(done)

    # -- helpers ---------------------------------------------------------------------------

    async def _ids(self, sql: str, *params: Any) -> list[str]:
        return [str(row[0]) for row in await self._db.pool().fetch(sql, *params)]


async def _take_oldest_waiter(conn: Any, token: str) -> Any:
    """Delete and return the oldest waiter on ``token`` (``None``: nobody waits).

    New waiters need the token's advisory lock, which the caller holds, but a
    run ending deletes its waiters without it: under READ COMMITTED the oldest
    row picked may vanish before the DELETE reaches it, and the statement then
    deletes nothing although younger waiters remain. ``picked`` tells that
    race (a row was seen, none deleted) from an empty line, in the same round
    trip; the race retries on a fresh snapshot, so it never buffers a signal
    that a live waiter should have had."""
    while True:
        row = await conn.fetchrow(_TAKE_OLDEST_WAITER, token)
        if row["run_id"] is not None:
            return row
        if not row["picked"]:
            return None


@functools.lru_cache(maxsize=64)
def _cached_keys(workflows: Executable) -> list[str]:
    return sorted(f"{name}\x1f{version}" for name, version in workflows)


def _keys(workflows: Executable | None) -> list[str] | None:
    """The one array parameter of a ``(workflow, version)`` filter (``None``:
    no filter); cached, since an engine passes the same set on every claim."""
    if workflows is None:
        return None
    return _cached_keys(workflows)


async def _time_out_wait(
    conn: Any,
    run_id: str,
    seq: int,
    error: ErrorInfo,
    now: int,
    forget_waiter: str,
    waiter_params: tuple[Any, ...],
) -> Checkpoint | None:
    """A signal or event wait timed out (inside the caller's transaction and
    advisory lock): return the checkpoint if a delivery won the race, else
    forget exactly this waiter and fail the checkpoint."""
    row = await conn.fetchrow(
        f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = $1 AND seq = $2 FOR UPDATE",
        run_id,
        seq,
    )
    if row is not None and row["status"] == CheckpointStatus.COMPLETED.value:
        return checkpoint_from_row(row)
    await conn.execute(forget_waiter, *waiter_params)
    await conn.execute(
        "UPDATE durably_checkpoints SET status = 'failed', error = $1, finished_at = $2 "
        "WHERE run_id = $3 AND seq = $4 AND status <> 'completed'",
        codec.dumps(error),
        now,
        run_id,
        seq,
    )
    return None


_DELIVER_EVENT = """
    WITH taken AS (
        DELETE FROM durably_event_waiters
        WHERE name = $1 AND match_keys = $2 AND match = $3
        RETURNING run_id, seq
    )
    UPDATE durably_checkpoints AS cp
    SET status = 'completed', output = $4, finished_at = $5
    FROM taken
    WHERE cp.run_id = taken.run_id AND cp.seq = taken.seq
        AND cp.kind = 'event' AND cp.status = 'pending'
        AND EXISTS (
            SELECT 1 FROM durably_runs AS r
            WHERE r.id = cp.run_id AND r.status <> ALL($6::text[])
        )
    RETURNING cp.run_id
"""
"""Take the waiters on ``(name, match_keys, match)`` and complete the waits
of those whose run is live, in one statement; returns those runs."""


def _flow_lock(queue: str) -> str:
    """The advisory-lock key of a flow-control queue, apart from tokens and events."""
    return f"durably:flow:{queue}"


def _history(run_id: str, text: str, since: int = 0) -> dict[int, Checkpoint]:
    """Decode what :func:`_history_from` selected (each item the
    checkpoint's columns after ``run_id``), read from ``since``."""
    items = codec.loads(text)
    if since <= 0:
        return {item[0]: checkpoint_from_row((run_id, *item)) for item in items}
    return read_tail(since, ((item[0], checkpoint_from_row((run_id, *item))) for item in items))


def _agreed_holders(entries: list[Resolution]) -> dict[str, str]:
    """The owner of the held turn each run's entries name, for the runs whose
    entries all name the same one (as :func:`_held_owners` decides it)."""
    held: dict[str, str | None] = {}
    for r in entries:
        held[r.run_id] = r.held_by if held.get(r.run_id, r.held_by) == r.held_by else None
    return {run_id: owner for run_id, owner in held.items() if owner is not None}


def _held_owners(entries: list[Resolution], run_ids: list[str]) -> list[str | None]:
    """Per run of ``run_ids``, the owner of the held turn its entries name
    (``Resolution.held_by``), ``None`` if they name none or differ: parallel
    to ``run_ids``, the ``held_by`` array of :data:`_WAKE_RUNS`."""
    wanted = set(run_ids)
    held: dict[str, str | None] = {}
    for r in entries:
        if r.run_id in wanted:
            held[r.run_id] = r.held_by if held.get(r.run_id, r.held_by) == r.held_by else None
    return [held.get(run_id) for run_id in run_ids]


def _positions(
    read_from: ReadFrom | None, run_ids: list[str]
) -> tuple[Callable[[str], int], list[int] | None]:
    """Where each of ``run_ids`` is read from, asked once each: the lookup,
    and the array parallel to ``run_ids`` the batch statements take as $7."""
    if read_from is None:
        return lambda _run_id: 0, None
    froms = {run_id: max(0, read_from(run_id)) for run_id in run_ids}
    return froms.__getitem__, [froms[run_id] for run_id in run_ids]


_WAKE_RUN = (
    "UPDATE durably_runs SET wake_requested_at = $1 "
    "WHERE id = $2 AND status <> ALL($3::text[]) "
    f"RETURNING (SELECT pg_notify($4, '{StoreNotice.WAKE}:' || {notice_argument('id')})) IS NULL"
)

_RECORD_BEAT = (
    "UPDATE durably_checkpoints SET "
    "last_heartbeat_at = greatest(last_heartbeat_at, $1::bigint), "
    "progress = coalesce($2::text, progress) "
    "WHERE run_id = $3 AND seq = $4 AND status = 'pending' RETURNING true"
)

_RECORD_BEATS = """
    WITH v AS (
        SELECT * FROM unnest($1::text[], $2::integer[], $3::bigint[], $4::text[])
            AS v(run_id, seq, at, progress)
    ), free AS (
        SELECT c.run_id, c.seq FROM durably_checkpoints c
        JOIN v ON c.run_id = v.run_id AND c.seq = v.seq
        WHERE c.status = 'pending'
        ORDER BY c.run_id, c.seq
        FOR UPDATE OF c SKIP LOCKED
    )
    UPDATE durably_checkpoints c SET
        last_heartbeat_at = greatest(c.last_heartbeat_at, v.at),
        progress = coalesce(v.progress, c.progress)
    FROM v, free
    WHERE c.run_id = free.run_id AND c.seq = free.seq
        AND v.run_id = c.run_id AND v.seq = c.seq AND c.status = 'pending'
    RETURNING c.run_id, c.seq
"""
""":data:`_RECORD_BEAT` for many steps (each named once) in one statement. It
skips the rows another transaction holds (a result being settled, a turn's
write): waiting on them while holding the others could deadlock against that
transaction; the caller writes those alone."""

# The results consumer's claim, settle and ack in one: the rows are deleted in
# the settle's transaction (rolled back with it), and SKIP LOCKED leaves the
# rows another consumer's open transaction took to it.
# The served tasks named in $4 (whose results this settle carries) go too.
_DELETE_MESSAGES = "DELETE FROM durably_messages WHERE id = ANY($1::bigint[])"

_TAKE_MESSAGES = """
    DELETE FROM durably_messages
    WHERE id = ANY($4::bigint[]) OR id IN (
        SELECT id FROM durably_messages
        WHERE topic = ANY($1::text[]) AND available_at <= $2
            AND (claimed_until IS NULL OR claimed_until < $2)
        ORDER BY priority DESC, id
        LIMIT $3
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id, topic, body, priority, deliveries + 1 AS deliveries,
        id = ANY($4::bigint[]) AS deleted
"""

_LEASE_AND_WAKE = (
    "WITH r AS (UPDATE durably_runs SET status = 'running', locked_by = $1, "
    "locked_until = $2, wake_requested_at = NULL, wake_at = NULL, updated_at = $3 "
    "WHERE id = ANY($4::text[]) AND status = ANY($5::text[]) "
    "AND (locked_by IS NULL OR locked_until IS NULL OR locked_until < $3) "
    f"AND ($6::text[] IS NULL OR {_KEY} = ANY($6::text[])) "
    f"RETURNING {_SELECT_RUN}), "
    # The runs to wake that the lease did not take: the statement's snapshot
    # shows every row as it was before ``r``, so a row ``r`` leased is left out
    # here, not written twice; any other row is as the lease left it.
    "w AS (UPDATE durably_runs x SET wake_requested_at = $3 "
    "FROM unnest($8::text[], $9::text[]) AS v(run_id, held_by) "
    "WHERE x.id = v.run_id AND x.id NOT IN (SELECT id FROM r) "
    "AND x.status <> ALL($10::text[]) "
    "AND NOT coalesce(x.locked_by = v.held_by AND x.locked_until > $3, false) "
    f"RETURNING (SELECT pg_notify($11, '{StoreNotice.WAKE}:' || {notice_argument('x.id')})) "
    "IS NULL) "
    # The one-time filter runs ``w`` (and with it ``r``) before the rows are read.
    f"SELECT r.*, {_HISTORY} AS history FROM r WHERE (SELECT count(*) FROM w) >= 0"
)
"""Lease the runs a resolution woke (their rows locked by the resolving
transaction), with their histories, as ``start_turns`` does, and stamp the
wake of those it did not lease as :data:`_WAKE_RUNS` does, in one round
trip: $8 every run to wake (the first ones, $4, offered to the lease), $9
their held turns' owners, $10 the terminal statuses, $11 the channel."""

_WAKE_RUNS = (
    "UPDATE durably_runs r SET wake_requested_at = $1 "
    "FROM unnest($2::text[], $5::text[]) AS v(run_id, held_by) "
    "WHERE r.id = v.run_id AND r.status <> ALL($3::text[]) "
    # Not while the held turn that takes the result holds the lease.
    "AND NOT coalesce(r.locked_by = v.held_by AND r.locked_until > $1, false) "
    f"RETURNING (SELECT pg_notify($4, '{StoreNotice.WAKE}:' || {notice_argument('r.id')})) IS NULL"
)
""":data:`_WAKE_RUN` for many runs in one statement (one notice each)."""

# The waiters of a queue in admission order: priority, then the fairness key
# holding the fewest slots, then the oldest (the step id breaks ties).
_WAITERS_IN_ORDER = """
    SELECT w.step_id, w.run_id FROM durably_flow_waiters w
    LEFT JOIN (
        SELECT fairness_key, count(*) AS held FROM durably_flow_slots
        WHERE queue = $1 AND released_at IS NULL GROUP BY fairness_key
    ) h ON h.fairness_key = w.fairness_key
    WHERE w.queue = $1
    ORDER BY w.priority DESC, coalesce(h.held, 0), w.enqueued_at, w.step_id
    LIMIT $2
"""

# try_admit under the queue's lock, in one statement: does the step hold a
# slot already; drop waiters unseen for 3 * retry_ms ($3) and released slots
# older than the rate window ($4); register (or refresh) the asker as a
# waiter, keeping its place unless it had expired; count the held slots and
# the admissions within the window. (The counts, taken from the statement's
# snapshot, are unchanged by the pruning: pruned slots count in neither.)
_ASK_FOR_SLOT = """
    WITH mine AS (
        SELECT EXISTS (
            SELECT 1 FROM durably_flow_slots
            WHERE queue = $1 AND step_id = $2 AND released_at IS NULL
        ) AS held
    ), pruned_waiters AS (
        DELETE FROM durably_flow_waiters WHERE queue = $1 AND seen_at < $3 AND step_id <> $2
    ), pruned_slots AS (
        DELETE FROM durably_flow_slots
        WHERE queue = $1 AND released_at IS NOT NULL AND acquired_at <= $4
    ), waiting AS (
        INSERT INTO durably_flow_waiters
            (queue, step_id, run_id, priority, fairness_key, enqueued_at, seen_at)
        SELECT $1, $2, $5, $6, $7, $9, $8 FROM mine WHERE NOT mine.held
        ON CONFLICT (queue, step_id) DO UPDATE SET
            run_id = excluded.run_id, priority = excluded.priority,
            fairness_key = excluded.fairness_key, seen_at = excluded.seen_at,
            enqueued_at = CASE WHEN durably_flow_waiters.seen_at < $3
                THEN excluded.enqueued_at ELSE durably_flow_waiters.enqueued_at END
    )
    SELECT (SELECT held FROM mine) AS mine,
        count(*) FILTER (WHERE released_at IS NULL) AS held,
        count(*) FILTER (WHERE acquired_at > $4) AS recent
    FROM durably_flow_slots WHERE queue = $1
"""

_FREE_ENDED_SLOTS = """
    UPDATE durably_flow_slots s SET released_at = $2 FROM durably_runs r
    WHERE s.queue = $1 AND s.released_at IS NULL AND r.id = s.run_id
      AND r.status = ANY($3::text[])
"""

_TAKE_SLOT = """
    WITH admitted AS (DELETE FROM durably_flow_waiters WHERE queue = $1 AND step_id = $2)
    INSERT INTO durably_flow_slots (queue, step_id, run_id, fairness_key, acquired_at)
    VALUES ($1, $2, $3, $4, $5)
    ON CONFLICT (queue, step_id) DO UPDATE SET
        run_id = excluded.run_id, fairness_key = excluded.fairness_key,
        acquired_at = excluded.acquired_at, released_at = NULL
"""


async def _lock_queues(conn: Any, queues: set[str]) -> None:
    """Take the advisory locks ``try_admit`` takes, in a fixed order (no deadlock).

    Without them, an asker refused because a slot was still held could register
    as a waiter in a transaction this release cannot see yet: the release finds
    nobody to wake and the asker sleeps its whole ``retry_ms``.
    """
    for queue in sorted(queues):
        await conn.execute(_LOCK_TOKEN, _flow_lock(queue))


async def _first_waiters(conn: Any, queues: set[str]) -> list[str]:
    """The runs whose steps are first in line for each of ``queues``."""
    runs: list[str] = []
    for queue in sorted(queues):
        row = await conn.fetchrow(_WAITERS_IN_ORDER, queue, 1)
        if row is not None:
            runs.append(row["run_id"])
    return runs


def _event_lock(name: str) -> str:
    """The advisory-lock key of an event name, apart from any signal token."""
    return f"durably:event:{name}"


async def _take_buffered_event(conn: Any, name: str, keys: str, match: str) -> str | None:
    """Delete and return (as JSON text) the oldest buffered event on ``name``
    matching ``(keys, match)``, or ``None``. The caller holds the name's lock."""
    if keys == "[]":
        row = await conn.fetchrow(
            "DELETE FROM durably_buffered_events WHERE id = ("
            " SELECT id FROM durably_buffered_events WHERE name = $1 ORDER BY id LIMIT 1"
            ") RETURNING payload",
            name,
        )
        return str(row[0]) if row is not None else None
    after = 0
    while True:
        rows = await conn.fetch(
            "SELECT id, payload FROM durably_buffered_events WHERE name = $1 AND id > $2 "
            "ORDER BY id LIMIT 200",
            name,
            after,
        )
        for row in rows:
            if project(codec.loads(row["payload"]), keys) == match:
                await conn.execute("DELETE FROM durably_buffered_events WHERE id = $1", row["id"])
                return str(row["payload"])
        if len(rows) < 200:
            return None
        after = rows[-1]["id"]


def list_runs_sql(query: RunQuery) -> tuple[str, list[Any]]:
    """The statement ``list_runs`` runs for ``query``, with its parameters
    (a test ``EXPLAIN``s it to prove the indexes serve it)."""
    params: list[Any] = []
    clauses = _run_filter(query, params)
    after = decode_cursor(query.cursor)
    if after is not None:
        params.extend(after)
        clauses.append(f"(created_at, id) < (${len(params) - 1}::bigint, ${len(params)})")
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    params.append(query.limit + 1)
    sql = (
        f"SELECT {_SELECT_RUN} FROM durably_runs {where} "
        f"ORDER BY created_at DESC, id DESC LIMIT ${len(params)}"
    )
    return sql, params


def _attribute_rows(run_id: str, values: dict[str, Any] | None) -> list[tuple[Any, ...]]:
    return [(run_id, key, *attrcodec.encode(value)) for key, value in (values or {}).items()]


def _row_count(status: str) -> int:
    """The row count of an asyncpg command tag (``UPDATE 3`` → 3)."""
    tail = status.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _run_filter(query: RunQuery, params: list[Any]) -> list[str]:
    # The WHERE clauses of list_runs and count_runs, their values appended to
    # params; each one an index serves (see the schema's migrations 1, 8 and 14).
    clauses: list[str] = []

    def param(value: Any) -> str:
        params.append(value)
        return f"${len(params)}"

    if query.status is not None:
        clauses.append(status_match([RunStatus(query.status).value]))
    for column, value in (
        ("workflow", query.workflow),
        ("namespace", query.namespace),
        ("parent_id", query.parent_id),
    ):
        if value is not None:
            clauses.append(f"{column} = {param(value)}")
    if query.tag is not None:
        # the second clause matches the tag index's predicate (untagged runs
        # are not in it) and changes no answer: a run with a tag has tags
        clauses.append(f"tags @> {param(codec.dumps([query.tag]))}::jsonb AND tags <> '[]'::jsonb")
    if query.statuses is not None:
        clauses.append(status_match(RunStatus(st).value for st in query.statuses))
    for flt in query.attributes:
        # One probe of the (key, value) index per condition (migration 9); a
        # run without the key has no row, so it never matches (not even ne).
        clauses.append(
            "EXISTS (SELECT 1 FROM durably_run_attributes a WHERE a.run_id = durably_runs.id "
            f"AND a.key = {param(flt.key)} AND a.type = ANY({param(list(flt.types))}::text[]) "
            f"AND a.{flt.column} {attrcodec.OPS[flt.op]} {param(flt.value)})"
        )
    if query.run_id_prefix:
        clauses.append(f'id COLLATE "C" >= {param(query.run_id_prefix)}')
        bound = prefix_bound(query.run_id_prefix)
        if bound is not None:
            clauses.append(f'id COLLATE "C" < {param(bound)}')
    if query.created_after is not None:
        clauses.append(f"created_at >= {param(query.created_after)}::bigint")
    if query.created_before is not None:
        clauses.append(f"created_at < {param(query.created_before)}::bigint")
    return clauses


def _update_from_row(row: Any) -> UpdateRecord:
    return UpdateRecord(
        row["run_id"],
        row["update_id"],
        row["name"],
        codec.loads(row["payload"]),
        row["created_at"],
        codec.loads(row["answer"]),
        row["answered_at"],
    )
