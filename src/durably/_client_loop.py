"""An event loop of its own in a daemon thread, for calling async code from sync code.

:class:`~durably.SyncClient` runs its :class:`~durably.Client` here. Every
call is handed to this one loop (``asyncio.run_coroutine_threadsafe``), so
the store's connections (an asyncpg pool, say) stay bound to the loop they
were made on however many threads and requests call in — unlike
``asyncio.run(...)`` per request, which fails at the second call once the
first loop is closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .errors import DurablyError, WrongEventLoop

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """A running event loop in a daemon thread, and a blocking :meth:`call` into it."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._closed

    def call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Run ``coro`` on the loop and block until it returns (or raises).

        Raises :class:`~durably.WrongEventLoop` when called from a thread
        that is running an event loop: blocking it would stall that loop (and
        deadlock if it is this one), so async code must ``await`` a
        :class:`~durably.Client` instead.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise WrongEventLoop(
                f"SyncClient.{what}() was called from a running event loop, where blocking "
                "would stall (or deadlock) it; in async code use durably.Client and await "
                "its methods"
            )
        if os.getpid() != self._pid:
            # Forked: the loop thread stayed in the parent; waiting on it would hang.
            coro.close()
            raise DurablyError(
                f"SyncClient.{what}(): this object was made in another process (before a "
                "fork); make a handle again from the SyncClient in this process"
            )
        with self._lock:
            if self._closed:
                coro.close()
                raise DurablyError(f"SyncClient.{what}(): the client is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._closed:
                raise DurablyError(f"SyncClient.{what}(): the client was closed") from None
            raise
        except BaseException:
            # KeyboardInterrupt in the caller: do not leave the call running.
            future.cancel()
            raise
        finally:
            with self._lock:
                self._pending.discard(future)

    def stop(self) -> None:
        """Stop the loop and wait for its thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stranded = list(self._pending)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        for future in stranded:
            # A call still in flight when the loop stopped would block forever.
            future.cancel()
