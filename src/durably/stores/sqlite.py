"""The embedded default store: one SQLite file in WAL mode.

Zero setup: ``Engine()`` opens ``./durably.db``. Several processes may share
the file (SQLite serialises writers; ``busy_timeout`` waits instead of failing),
which is how the crash tests and a small multi-process deployment run. Every
call is executed on one thread per store with group commit
(:mod:`._sqlite_thread`), so the event loop never blocks on the database.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import os
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from .. import _attributes as attrcodec
from .. import _codec as codec
from .._queue import Message, OutMessage, SettledMessages
from .._urls import redact_url
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
from ._sqlite_messages import SqliteMessageQueue, free_messages, insert_messages
from ._sqlite_schema import MIGRATIONS
from ._sqlite_thread import SqliteThread
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

__all__ = ["SqliteStore", "sqlite_path_from_url"]

_TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL_STATUSES))
# The stranded signature (StateStore.list_stalled): ?1 before, ?2 limit, ?3
# namespace or NULL. The wait branch reads progress from the checkpoints, not
# from updated_at, which every reconcile turn bumps without progressing.
_STALLED = """
    SELECT r.id FROM durably_runs r
    WHERE r.status IN ('suspended', 'running')
    AND (?3 IS NULL OR r.namespace = ?3) AND (
        EXISTS (
            SELECT 1 FROM durably_checkpoints c
            WHERE c.run_id = r.id AND c.status = 'pending' AND c.dispatched_at < ?1
                AND COALESCE(c.last_heartbeat_at, 0) < ?1
        )
        OR (
            r.status = 'suspended'
            AND NOT EXISTS (
                SELECT 1 FROM durably_checkpoints c
                WHERE c.run_id = r.id AND (
                    (c.status = 'pending'
                        AND NOT (c.kind IN ('signal', 'event') AND c.wake_at IS NULL))
                    OR c.started_at >= ?1 OR c.finished_at >= ?1
                )
            )
            AND (
                (r.wake_at IS NULL AND r.updated_at < ?1)
                OR EXISTS (
                    SELECT 1 FROM durably_checkpoints c
                    WHERE c.run_id = r.id AND c.status = 'pending'
                        AND c.kind IN ('signal', 'event')
                )
            )
        )
    )
    ORDER BY r.updated_at, r.id LIMIT ?2
"""
_UPSERT_CHECKPOINT = f"""
    INSERT INTO durably_checkpoints ({CP_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
    ON CONFLICT (run_id, seq) DO UPDATE SET
        name = excluded.name, kind = excluded.kind, status = excluded.status,
        input = excluded.input, output = excluded.output, error = excluded.error,
        attempts = excluded.attempts, wake_at = excluded.wake_at,
        started_at = excluded.started_at, finished_at = excluded.finished_at,
        parallel_group = excluded.parallel_group, dispatched_at = excluded.dispatched_at,
        redispatches = excluded.redispatches, queue = excluded.queue,
        last_heartbeat_at = coalesce(
            max(excluded.last_heartbeat_at, durably_checkpoints.last_heartbeat_at),
            excluded.last_heartbeat_at, durably_checkpoints.last_heartbeat_at),
        progress = coalesce(excluded.progress, durably_checkpoints.progress)
    WHERE durably_checkpoints.status != 'completed'
"""
_INSERT_CHECKPOINT = f"""
    INSERT INTO durably_checkpoints ({CP_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
    ON CONFLICT (run_id, seq) DO NOTHING
"""
_UPSERT_ATTRIBUTE = """
    INSERT INTO durably_run_attributes (run_id, key, type, str_value, num_value)
    VALUES (?, ?, ?, ?, ?)
    ON CONFLICT (run_id, key) DO UPDATE SET
        type = excluded.type, str_value = excluded.str_value, num_value = excluded.num_value
"""
_HOLDS_LEASE = "SELECT 1 FROM durably_runs WHERE id = ? AND locked_by = ?"


_UPDATE_COLUMNS = "run_id, update_id, name, payload, created_at, answer, answered_at"


def _update_from_row(row: Any) -> UpdateRecord:
    run_id, update_id, name, payload, created_at, answer, answered_at = row
    return UpdateRecord(
        run_id,
        update_id,
        name,
        None if payload is None else codec.loads(payload),
        created_at,
        None if answer is None else codec.loads(answer),
        answered_at,
    )


def sqlite_path_from_url(url: str) -> str:
    """``sqlite:///rel.db`` → ``rel.db``; ``sqlite:////abs.db`` → ``/abs.db``;
    ``sqlite://:memory:`` → ``:memory:``; a bare path is returned as is."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    if parts.scheme != "sqlite":
        raise ValueError(f"not a sqlite URL: {redact_url(url)!r}")
    if parts.netloc == ":memory:" or url == "sqlite://":
        return ":memory:"
    path = unquote(parts.path)
    path = path[1:] if path.startswith("/") else path
    if not path:
        raise ValueError(f"the sqlite URL {redact_url(url)!r} names no file")
    return path


class SqliteStore:
    """A :class:`~durably.stores.base.StateStore` in one SQLite file."""

    def __init__(self, url: str = "sqlite:///durably.db", *, busy_timeout_ms: int = 30_000) -> None:
        self.url = url
        self.path = sqlite_path_from_url(url)
        self.ordered_writes = True  # one connection, one thread, FIFO
        self._db = SqliteThread(self.path, busy_timeout_ms=busy_timeout_ms)
        self._opened = False
        self._messages: SqliteMessageQueue | None = None
        self._identity: tuple[int, int] | None = None

    async def open(self) -> None:
        """Open the file (creating its folder) and migrate the schema."""
        if self._opened:
            return
        if self.path != ":memory:":
            folder = os.path.dirname(os.path.abspath(self.path))  # noqa: ASYNC240 - no I/O
            os.makedirs(folder, exist_ok=True)
        self._db.start()
        self._opened = True
        await self._db.run(_migrate)
        self._db.gone = None
        if self.path != ":memory:":
            found = os.stat(self.path)
            self._identity = (found.st_dev, found.st_ino)

    def check_file(self) -> str | None:
        """Whether the path still names the file this store has open.

        A file deleted (or replaced) under a running process stays writable
        through the open connection, and every write then vanishes with the
        process. Returns the problem in one sentence once that happened, and
        from then on every call to the store raises ``FileNotFoundError``
        (nothing more is written where it would be lost); ``None`` while fine.
        """
        if self._identity is None:
            return self._db.gone
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            problem = "was deleted"
        else:
            if (found.st_dev, found.st_ino) == self._identity:
                return None
            problem = "was replaced by another file"
        self._identity = None
        self._db.gone = (
            f"the SQLite file {self.path} {problem} while this process had it open; "
            "durably stopped writing to it (anything written now would be lost): "
            "restore the file and restart the process"
        )
        return self._db.gone

    async def close(self) -> None:
        """Flush and close."""
        self._opened = False
        await self._db.stop()

    async def subscribe(self, on_event: Callable[[str, str], None]) -> bool:
        """No cross-process channel: the engine polls."""
        return False

    def messages(self) -> SqliteMessageQueue:
        """The message queue in this file (the ``db`` transport's), made on first use."""
        if self._messages is None:
            self._messages = SqliteMessageQueue(self._db, self.path)
        return self._messages

    # -- runs --------------------------------------------------------------------

    async def create_run(
        self, run: Run, attributes: dict[str, Any] | None = None
    ) -> tuple[Run, bool]:
        """Insert unless the id exists (with its search attributes)."""
        rows = _attribute_rows(run.run_id, attributes)

        def op(conn: sqlite3.Connection) -> tuple[Run, bool]:
            cur = conn.execute(
                f"INSERT INTO durably_runs ({RUN_COLUMNS}) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (id) DO NOTHING",
                run_params(run),
            )
            if cur.rowcount == 1:
                conn.executemany(_UPSERT_ATTRIBUTE, rows)
                return run, True
            existing = _fetch_run(conn, run.run_id)
            assert existing is not None
            return existing, False

        return await self._db.run(op)

    async def create_runs(self, runs: list[Run]) -> list[str]:
        """Insert the runs whose ids are new, in one transaction."""
        params = [run_params(run) for run in runs]

        def op(conn: sqlite3.Connection) -> list[str]:
            created: list[str] = []
            for row in params:
                cur = conn.execute(
                    f"INSERT INTO durably_runs ({RUN_COLUMNS}) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
                    "ON CONFLICT (id) DO NOTHING",
                    row,
                )
                if cur.rowcount == 1:
                    created.append(row[0])
            return created

        return await self._db.run(op)

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        return await self._db.run(lambda conn: _fetch_run(conn, run_id))

    async def get_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs that exist among ``run_ids``."""
        ids = list(dict.fromkeys(run_ids))

        def op(conn: sqlite3.Connection) -> list[Run]:
            found: list[Run] = []
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows = conn.execute(
                    f"SELECT {RUN_COLUMNS} FROM durably_runs WHERE id IN ({marks})", chunk
                )
                found.extend(run_from_row(row) for row in rows)
            return found

        return await self._db.run(op)

    async def get_run_statuses(self, run_ids: list[str]) -> dict[str, RunStatus]:
        """The status of each run that exists among ``run_ids`` (``RunStatusStore``)."""
        ids = list(dict.fromkeys(run_ids))

        def op(conn: sqlite3.Connection) -> dict[str, RunStatus]:
            found: dict[str, RunStatus] = {}
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                for run_id, status in conn.execute(
                    f"SELECT id, status FROM durably_runs WHERE id IN ({marks})", chunk
                ):
                    found[run_id] = run_status(status)
            return found

        return await self._db.run(op)

    async def watch_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs, as :meth:`get_runs` (no notices cross processes here:
        other processes find settles by polling)."""
        return await self.get_runs(run_ids)

    async def list_runs(self, query: RunQuery) -> RunPage:
        """Runs matching ``query``, newest first."""
        sql, params = list_runs_sql(query)

        def op(conn: sqlite3.Connection) -> RunPage:
            runs = [run_from_row(row) for row in conn.execute(sql, params)]
            if len(runs) <= query.limit:
                return RunPage(runs, None)
            runs = runs[: query.limit]
            return RunPage(runs, encode_cursor(runs[-1].created_at, runs[-1].run_id))

        return await self._db.run(op)

    async def count_runs(self, query: RunQuery, cap: int) -> dict[str, int]:
        """Runs matching ``query`` per status, each count at most ``cap``."""
        clauses, filter_params = _run_filter(dataclasses.replace(query, status=None, statuses=None))
        where = " AND ".join(["status = ?", *clauses])
        # One bounded probe per status, as PostgreSQL does.
        probe = f"SELECT count(*) FROM (SELECT 1 FROM durably_runs WHERE {where} LIMIT ?)"
        statuses = [s.value for s in RunStatus]
        sql = " UNION ALL ".join(f"SELECT ?, ({probe})" for _ in statuses)
        params: list[Any] = []
        for status in statuses:
            params.extend([status, status, *filter_params, cap])

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            return {status: n for status, n in conn.execute(sql, params) if n}

        return await self._db.run(op)

    async def list_queues(self) -> list[QueueState]:
        """Flow-control queues holding slots or waiters, by name."""

        def op(conn: sqlite3.Connection) -> list[QueueState]:
            held = conn.execute(
                "SELECT queue, count(*) FROM durably_flow_slots "
                "WHERE released_at IS NULL GROUP BY queue"
            )
            waiting = conn.execute(
                "SELECT queue, count(*), min(enqueued_at) FROM durably_flow_waiters GROUP BY queue"
            )
            return merge_queue_counts(
                {queue: n for queue, n in held},
                {queue: (n, oldest) for queue, n, oldest in waiting},
            )

        return await self._db.run(op)

    async def list_changed(self, after: int, limit: int) -> list[Run]:
        """Runs updated after ``after``, oldest change first."""
        sql = (
            f"SELECT {RUN_COLUMNS} FROM durably_runs WHERE updated_at > ? "
            "ORDER BY updated_at, id LIMIT ?"
        )

        def op(conn: sqlite3.Connection) -> list[Run]:
            return [run_from_row(row) for row in conn.execute(sql, (after, limit))]

        return await self._db.run(op)

    async def delete_run(self, run_id: str) -> bool:
        """Delete a run with its history."""

        def op(conn: sqlite3.Connection) -> bool:
            conn.execute("DELETE FROM durably_checkpoints WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM durably_run_attributes WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM durably_updates WHERE run_id = ?", (run_id,))
            _drop_waiters(conn, run_id)
            _release_run_slots(conn, run_id, now=None)
            return conn.execute("DELETE FROM durably_runs WHERE id = ?", (run_id,)).rowcount == 1

        return await self._db.run(op)

    async def get_attributes(self, run_id: str) -> dict[str, Any]:
        """The run's search attributes."""

        def op(conn: sqlite3.Connection) -> dict[str, Any]:
            rows = conn.execute(
                "SELECT key, type, str_value, num_value FROM durably_run_attributes "
                "WHERE run_id = ? ORDER BY key",
                (run_id,),
            )
            return {key: attrcodec.decode(kind, text, num) for key, kind, text, num in rows}

        return await self._db.run(op)

    async def upsert_attributes(
        self, checkpoint: Checkpoint, attributes: dict[str, Any], owner: str
    ) -> bool:
        """Write the checkpoint and merge the attributes, under the lease."""
        params = checkpoint_params(checkpoint)
        rows = _attribute_rows(checkpoint.run_id, attributes)

        def op(conn: sqlite3.Connection) -> bool:
            if not conn.execute(_HOLDS_LEASE, (checkpoint.run_id, owner)).fetchone():
                return False
            conn.execute(_UPSERT_CHECKPOINT, params)
            conn.executemany(_UPSERT_ATTRIBUTE, rows)
            return True

        return await self._db.run(op)

    # -- updates -----------------------------------------------------------------------

    async def put_update(self, record: UpdateRecord) -> UpdateRecord:
        """Add the update unless its id is there; return the stored one."""
        params = (
            record.run_id,
            record.update_id,
            record.name,
            dump_json(record.payload),
            record.created_at,
        )

        def op(conn: sqlite3.Connection) -> UpdateRecord:
            conn.execute(
                "INSERT INTO durably_updates (run_id, update_id, name, payload, created_at) "
                "VALUES (?,?,?,?,?) ON CONFLICT (run_id, update_id) DO NOTHING",
                params,
            )
            row = conn.execute(
                f"SELECT {_UPDATE_COLUMNS} FROM durably_updates WHERE run_id = ? AND update_id = ?",
                (record.run_id, record.update_id),
            ).fetchone()
            return _update_from_row(row)

        return await self._db.run(op)

    async def get_update(self, run_id: str, update_id: str) -> UpdateRecord | None:
        """The update, or ``None``."""

        def op(conn: sqlite3.Connection) -> UpdateRecord | None:
            row = conn.execute(
                f"SELECT {_UPDATE_COLUMNS} FROM durably_updates WHERE run_id = ? AND update_id = ?",
                (run_id, update_id),
            ).fetchone()
            return None if row is None else _update_from_row(row)

        return await self._db.run(op)

    async def pending_updates(self, run_id: str, limit: int) -> list[UpdateRecord]:
        """Unanswered updates, oldest first."""

        def op(conn: sqlite3.Connection) -> list[UpdateRecord]:
            rows = conn.execute(
                f"SELECT {_UPDATE_COLUMNS} FROM durably_updates "
                "WHERE run_id = ? AND answer IS NULL ORDER BY id LIMIT ?",
                (run_id, limit),
            ).fetchall()
            return [_update_from_row(row) for row in rows]

        return await self._db.run(op)

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
        params = None if checkpoint is None else checkpoint_params(checkpoint)
        text = dump_json(answer)

        def op(conn: sqlite3.Connection) -> bool:
            if owner is not None and not conn.execute(_HOLDS_LEASE, (run_id, owner)).fetchone():
                return False
            answered = conn.execute(
                "UPDATE durably_updates SET answer = ?, answered_at = ? "
                "WHERE run_id = ? AND update_id = ? AND answer IS NULL",
                (text, now, run_id, update_id),
            ).rowcount
            if params is not None:
                conn.execute(_UPSERT_CHECKPOINT, params)
            return owner is not None or answered == 1

        return await self._db.run(op)

    async def move_updates(self, from_run: str, to_run: str, now: int) -> int:
        """Hand the unanswered updates to ``to_run`` in one transaction."""
        moved = dump_json({"outcome": "moved", "run_id": to_run})

        def op(conn: sqlite3.Connection) -> int:
            conn.execute(
                "INSERT INTO durably_updates (run_id, update_id, name, payload, created_at) "
                "SELECT ?, update_id, name, payload, created_at FROM durably_updates "
                "WHERE run_id = ? AND answer IS NULL ORDER BY id "
                "ON CONFLICT (run_id, update_id) DO NOTHING",
                (to_run, from_run),
            )
            return int(
                conn.execute(
                    "UPDATE durably_updates SET answer = ?, answered_at = ? "
                    "WHERE run_id = ? AND answer IS NULL",
                    (moved, now, from_run),
                ).rowcount
            )

        return await self._db.run(op)

    # -- leases and turns ------------------------------------------------------------

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
        """Lease each free run and load its history: one trip to the store
        thread and one transaction for the whole batch."""
        if not run_ids:
            return {}
        of, of_params = _of(workflows)
        sql = _lease_statement(len(statuses), of)
        values = [s.value for s in statuses]

        def op(conn: sqlite3.Connection) -> dict[str, tuple[Run, dict[int, Checkpoint]]]:
            leased: dict[str, tuple[Run, dict[int, Checkpoint]]] = {}
            for run_id in dict.fromkeys(run_ids):
                params = [owner, lease_until, now, run_id, *values, now, *of_params]
                row = conn.execute(sql, params).fetchone()
                if row is None:
                    continue
                since = 0 if read_from is None else read_from(run_id)
                leased[run_id] = run_from_row(row), _read_history(conn, run_id, since)
            return leased

        return await self._db.run(op)

    async def continue_turn(self, run_id: str, owner: str, lease_until: int) -> Run | None:
        """Keep the lease for one more turn."""

        def op(conn: sqlite3.Connection) -> Run | None:
            row = conn.execute(
                "UPDATE durably_runs SET wake_requested_at = NULL, locked_until = ? "
                "WHERE id = ? AND status = 'running' AND locked_by = ? "
                f"RETURNING {RUN_COLUMNS}",
                (lease_until, run_id, owner),
            ).fetchone()
            return run_from_row(row) if row else None

        return await self._db.run(op)

    async def renew_lease(self, run_id: str, owner: str, lease_until: int) -> bool:
        """Extend our lease."""

        def op(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE durably_runs SET locked_until = ? "
                "WHERE id = ? AND status = 'running' AND locked_by = ?",
                (lease_until, run_id, owner),
            )
            return cur.rowcount == 1

        return await self._db.run(op)

    def settle_run(
        self, run_id: str, owner: str, status: RunStatus, changes: RunChanges, now: int
    ) -> asyncio.Future[SettleResult]:
        """End a turn by compare-and-set (queued when called)."""
        terminal = status in TERMINAL_STATUSES
        guard = "" if terminal else " AND wake_requested_at IS NULL"
        params = (
            status.value,
            dump_json(changes.output),
            dump_json(changes.error),
            changes.wake_at,
            now,
            run_id,
            owner,
        )

        def op(conn: sqlite3.Connection) -> SettleResult:
            cur = conn.execute(
                "UPDATE durably_runs SET status = ?, output = ?, error = ?, wake_at = ?, "
                "locked_by = NULL, locked_until = NULL, updated_at = ? "
                f"WHERE id = ? AND status = 'running' AND locked_by = ?{guard}",
                params,
            )
            if cur.rowcount == 1:
                if terminal:
                    _drop_waiters(conn, run_id)
                return SettleResult.SETTLED
            if (
                not terminal
                and conn.execute(
                    "SELECT 1 FROM durably_runs WHERE id = ? AND status = 'running' "
                    "AND locked_by = ?",
                    (run_id, owner),
                ).fetchone()
            ):
                return SettleResult.WAKE_REQUESTED
            return SettleResult.LOST

        return self._db.submit(op)

    async def end_child_runs(self, ends: list[ChildEnd], now: int) -> list[tuple[bool, int | None]]:
        """End each child still as expected and settle its parent's
        placeholder, in one transaction."""
        entries = [
            (
                end.run_id,
                end.owner,
                [status.value for status in end.statuses],
                (
                    end.status.value,
                    dump_json(end.changes.output),
                    dump_json(end.changes.error),
                    end.changes.wake_at,
                    now,
                ),
                (
                    end.report.status,
                    dump_json(end.report.output),
                    dump_json(end.report.error),
                    dump_json(end.report.events),
                    end.report.run_id,
                    end.report.seq,
                    end.report.held_by,
                ),
            )
            for end in ends
        ]

        def op(conn: sqlite3.Connection) -> list[tuple[bool, int | None]]:
            ended: list[int] = []
            reports: list[_Resolve] = []
            for index, (run_id, owner, statuses, values, report) in enumerate(entries):
                if owner is not None:
                    condition, params = "status = 'running' AND locked_by = ?", [owner]
                else:
                    marks = ",".join("?" * len(statuses)) or "NULL"
                    condition, params = f"status IN ({marks})", statuses
                cur = conn.execute(
                    "UPDATE durably_runs SET status = ?, output = ?, error = ?, wake_at = ?, "
                    "locked_by = NULL, locked_until = NULL, updated_at = ? "
                    f"WHERE id = ? AND {condition}",
                    (*values, run_id, *params),
                )
                if cur.rowcount == 1:
                    _drop_waiters(conn, run_id)
                    ended.append(index)
                    reports.append(report)
            answers: list[tuple[bool, int | None]] = [(False, None)] * len(entries)
            for index, left in zip(ended, _resolve_all(conn, reports, now), strict=True):
                answers[index] = (True, left)
            return answers

        return await self._db.run(op)

    async def release_run(self, run_id: str, owner: str, now: int) -> bool:
        """Hand the run back as pending."""

        def op(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE durably_runs SET status = 'pending', locked_by = NULL, "
                "locked_until = NULL, updated_at = ? "
                "WHERE id = ? AND status = 'running' AND locked_by = ?",
                (now, run_id, owner),
            )
            return cur.rowcount == 1

        return await self._db.run(op)

    async def request_wake(self, run_id: str, now: int) -> bool:
        """Stamp a wake request on a live run."""

        def op(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE durably_runs SET wake_requested_at = ? "
                f"WHERE id = ? AND status NOT IN ({_TERMINAL_SQL})",
                (now, run_id),
            )
            return cur.rowcount == 1

        return await self._db.run(op)

    # -- remote workflow turns --------------------------------------------------------

    async def mark_awaiting(self, run_id: str, owner: str, task_id: str | None) -> bool:
        """Record (or clear) the turn a run leased by ``owner`` awaits."""

        def op(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE durably_runs SET awaiting_decision_task_id = ? "
                "WHERE id = ? AND status = 'running' AND locked_by = ?",
                (task_id, run_id, owner),
            )
            return cur.rowcount == 1

        return await self._db.run(op)

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
        params = [checkpoint_params(cp) for cp in checkpoints]

        def op(conn: sqlite3.Connection) -> Run | None:
            row = conn.execute(
                "UPDATE durably_runs SET status = 'running', locked_by = ?, locked_until = ?, "
                "wake_at = NULL, wake_requested_at = NULL, awaiting_decision_task_id = NULL, "
                "updated_at = ? WHERE id = ? AND status = 'suspended' "
                f"AND awaiting_decision_task_id = ? RETURNING {RUN_COLUMNS}",
                (owner, lease_until, now, run_id, task_id),
            ).fetchone()
            if row is None:
                return None
            conn.executemany(_INSERT_CHECKPOINT, params)
            return run_from_row(row)

        return await self._db.run(op)

    async def mark_dispatched(self, run_id: str, seqs: list[int], at: int) -> None:
        """Stamp the pending, unstamped checkpoints at ``seqs`` as sent."""
        params = [(at, run_id, seq) for seq in seqs]

        def op(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "UPDATE durably_checkpoints SET dispatched_at = ? WHERE run_id = ? AND seq = ? "
                "AND status = 'pending' AND dispatched_at IS NULL",
                params,
            )

        await self._db.run(op)

    async def extend_decision_wait(self, run_id: str, wake_at: int, now: int) -> bool:
        """Push back the re-drive time of a run awaiting a decision."""

        def op(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE durably_runs SET wake_at = max(coalesce(wake_at, 0), ?), updated_at = ? "
                "WHERE id = ? AND status = 'suspended' "
                "AND awaiting_decision_task_id IS NOT NULL",
                (wake_at, now, run_id),
            )
            return cur.rowcount == 1

        return await self._db.run(op)

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
        sets = "".join(f"{column} = ?, " for column in changes)  # may be empty: a touch
        values = [run_column_value(column, value) for column, value in changes.items()]
        marks = ",".join("?" * len(statuses))
        sql = f"UPDATE durably_runs SET {sets}updated_at = ? WHERE id = ? AND status IN ({marks})"
        params = [*values, now, run_id, *(s.value for s in statuses)]

        def op(conn: sqlite3.Connection) -> bool:
            if conn.execute(sql, params).rowcount != 1:
                return False
            if terminal:
                _drop_waiters(conn, run_id)
            return True

        return await self._db.run(op)

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
        ns, ns_params = _namespace(namespace)
        of, of_params = _of(workflows)
        return await self._ids(
            f"SELECT id FROM durably_runs WHERE status = 'pending'{ns}{of} "
            "ORDER BY priority DESC, created_at, id LIMIT ?",
            (*ns_params, *of_params, limit),
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
        ns, ns_params = _namespace(namespace)
        of, of_params = _of(workflows)
        return await self._ids(
            f"SELECT id FROM durably_runs WHERE status = 'running'{ns}{of} AND "
            "(locked_until IS NULL OR locked_until < ?) ORDER BY locked_until, id LIMIT ?",
            (*ns_params, *of_params, now, limit),
        )

    async def recover_orphans(
        self, run_ids: list[str], now: int, max_attempts: int
    ) -> dict[str, RunStatus]:
        """Count a recovery of each run still orphaned; pending again, or dead
        past ``max_attempts``: one conditional UPDATE in one transaction."""
        if not run_ids:
            return {}

        def op(conn: sqlite3.Connection) -> dict[str, RunStatus]:
            # The orphan conditions are re-checked row by row inside the write
            # transaction (SQLite has one writer), so a run recovered or
            # re-leased since it was listed is left alone.
            rows = conn.execute(
                "UPDATE durably_runs SET recovery_attempts = recovery_attempts + 1, "
                "locked_by = NULL, locked_until = NULL, updated_at = ?, "
                "status = CASE WHEN recovery_attempts + 1 > ? THEN 'dead' ELSE 'pending' END "
                "WHERE id IN (SELECT value FROM json_each(?)) AND status = 'running' "
                "AND (locked_until IS NULL OR locked_until < ?) "
                "RETURNING id, status, recovery_attempts",
                (now, max_attempts, codec.dumps(run_ids), now),
            ).fetchall()
            recovered: dict[str, RunStatus] = {}
            for run_id, status, attempts in rows:
                recovered[run_id] = RunStatus(status)
                if recovered[run_id] is RunStatus.DEAD:
                    conn.execute(
                        "UPDATE durably_runs SET error = ? WHERE id = ?",
                        (codec.dumps(dead_error(attempts)), run_id),
                    )
                    _drop_waiters(conn, run_id)
            return recovered

        return await self._db.run(op)

    async def list_due(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Suspended runs whose timer is due or whose wake was requested."""
        return await self._ids(*list_due_sql(now, limit, namespace=namespace, workflows=workflows))

    async def next_wake_at(
        self,
        after: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> int | None:
        """The earliest timer of a suspended run later than ``after``."""
        sql, params = next_wake_sql(after, namespace=namespace, workflows=workflows)

        def op(conn: sqlite3.Connection) -> int | None:
            row = conn.execute(sql, params).fetchone()
            return None if row is None else int(row[0])

        return await self._db.run(op)

    async def list_unclaimed(
        self,
        before: int,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Runs outside ``workflows`` nobody took since ``before``, oldest first."""
        ns, ns_params = _namespace(namespace)
        of, of_params = _of(workflows, outside=True)
        return await self._ids(
            "SELECT id FROM ("
            " SELECT id, updated_at AS since FROM durably_runs"
            f"  WHERE status = 'pending' AND updated_at < ?{ns}{of}"
            " UNION ALL"
            " SELECT id, wake_at AS since FROM durably_runs"
            f"  WHERE status = 'suspended' AND wake_at < ?{ns}{of}"
            " UNION ALL"
            " SELECT id, wake_requested_at AS since FROM durably_runs"
            f"  WHERE wake_requested_at < ? AND status = 'suspended'{ns}{of}"
            ") GROUP BY id ORDER BY min(since), id LIMIT ?",
            (
                *(p for _ in range(3) for p in (before, *ns_params, *of_params)),
                limit,
            ),
        )

    async def list_blocked(
        self,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Blocked runs of ``workflows``, most urgent first, then oldest."""
        ns, ns_params = _namespace(namespace)
        of, of_params = _of(workflows)
        return await self._ids(
            f"SELECT id FROM durably_runs WHERE status = 'blocked'{ns}{of} "
            "ORDER BY priority DESC, created_at, id LIMIT ?",
            (*ns_params, *of_params, limit),
        )

    async def claim_due_batch(self, run_ids: list[str], now: int, next_wake_at: int) -> list[str]:
        """Move each due run's wake time ahead so no other poll takes it: one
        conditional UPDATE, re-checked row by row under SQLite's one writer."""
        if not run_ids:
            return []
        return await self._ids(
            "UPDATE durably_runs SET wake_at = ?, wake_requested_at = NULL "
            "WHERE id IN (SELECT value FROM json_each(?)) AND status = 'suspended' "
            "AND (wake_at <= ? OR wake_requested_at IS NOT NULL) "
            "AND (locked_by IS NULL OR locked_until IS NULL OR locked_until < ?) "
            "RETURNING id",
            (next_wake_at, codec.dumps(run_ids), now, now),
        )

    async def list_finished_before(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Terminal runs last updated before ``before``, oldest first."""
        ns, ns_params = _namespace(namespace)
        return await self._ids(
            f"SELECT id FROM durably_runs WHERE status IN ({_TERMINAL_SQL}) AND updated_at < ?"
            f"{ns} ORDER BY updated_at, id LIMIT ?",
            (before, *ns_params, limit),
        )

    async def list_stalled(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Live runs showing the stranded signature since ``before``."""
        return await self._ids(_STALLED, (before, limit, namespace))

    async def list_expired(
        self, now: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Live runs past their execution deadline."""
        ns, ns_params = _namespace(namespace)
        return await self._ids(
            "SELECT id FROM durably_runs WHERE deadline_at IS NOT NULL AND deadline_at <= ? "
            f"AND status NOT IN ({_TERMINAL_SQL}){ns} ORDER BY deadline_at, id LIMIT ?",
            (now, *ns_params, limit),
        )

    # -- checkpoints -------------------------------------------------------------------

    async def load_checkpoints(self, run_id: str, since: int = 0) -> dict[int, Checkpoint]:
        """Every checkpoint of the run (from ``since``, and the negative ones)."""
        return await self._db.run(lambda conn: _read_history(conn, run_id, since))

    def save_checkpoint(self, checkpoint: Checkpoint, owner: str) -> asyncio.Future[bool]:
        """Upsert under the lease; never replace a completed checkpoint.

        Queued when called (not when awaited), so writes land in call order.
        """
        params = checkpoint_params(checkpoint)
        run_id = checkpoint.run_id

        def op(conn: sqlite3.Connection) -> bool:
            if not conn.execute(_HOLDS_LEASE, (run_id, owner)).fetchone():
                return False
            conn.execute(_UPSERT_CHECKPOINT, params)
            return True

        return self._db.submit(op)

    def save_checkpoint_sending(
        self, checkpoint: Checkpoint, owner: str, messages: list[OutMessage]
    ) -> asyncio.Future[bool]:
        """:meth:`save_checkpoint` that pushes ``messages`` into the message
        queue in its transaction, if the lease held (``OutboxStore``)."""
        params = checkpoint_params(checkpoint)
        run_id = checkpoint.run_id
        queue = self.messages()
        free = free_messages(messages)

        def op(conn: sqlite3.Connection) -> bool:
            if not conn.execute(_HOLDS_LEASE, (run_id, owner)).fetchone():
                return False
            conn.execute(_UPSERT_CHECKPOINT, params)
            queue.ready_in(conn)
            insert_messages(conn, messages)
            return True

        def told(done: asyncio.Future[bool]) -> None:
            if not done.cancelled() and done.exception() is None and done.result():
                queue.announce(free)

        future = self._db.submit(op)
        if free:
            future.add_done_callback(told)
        return future

    def save_checkpoint_claiming(
        self, checkpoint: Checkpoint, owner: str, messages: list[OutMessage]
    ) -> asyncio.Future[list[int] | None]:
        """:meth:`save_checkpoint_sending` answering the ids of the messages
        born claimed, or ``None`` if the lease was lost (``OutboxStore``)."""
        params = checkpoint_params(checkpoint)
        run_id = checkpoint.run_id
        queue = self.messages()
        free = free_messages(messages)

        def op(conn: sqlite3.Connection) -> list[int] | None:
            if not conn.execute(_HOLDS_LEASE, (run_id, owner)).fetchone():
                return None
            conn.execute(_UPSERT_CHECKPOINT, params)
            queue.ready_in(conn)
            return insert_messages(conn, messages)

        def told(done: asyncio.Future[list[int] | None]) -> None:
            if not done.cancelled() and done.exception() is None and done.result() is not None:
                queue.announce(free)

        future = self._db.submit(op)
        if free:
            future.add_done_callback(told)
        return future

    async def save_checkpoints(self, checkpoints: list[Checkpoint], owner: str) -> bool:
        """Upsert many checkpoints under the lease, in one transaction."""
        params = [checkpoint_params(cp) for cp in checkpoints]
        run_ids = {cp.run_id for cp in checkpoints}

        def op(conn: sqlite3.Connection) -> bool:
            for run_id in run_ids:
                if not conn.execute(_HOLDS_LEASE, (run_id, owner)).fetchone():
                    return False
            conn.executemany(_UPSERT_CHECKPOINT, params)
            return True

        return await self._db.run(op)

    async_transactions = False
    """``ctx.transaction`` functions here are plain (sqlite3)."""

    async def transact(
        self,
        run_id: str,
        owner: str,
        fn: Callable[[Any], Any],
        checkpoint_for: Callable[[Any], Checkpoint],
    ) -> tuple[bool, Any]:
        """``ctx.transaction`` on SQLite: ``fn(sqlite3.Connection)`` runs on the
        store's thread, inside the transaction that writes the checkpoint."""

        def op(conn: sqlite3.Connection) -> tuple[bool, Any]:
            if not conn.execute(_HOLDS_LEASE, (run_id, owner)).fetchone():
                return False, None
            # A savepoint, not the batch's transaction: the other writes
            # committed with this one must survive ``fn`` failing.
            conn.execute("SAVEPOINT durably_transaction")
            try:
                value = fn(conn)
                if inspect.isawaitable(value):
                    close = getattr(value, "close", None)
                    if close is not None:
                        close()
                    raise TypeError(
                        "on SQLite, ctx.transaction's function is a plain (sync) function "
                        "taking a sqlite3.Connection"
                    )
                checkpoint = checkpoint_for(value)
                conn.execute(_UPSERT_CHECKPOINT, checkpoint_params(checkpoint))
            except Exception as exc:
                conn.execute("ROLLBACK TO durably_transaction")
                conn.execute("RELEASE durably_transaction")
                return True, _Failed(exc)
            conn.execute("RELEASE durably_transaction")
            return True, checkpoint.output

        held, output = await self._db.run(op)
        if isinstance(output, _Failed):
            raise output.error
        return held, output

    async def delete_checkpoints(self, run_id: str, seqs: list[int]) -> None:
        """Forget the given checkpoints."""
        params = [(run_id, seq) for seq in seqs]

        def op(conn: sqlite3.Connection) -> None:
            conn.executemany("DELETE FROM durably_checkpoints WHERE run_id = ? AND seq = ?", params)

        await self._db.run(op)

    async def resolve_checkpoints(
        self, resolutions: list[Resolution], now: int
    ) -> list[int | None]:
        """Settle the outcomes in one transaction."""
        values = _resolve_values(resolutions)
        return await self._db.run(lambda conn: _resolve_all(conn, values, now))

    async def resolve_and_lease(
        self, resolutions: list[Resolution], now: int, lease: TurnLease
    ) -> tuple[list[int | None], dict[str, tuple[Run, dict[int, Checkpoint]]]]:
        """Settle the outcomes and lease the runs they wake, in one transaction."""
        values = _resolve_values(resolutions)

        def op(
            conn: sqlite3.Connection,
        ) -> tuple[list[int | None], dict[str, tuple[Run, dict[int, Checkpoint]]]]:
            leased: dict[str, tuple[Run, dict[int, Checkpoint]]] = {}
            return _resolve_all(conn, values, now, _lease_woken(conn, lease, now, leased)), leased

        return await self._db.run(op)

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
        queue = self.messages()
        params = (json.dumps(topics), visible_at, visible_at, limit)

        deleted = json.dumps(list(delete)) if delete else None

        def op(conn: sqlite3.Connection) -> SettledMessages:
            queue.ready_in(conn)
            if deleted is not None:
                conn.execute(
                    "DELETE FROM durably_messages WHERE id IN (SELECT value FROM json_each(?))",
                    (deleted,),
                )
            messages: list[Message] = []
            if limit > 0:
                messages = sorted(
                    (Message(*row) for row in conn.execute(_TAKE_MESSAGES, params).fetchall()),
                    key=lambda m: (-m.priority, m.id),
                )
            decoded, resolutions = decode(messages)
            leased: dict[str, tuple[Run, dict[int, Checkpoint]]] = {}
            take = None if lease is None else _lease_woken(conn, lease, now, leased)
            answers = _resolve_all(conn, _resolve_values(resolutions), now, take)
            return SettledMessages(messages, decoded, answers, leased)

        return await self._db.run(op)

    # -- dispatched steps --------------------------------------------------------------

    async def get_checkpoint(self, run_id: str, seq: int) -> Checkpoint | None:
        """One checkpoint, or ``None``."""

        def op(conn: sqlite3.Connection) -> Checkpoint | None:
            row = conn.execute(
                f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = ? AND seq = ?",
                (run_id, seq),
            ).fetchone()
            return checkpoint_from_row(row) if row else None

        return await self._db.run(op)

    async def record_heartbeat(self, run_id: str, seq: int, at: int, progress: Any) -> bool:
        """Keep the later heartbeat (and its progress) on a pending checkpoint."""
        params = (at, at, dump_json(progress), run_id, seq)
        return await self._db.run(lambda conn: _record_beat(conn, params))

    async def record_heartbeats(self, beats: list[BeatRecord]) -> list[bool]:
        """Each beat as :meth:`record_heartbeat`, in one transaction."""
        encoded: list[tuple[Any, ...] | None] = []
        for b in beats:
            try:
                encoded.append((b.at, b.at, dump_json(b.progress), b.run_id, b.seq))
            except Exception:
                encoded.append(None)  # not encodable: only this beat is lost

        def op(conn: sqlite3.Connection) -> list[bool]:
            return [params is not None and _record_beat(conn, params) for params in encoded]

        return await self._db.run(op)

    async def try_admit(self, request: Admission, now: int) -> int | None:
        """A slot for the step, or when to ask again (serialised by the one writer)."""
        return await self._db.run(lambda conn: _try_admit(conn, request, now))

    async def release_slots(self, run_id: str, now: int) -> int:
        """Free the run's slots, drop its waiters, wake each queue's next waiter."""

        def op(conn: sqlite3.Connection) -> int:
            freed, queues = _release_run_slots(conn, run_id, now)
            for queue in sorted(queues):
                _wake_first_waiter(conn, queue, now)
            return freed

        return await self._db.run(op)

    # -- signals -------------------------------------------------------------------------

    async def wait_signal(
        self, checkpoint: Checkpoint, token: str, owner: str, now: int
    ) -> SignalWait | None:
        """Consume a buffered signal or register the waiter."""

        def op(conn: sqlite3.Connection) -> SignalWait | None:
            if not conn.execute(_HOLDS_LEASE, (checkpoint.run_id, owner)).fetchone():
                return None
            row = conn.execute(
                "DELETE FROM durably_buffered_signals WHERE id = ("
                " SELECT id FROM durably_buffered_signals WHERE token = ? ORDER BY id LIMIT 1"
                ") RETURNING payload",
                (token,),
            ).fetchone()
            if row is not None:
                payload = codec.loads(row[0])
                done = completed_params(checkpoint, row[0], now)
                conn.execute(_UPSERT_CHECKPOINT, done)
                return SignalWait(True, payload)
            conn.execute(
                # A wait registered again keeps its place in line.
                "INSERT INTO durably_signal_waiters (token, run_id, seq) VALUES (?, ?, ?) "
                "ON CONFLICT (run_id, seq, token) DO NOTHING",
                (token, checkpoint.run_id, checkpoint.seq),
            )
            conn.execute(_UPSERT_CHECKPOINT, checkpoint_params(checkpoint))
            return SignalWait(False)

        return await self._db.run(op)

    async def send_signal(self, token: str, payload: Any, now: int) -> str | None:
        """Deliver to the oldest waiter, or buffer."""
        text = codec.dumps(payload)

        def op(conn: sqlite3.Connection) -> str | None:
            waiter = conn.execute(
                "DELETE FROM durably_signal_waiters WHERE id = ("
                " SELECT id FROM durably_signal_waiters WHERE token = ? ORDER BY id LIMIT 1"
                ") RETURNING run_id, seq",
                (token,),
            ).fetchone()
            if waiter is None:
                conn.execute(
                    "INSERT INTO durably_buffered_signals (token, payload, created_at) "
                    "VALUES (?, ?, ?)",
                    (token, text, now),
                )
                return None
            run_id, seq = waiter
            cur = conn.execute(
                "UPDATE durably_checkpoints SET status = 'completed', output = ?, finished_at = ? "
                "WHERE run_id = ? AND seq = ? AND status != 'completed'",
                (text, now, run_id, seq),
            )
            if cur.rowcount == 0:
                base = Checkpoint(
                    run_id, seq, f"signal:{token}", CheckpointKind.SIGNAL, CheckpointStatus.PENDING
                )
                conn.execute(_UPSERT_CHECKPOINT, completed_params(base, text, now))
            return str(run_id)

        return await self._db.run(op)

    async def cancel_signal_wait(
        self, run_id: str, seq: int, token: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """Time a wait out unless a signal won the race."""

        return await self._db.run(
            lambda conn: _time_out_wait(
                conn,
                run_id,
                seq,
                error,
                now,
                "DELETE FROM durably_signal_waiters WHERE token = ? AND run_id = ? AND seq = ?",
                (token, run_id, seq),
            )
        )

    async def list_buffered_signals(self, token: str) -> list[Any]:
        """Buffered payloads for ``token``."""

        def op(conn: sqlite3.Connection) -> list[Any]:
            rows = conn.execute(
                "SELECT payload FROM durably_buffered_signals WHERE token = ? ORDER BY id",
                (token,),
            )
            return [codec.loads(row[0]) for row in rows]

        return await self._db.run(op)

    # -- events --------------------------------------------------------------------------

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
        params = checkpoint_params(checkpoint)

        def op(conn: sqlite3.Connection) -> SignalWait | None:
            if not conn.execute(_HOLDS_LEASE, (checkpoint.run_id, owner)).fetchone():
                return None
            found = _take_buffered_event(conn, name, keys, text)
            if found is not None:
                conn.execute(_UPSERT_CHECKPOINT, completed_params(checkpoint, found, now))
                return SignalWait(True, codec.loads(found))
            conn.execute(
                "INSERT INTO durably_event_waiters "
                "(run_id, seq, name, match_keys, match, created_at) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, seq) DO UPDATE SET name = excluded.name, "
                "match_keys = excluded.match_keys, match = excluded.match",
                (checkpoint.run_id, checkpoint.seq, name, keys, text, now),
            )
            conn.execute(_UPSERT_CHECKPOINT, params)
            return SignalWait(False)

        return await self._db.run(op)

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

        def op(conn: sqlite3.Connection) -> EventDelivery:
            if event_id is not None:
                seen = conn.execute(
                    "SELECT recipients FROM durably_published_events WHERE id = ?", (event_id,)
                ).fetchone()
                if seen is not None:
                    return EventDelivery([], int(seen[0]), duplicate=True)
            key_sets = [
                row[0]
                for row in conn.execute(
                    "SELECT DISTINCT match_keys FROM durably_event_waiters WHERE name = ?",
                    (name,),
                ).fetchall()
            ]
            delivered: list[str] = []
            for keys in key_sets:
                projection = project(value, keys)
                if projection is None:
                    continue
                taken = conn.execute(
                    "DELETE FROM durably_event_waiters "
                    "WHERE name = ? AND match_keys = ? AND match = ? RETURNING run_id, seq",
                    (name, keys, projection),
                ).fetchall()
                for run_id, seq in sorted(taken):
                    done = conn.execute(
                        "UPDATE durably_checkpoints SET status = 'completed', output = ?, "
                        "finished_at = ? WHERE run_id = ? AND seq = ? AND kind = 'event' "
                        "AND status = 'pending' AND EXISTS (SELECT 1 FROM durably_runs "
                        f"WHERE id = ? AND status NOT IN ({_TERMINAL_SQL}))",
                        (text, now, run_id, seq, run_id),
                    )
                    if done.rowcount == 1 and run_id not in delivered:
                        delivered.append(str(run_id))
            buffered = buffer and not delivered and not triggered
            if buffered:
                conn.execute(
                    "INSERT INTO durably_buffered_events (name, event_id, payload, created_at) "
                    "VALUES (?, ?, ?, ?)",
                    (name, event_id, text, now),
                )
            recipients = len(delivered) + triggered
            if event_id is not None:
                conn.execute(
                    "INSERT INTO durably_published_events (id, name, recipients, published_at) "
                    "VALUES (?, ?, ?, ?)",
                    (event_id, name, recipients, now),
                )
            return EventDelivery(delivered, recipients, buffered=buffered)

        return await self._db.run(op)

    async def cancel_event_wait(
        self, run_id: str, seq: int, name: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """Time an event wait out unless an event won the race."""

        return await self._db.run(
            lambda conn: _time_out_wait(
                conn,
                run_id,
                seq,
                error,
                now,
                "DELETE FROM durably_event_waiters WHERE run_id = ? AND seq = ? AND name = ?",
                (run_id, seq, name),
            )
        )

    async def list_buffered_events(self, name: str) -> list[Any]:
        """Buffered payloads on event ``name``."""

        def op(conn: sqlite3.Connection) -> list[Any]:
            rows = conn.execute(
                "SELECT payload FROM durably_buffered_events WHERE name = ? ORDER BY id", (name,)
            )
            return [codec.loads(row[0]) for row in rows]

        return await self._db.run(op)

    async def count_pending(self, namespace: str | None = None) -> int:
        """Pending runs (in ``namespace``)."""
        ns, ns_params = _namespace(namespace)

        def op(conn: sqlite3.Connection) -> int:
            sql = f"SELECT count(*) FROM durably_runs WHERE status = 'pending'{ns}"
            return int(conn.execute(sql, ns_params).fetchone()[0])

        return await self._db.run(op)

    async def count_flow_waiters(self) -> dict[str, int]:
        """Steps waiting for admission, by queue."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            rows = conn.execute(
                "SELECT queue, count(*) FROM durably_flow_waiters GROUP BY queue"
            ).fetchall()
            return {row[0]: int(row[1]) for row in rows}

        return await self._db.run(op)

    async def expire_buffered(self, before: int, limit: int) -> int:
        """Delete up to ``limit`` buffered signals and events created before ``before``."""

        def op(conn: sqlite3.Connection) -> int:
            expired = 0
            for table in ("durably_buffered_signals", "durably_buffered_events"):
                expired += conn.execute(
                    f"DELETE FROM {table} WHERE id IN ("  # one of two fixed table names
                    f" SELECT id FROM {table} WHERE created_at < ? ORDER BY id LIMIT ?)",
                    (before, limit - expired),
                ).rowcount
            return expired

        return await self._db.run(op)

    # -- schedules -----------------------------------------------------------------------

    async def create_schedule(self, record: ScheduleRecord) -> tuple[ScheduleRecord, bool]:
        """Insert unless the name exists."""

        def op(conn: sqlite3.Connection) -> tuple[ScheduleRecord, bool]:
            cur = conn.execute(
                f"INSERT INTO durably_schedules ({SCHEDULE_COLUMNS}) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (name) DO NOTHING",
                schedule_params(record),
            )
            if cur.rowcount == 1:
                return record, True
            existing = _fetch_schedule(conn, record.name)
            assert existing is not None
            return existing, False

        return await self._db.run(op)

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        """The schedule, or ``None``."""
        return await self._db.run(lambda conn: _fetch_schedule(conn, name))

    async def list_schedules(self, namespace: str | None = None) -> list[ScheduleRecord]:
        """Schedules by name."""
        where, params = ("WHERE namespace = ?", (namespace,)) if namespace is not None else ("", ())

        def op(conn: sqlite3.Connection) -> list[ScheduleRecord]:
            rows = conn.execute(
                f"SELECT {SCHEDULE_COLUMNS} FROM durably_schedules {where} ORDER BY name", params
            )
            return [schedule_from_row(row) for row in rows]

        return await self._db.run(op)

    async def list_due_schedules(
        self, namespace: str, now: int, limit: int, workflows: list[str] | None = None
    ) -> list[ScheduleRecord]:
        """Schedules with a window due or a start to confirm."""
        only = ""
        if workflows is not None:
            only = " AND json_extract(spec, '$.workflow') IN (SELECT value FROM json_each(?))"
        params = (namespace, now, *(() if workflows is None else (codec.dumps(workflows),)), limit)

        def op(conn: sqlite3.Connection) -> list[ScheduleRecord]:
            rows = conn.execute(
                f"SELECT {SCHEDULE_COLUMNS} FROM durably_schedules WHERE namespace = ? AND "
                f"((paused = 0 AND next_fire_at <= ?) OR firing_run_id IS NOT NULL){only} "
                "ORDER BY coalesce(next_fire_at, -1), name LIMIT ?",
                params,
            )
            return [schedule_from_row(row) for row in rows]

        return await self._db.run(op)

    async def update_schedule(
        self, name: str, changes: dict[str, Any], now: int, *, revision: int | None = None
    ) -> ScheduleRecord | None:
        """Apply ``changes`` (compare-and-set on ``revision`` when given)."""
        check_schedule_changes(changes)
        sets = "".join(f"{column} = ?, " for column in changes)
        values = [schedule_column_value(column, value) for column, value in changes.items()]
        guard = "" if revision is None else " AND revision = ?"
        sql = (
            f"UPDATE durably_schedules SET {sets}revision = revision + 1, updated_at = ? "
            f"WHERE name = ?{guard} RETURNING {SCHEDULE_COLUMNS}"
        )
        params = [*values, now, name, *([] if revision is None else [revision])]

        def op(conn: sqlite3.Connection) -> ScheduleRecord | None:
            row = conn.execute(sql, params).fetchone()
            return schedule_from_row(row) if row else None

        return await self._db.run(op)

    async def delete_schedule(self, name: str) -> bool:
        """Delete a schedule."""

        def op(conn: sqlite3.Connection) -> bool:
            cur = conn.execute("DELETE FROM durably_schedules WHERE name = ?", (name,))
            return cur.rowcount == 1

        return await self._db.run(op)

    # -- helpers ---------------------------------------------------------------------------

    async def _ids(self, sql: str, params: tuple[Any, ...]) -> list[str]:
        return await self._db.run(lambda conn: [row[0] for row in conn.execute(sql, params)])


def _time_out_wait(
    conn: sqlite3.Connection,
    run_id: str,
    seq: int,
    error: ErrorInfo,
    now: int,
    forget_waiter: str,
    waiter_params: tuple[Any, ...],
) -> Checkpoint | None:
    """A signal or event wait timed out: return the checkpoint if a delivery
    won the race, else forget exactly this waiter and fail the checkpoint."""
    row = conn.execute(
        f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = ? AND seq = ?",
        (run_id, seq),
    ).fetchone()
    if row is not None and row[4] == CheckpointStatus.COMPLETED.value:
        return checkpoint_from_row(row)
    conn.execute(forget_waiter, waiter_params)
    conn.execute(
        "UPDATE durably_checkpoints SET status = 'failed', error = ?, finished_at = ? "
        "WHERE run_id = ? AND seq = ? AND status != 'completed'",
        (codec.dumps(error), now, run_id, seq),
    )
    return None


def _namespace(namespace: str | None) -> tuple[str, tuple[str, ...]]:
    """A ``namespace = ?`` filter and its parameter, or nothing for every namespace."""
    return ("", ()) if namespace is None else (" AND namespace = ?", (namespace,))


def list_due_sql(
    now: int, limit: int, *, namespace: str | None, workflows: Executable | None
) -> tuple[str, tuple[Any, ...]]:
    """The statement of :meth:`SqliteStore.list_due` and its parameters.

    Each branch takes its own page from its index before the two are merged:
    grouping every due row to return one page made each poll's cost grow with
    the backlog of due timers (``tests/stores/test_sqlite_due_page.py``).
    """
    ns, ns_params = _namespace(namespace)
    of, of_params = _of(workflows)
    return (
        "SELECT id FROM ("
        " SELECT * FROM (SELECT id, wake_at AS due FROM durably_runs"
        f"  WHERE status = 'suspended' AND wake_at <= ?{ns}{of}"
        "  ORDER BY wake_at, id LIMIT ?)"
        " UNION ALL"
        " SELECT * FROM (SELECT id, wake_requested_at AS due FROM durably_runs"
        f"  WHERE wake_requested_at IS NOT NULL AND status = 'suspended'{ns}{of}"
        "  ORDER BY wake_requested_at, id LIMIT ?)"
        ") GROUP BY id ORDER BY min(due), id LIMIT ?",
        (now, *ns_params, *of_params, limit, *ns_params, *of_params, limit, limit),
    )


def next_wake_sql(
    after: int, *, namespace: str | None, workflows: Executable | None
) -> tuple[str, tuple[Any, ...]]:
    """The statement of :meth:`SqliteStore.next_wake_at` and its parameters:
    the first row of the ``(status, wake_at)`` index past ``after`` that
    matches, not a ``min()`` over every suspended run."""
    ns, ns_params = _namespace(namespace)
    of, of_params = _of(workflows)
    return (
        "SELECT wake_at FROM durably_runs"
        f" WHERE status = 'suspended' AND wake_at > ?{ns}{of}"
        " ORDER BY wake_at LIMIT 1",
        (after, *ns_params, *of_params),
    )


def _of(workflows: Executable | None, *, outside: bool = False) -> tuple[str, tuple[str, ...]]:
    """A filter on the run's ``(workflow, version)`` (one JSON array parameter
    of ``workflow\x1fversion`` keys, read by ``json_each``), or nothing for
    every run; ``outside`` keeps the runs *not* in ``workflows``."""
    if workflows is None:
        return "", ()
    negate = "NOT " if outside else ""
    return (
        f" AND workflow || char(31) || workflow_version {negate}IN "
        "(SELECT value FROM json_each(?))",
        (_keys_json(workflows),),
    )


@functools.lru_cache(maxsize=64)
def _keys_json(workflows: Executable) -> str:
    # Cached: an engine passes the same set on every poll and lease.
    return codec.dumps(sorted(f"{name}\x1f{version}" for name, version in workflows))


def _migrate(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS durably_meta (key TEXT PRIMARY KEY, value TEXT)")
    row = conn.execute("SELECT value FROM durably_meta WHERE key = 'schema_version'").fetchone()
    version = int(row[0]) if row else 0
    if version > len(MIGRATIONS):
        raise RuntimeError(
            f"the database schema is version {version}, newer than this durably "
            f"({len(MIGRATIONS)}); upgrade durably"
        )
    for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
        for statement in script.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(
            "INSERT INTO durably_meta (key, value) VALUES ('schema_version', ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(number),),
        )


_Resolve = tuple[CheckpointStatus, str | None, str | None, str | None, str, int, str | None]
"""One outcome to settle: status, output, error, events (JSON), run id, seq,
and the owner whose held turn awaits it (``Resolution.held_by``)."""


_READ_HISTORY = f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = ? ORDER BY seq"
# Two ranges of the primary key, not one scan filtered: the rows below
# ``since`` are neither read nor decoded.
_READ_TAIL = (
    f"SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = ?1 AND seq < 0 "
    f"UNION ALL SELECT {CP_SELECT} FROM durably_checkpoints WHERE run_id = ?1 AND seq >= ?2 "
    "ORDER BY seq"
)


def _read_history(conn: sqlite3.Connection, run_id: str, since: int) -> dict[int, Checkpoint]:
    """A run's history as a lease call returns it (from ``since``: see
    :data:`~durably.stores.base.ReadFrom`)."""
    if since <= 0:
        return {r[1]: checkpoint_from_row(r) for r in conn.execute(_READ_HISTORY, (run_id,))}
    rows = conn.execute(_READ_TAIL, (run_id, since))
    return read_tail(since, ((r[1], checkpoint_from_row(r)) for r in rows))


def _lease_woken(
    conn: sqlite3.Connection,
    lease: TurnLease,
    now: int,
    leased: dict[str, tuple[Run, dict[int, Checkpoint]]],
) -> Callable[[list[str]], set[str]]:
    """How a settle leases the runs it wakes (into ``leased``, with their
    histories) as ``lease`` says, for :func:`_resolve_all`."""
    of, of_params = _of(lease.workflows)
    sql = _lease_statement(len(lease.statuses), of)
    statuses = [s.value for s in lease.statuses]

    def take(woken: list[str]) -> set[str]:
        for run_id in woken[: max(0, lease.limit)]:
            params = [lease.owner, lease.lease_until, now, run_id, *statuses, now]
            row = conn.execute(sql, [*params, *of_params]).fetchone()
            if row is None:
                continue
            since = 0 if lease.read_from is None else lease.read_from(run_id)
            leased[run_id] = (run_from_row(row), _read_history(conn, run_id, since))
        return set(leased)

    return take


# The results consumer's claim, settle and ack in one (SQLite has one writer:
# nothing else can take the rows while the transaction is open).
_TAKE_MESSAGES = """
    DELETE FROM durably_messages
    WHERE id IN (
        SELECT id FROM durably_messages
        WHERE topic IN (SELECT value FROM json_each(?))
            AND available_at <= ? AND (claimed_until IS NULL OR claimed_until < ?)
        ORDER BY priority DESC, id
        LIMIT ?
    )
    RETURNING id, topic, body, priority, deliveries + 1
"""


def _resolve_values(resolutions: list[Resolution]) -> list[_Resolve]:
    """The parameters of :func:`_resolve_all` (JSON encoded up front)."""
    return [
        (
            r.status,
            dump_json(r.output),
            dump_json(r.error),
            dump_json(r.events),
            r.run_id,
            r.seq,
            r.held_by,
        )
        for r in resolutions
    ]


def _resolve_all(
    conn: sqlite3.Connection,
    values: list[_Resolve],
    now: int,
    lease: Callable[[list[str]], set[str]] | None = None,
) -> list[int | None]:
    """Settle pending checkpoints, in order (see ``StateStore.resolve_checkpoints``).

    Each parallel group is counted once per batch, not once per entry: a fan's
    10,000 children reporting in batches counted the group's remaining
    pending siblings 10,000 times, n^2/2 index entries (41% of the SQLite
    fan-out's profile). An entry's answer is then the group's pending count
    after the batch plus the entries after it that settled a pending sibling.
    """
    settled: list[tuple[int, str, str | None, bool, CheckpointStatus, str | None, int]] = []
    held: dict[str, str | None] = {}  # run id -> its held turn's owner (None: any entry unheld)
    holder: dict[str, str | None] = {}  # run id -> who holds its lease now (None: nobody)
    for index, (status, output, error, events, run_id, seq, held_by) in enumerate(values):
        row = conn.execute(
            "SELECT c.status, c.parallel_group, c.queue, "
            "CASE WHEN r.locked_until > ? THEN r.locked_by END "
            "FROM durably_checkpoints c LEFT JOIN durably_runs r ON r.id = c.run_id "
            "WHERE c.run_id = ? AND c.seq = ?",
            (now, run_id, seq),
        ).fetchone()
        if row is None or row[0] in ("completed", "failed"):
            continue  # nothing to settle (a position named twice: settled by its first)
        holder[run_id] = row[3]
        conn.execute(
            "UPDATE durably_checkpoints SET status = ?, output = ?, error = ?, events = ?, "
            "finished_at = ? WHERE run_id = ? AND seq = ?",
            (status.value, output, error, events, now, run_id, seq),
        )
        settled.append((index, run_id, row[1], row[0] == "pending", status, row[2], seq))
        held[run_id] = held_by if held.get(run_id, held_by) == held_by else None
    pending: dict[tuple[str, str], int] = {}
    for key in {(run_id, group) for _, run_id, group, *_ in settled if group is not None}:
        pending[key] = conn.execute(
            "SELECT count(*) FROM durably_checkpoints "
            "WHERE run_id = ? AND parallel_group = ? AND status = 'pending'",
            key,
        ).fetchone()[0]
    answers: list[int | None] = [None] * len(values)
    later: dict[tuple[str, str], int] = {}
    wake: set[str] = set()
    for index, run_id, group, was_pending, status, _, _ in reversed(settled):
        left = 0
        if group is not None:
            left = pending[(run_id, group)] + later.get((run_id, group), 0)
            if was_pending:
                later[(run_id, group)] = later.get((run_id, group), 0) + 1
        answers[index] = left
        if left == 0 or status is CheckpointStatus.FAILED:
            wake.add(run_id)
    # ``lease`` (resolve_and_lease) takes some of them for a turn now: no stamp.
    # Not a run a turn holds (every entry ``held_by``): it is running, not
    # leasable, and a statement per held step found so (a lapsed holder is
    # stamped below, and whoever leases the run next sees the result).
    holding = {run_id for run_id, owner in held.items() if owner is not None}
    taken = lease(sorted(wake - holding)) if lease is not None else set()
    for run_id in sorted(wake - taken):
        # Not while the held turn that takes the result holds the lease (read
        # above, in this transaction: SQLite has one writer), which is the
        # usual case: no statement then.
        owner = held.get(run_id)
        if owner is not None and holder.get(run_id) == owner:
            continue
        conn.execute(
            "UPDATE durably_runs SET wake_requested_at = ? "
            f"WHERE id = ? AND status NOT IN ({_TERMINAL_SQL}) "
            "AND coalesce(locked_by = ? AND locked_until > ?, 0) = 0",
            (now, run_id, held.get(run_id), now),
        )
    for _, run_id, _, _, _, queue, seq in settled:
        if queue is None:
            continue
        freed = conn.execute(
            "UPDATE durably_flow_slots SET released_at = ? "
            "WHERE queue = ? AND step_id = ? AND released_at IS NULL",
            (now, queue, f"{run_id}:{seq}"),
        )
        if freed.rowcount:
            _wake_first_waiter(conn, queue, now)
    return answers


# The waiters of a queue in admission order: priority, then the fairness key
# holding the fewest slots, then the oldest (the step id breaks ties).
_WAITERS_IN_ORDER = """
    SELECT w.step_id, w.run_id FROM durably_flow_waiters w
    LEFT JOIN (
        SELECT fairness_key, count(*) AS held FROM durably_flow_slots
        WHERE queue = ? AND released_at IS NULL GROUP BY fairness_key
    ) h ON h.fairness_key = w.fairness_key
    WHERE w.queue = ?
    ORDER BY w.priority DESC, coalesce(h.held, 0), w.enqueued_at, w.step_id
    LIMIT ?
"""


def _try_admit(conn: sqlite3.Connection, request: Admission, now: int) -> int | None:
    """``StateStore.try_admit`` inside the writer's transaction."""
    queue, step_id = request.queue, request.step_id
    key = request.fairness_key if request.fairness_key is not None else request.run_id
    if conn.execute(
        "SELECT 1 FROM durably_flow_slots WHERE queue = ? AND step_id = ? AND released_at IS NULL",
        (queue, step_id),
    ).fetchone():
        return None
    # Free the slots of runs that ended without freeing them (their process
    # died between the terminal write and the release).
    conn.execute(
        "UPDATE durably_flow_slots SET released_at = ? WHERE queue = ? AND released_at IS NULL "
        "AND EXISTS (SELECT 1 FROM durably_runs r WHERE r.id = durably_flow_slots.run_id "
        f"AND r.status IN ({_TERMINAL_SQL}))",
        (now, queue),
    )
    conn.execute(
        "DELETE FROM durably_flow_waiters WHERE queue = ? AND seen_at < ?",
        (queue, now - 3 * request.retry_ms),
    )
    conn.execute(
        "DELETE FROM durably_flow_slots "
        "WHERE queue = ? AND released_at IS NOT NULL AND acquired_at <= ?",
        (queue, now - request.rate_period_ms),
    )
    free: int | None = None
    if request.concurrency is not None:
        held = conn.execute(
            "SELECT count(*) FROM durably_flow_slots WHERE queue = ? AND released_at IS NULL",
            (queue,),
        ).fetchone()[0]
        free = request.concurrency - int(held)
    if request.rate_limit is not None:
        recent = conn.execute(
            "SELECT count(*) FROM durably_flow_slots WHERE queue = ? AND acquired_at > ?",
            (queue, now - request.rate_period_ms),
        ).fetchone()[0]
        by_rate = request.rate_limit - int(recent)
        free = by_rate if free is None else min(free, by_rate)
    conn.execute(
        "INSERT INTO durably_flow_waiters "
        "(queue, step_id, run_id, priority, fairness_key, enqueued_at, seen_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (queue, step_id) DO UPDATE SET "
        "run_id = excluded.run_id, priority = excluded.priority, "
        "fairness_key = excluded.fairness_key, seen_at = excluded.seen_at",
        (
            queue,
            step_id,
            request.run_id,
            request.priority,
            key,
            now if request.enqueued_at is None else request.enqueued_at,
            now,
        ),
    )
    admitted = free is None
    if free is not None and free > 0:
        first = conn.execute(_WAITERS_IN_ORDER, (queue, queue, free)).fetchall()
        admitted = any(row[0] == step_id for row in first)
        if not admitted:
            # Room, but for waiters ahead of this one: wake them, in case the
            # release that made the room woke nobody (it found its slot freed).
            for row in first:
                conn.execute(
                    "UPDATE durably_runs SET wake_requested_at = ? "
                    f"WHERE id = ? AND status NOT IN ({_TERMINAL_SQL})",
                    (now, row[1]),
                )
    if not admitted:
        return now + request.retry_ms
    conn.execute(
        "DELETE FROM durably_flow_waiters WHERE queue = ? AND step_id = ?", (queue, step_id)
    )
    conn.execute(
        "INSERT INTO durably_flow_slots "
        "(queue, step_id, run_id, fairness_key, acquired_at, released_at) "
        "VALUES (?, ?, ?, ?, ?, NULL) ON CONFLICT (queue, step_id) DO UPDATE SET "
        "run_id = excluded.run_id, fairness_key = excluded.fairness_key, "
        "acquired_at = excluded.acquired_at, released_at = NULL",
        (queue, step_id, request.run_id, key, now),
    )
    return None


def _release_run_slots(
    conn: sqlite3.Connection, run_id: str, now: int | None
) -> tuple[int, set[str]]:
    """Free a run's slots and drop its waiters; how many slots were freed and
    the queues touched. ``now=None`` (the run is deleted) deletes the slots."""
    if now is None:
        freed = conn.execute(
            "DELETE FROM durably_flow_slots WHERE run_id = ? AND released_at IS NULL "
            "RETURNING queue",
            (run_id,),
        ).fetchall()
    else:
        freed = conn.execute(
            "UPDATE durably_flow_slots SET released_at = ? "
            "WHERE run_id = ? AND released_at IS NULL RETURNING queue",
            (now, run_id),
        ).fetchall()
    dropped = conn.execute(
        "DELETE FROM durably_flow_waiters WHERE run_id = ? RETURNING queue", (run_id,)
    ).fetchall()
    return len(freed), {row[0] for row in freed} | {row[0] for row in dropped}


def _record_beat(conn: sqlite3.Connection, params: tuple[Any, ...]) -> bool:
    """Keep the later heartbeat (and its progress) on a pending checkpoint."""
    cur = conn.execute(
        "UPDATE durably_checkpoints SET last_heartbeat_at = CASE "
        "WHEN last_heartbeat_at IS NULL OR last_heartbeat_at < ? THEN ? "
        "ELSE last_heartbeat_at END, progress = coalesce(?, progress) "
        "WHERE run_id = ? AND seq = ? AND status = 'pending'",
        params,
    )
    return cur.rowcount == 1


def _wake_first_waiter(conn: sqlite3.Connection, queue: str, now: int) -> None:
    """Stamp the wake of the run whose step is first in line for ``queue``."""
    row = conn.execute(_WAITERS_IN_ORDER, (queue, queue, 1)).fetchone()
    if row is not None:
        conn.execute(
            "UPDATE durably_runs SET wake_requested_at = ? "
            f"WHERE id = ? AND status NOT IN ({_TERMINAL_SQL})",
            (now, row[1]),
        )


def _drop_waiters(conn: sqlite3.Connection, run_id: str) -> None:
    """Forget every signal and event wait of a run that ended or is deleted."""
    conn.execute("DELETE FROM durably_signal_waiters WHERE run_id = ?", (run_id,))
    conn.execute("DELETE FROM durably_event_waiters WHERE run_id = ?", (run_id,))


def _take_buffered_event(conn: sqlite3.Connection, name: str, keys: str, match: str) -> str | None:
    """Delete and return (as JSON text) the oldest buffered event on ``name``
    matching ``(keys, match)``, or ``None``."""
    rows = conn.execute(
        "SELECT id, payload FROM durably_buffered_events WHERE name = ? ORDER BY id", (name,)
    )
    for event_row, payload in rows:
        if keys == "[]" or project(codec.loads(payload), keys) == match:
            rows.close()
            conn.execute("DELETE FROM durably_buffered_events WHERE id = ?", (event_row,))
            return str(payload) if payload is not None else "null"
    return None


def _fetch_schedule(conn: sqlite3.Connection, name: str) -> ScheduleRecord | None:
    row = conn.execute(
        f"SELECT {SCHEDULE_COLUMNS} FROM durably_schedules WHERE name = ?", (name,)
    ).fetchone()
    return schedule_from_row(row) if row else None


def _lease_statement(statuses: int, of: str = "") -> str:
    """Lease one run (parameters: owner, lease_until, now, id, ``statuses``
    statuses, now, then those of ``of``, a :func:`_of` filter) if its status
    allows and nobody else holds it."""
    marks = ",".join("?" * statuses)
    return (
        "UPDATE durably_runs SET status = 'running', locked_by = ?, locked_until = ?, "
        "wake_requested_at = NULL, wake_at = NULL, updated_at = ? "
        f"WHERE id = ? AND status IN ({marks}) "
        f"AND (locked_by IS NULL OR locked_until IS NULL OR locked_until < ?){of} "
        f"RETURNING {RUN_COLUMNS}"
    )


def list_runs_sql(query: RunQuery) -> tuple[str, list[Any]]:
    """The statement ``list_runs`` runs for ``query``, with its parameters
    (a test explains it to prove the indexes serve it)."""
    clauses, params = _run_filter(query)
    after = decode_cursor(query.cursor)
    if after is not None:
        clauses.append("(created_at < ? OR (created_at = ? AND id < ?))")
        params.extend([after[0], after[0], after[1]])
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    sql = (
        f"SELECT {RUN_COLUMNS} FROM durably_runs {where} ORDER BY created_at DESC, id DESC LIMIT ?"
    )
    params.append(query.limit + 1)
    return sql, params


def _attribute_rows(run_id: str, values: dict[str, Any] | None) -> list[tuple[Any, ...]]:
    return [(run_id, key, *attrcodec.encode(value)) for key, value in (values or {}).items()]


def _fetch_run(conn: sqlite3.Connection, run_id: str) -> Run | None:
    row = conn.execute(f"SELECT {RUN_COLUMNS} FROM durably_runs WHERE id = ?", (run_id,)).fetchone()
    return run_from_row(row) if row else None


def _run_filter(query: RunQuery) -> tuple[list[str], list[Any]]:
    # The WHERE clauses of list_runs and count_runs, with their values.
    clauses: list[str] = []
    params: list[Any] = []
    for column, value in (
        ("status", query.status.value if query.status else None),
        ("workflow", query.workflow),
        ("namespace", query.namespace),
        ("parent_id", query.parent_id),
    ):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    if query.tag is not None:
        clauses.append("EXISTS (SELECT 1 FROM json_each(durably_runs.tags) WHERE value = ?)")
        params.append(query.tag)
    if query.statuses is not None:
        clauses.append(f"status IN ({','.join('?' * len(query.statuses)) or 'NULL'})")
        params.extend(status.value for status in query.statuses)
    for flt in query.attributes:
        # The runs the (key, value) index lists, looked up by id: a
        # correlated EXISTS would walk every run newest first and probe
        # each (30-60 ms at 100k runs for a rare value, against 1-9 ms). A run
        # without the key has no row, so it never matches (not even ``ne``).
        clauses.append(
            "id IN (SELECT a.run_id FROM durably_run_attributes a "
            f"WHERE a.key = ? AND a.type IN ({','.join('?' * len(flt.types))}) "
            f"AND a.{flt.column} {attrcodec.OPS[flt.op]} ?)"
        )
        params.extend([flt.key, *flt.types, flt.value])
    if query.run_id_prefix:
        # The primary key compares bytes (BINARY): a range on it is the prefix.
        clauses.append("id >= ?")
        params.append(query.run_id_prefix)
        bound = prefix_bound(query.run_id_prefix)
        if bound is not None:
            clauses.append("id < ?")
            params.append(bound)
    for clause, moment in (
        ("created_at >= ?", query.created_after),
        ("created_at < ?", query.created_before),
    ):
        if moment is not None:
            clauses.append(clause)
            params.append(moment)
    return clauses, params


class _Failed:
    """An exception raised inside a batch, carried out as a value so the batch commits."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error
