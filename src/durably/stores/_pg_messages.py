"""The message queue (:mod:`durably._queue`) in PostgreSQL.

Claims are one ``UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED)``:
concurrent consumers skip each other's rows instead of queueing behind them,
and a row whose claim was taken while we waited is re-checked, never taken
twice. A push inserts with ``unnest`` (one statement per
:data:`~durably._queue.PUSH_CHUNK` rows) and ``NOTIFY``-s ``message:<topic>`` on the
store's channel once per topic in the same transaction, so a consumer in any
process wakes when the messages are visible, not before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._notices import StoreNotice
from .._queue import PUSH_CHUNK, Listener, Message, OutMessage, Unlisten
from ._pg_sql import notice_argument

__all__ = ["PgMessageQueue"]

_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('durably:messages', 0))"
_CREATE = (
    """
    CREATE TABLE IF NOT EXISTS durably_messages (
        id BIGSERIAL PRIMARY KEY,
        topic TEXT NOT NULL,
        body TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        available_at BIGINT NOT NULL DEFAULT 0,
        claimed_by TEXT,
        claimed_until BIGINT,
        deliveries INTEGER NOT NULL DEFAULT 0,
        created_at BIGINT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS durably_messages_claim "
    "ON durably_messages (topic, priority DESC, id)",
)
# The notify part runs once the insert has (a data-modifying CTE always runs);
# NOTIFY is delivered at commit.
_PUSH = f"""
    WITH ins AS (
        INSERT INTO durably_messages (topic, body, priority, available_at, created_at)
        SELECT * FROM unnest($1::text[], $2::text[], $3::integer[], $4::bigint[], $5::bigint[])
    )
    SELECT pg_notify($6::text, '{StoreNotice.MESSAGE}:' || {notice_argument("t")})
    FROM unnest($7::text[]) AS t
"""
_CLAIM = """
    UPDATE durably_messages m
    SET claimed_by = $2, claimed_until = $4::bigint + $5::bigint, deliveries = m.deliveries + 1
    WHERE m.id IN (
        SELECT id FROM durably_messages
        WHERE topic = ANY($1::text[]) AND available_at <= $4
            AND (claimed_until IS NULL OR claimed_until < $4)
        ORDER BY priority DESC, id
        LIMIT $3
        FOR UPDATE SKIP LOCKED
    )
    RETURNING m.id, m.topic, m.body, m.priority, m.deliveries
"""
_RELEASE = """
    UPDATE durably_messages SET claimed_by = NULL, claimed_until = NULL,
        available_at = COALESCE($3::bigint, available_at)
    WHERE id = ANY($1::bigint[]) AND claimed_by = $2
    RETURNING topic
"""
_EXTEND = """
    UPDATE durably_messages SET claimed_until = $3
    WHERE id = ANY($1::bigint[]) AND claimed_by = $2
    RETURNING id
"""
_NOTIFY = (
    f"SELECT pg_notify($1::text, $2::text || ':' || {notice_argument('a')}) "
    "FROM unnest($3::text[]) AS a"
)


class PgMessageQueue:
    """A :class:`~durably._queue.MessageQueue` on a :class:`PostgresStore`'s pool."""

    poll_interval = 1.0

    def __init__(
        self,
        pool: Callable[[], Any],
        channel: str,
        listen: Callable[[Listener], Awaitable[Unlisten]],
    ) -> None:
        self._pool = pool
        self._channel = channel
        self._listen = listen
        self._created = False
        self._creating = asyncio.Lock()

    async def _ready(self) -> Any:
        pool = self._pool()
        if not self._created:
            async with self._creating:
                if not self._created:
                    async with pool.acquire() as conn, conn.transaction():
                        # concurrent CREATE … IF NOT EXISTS may still collide
                        await conn.execute(_LOCK)
                        for statement in _CREATE:
                            await conn.execute(statement)
                    self._created = True
        return pool

    async def push(self, messages: list[OutMessage]) -> None:
        """Insert the messages and notify their topics, in one transaction."""
        if not messages:
            return
        pool = await self._ready()
        created = int(time.time() * 1000)
        topics = list(dict.fromkeys(m.topic for m in messages))
        chunks = [messages[i : i + PUSH_CHUNK] for i in range(0, len(messages), PUSH_CHUNK)]

        def params(number: int, chunk: list[OutMessage]) -> tuple[Any, ...]:
            return (
                [m.topic for m in chunk],
                [m.body for m in chunk],
                [int(m.priority) for m in chunk],
                [int(m.available_at or 0) for m in chunk],
                [created] * len(chunk),
                self._channel,
                topics if number == len(chunks) else [],
            )

        if len(chunks) == 1:
            # One statement is its own transaction: no BEGIN and COMMIT
            # round trips around it.
            await pool.execute(_PUSH, *params(1, chunks[0]))
            return
        async with pool.acquire() as conn, conn.transaction():
            for number, chunk in enumerate(chunks, start=1):
                await conn.execute(_PUSH, *params(number, chunk))

    async def claim(
        self, topics: list[str], owner: str, limit: int, lease_ms: int, now: int
    ) -> list[Message]:
        """Claim up to ``limit`` visible messages, highest priority then oldest first."""
        if not topics or limit <= 0:
            return []
        pool = await self._ready()
        rows = await pool.fetch(_CLAIM, topics, owner, limit, now, lease_ms)
        claimed = [
            Message(r["id"], r["topic"], r["body"], r["priority"], r["deliveries"]) for r in rows
        ]
        claimed.sort(key=lambda m: (-m.priority, m.id))
        return claimed

    async def ack(self, ids: list[int]) -> None:
        """Delete the messages."""
        if ids:
            pool = await self._ready()
            await pool.execute("DELETE FROM durably_messages WHERE id = ANY($1::bigint[])", ids)

    async def release(self, ids: list[int], owner: str, *, available_at: int | None = None) -> None:
        """Hand back the messages ``owner`` holds (and wake their consumers)."""
        if not ids:
            return
        pool = await self._ready()
        async with pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(_RELEASE, ids, owner, available_at)
            topics = list(dict.fromkeys(row["topic"] for row in rows))
            if topics and available_at is None:
                await conn.execute(_NOTIFY, self._channel, StoreNotice.MESSAGE, topics)

    async def extend(self, ids: list[int], owner: str, lease_ms: int, now: int) -> list[int]:
        """Push the lease of the messages ``owner`` still holds to ``now + lease_ms``."""
        if not ids:
            return []
        pool = await self._ready()
        rows = await pool.fetch(_EXTEND, ids, owner, now + lease_ms)
        return [row["id"] for row in rows]

    async def depth(self, topics: list[str] | None = None) -> dict[str, int]:
        """Messages per topic."""
        pool = await self._ready()
        if topics is None:
            rows = await pool.fetch(
                "SELECT topic, count(*) AS n FROM durably_messages GROUP BY topic"
            )
        else:
            rows = await pool.fetch(
                "SELECT topic, count(*) AS n FROM durably_messages "
                "WHERE topic = ANY($1::text[]) GROUP BY topic",
                topics,
            )
        return {row["topic"]: row["n"] for row in rows}

    async def broadcast(self, kind: str, arguments: list[str]) -> None:
        """``NOTIFY <channel>, '<kind>:<argument>'`` for each argument."""
        if arguments:
            await self._pool().execute(_NOTIFY, self._channel, kind, arguments)

    async def listen(self, listener: Listener) -> Unlisten:
        """Hear every notification on the store's channel (pushes, broadcasts,
        and the store's own ``pending:``/``settled:``… which listeners ignore)."""
        return await self._listen(listener)
