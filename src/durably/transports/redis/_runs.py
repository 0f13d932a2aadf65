"""The run queue on BullMQ (:class:`RedisRuns`): one queue per engine pool,
``{P}-runs`` (``{P}-runs@{pool}`` for a pool other than ``default``).

A job (name ``run``) carries ``{"runId", "wake"}`` and the run's priority
(inverted for BullMQ, as step tasks'). A start's job id is derived from its
run id and the pending state it is for, so a start pushed twice for the same
state is queued once (BullMQ keeps the first job of an id), while a run that
went pending again (a retry, a recovery) gets a job of its own even if the
previous one is still being processed. Wakes get BullMQ's counter ids.

One BullMQ worker per consumed pool, each taking at most ``capacity`` jobs,
with one slot pool across them; BullMQ keeps the locks of held jobs alive and
brings back the jobs of a holder that died (its stalled-job check). The
shared rules live in :mod:`durably._run_queue`.

A consumer also lends its slots to runs born leased here (:meth:`RedisRuns.lend`):
a start on this instance, while every worker here found its queue dry on its
last take and a slot is free, inserts its run already leased to this instance
and runs it here, with no job at all (no add, take or finish: three BullMQ
scripts fewer). A lent slot counts against the slot pool as a held job does,
and keeps room in every worker, so an instance still holds at most
``capacity`` of the queue's runs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import redis.asyncio as aioredis

from ..._queue import Deliver, Delivered, QueuedRun
from ._bullmq import Finisher, Reserved, _BatchWorker, _Consumer, _delayed, _Job, _Queue
from ._names import RedisNames, bullmq_priority

__all__ = ["RedisRuns", "start_job_id"]

_log = logging.getLogger("durably.runqueue")

_ADD_CHUNK = 500
"""Jobs per transaction."""
_RETRY_DELAY_MS = 1000
_JOB_OPTS: dict[str, Any] = {"removeOnComplete": True, "removeOnFail": True}
_COUNTED = ("wait", "active", "delayed", "prioritized", "paused")
_DISCOVER_EVERY_S = 1.0
_STALLS_ALLOWED = 1_000_000
"""A job whose holders keep dying comes back each time (BullMQ's default of 1
would fail it for good; the store would still find the run, but only by polling)."""


class GiveBack(Protocol):
    """Moves a held job back to its queue, visible again after ``delay_ms``."""

    def __call__(self, queue: str, job: _Job, token: str, delay_ms: int = 0) -> Awaitable[None]: ...


AddJobs = Callable[[list[tuple[str, dict[str, Any]]]], Awaitable[None]]
"""Adds jobs (queue name, ``{"name", "data", "opts"}``) in one transaction."""


def start_job_id(run_id: str, state: str) -> str:
    """The job id of a start of ``run_id`` for one pending state (any run id
    fits: BullMQ keys and ids stay free of ``:`` and never look numeric)."""
    digest = hashlib.sha256(f"{run_id}\x00{state}".encode()).hexdigest()[:40]
    return f"start-{digest}"


class _Slots:
    """A semaphore whose slots can also be taken without waiting (:meth:`try_take`)."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        """Take a slot if one is free and nobody waits for one."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def take(self) -> None:
        """Take a slot, waiting in turn for one."""
        if self.try_take():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            else:
                self.give()  # given to us as we were cancelled: pass it on
            raise

    def give(self) -> None:
        """Free a slot: the next waiter's, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1


class _Loan:
    """A slot lent to a run born leased here: the slot pool's slot and the
    room it keeps in each worker."""

    __slots__ = ("room", "slots")

    def __init__(self, slots: _Slots, room: list[Reserved]) -> None:
        self.slots = slots
        self.room = room

    def end(self) -> None:
        for reserved in self.room:
            reserved.cancel()
        self.slots.give()


class RedisRuns:
    """A :class:`~durably._queue.RunBroker` over BullMQ queues."""

    wants_state = True

    def __init__(
        self,
        names: RedisNames,
        connect_url: str,
        client: aioredis.Redis,
        queue: Callable[[str], _Queue],
        give_back: GiveBack,
        add_jobs: AddJobs,
        batches: aioredis.Redis | None = None,
        finisher: Finisher | None = None,
    ) -> None:
        self._names = names
        self._connect_url = connect_url
        self._client = client
        self._queue = queue
        self._give_back = give_back
        self._add_jobs = add_jobs
        self._batches = batches
        self._finisher = finisher
        self._deliver: Deliver | None = None
        self._pools: list[str] | None = None
        self._consumers: dict[str, _Consumer] = {}
        self._closing: list[asyncio.Task[None]] = []
        self._discovery: asyncio.Task[None] | None = None
        self._slots = _Slots(1)
        self._capacity = 1
        self._options: dict[str, Any] = {}
        self._held: set[str] = set()
        self._generation = 0
        self._loans: list[_Loan] = []

    @property
    def held(self) -> int:
        """Jobs taken and not yet finished or handed back."""
        return len(self._held)

    @property
    def lent(self) -> int:
        """Slots lent to runs born leased here and not given back yet."""
        return len(self._loans)

    def lend(self, namespace: str) -> bool:
        """Take a slot for a run of ``namespace`` a start here inserts leased
        to this instance; ``False`` if this instance does not take that
        namespace's runs, has no free slot, or jobs may wait for it (some
        worker's last take filled its room, or it has not taken yet: they go
        first). :meth:`give_back` when that run's turn is over."""
        if self._deliver is None or len(self._held) + len(self._loans) >= self._capacity:
            return False
        if self._names.runs(namespace) not in self._consumers:
            return False
        workers: list[_BatchWorker] = []
        for consumer in self._consumers.values():
            worker: _BatchWorker = consumer.worker  # type: ignore[assignment]
            if not worker.drained or worker.closing:
                return False
            workers.append(worker)
        if not self._slots.try_take():
            return False
        # The slots are shared: a lent one is room no worker may take a job
        # for. A worker without room has a take of its own out.
        loan = _Loan(self._slots, [])
        for worker in workers:
            reserved = worker.reserve(1)
            if reserved is None:
                loan.end()
                return False
            loan.room.append(reserved)
        self._loans.append(loan)
        return True

    def give_back(self) -> None:
        """A slot :meth:`lend` took is free again (for a job, if one waits)."""
        if self._loans:
            self._loans.pop().end()

    def consumer(self, queue: str) -> _Consumer | None:
        """The consumer taking ``queue``'s runs here, if any."""
        return self._consumers.get(queue)

    @property
    def consuming(self) -> bool:
        """Whether this instance takes runs."""
        return self._deliver is not None

    # -- producing -----------------------------------------------------------------------

    async def push(self, runs: list[QueuedRun]) -> None:
        """Add one job per run, by 500 per queue and transaction (BullMQ's add
        scripts, as ``addBulk`` would run them, without its ``SCRIPT EXISTS``)."""
        by_queue: dict[str, list[dict[str, Any]]] = {}
        for run in runs:
            opts = {**_JOB_OPTS, "priority": bullmq_priority(run.priority)}
            if not run.wake and run.state is not None:
                opts["jobId"] = start_job_id(run.run_id, run.state)
            job = {"name": "run", "data": {"runId": run.run_id, "wake": run.wake}, "opts": opts}
            by_queue.setdefault(self._names.runs(run.namespace), []).append(job)
        await asyncio.gather(*(self._add(name, jobs) for name, jobs in by_queue.items()))

    async def _add(self, name: str, jobs: list[dict[str, Any]]) -> None:
        for start in range(0, len(jobs), _ADD_CHUNK):
            await self._add_jobs([(name, job) for job in jobs[start : start + _ADD_CHUNK]])

    # -- consuming -----------------------------------------------------------------------

    async def start(
        self, pools: list[str] | None, deliver: Deliver, *, owner: str, lease_ms: int, capacity: int
    ) -> None:
        """Take the runs of these pools (``None``: of every pool, found by scanning)."""
        if self._deliver is not None:
            return
        self._deliver = deliver
        self._pools = pools
        self._generation += 1
        self._slots = _Slots(capacity)
        self._capacity = capacity
        self._options = {
            "concurrency": capacity,
            "lockDuration": lease_ms,
            "stalledInterval": lease_ms,
            "maxStalledCount": _STALLS_ALLOWED,
            "drainDelay": 1,
        }
        if pools is not None:
            for pool in pools:
                self._consume(self._names.runs(pool))
        else:
            # The default pool's queue at once (an engine without a namespace
            # queues its own runs there); other pools' as they are found.
            self._consume(self._names.runs(None))
            await self._discover_once()
            self._discovery = asyncio.create_task(self._discover(), name="durably-run-queues")

    def _consume(self, name: str) -> None:
        if name not in self._consumers:
            process = self._processor(self._generation, name)
            self._consumers[name] = _Consumer(
                name,
                process,
                self._connect_url,
                self._options,
                self._give_back,
                batches=self._batches,
                finisher=self._finisher,
            )

    async def _queue_names(self) -> list[str]:
        # A page of 1,000: the whole database is scanned each second.
        pattern = self._names.runs_pattern
        keys = [key async for key in self._client.scan_iter(match=pattern, count=1000)]
        return sorted(str(key)[len("bull:") : -len(":meta")] for key in keys)

    async def _discover_once(self) -> None:
        try:
            names = await self._queue_names()
        except Exception as exc:
            _log.warning("could not list the run queues: %s", exc)
            return
        if self._deliver is not None:
            for name in names:
                self._consume(name)

    async def _discover(self) -> None:
        """An engine driving every pool takes from every pool's queue, as pools appear."""
        # Checked as well as cancelled: a cancellation that lands inside a
        # redis-py call can be swallowed there, and the loop must still end.
        while self._deliver is not None:
            await asyncio.sleep(_DISCOVER_EVERY_S)
            await self._discover_once()

    def _processor(self, generation: int, queue: str) -> Callable[[_Job, str], Awaitable[None]]:
        async def process(job: _Job, token: str) -> None:
            key = f"{queue}/{job.id}"
            self._held.add(key)
            try:
                slots = self._slots
                await slots.take()
                try:
                    deliver = self._deliver
                    if deliver is None or generation != self._generation:
                        outcome = Delivered.AGAIN
                    else:
                        outcome = await deliver(json.dumps(job.data))
                finally:
                    slots.give()
                if outcome is not Delivered.DONE:
                    delay = _RETRY_DELAY_MS if outcome is Delivered.LATER else 0
                    await self._give_back(queue, job, token, delay)
                    raise _delayed()
            finally:
                self._held.discard(key)

        return process

    async def stop_claiming(self) -> None:
        """Stop fetching jobs; the held ones are finished or handed back by their turns."""
        self._deliver = None
        discovery, self._discovery = self._discovery, None
        if discovery is not None:
            discovery.cancel()
            await asyncio.wait([discovery], timeout=_DISCOVER_EVERY_S * 2)
        consumers, self._consumers = list(self._consumers.values()), {}
        for consumer in consumers:
            # close() sets the worker closing at once (no more fetches), then
            # waits for the jobs it holds: awaited by hand_back(), once the
            # drain handed the running turns back.
            self._closing.append(asyncio.create_task(consumer.close()))
        await asyncio.sleep(0)

    async def hand_back(self) -> None:
        """Wait for the held jobs to be finished or handed back, and the workers closed."""
        closing, self._closing = self._closing, []
        if not closing:
            return
        _done, pending = await asyncio.wait(closing, timeout=10.0)
        for task in pending:
            # A job still held after the drain: its lock runs out and BullMQ
            # gives it to another instance.
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*closing, return_exceptions=True)

    async def backlog(self) -> bool:
        """Whether our pools' queues (producers: any run queue) hold jobs, taken or not."""
        if self._pools is not None and self._deliver is not None:
            names = [self._names.runs(pool) for pool in self._pools]
        else:
            names = await self._queue_names()
        for name in names:
            counts = await self._queue(name).getJobCounts(*_COUNTED)
            if any(counts.values()):
                return True
        return False
