"""Waiting for runs to settle, for any number of waiters at once.

A turn that settles in this process hands its outcome straight to the
waiters. Runs settled by other processes are found by one poll for all
waiters together (``get_runs`` in batches of 500), so ten thousand
``wait_for_run`` calls cost a few queries per interval, not ten thousand.
Where the store announces settles (PostgreSQL), that poll only stands in for
announcements lost, and runs at a slower interval.

The store announces a settle to other processes only for runs marked watched
(``watch_runs``): a waiter here marks a run executing elsewhere as it first
reads it, and a run of its own once it is put aside (suspended or blocked:
it may resume in any process). A run waited for only where it executes
costs no announcement at all.

A read is never newer than this process's own word on a run it drives: from
the moment a run is woken here until its turn settles, the store still shows
the settle before the wake, so a read of a run queued or executing here, or
one that was woken here while the read was out, answers no waiter.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from ._aio import wait_event
from ._batch import BatchCall
from .model import Run, RunResult, RunStatus

__all__ = ["RunWatcher"]


def _nowhere(run_id: str) -> bool:
    return False


_Entry = tuple[asyncio.Future[RunResult], frozenset[RunStatus]]
ANNOUNCED_INTERVAL = 1.0
"""The safety net's interval (seconds) once the store announces settles here."""
_RECENT_LIMIT = 1024
_ASIDE = frozenset({RunStatus.SUSPENDED, RunStatus.BLOCKED})
_REMEMBERED = frozenset(
    {
        RunStatus.COMPLETED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.DEAD,
        RunStatus.SUSPENDED,
    }
)


class RunWatcher:
    """Resolves waiters when their run reaches one of the statuses they wait for."""

    def __init__(
        self,
        get_runs: Callable[[list[str]], Awaitable[list[Run]]],
        interval: float = 0.1,
        watch_runs: Callable[[list[str]], Awaitable[list[Run]]] | None = None,
        get_statuses: Callable[[list[str]], Awaitable[dict[str, RunStatus]]] | None = None,
        announced_interval: float = ANNOUNCED_INTERVAL,
    ) -> None:
        """``watch_runs`` reads runs as ``get_runs`` does and marks them watched
        (the store's :meth:`~durably.stores.base.RunStore.watch_runs`);
        ``get_statuses`` reads their statuses alone
        (:class:`~durably.stores.base.RunStatusStore`). Every waited run is
        read each ``interval`` seconds, or each ``announced_interval`` once
        :attr:`announced`."""
        self._get_runs = get_runs
        self._watch_runs = watch_runs or get_runs
        # Many waits begun at once (a client starting a batch of runs, then
        # waiting for each) read and mark their runs in one statement, not
        # one each (a round trip per run on PostgreSQL).
        self._watch_batch: BatchCall[str, Run | None] = BatchCall(self._watch_many)
        self._get_statuses = get_statuses
        self.interval = interval
        self.announced_interval = announced_interval
        self.announced = False
        """Whether the store announces here the settles of runs marked watched
        (set by the engine once subscribed): the net then only stands in for
        announcements lost, and reads every ``announced_interval``. A thousand
        waits for runs queued elsewhere made its reads ~5-10% of a dispatched
        step's CPU on PostgreSQL at ``interval``."""
        self._waiting: dict[str, list[_Entry]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._poke = asyncio.Event()
        self._poked: set[str] = set()
        self._recent: OrderedDict[str, RunResult] = OrderedDict()
        self._watched: set[str] = set()  # waited-for runs marked watched by this process
        self._marking: set[asyncio.Task[None]] = set()
        self._wakes = 0  # how many times a waited run was woken here, ever
        self._woken_at: dict[str, int] = {}  # a waited run -> ``_wakes`` at its last wake
        self.runs_here: Callable[[str], bool] = _nowhere
        """Whether a run is queued or executing in this process (set by the
        router): its turn's settle is the only current word on it."""

    async def watch(self, run_id: str) -> Run | None:
        """Read a run this process does not execute and mark it watched, so its
        settles elsewhere are announced here (then :meth:`wait` on it)."""
        return await self._watch_batch(run_id)

    async def _watch_many(self, run_ids: list[str]) -> list[Run | None]:
        found = {run.run_id: run for run in await self._watch_runs(run_ids)}
        return [found.get(run_id) for run_id in run_ids]

    async def wait(
        self, run: Run, statuses: frozenset[RunStatus], timeout: float | None
    ) -> RunResult:
        """Wait until ``run`` (as last read) reaches one of ``statuses``."""
        if run.status in statuses:
            return RunResult(run.run_id, run.status, run.output, run.error)
        future: asyncio.Future[RunResult] = asyncio.get_running_loop().create_future()
        self._watched.add(run.run_id)  # read through watch()
        # Settled between the caller's read and our registration: the next
        # poll sees it, and it is due at once.
        return await self._register(run.run_id, (future, statuses), timeout, poke=True)

    async def _register(
        self, run_id: str, entry: _Entry, timeout: float | None, *, poke: bool
    ) -> RunResult:
        self._waiting.setdefault(run_id, []).append(entry)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        if poke:
            self._poked.add(run_id)
            self._poke.set()
        future = entry[0]
        try:
            # Not asyncio.wait_for: on Python 3.11 it drops a cancel of the
            # caller that lands as the run settles, and returns the result.
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            if future.done() and not future.cancelled():
                return future.result()  # settled in the iteration the timeout fired
            raise TimeoutError(f"wait_for_run({run_id!r}) timed out") from None
        finally:
            entries = self._waiting.get(run_id)
            if entries is not None:
                if entry in entries:
                    entries.remove(entry)
                if not entries:
                    del self._waiting[run_id]
            if run_id not in self._waiting:
                self._watched.discard(run_id)
                self._woken_at.pop(run_id, None)

    async def wait_local(
        self, run_id: str, statuses: frozenset[RunStatus], timeout: float | None
    ) -> RunResult:
        """Wait for a run executing in this process: its settle hands the
        outcome over, so no read is needed (the poll remains the safety net)."""
        recent = self._recent.get(run_id)
        if recent is not None and recent.status in statuses:
            return recent
        future: asyncio.Future[RunResult] = asyncio.get_running_loop().create_future()
        return await self._register(run_id, (future, statuses), timeout, poke=False)

    def forget(self, run_id: str) -> None:
        """A turn of the run starts: what it settled before is no longer current."""
        self._recent.pop(run_id, None)
        if run_id in self._waiting:
            self._wakes += 1
            self._woken_at[run_id] = self._wakes

    def settled(self, result: RunResult) -> None:
        """A run settled in this process: hand its outcome to its waiters."""
        if result.status in _REMEMBERED:
            self._recent[result.run_id] = result
            self._recent.move_to_end(result.run_id)
            if len(self._recent) > _RECENT_LIMIT:
                self._recent.popitem(last=False)
        self._hand_over(result)

    def _hand_over(self, result: RunResult) -> None:
        unmet = False
        for future, statuses in self._waiting.get(result.run_id, ()):
            if result.status in statuses:
                if not future.done():
                    future.set_result(result)
            else:
                unmet = True
        if unmet and result.status in _ASIDE:
            # Put aside until a timer, a signal or a slot: its next turn may
            # run in any process, and that settle must be heard here.
            self._mark(result.run_id)

    def _mark(self, run_id: str) -> None:
        if run_id in self._watched:
            return
        self._watched.add(run_id)
        task = asyncio.get_running_loop().create_task(self._marked(run_id))
        self._marking.add(task)
        task.add_done_callback(self._marking.discard)

    async def _marked(self, run_id: str) -> None:
        asked_at = self._wakes
        try:
            run = await self._watch_batch(run_id)
            runs = [run] if run is not None else []
        except Exception:
            self._watched.discard(run_id)  # the poll remains the net
            return
        self._read(runs, asked_at)

    def _read(self, runs: list[Run], asked_at: int) -> None:
        """Hand runs read from the store (asked when ``_wakes`` was
        ``asked_at``) to their waiters, unless the read may predate a wake here."""
        for run in runs:
            run_id = run.run_id
            if self.runs_here(run_id) or self._woken_at.get(run_id, 0) > asked_at:
                # Its turn here settles it (or the next poll reads it again):
                # the stored row still shows the settle from before the wake.
                continue
            result = RunResult(run_id, run.status, run.output, run.error)
            # Waiters only: ``_recent`` holds this process's own settles, which
            # a read that was out while one happened must not overwrite.
            self._hand_over(result)

    def changed(self, run_id: str) -> None:
        """A run changed somewhere (a notification): look at it now."""
        if run_id in self._waiting:
            self._poked.add(run_id)
            self._poke.set()

    async def close(self) -> None:
        """Stop polling (waiters still waiting time out on their own)."""
        poller, self._poller = self._poller, None
        tasks = [*self._marking, *([poller] if poller is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        every_run_at = loop.time() + self._net_interval()
        while self._waiting:
            # Wait first: a poke (a waiter that read the run before
            # registering, a notification) makes a read of the poked runs due
            # at once; a waiter for a run executing here needs no read at
            # all. Every interval, all waited runs are read (the safety net).
            await wait_event(self._poke, max(0.0, every_run_at - loop.time()))
            self._poke.clear()
            if loop.time() >= every_run_at:
                every_run_at = loop.time() + self._net_interval()
                ids = list(self._waiting)
                net = self._get_statuses is not None
            else:
                # Only the poked ones: with thousands of waiters, a notice
                # per settled turn made each a read of every waited run.
                ids = [run_id for run_id in self._poked if run_id in self._waiting]
                net = False
            self._poked.clear()
            # A run queued or executing here is answered by its own settle
            # (_read would skip its row): reading it is waste, and with a
            # thousand runs waited for while they run here, the net's reads
            # were ~5% of a dispatched step's CPU on PostgreSQL.
            here = self.runs_here
            ids = [run_id for run_id in ids if not here(run_id)]
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                asked_at = self._wakes
                try:
                    if net:
                        # The safety net reads every waited run each interval:
                        # whole (input, output, error decoded) for a thousand
                        # waiters that was ~10% of a dispatched step's CPU.
                        chunk = await self._wanted(chunk)
                    runs = await self._get_runs(chunk) if chunk else []
                except Exception:
                    continue  # the store is failing; the next round tries again
                self._read(runs, asked_at)

    def _net_interval(self) -> float:
        if self.announced:
            return max(self.interval, self.announced_interval)
        return self.interval

    async def _wanted(self, run_ids: list[str]) -> list[str]:
        """Of ``run_ids``, those whose status (read alone) a waiter wants; a run
        put aside that no waiter wants yet is marked, as a whole read would."""
        assert self._get_statuses is not None
        wanted: list[str] = []
        waiting = self._waiting
        # Plain loops, no generator per run: the net reads every run waited
        # for each interval, most of them still queued elsewhere (db://).
        for run_id, status in (await self._get_statuses(run_ids)).items():
            entries = waiting.get(run_id)
            if entries is None:
                continue  # its waiters are gone
            for _, statuses in entries:
                if status in statuses:
                    wanted.append(run_id)
                    break
            else:
                if status in _ASIDE:
                    self._mark(run_id)
        return wanted
