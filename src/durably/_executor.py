"""The in-process executor: at most N runs at once, the rest wait as ids."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from ._logs import engine_logger

__all__ = ["Done", "RunExecutor"]

Done = Callable[[bool], None]
"""Called when a submission's execution finished (``True``) or was dropped."""

_log = engine_logger("durably.executor")


class RunExecutor:
    """Executes ``handler(run_id)`` for submitted ids, ``limit`` at a time.

    Waiting ids cost a string each, so a fan of thousands of runs does not
    hold thousands of coroutines. An id already waiting is not queued twice,
    and a poll's id (``wake=False``) is dropped while that run executes here.
    A wake is kept: it must reach the run even mid-turn.

    An execution that only waits (a turn holding for a dispatched step's
    result) may lend its slot (:meth:`lend`) to the next waiting id, and
    takes one back (:meth:`reclaim`) before it does anything more, ahead of
    the ids waiting: at most ``limit`` executions work at once.
    """

    def __init__(
        self,
        handler: Callable[[str, bool], Awaitable[None]],
        limit: int,
        *,
        on_room: Callable[[], None] | None = None,
        on_full: Callable[[int], None] | None = None,
    ) -> None:
        """``on_room()`` is called each time an execution ends with no id
        waiting: a slot is free, and the owner may have more work to hand over.
        ``on_full(waiting)`` is called when ids are left waiting for a slot:
        executions that can let go of theirs (turns holding across a
        dispatched step) should, that many."""
        self._handler = handler
        self._limit = limit
        self._on_room = on_room
        self._on_full = on_full
        self._waiting: deque[str] = deque()
        self._waiting_ids: dict[str, bool] = {}
        self._executing: dict[str, int] = {}
        """Executions of each run id now: a wake mid-turn starts a second one."""
        self._waiting_done: dict[str, list[Done]] = {}
        self._executing_done: dict[str, list[Done]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lent: set[str] = set()
        self._reclaims: deque[tuple[str, asyncio.Future[None]]] = deque()
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def busy(self) -> int:
        """Runs executing now."""
        return len(self._tasks)

    @property
    def waiting(self) -> int:
        """Run ids waiting for a slot."""
        return len(self._waiting)

    @property
    def working(self) -> int:
        """Executions holding a slot now (busy ones that did not lend theirs)."""
        return len(self._tasks) - len(self._lent)

    @property
    def lent(self) -> int:
        """Executions that lent their slot (:meth:`lend`) and hold none now."""
        return len(self._lent)

    @property
    def reclaiming(self) -> int:
        """Executions waiting to take a slot back (:meth:`reclaim`)."""
        return len(self._reclaims)

    def lend(self, run_id: str) -> bool:
        """``run_id``'s execution only waits from now on: its slot goes to
        the next waiting id. ``False`` (nothing lent) if ``run_id`` does not
        execute here or lent its slot already; otherwise it must
        :meth:`reclaim` a slot before it does anything more."""
        if run_id not in self._executing or run_id in self._lent:
            return False
        self._lent.add(run_id)
        if self._waiting or self._reclaims:
            self._pump()
        return True

    def reclaim(self, run_id: str) -> asyncio.Future[None] | None:
        """Take a slot back for ``run_id``'s execution, which lent its own:
        ``None`` if it has one again now, else a future done once it has
        (served before any waiting id). Cancelling that future gives up the
        claim; the execution then holds no slot until it ends."""
        if run_id not in self._lent:
            return None
        if len(self._tasks) - len(self._lent) < self._limit:
            self._lent.discard(run_id)
            return None
        claim: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reclaims.append((run_id, claim))
        return claim

    def submit(self, run_id: str, *, wake: bool = False, on_done: Done | None = None) -> None:
        """Execute ``run_id`` when a slot is free (no-op once closed).

        ``on_done(True)`` is called once the execution this submission joined
        has finished (at once if a poll's id was merged into one executing
        now), ``on_done(False)`` if it raised or was dropped (the executor closed).
        """
        if self._closed:
            if on_done is not None:
                on_done(False)
            return
        if run_id in self._waiting_ids:
            self._waiting_ids[run_id] |= wake
            if on_done is not None:
                self._waiting_done.setdefault(run_id, []).append(on_done)
            return
        if not wake and run_id in self._executing:
            if on_done is not None:
                on_done(True)
            return
        self._waiting.append(run_id)
        self._waiting_ids[run_id] = wake
        if on_done is not None:
            self._waiting_done.setdefault(run_id, []).append(on_done)
        self._pump()

    def knows(self, run_id: str) -> bool:
        """Whether ``run_id`` is waiting for a slot or executing here."""
        return run_id in self._waiting_ids or run_id in self._executing

    def executing(self, run_id: str) -> bool:
        """Whether ``run_id`` is executing in this process now."""
        return run_id in self._executing

    def _pump(self) -> None:
        # A slot taken back goes first: that execution is mid-turn, under its lease.
        reclaims = self._reclaims
        while reclaims and len(self._tasks) - len(self._lent) < self._limit:
            run_id, claim = reclaims.popleft()
            if claim.done() or run_id not in self._lent:
                continue  # given up (its turn was cancelled), or its execution ended
            self._lent.discard(run_id)
            claim.set_result(None)
        while self._waiting and len(self._tasks) - len(self._lent) < self._limit:
            run_id = self._waiting.popleft()
            wake = self._waiting_ids.pop(run_id)
            done = self._waiting_done.pop(run_id, None)
            if done:
                self._executing_done.setdefault(run_id, []).extend(done)
            # Known from submission on (no gap before the task runs).
            self._executing[run_id] = self._executing.get(run_id, 0) + 1
            task = asyncio.create_task(self._run(run_id, wake), name=f"durably-run:{run_id}")
            self._tasks.add(task)
            self._idle.clear()
        if self._waiting and self._on_full is not None:
            self._on_full(len(self._waiting))

    async def _run(self, run_id: str, wake: bool) -> None:
        ok = True
        try:
            await self._handler(run_id, wake)
        except Exception:
            ok = False
            _log.exception("executing run %s failed", run_id)
        finally:
            # Another execution of this id (a wake's, which found the run
            # leased by this one or waited for it) may still run and may be
            # the one that lent the slot: its mark and claim stay until the
            # last one ends, else its claim would never be served.
            left = self._executing.pop(run_id) - 1
            if left:
                self._executing[run_id] = left
            else:
                self._lent.discard(run_id)  # ended without taking its slot back
            for on_done in self._executing_done.pop(run_id, ()):
                on_done(ok)
            task = asyncio.current_task()
            if task is not None:
                self._tasks.discard(task)
            self._pump()
            if not self._tasks and not self._waiting:
                self._idle.set()
            if not self._waiting and not self._closed and self._on_room is not None:
                self._on_room()

    async def join(self) -> None:
        """Wait until nothing executes or waits."""
        await self._idle.wait()

    async def close(self, timeout: float) -> set[asyncio.Task[None]]:
        """Stop taking work, drop waiting ids, wait up to ``timeout`` for the
        running ones; return those still running."""
        self._closed = True
        self._waiting.clear()
        self._waiting_ids.clear()
        dropped, self._waiting_done = self._waiting_done, {}
        for callbacks in dropped.values():
            for on_done in callbacks:
                on_done(False)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        return {t for t in self._tasks if not t.done()}

    def reopen(self) -> None:
        """Accept work again after :meth:`close`."""
        self._closed = False
