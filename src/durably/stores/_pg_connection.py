"""The plumbing under one PostgreSQL store: its pool, its LISTEN connection
and its schema migration.

:class:`~durably.stores.postgres.PostgresStore` holds the SQL of every store
method; this module holds what any of them needs first, and keeps it out of
the way of reading that SQL (as :mod:`._sqlite_thread` does for SQLite):

- **The pool.** asyncpg connections with generic plans, no reset query and
  the store's schema on the ``search_path``. :meth:`PgConnection.connection`
  keeps one connection out of the pool for the next sequential call and
  gives any other back *after* the caller has its answer.
- **LISTEN.** One dedicated connection listens on the schema's channel and
  fans each notification out to the store's subscriber and to any listeners
  (the message queue's); it is re-opened if it drops.
- **Migration.** Creating or upgrading the schema, serialised across
  processes by an advisory lock, so a fleet starting together migrates once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from .._logs import engine_logger
from .._notices import StoreNotice
from ._postgres_schema import MIGRATIONS

__all__ = ["PgConnection", "split_schema"]

_log = engine_logger("durably.stores.postgres")

_LOCK_MIGRATIONS = "SELECT pg_advisory_xact_lock(hashtextextended('durably:migrate', 0))"
RELISTEN_DELAYS: tuple[float, ...] = (0.5, 1, 2, 5, 10, 30)
"""Seconds between attempts to LISTEN again after the connection dropped; the
last repeats until it works."""

_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def _has_idle(pool: Any) -> bool:
    """Whether ``pool`` holds an idle, connected connection of its own.

    ``Pool.get_idle_size()`` counts every one (two calls per holder: ~45 calls
    of each one-step run's ~1,000); the first found is enough. asyncpg connects
    its ``min_size`` connections at the end of its (private) holder list, so
    the search starts there; without that list, the public count."""
    holders = getattr(pool, "_holders", None)
    if holders is None:
        return bool(pool.get_idle_size())
    return any(h.is_connected() and h.is_idle() for h in reversed(holders))


class _Checkout:
    """:meth:`PgConnection.connection`'s context manager. A class, not an
    ``@asynccontextmanager`` generator: it is entered for both statements of
    every one-step run, and the generator costs a frame, a wrapper object and
    two more coroutine hops on each entry and exit (profiled on the latency
    path, bench/RESULTS.md 2026-12-02)."""

    __slots__ = ("_conn", "_db", "_pool")

    def __init__(self, db: PgConnection) -> None:
        self._db = db
        self._pool: Any = None
        self._conn: Any = None

    async def __aenter__(self) -> Any:
        db = self._db
        pool = self._pool = db.pool()
        if db._hot is not None and not db._queued:
            self._conn, db._hot = db._hot, None
        else:
            self._conn = await db._acquire(pool)
        return self._conn

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        conn, pool, self._conn = self._conn, self._pool, None
        if exc_type is not None:
            await pool.release(conn)
            return
        self._db._give_back(pool, conn)


class PgConnection:
    """The pool, LISTEN connection and migrations of one store on one schema.

    ``url`` may carry ``?schema=``; ``schema`` overrides it. ``connect_kwargs``
    go to :func:`asyncpg.create_pool` (and, minus the pool options, to the
    LISTEN connection).
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str | None,
        min_size: int,
        max_size: int,
        connect_kwargs: dict[str, Any],
    ) -> None:
        dsn, url_schema = split_schema(url)
        self.schema = schema if schema is not None else url_schema
        """The schema holding the tables (``None``: the server's ``search_path``)."""
        if self.schema is not None and not _SCHEMA_NAME.match(self.schema):
            raise ValueError(f"invalid schema name {self.schema!r}")
        self.channel = f"durably_{self.schema or 'public'}"
        """The LISTEN/NOTIFY channel of this schema."""
        self._dsn = dsn
        self._min_size = min_size
        self._max_size = max_size
        self._connect_kwargs = connect_kwargs
        self._pool: Any = None
        self._opening = asyncio.Lock()
        self._releasing: set[asyncio.Future[None]] = set()
        self._hot: Any = None  # an idle connection kept out of the pool (see connection())
        self._queued = 0  # connection() callers waiting for the pool
        self._listener: Any = None
        self._on_event: Callable[[str, str], None] | None = None
        self._listeners: list[Callable[[str, str], None]] = []  # besides on_event
        self._relistening: asyncio.Task[None] | None = None
        # Server pids of this pool's connections: a settle notice from one of
        # them is this process's own (see _heard).
        self._own_pids: set[int] = set()

    # -- the pool ----------------------------------------------------------------------

    async def open(self) -> None:
        """Connect the pool and create or upgrade the schema. Idempotent."""
        async with self._opening:
            if self._pool is None:
                self._pool = await self._connect()

    def pool(self) -> Any:
        """The open pool; ``RuntimeError`` when the store is not open."""
        if self._pool is None:
            raise RuntimeError("the PostgreSQL store is not open")
        return self._pool

    def connection(self) -> _Checkout:
        """A connection for one hot-path statement (or transaction).

        One connection stays checked out between calls (the *hot* one) and
        serves the next call that finds it idle: a sequential caller skips the
        pool's acquire and release (several loop turns and a task each), and
        its statements keep landing on the same, warm, server backend. A
        concurrent caller gets a pooled connection, which it gives back after
        it has its answer, or keeps as the hot one (see :meth:`_keeps`). A
        connection whose call raised (cancelled included) goes back to the
        pool, which cleans it up, and is never kept.
        """
        return _Checkout(self)

    async def _acquire(self, pool: Any) -> Any:
        """A connection from the pool, for a caller that found no idle hot one."""
        # Behind callers already waiting for the pool, never ahead of
        # them: statements go out in the order they were asked for.
        self._queued += 1
        try:
            return await pool.acquire()
        finally:
            self._queued -= 1

    def _give_back(self, pool: Any, conn: Any) -> None:
        """After a call that succeeded: keep ``conn`` hot, or release it in the background."""
        if self._keeps(pool, conn):
            self._hot = conn
        else:
            release = asyncio.ensure_future(pool.release(conn))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)

    def _keeps(self, pool: Any, conn: Any) -> bool:
        """Whether ``conn``, just used, stays out as the hot connection: when
        the slot is free, nobody waits for the pool, and the pool keeps an idle
        connection of its own. Otherwise a concurrent caller would have to open
        a new connection (milliseconds) while this one sits idle, and callers
        would overtake each other (a turn that asked first would take its slot
        in a queue last)."""
        return (
            self._hot is None
            and not self._queued
            and self._pool is pool
            and not conn.is_closed()
            and _has_idle(pool)
        )

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        """A connection inside a transaction, committed on exit (the hot one when idle)."""
        async with self.connection() as conn, conn.transaction():
            yield conn

    async def close(self) -> None:
        """Wait for connections still being given back, then close the pool.
        Idempotent; call :meth:`stop_listening` first."""
        hot, self._hot = self._hot, None
        if hot is not None and self._pool is not None:
            await self._pool.release(hot)
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def _connect(self) -> Any:
        kwargs = dict(self._connect_kwargs)
        settings: dict[str, str] = dict(kwargs.pop("server_settings", None) or {})
        settings.setdefault("application_name", "durably")
        # Every statement here is index-driven by design and sent as a prepared
        # statement; left to choose, PostgreSQL re-plans the multi-part write
        # batch on every execution (its custom plan looks cheaper than the
        # generic one), which cost more than executing it.
        settings.setdefault("plan_cache_mode", "force_generic_plan")
        # Nor do they gain from parallel workers, which the generic plan can
        # choose for a poll that reads a page: at 1,000,000 runs the deadline
        # sweep found nothing in its index and still started two workers, 8 ms
        # a tick instead of 0.1 (bench/grow-explain.md).
        settings.setdefault("max_parallel_workers_per_gather", "0")
        if self.schema is not None:
            settings["search_path"] = f'"{self.schema}"'
        # The store keeps no session state on pooled connections (advisory
        # locks are transaction-scoped, LISTEN has its own connection), so a
        # released connection needs no reset query: asyncpg still rolls back a
        # transaction left open, and the round trip it saves is on every call.
        kwargs.setdefault("reset", _keep_session)
        user_init = kwargs.pop("init", None)

        async def init(conn: Any) -> None:
            self._own_pids.add(conn.get_server_pid())
            if user_init is not None:
                await user_init(conn)

        kwargs["init"] = init
        pool = await asyncpg.create_pool(
            self._dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            server_settings=settings,
            **kwargs,
        )
        try:
            async with pool.acquire() as conn:
                await self._migrate(conn)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def _migrate(self, conn: Any) -> None:
        async with conn.transaction():
            await conn.execute(_LOCK_MIGRATIONS)
            if self.schema is not None:
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS durably_meta (key TEXT PRIMARY KEY, value TEXT)"
            )
            found = await conn.fetchval(
                "SELECT value FROM durably_meta WHERE key = 'schema_version'"
            )
            version = int(found) if found is not None else 0
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"the database schema is version {version}, newer than this durably "
                    f"({len(MIGRATIONS)}); upgrade durably"
                )
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                await conn.execute(script)
                await conn.execute(
                    "INSERT INTO durably_meta (key, value) VALUES ('schema_version', $1) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    str(number),
                )

    # -- LISTEN --------------------------------------------------------------------------

    async def subscribe(self, on_event: Callable[[str, str], None]) -> None:
        """LISTEN on the channel; ``on_event(kind, argument)`` for each
        notification (one subscriber: a later call replaces it)."""
        self._on_event = on_event
        if self._listener is None and not self._reconnecting():
            await self._listen()

    async def listen(self, listener: Callable[[str, str], None]) -> Callable[[], None]:
        """Also call ``listener(kind, argument)`` for each notification on the
        channel (LISTENing from now on); returns its removal."""
        self._listeners.append(listener)
        if self._listener is None and not self._reconnecting():
            await self._listen()

        def unlisten() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unlisten

    async def stop_listening(self) -> None:
        """Forget every listener and close the LISTEN connection. Idempotent."""
        self._on_event = None
        self._listeners.clear()
        relistening, self._relistening = self._relistening, None
        if relistening is not None and relistening is not asyncio.current_task():
            relistening.cancel()
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.close()

    async def _listen(self) -> None:
        kwargs = dict(self._connect_kwargs)
        kwargs.pop("server_settings", None)
        kwargs.pop("reset", None)  # pool options
        kwargs.pop("init", None)
        conn = await asyncpg.connect(self._dsn, **kwargs)
        await conn.add_listener(self.channel, self._heard)
        conn.add_termination_listener(self._listener_lost)
        self._listener = conn

    def _heard(self, _conn: Any, pid: int, _channel: str, payload: str) -> None:
        kind, _, argument = payload.partition(":")
        # The subscriber hears other processes' changes. A settle sent from our
        # own pool was handed to this process's waiters in memory already;
        # passing its echo on made the engine re-read the run, once per turn
        # of every watched run. Other listeners still hear everything.
        if self._on_event is not None and not (
            kind == StoreNotice.SETTLED and pid in self._own_pids
        ):
            self._on_event(kind, argument)
        for listener in list(self._listeners):
            listener(kind, argument)

    def _listener_lost(self, _conn: Any) -> None:
        if not self._wants_notices():
            return  # closing
        _log.warning("lost the LISTEN connection of %s; reconnecting", self.channel)
        self._listener = None
        if self._relistening is None or self._relistening.done():
            # Kept referenced: the loop holds tasks weakly, and a collected
            # one would end the reconnecting silently.
            self._relistening = asyncio.get_running_loop().create_task(self._relisten())

    def _reconnecting(self) -> bool:
        return self._relistening is not None and not self._relistening.done()

    def _wants_notices(self) -> bool:
        return (self._on_event is not None or bool(self._listeners)) and self._pool is not None

    async def _relisten(self) -> None:
        # Until it works or nobody listens any more: a database restart can
        # outlast any fixed schedule, and giving up would leave the engine
        # deaf until restarted (leaning on its poll, which may be long).
        attempt = 0
        while self._wants_notices() and self._listener is None:
            try:
                await self._listen()
            except (OSError, asyncpg.PostgresError) as exc:
                delay = RELISTEN_DELAYS[min(attempt, len(RELISTEN_DELAYS) - 1)]
                if attempt == len(RELISTEN_DELAYS) - 1:
                    _log.error(
                        "cannot LISTEN on %s (%s); relying on polling, retrying every %ss",
                        self.channel,
                        exc,
                        delay,
                    )
                attempt += 1
                await asyncio.sleep(delay)
                continue
            if not self._wants_notices():
                # Stopped while connecting: do not keep a connection nobody closes.
                stray: Any = self._listener
                self._listener = None
                await stray.close()
            return


async def _keep_session(_conn: Any) -> None:
    """The pool's ``reset=``: nothing to undo on a released connection."""


def split_schema(url: str) -> tuple[str, str | None]:
    """Take a ``schema`` query parameter out of ``url``: asyncpg would send it
    to the server as a setting, which PostgreSQL rejects."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((value for key, value in query if key == "schema"), None)
    if schema is None:
        return url, None
    rest = urlencode([(key, value) for key, value in query if key != "schema"])
    return urlunsplit(parts._replace(query=rest)), schema
