"""The message queue (:mod:`durably._queue`) in a SQLite file.

Every operation is one function run by the store's writer thread inside its
``BEGIN IMMEDIATE`` transaction, so a claim's select-and-mark is atomic
against every other process on the file (SQLite has one writer at a time).
Id lists travel as one JSON parameter (``json_each``). There is no
cross-process notification: a push wakes listeners in this process at once,
consumers elsewhere find it on their next poll (every 50 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from .._notices import StoreNotice
from .._queue import PUSH_CHUNK, Listener, Message, OutMessage, Unlisten

if TYPE_CHECKING:
    from ._sqlite_thread import SqliteThread

__all__ = ["SqliteMessageQueue", "free_messages", "insert_messages"]

_T = TypeVar("_T")

_CREATE = (
    """
    CREATE TABLE IF NOT EXISTS durably_messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        topic TEXT NOT NULL,
        body TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        available_at INTEGER NOT NULL DEFAULT 0,
        claimed_by TEXT,
        claimed_until INTEGER,
        deliveries INTEGER NOT NULL DEFAULT 0,
        created_at INTEGER NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS durably_messages_claim "
    "ON durably_messages (topic, priority DESC, id)",
)
_CLAIM = """
    UPDATE durably_messages
    SET claimed_by = ?, claimed_until = ?, deliveries = deliveries + 1
    WHERE id IN (
        SELECT id FROM durably_messages
        WHERE topic IN (SELECT value FROM json_each(?))
            AND available_at <= ? AND (claimed_until IS NULL OR claimed_until < ?)
        ORDER BY priority DESC, id
        LIMIT ?
    )
    RETURNING id, topic, body, priority, deliveries
"""
_IDS = "id IN (SELECT value FROM json_each(?))"

# Listeners of every queue object of this process, by database file: a
# second store object on the same file (another engine in this process)
# hears the pushes of the first.
_LISTENERS: dict[str, list[tuple[asyncio.AbstractEventLoop, Listener]]] = {}


class SqliteMessageQueue:
    """A :class:`~durably._queue.MessageQueue` on a :class:`SqliteStore`'s writer thread."""

    poll_interval = 0.05

    def __init__(self, db: SqliteThread, path: str) -> None:
        self._db = db
        self._key = os.path.abspath(path) if path != ":memory:" else f":memory:{id(db)}"
        self._created = False

    async def _run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        if not self._created:
            await self._db.run(_create)
            self._created = True
        return await self._db.run(fn)

    async def push(self, messages: list[OutMessage]) -> None:
        """Insert the messages (multi-row INSERTs, one transaction); wake this
        process's listeners of their topics."""
        if not messages:
            return
        await self._run(lambda conn: insert_messages(conn, messages))
        self.announce(free_messages(messages))

    async def claim(
        self, topics: list[str], owner: str, limit: int, lease_ms: int, now: int
    ) -> list[Message]:
        """Claim up to ``limit`` visible messages, highest priority then oldest first."""
        if not topics or limit <= 0:
            return []
        params = (owner, now + lease_ms, json.dumps(topics), now, now, limit)

        def op(conn: sqlite3.Connection) -> list[Message]:
            return [Message(*row) for row in conn.execute(_CLAIM, params).fetchall()]

        claimed = await self._run(op)
        claimed.sort(key=lambda m: (-m.priority, m.id))
        return claimed

    async def ack(self, ids: list[int]) -> None:
        """Delete the messages."""
        if not ids:
            return
        text = json.dumps(ids)

        def op(conn: sqlite3.Connection) -> None:
            conn.execute(f"DELETE FROM durably_messages WHERE {_IDS}", (text,))

        await self._run(op)

    async def release(self, ids: list[int], owner: str, *, available_at: int | None = None) -> None:
        """Hand back the messages ``owner`` holds."""
        if not ids:
            return
        params = (available_at, json.dumps(ids), owner)

        def op(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "UPDATE durably_messages SET claimed_by = NULL, claimed_until = NULL, "
                f"available_at = COALESCE(?, available_at) WHERE {_IDS} AND claimed_by = ? "
                "RETURNING topic",
                params,
            )
            return [row[0] for row in rows]

        topics = await self._run(op)
        if available_at is None:
            self._tell(StoreNotice.MESSAGE, list(dict.fromkeys(topics)))

    async def extend(self, ids: list[int], owner: str, lease_ms: int, now: int) -> list[int]:
        """Push the lease of the messages ``owner`` still holds to ``now + lease_ms``."""
        if not ids:
            return []
        params = (now + lease_ms, json.dumps(ids), owner)

        def op(conn: sqlite3.Connection) -> list[int]:
            rows = conn.execute(
                "UPDATE durably_messages SET claimed_until = ? "
                f"WHERE {_IDS} AND claimed_by = ? RETURNING id",
                params,
            )
            return [row[0] for row in rows]

        return await self._run(op)

    async def depth(self, topics: list[str] | None = None) -> dict[str, int]:
        """Messages per topic."""
        where = "WHERE topic IN (SELECT value FROM json_each(?))" if topics is not None else ""
        params = (json.dumps(topics),) if topics is not None else ()

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            rows = conn.execute(
                f"SELECT topic, count(*) FROM durably_messages {where} GROUP BY topic", params
            )
            return {topic: count for topic, count in rows}

        return await self._run(op)

    async def broadcast(self, kind: str, arguments: list[str]) -> None:
        """Tell this process's listeners on the same file (SQLite has no channel)."""
        self._tell(kind, arguments)

    async def listen(self, listener: Listener) -> Unlisten:
        """Hear pushes and broadcasts made in this process on this file."""
        entry = (asyncio.get_running_loop(), listener)
        _LISTENERS.setdefault(self._key, []).append(entry)

        def unlisten() -> None:
            entries = _LISTENERS.get(self._key, [])
            with contextlib.suppress(ValueError):
                entries.remove(entry)
            if not entries:
                _LISTENERS.pop(self._key, None)

        return unlisten

    def ready_in(self, conn: sqlite3.Connection) -> None:
        """Create the table in ``conn``'s transaction unless done already
        (for the store's writes that push into it)."""
        if not self._created:
            _create(conn)
            self._created = True

    def announce(self, messages: list[OutMessage]) -> None:
        """Wake this process's listeners of the topics of ``messages``, pushed
        and committed (by :meth:`push`, or with a checkpoint by the store)."""
        self._tell(StoreNotice.MESSAGE, list(dict.fromkeys(m.topic for m in messages)))

    def _tell(self, kind: str, arguments: list[str]) -> None:
        for loop, listener in list(_LISTENERS.get(self._key, ())):
            for argument in arguments:
                # A loop that closed has nobody listening any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(listener, kind, argument)


def insert_messages(conn: sqlite3.Connection, messages: list[OutMessage]) -> list[int]:
    """Insert ``messages`` (multi-row INSERTs), in the caller's transaction;
    the ids of those born claimed (``claimed_by`` set), in order."""
    created = int(time.time() * 1000)
    rows = [
        (m.topic, m.body, int(m.priority), int(m.available_at or 0), created)
        for m in messages
        if m.claimed_by is None
    ]
    most = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // 5
    chunk = max(1, min(PUSH_CHUNK, most))
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        marks = ",".join(["(?,?,?,?,?)"] * len(part))
        conn.execute(
            "INSERT INTO durably_messages "
            f"(topic, body, priority, available_at, created_at) VALUES {marks}",
            [value for row in part for value in row],
        )
    if len(rows) == len(messages):
        return []
    # One row each (a step's task, usually alone): its id is the insert's rowid.
    born: list[int] = []
    for m in messages:
        if m.claimed_by is not None:
            cursor = conn.execute(_INSERT_BORN, _born_row(m, created))
            assert cursor.lastrowid is not None
            born.append(cursor.lastrowid)
    return born


_INSERT_BORN = (
    "INSERT INTO durably_messages (topic, body, priority, available_at, created_at, "
    "claimed_by, claimed_until, deliveries) VALUES (?,?,?,?,?,?,?,1)"
)


def _born_row(m: OutMessage, created: int) -> tuple[object, ...]:
    """The values of :data:`_INSERT_BORN` for ``m``: held as claimed once."""
    return (
        m.topic,
        m.body,
        int(m.priority),
        int(m.available_at or 0),
        created,
        m.claimed_by,
        m.claimed_until,
    )


def free_messages(messages: list[OutMessage]) -> list[OutMessage]:
    """Those of ``messages`` not born claimed: the ones to announce."""
    return [m for m in messages if m.claimed_by is None]


def _create(conn: sqlite3.Connection) -> None:
    for statement in _CREATE:
        conn.execute(statement)
