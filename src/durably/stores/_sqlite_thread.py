"""One SQLite connection owned by one thread, with group commit.

SQLite allows one writer at a time, and a commit costs far more than the
statements inside it. So every operation is queued to a single thread, which
takes whatever has queued up since its last commit and runs it all inside one
``BEGIN IMMEDIATE … COMMIT``. Operations rarely fail, so none pays for a
savepoint: if one raises, the batch is rolled back and every operation of it
runs again in a transaction of its own, so only the failing one fails. The
event loop pays one thread hop per batch, never a blocking call.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["SqliteThread"]

T = TypeVar("T")
_Op = tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]
_Outcome = tuple[asyncio.Future[Any], Any, BaseException | None]

_MAX_BATCH = 512


class SqliteThread:
    """Runs functions of a connection on a dedicated thread, batching commits."""

    def __init__(self, path: str, *, busy_timeout_ms: int = 30_000) -> None:
        self._path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.gone: str | None = None
        """Why the file may no longer be used (deleted under us), once it happened."""

    def start(self) -> None:
        """Open the connection on a new thread; raise if it cannot be opened."""
        if self._thread is not None:
            return
        self._ready.clear()  # a restart after stop() waits for its own connection
        self._thread = threading.Thread(target=self._serve, name="durably-sqlite", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread = None
            raise self._startup_error

    async def stop(self) -> None:
        """Finish queued work and close the connection."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(thread.join)

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` inside the next committed batch and return its result."""
        return await self.submit(fn)

    def submit(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        """Queue ``fn(connection)`` now; the future resolves once its batch committed.

        Calls are executed in the order they were submitted.
        """
        if self._thread is None:
            raise RuntimeError("the SQLite store is closed")
        if self.gone is not None:
            raise FileNotFoundError(self.gone)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((fn, future, loop))
        return future

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        # Processes opening a new file together race to switch it to WAL, and
        # SQLite answers the loser "database is locked" at once, busy_timeout
        # or not (about one start in eight with four openers): retry it here
        # for as long as busy_timeout would have waited.
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    conn.close()
                    raise
                time.sleep(0.005)
        # NORMAL in WAL mode never corrupts the database; a power loss may drop
        # the last commits, a process crash (what durably guards against) loses nothing.
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    def _serve(self) -> None:
        self._startup_error = None
        try:
            conn = self._connect()
        except BaseException as exc:  # surfaced to start()'s caller
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    return
                batch = [first]
                stop = False
                while len(batch) < _MAX_BATCH:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        stop = True
                        break
                    batch.append(item)
                self._run_batch(conn, batch)
                if stop:
                    return
        finally:
            conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        outcomes = self._try_together(conn, batch)
        if outcomes is None:
            # Something in the batch failed: undo it all, then give every
            # operation a transaction of its own so only the culprit fails.
            outcomes = [
                outcome
                for op in batch
                for outcome in self._try_together(conn, [op], alone=True) or ()
            ]
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for (_, _, loop), outcome in zip(batch, outcomes, strict=True):
            by_loop.setdefault(loop, []).append(outcome)
        for loop, items in by_loop.items():
            # A loop that closed while we worked has nobody waiting on it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, items)

    def _try_together(
        self, conn: sqlite3.Connection, batch: list[_Op], *, alone: bool = False
    ) -> list[_Outcome] | None:
        """Run ``batch`` in one transaction. ``None`` if an operation raised
        and the batch had others (all undone); alone, its error is the outcome."""
        outcomes: list[_Outcome] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for fn, future, _ in batch:
                outcomes.append((future, fn(conn), None))
            conn.execute("COMMIT")
        except Exception as exc:
            if conn.in_transaction:
                # a failing rollback must not kill the thread: every caller would hang
                with contextlib.suppress(sqlite3.Error):
                    conn.rollback()
            if len(batch) > 1 and not alone:
                return None
            return [(future, None, exc) for _, future, _ in batch]
        return outcomes


def _resolve(items: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, error in items:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
