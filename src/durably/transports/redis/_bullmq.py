"""A narrow typed view of the untyped ``bullmq`` package, and the consumer
(one BullMQ worker and its loop) the ``redis://`` transport serves queues with.

The worker is bullmq's, with its fetch loop and its job completion replaced
(:class:`_BatchWorker`): it takes as many jobs as it has room for in one
script call and finishes the jobs done meanwhile in one call, with BullMQ's
own scripts (see :mod:`._batched` and :mod:`._looped`); a consumer may
process a fetch's jobs together (``batch``), and a caller adding jobs to its
queue may have it take them in the same transaction (:meth:`_Consumer.reserve`).
Locks, their renewal, the stalled-job check, failures and hand-backs are
bullmq's unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from bullmq import DelayedError
from bullmq import Job as _BullJob
from bullmq import Queue as _BullQueue
from bullmq import Worker as _BullWorker
from bullmq.custom_errors import UnrecoverableError, WaitingChildrenError
from bullmq.job import optsFromJSON
from bullmq.timer import Timer

from ..._logs import engine_logger
from ._batched import (
    Call,
    Collector,
    Lane,
    Script,
    compact_json,
    move_to_active_args,
    parse_taken,
    run_scripts,
    take_script,
)
from ._looped import CALL_MAX, finish_call, finish_script, finished_opts

_log = engine_logger("durably.transport")


class _Job(Protocol):
    id: str
    data: Any


class _QueueBackend(Protocol):
    scripts: Any

    async def moveToDelayed(
        self, job_id: str, timestamp: int, delay: int, token: str, opts: dict[str, Any]
    ) -> Any: ...


class _Queue(Protocol):
    backend: _QueueBackend

    async def addBulk(self, jobs: list[dict[str, Any]]) -> list[Any]: ...

    async def getJobCounts(self, *types: str) -> dict[str, int]: ...


class _Backend(Protocol):
    async def close(self, force: bool = False) -> None: ...


class _Worker(Protocol):
    running: bool
    backend: _Backend
    processing: set[asyncio.Future[Any]]

    async def run(self) -> None: ...

    async def close(self, force: bool = False) -> None: ...

    def on(self, event_name: str, function: Callable[..., Any]) -> Any: ...


_Processor = Callable[[_Job, str], Awaitable[Any]]
_BatchProcessor = Callable[[list[Any]], Awaitable[list[bool]]]
"""Processes a fetch's jobs at once: for each, whether to complete it (False:
it was handed back already, and is neither completed nor failed)."""
_GiveBack = Callable[[str, _Job, str], Awaitable[None]]
Finisher = Callable[["_BatchWorker", tuple[Any, Any, str]], Awaitable[None]]
"""Completes a worker's job (job, return value, token) in a write shared with
others (the transport's: see ``RedisTransport._write``); raises what the
job's ``moveToFinished`` answered, as bullmq's own completion does."""

_PLAIN_FIELDS = frozenset(
    ("name", "data", "opts", "timestamp", "delay", "priority", "processedOn", "ats", "atm",
     "attemptsMade", "stc", "defa", "progress")
)  # fmt: skip
"""The fields of a job hash :meth:`_BatchWorker._job` builds the job from itself."""
_TEMPLATES = 256
"""Job templates kept per worker (one per job name and options seen)."""

_TAKE_MAX = 100
"""Jobs taken in one script call at most (Redis runs nothing else meanwhile)."""


def _new_queue(name: str, client: aioredis.Redis) -> _Queue:
    queue: _Queue = _BullQueue(name, {"connection": client})
    return queue


class _Consumer:
    """One BullMQ worker and the task running its loop."""

    def __init__(
        self,
        queue: str,
        processor: _Processor,
        url: str,
        options: dict[str, Any],
        give_back: _GiveBack,
        batch: _BatchProcessor | None = None,
        *,
        batches: aioredis.Redis | None = None,
        finisher: Finisher | None = None,
    ):
        # autorun off: bullmq's own ensure_future(run()) is untracked, and a
        # run() that starts after close() reconnects and leaks a connection.
        self.queue = queue
        self.worker: _Worker = _BatchWorker(
            queue,
            processor,
            {"connection": url, **options, "autorun": False},
            give_back,
            batch,
            batches=batches,
            finisher=finisher,
        )
        self.worker.on("error", _worker_error(queue))
        self._give_back = give_back
        self._loop = asyncio.create_task(self._run(queue), name=f"durably-{queue}")

    def reserve(self, wanted: int) -> Reserved | None:
        """Room for up to ``wanted`` jobs taken by a call of the caller's (see
        :meth:`_BatchWorker.reserve`); None: no room, or closing."""
        worker: _BatchWorker = self.worker  # type: ignore[assignment]
        return worker.reserve(wanted)

    async def _run(self, queue: str) -> None:
        try:
            await self.worker.run()
        except Exception as exc:
            _log.warning("the BullMQ worker on %s stopped: %s", queue, exc)

    async def close(self) -> None:
        """Stop taking jobs; return once the jobs it holds are finished or handed back."""
        # Close only once run() is inside its loop (or gone), so close() is
        # never undone by a loop starting after it.
        while not self.worker.running and not self._loop.done():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        try:
            await self.worker.close()
        except Exception as exc:
            _log.warning("could not close a BullMQ worker cleanly: %s", exc)
        await asyncio.gather(self._loop, return_exceptions=True)
        # bullmq's loop ends as soon as one fetch comes back empty while
        # closing, even if another fetch is still out: a job that fetch
        # returns (now active, locked by us) is processed by nobody. Wait
        # for what is left (holding the tasks: asyncio keeps them weakly),
        # and hand such jobs back at once instead of after their lock.
        left = list(self.worker.processing)
        await asyncio.gather(*left, return_exceptions=True)
        for done in left:
            if done.cancelled() or done.exception() is not None:
                continue
            job = done.result()
            token = getattr(job, "token", None)
            if job is not None and isinstance(token, str):
                await self._give_back(self.queue, job, token)
        # Once more after its loop ended: a command the loop sent after
        # close() (a racing fetch) reopens bullmq's single-connection client.
        with contextlib.suppress(Exception):
            await self.worker.backend.close(force=True)


def _delayed() -> BaseException:
    # Raised after job.moveToDelayed: tells the bullmq worker the job was
    # handed back and must be neither completed nor failed.
    error: BaseException = DelayedError()
    return error


def _worker_error(queue: str) -> Callable[..., None]:
    def report(error: BaseException, *_: Any) -> None:
        _log.warning("BullMQ worker on %s: %s", queue, error)

    return report


class Reserved:
    """Room a worker keeps for the jobs a caller's take call takes
    (:meth:`_BatchWorker.reserve`): send :attr:`call` (after the adds, in the
    same transaction), then hand its reply to :meth:`taken`, or call
    :meth:`cancel` if it did not run."""

    def __init__(self, worker: _BatchWorker, call: Call, token: str, room: int) -> None:
        self.call = call
        """The take script call (BullMQ's ``moveToActive``, up to ``room`` times)."""
        self.room = room
        """How many jobs the call may take."""
        self._worker = worker
        self._token = token
        self._room = room

    def taken(self, reply: Any) -> int:
        """Start the jobs the call took (a closing worker's processor hands
        them back at once); give the rest of the room back. How many it took."""
        room, self._room = self._room, 0
        return self._worker.taken(reply, self._token, room)

    def cancel(self) -> None:
        """The call did not run: give the room back."""
        room, self._room = self._room, 0
        self._worker.release(room)


class _BatchWorker(_BullWorker):  # type: ignore[misc]  # bullmq is untyped
    """bullmq's worker, taking and finishing jobs many at a time.

    One loop: block on the queue's marker while the queue is dry (as bullmq
    does), then take as many jobs as there is room for in one script call,
    start each, and go on. A finished job's ``moveToFinished`` goes out with
    the others finished meanwhile, in one pipeline. With a ``batch``
    processor, a fetch's jobs are processed together instead (one task, one
    call, then one finishing call for those it completed).
    """

    running: bool
    drained: bool
    closing: bool

    def __init__(
        self,
        name: str,
        processor: _Processor,
        opts: dict[str, Any],
        give_back: _GiveBack,
        batch: _BatchProcessor | None = None,
        *,
        batches: aioredis.Redis | None = None,
        finisher: Finisher | None = None,
    ) -> None:
        super().__init__(name, processor, opts)
        # Jobs done go out with the other writes of the finisher's owner
        # (its adds, other workers' finishes) when given, else in writes
        # of this worker's own.
        self._finisher = finisher
        # Takes and finishes go through ``batches`` (see _batched.batch_client)
        # when given, else through bullmq's own client.
        self._batch_client = batches
        self._give_back = give_back
        self._batch_processor = batch
        self._busy = 0
        self._promised = 0
        """Slots freed by jobs whose finishing write (and its take) is yet to go."""
        self._room = asyncio.Event()
        self._take = take_script(Script.of(self.scripts.commands["moveToActive"]))
        self._finishing: Collector[tuple[Any, Any, str], None] = Collector(self._finish_and_take)
        self._batches = 0
        self._fetching = 0
        self.handed = 0
        """Jobs taken by callers' take calls (:meth:`reserve`), for tests."""
        self._templates: dict[tuple[Any, str], dict[str, Any]] = {}
        # the fetch loop's and the finishing writer's connections (each sends a batch at a time)
        self._fetch_lane = Lane()
        self._finish_lane = Lane()

    async def run(self) -> None:
        if self.running:
            raise RuntimeError("Worker is already running")
        await self._ensure_client_names()
        self.lockManager.start()
        self.stalledCheckTimer = Timer(
            self.opts["stalledInterval"] / 1000, self.runStalledJobsCheck, self.emit
        )
        self.running = True
        try:
            while not self.closing:
                # (room promised to the next finishing write is taken by it)
                room = self.opts["concurrency"] - self._busy - self._promised
                if room <= 0:
                    self._room.clear()
                    await self._room.wait()
                    continue
                self._batches += 1
                batch = self._batches
                fetch = asyncio.ensure_future(
                    self.retryIfFailed(
                        functools.partial(self._next_jobs, batch, min(room, _TAKE_MAX)),
                        {"delay_in_ms": self.opts["runRetryDelay"], "only_emit_error": True},
                    )
                )
                # bullmq's close() waits for what is in ``processing``: a
                # fetch under way is finished (its jobs handed back) first.
                self.processing.add(fetch)
                try:
                    jobs = await fetch
                finally:
                    self.processing.discard(fetch)
                if jobs and self._batch_processor is not None:
                    self._start_batch(jobs)
                else:
                    for job in jobs or ():
                        self._start(job)
            if self.processing:
                await asyncio.wait(set(self.processing))
        finally:
            self.running = False
            if not self.closing:
                for task in self.processing:
                    task.cancel()
                if self.processing:
                    await asyncio.gather(*self.processing, return_exceptions=True)
                self.processing.clear()
            with contextlib.suppress(Exception):
                self.stalledCheckTimer.stop()
            await self.lockManager.close()

    async def close(self, force: bool = False) -> None:
        self.closing = True
        self._room.set()
        # Back to the pool first, so closing the client closes them too.
        await self._fetch_lane.close()
        await self._finish_lane.close()
        await super().close(force)

    def reserve(self, wanted: int) -> Reserved | None:
        """Keep room for up to ``wanted`` jobs for a take call the caller
        sends itself (in the transaction adding them: the jobs it adds and
        this worker would take next are taken in the same round trip, each
        locked by a token of this worker's, as its own fetch would). None:
        no room (counting a fetch of its own under way), or closing."""
        if self.closing or not self.running:
            return None
        room = min(wanted, self.opts["concurrency"] - self._busy - self._fetching, _TAKE_MAX)
        if room <= 0:
            return None
        self._busy += room
        self._batches += 1
        token = f"{self.id}:{self._batches}"
        keys, args = move_to_active_args(self.keys, token, self.opts["lockDuration"], room)
        return Reserved(self, Call(self._take, keys, args), token, room)

    def release(self, room: int) -> None:
        """Give back room kept by :meth:`reserve`."""
        self._busy -= room
        self._room.set()

    def taken(self, reply: Any, token: str, room: int) -> int:
        """Start the jobs a reserved take call took; release the rest of its room."""
        try:
            jobs = (
                [] if isinstance(reply, BaseException) else self._jobs(parse_taken(reply)[0], token)
            )
        except BaseException:
            self.release(room)  # what it took stays locked until BullMQ's stalled check
            raise
        self.release(room - len(jobs))
        self.handed += len(jobs)
        for job in jobs:
            # Started even if closing: its processor hands it back at once.
            self._start(job, reserved=True)
        return len(jobs)

    def _start(self, job: Any, reserved: bool = False) -> None:
        if not reserved:
            self._busy += 1
        task = asyncio.ensure_future(self.processJob(job, job.token))
        self.processing.add(task)
        # processJob gives its slot back itself (before its job is finished)
        task.add_done_callback(self.processing.discard)

    def _ended(self, task: asyncio.Future[Any], count: int = 1) -> None:
        self.processing.discard(task)
        self._busy -= count
        self._room.set()

    def _start_batch(self, jobs: list[Any]) -> None:
        self._busy += len(jobs)
        task = asyncio.ensure_future(self._process_batch(jobs))
        self.processing.add(task)
        task.add_done_callback(functools.partial(self._ended, count=len(jobs)))

    async def _process_batch(self, jobs: list[Any]) -> None:
        """bullmq's ``processJob`` for a fetch's jobs at once (see ``batch``)."""
        now = int(time.time() * 1000)
        for job in jobs:
            self.jobs.add((job, job.token))
            self.lockManager.track_job(job.id, job.token, now)
        try:
            plain = []
            for job in jobs:
                if job.deferredFailure:  # stalled too often: failed, as bullmq does
                    await self._fail(job, UnrecoverableError(job.deferredFailure))
                else:
                    plain.append(job)
            if not plain:
                return
            assert self._batch_processor is not None
            try:
                finish = await self._batch_processor(plain)
            except Exception as err:
                for job in plain:
                    await self._fail(job, err)
                return
            done = [(job, None, job.token) for job, ok in zip(plain, finish, strict=True) if ok]
            if not done or self.forceClosing:
                return
            try:
                outcomes = await self._finish_many(done)
            except Exception as err:
                outcomes = [err] * len(done)
            for (job, _, _), outcome in zip(done, outcomes, strict=True):
                if outcome is None:
                    job.attemptsMade = job.attemptsMade + 1
                    self.emit("completed", job, None)
                elif isinstance(outcome, Exception):
                    await self._fail(job, outcome)
        finally:
            for job in jobs:
                self.jobs.discard((job, job.token))
                self.lockManager.untrack_job(job.id)

    async def _fail(self, job: Any, err: Exception) -> None:
        """Fail a job as bullmq's ``processJob`` does when processing it raised."""
        try:
            if not self.forceClosing:
                await job.moveToFailed(err, job.token)
            self.emit("failed", job, err)
        except Exception as again:
            self.emit("error", again, job)

    async def _next_jobs(self, batch: int, room: int) -> list[Any]:
        """Jobs to process: up to ``room``, blocking on the marker while the queue is dry."""
        if self.drained:
            self.waiting = asyncio.ensure_future(self.waitForJob())
            try:
                self.blockUntil = await self.waiting
            except asyncio.CancelledError:
                if not self.closing:
                    raise
                return []  # close() ended the wait
            finally:
                self.waiting = None
            if self.blockUntil > 0 and self.blockUntil > int(time.time() * 1000):
                return []  # the next job is a delayed one: wait until it is due
            # Callers' take calls may have used the room meanwhile (reserve).
            room = min(room, self.opts["concurrency"] - self._busy)
            if room <= 0:
                self.drained = False  # the marker is consumed: take at once next time
                return []
        token = f"{self.id}:{batch}"
        keys, args = move_to_active_args(self.keys, token, self.opts["lockDuration"], room)
        self._fetching = room
        try:
            client = self._batch_client or self.client
            (reply,) = await run_scripts(
                client, [Call(self._take, keys, args)], lane=self._fetch_lane
            )
        finally:
            self._fetching = 0
        if isinstance(reply, BaseException):
            raise reply
        taken, delay_until = parse_taken(reply)
        jobs = self._jobs(taken, token)
        self.drained = len(jobs) < room
        self.blockUntil = delay_until if self.drained else 0
        if self.closing:
            # Taken while closing: nobody here will process them.
            for job in jobs:
                await self._give_back(self.name, job, job.token)
            return []
        return jobs

    def _jobs(self, taken: list[tuple[dict[str, str], str]], token: str) -> list[Any]:
        """The jobs a take call took (:func:`parse_taken`), each with its lock token."""
        jobs = []
        for i, (raw, job_id) in enumerate(taken, start=1):
            job = self._job(raw, job_id)
            job.token = f"{token}:{i}"
            jobs.append(job)
        return jobs

    def _job(self, raw: dict[str, str], job_id: str) -> Any:
        """``Job.fromJSON(self, raw, job_id)``, the same job, built from a
        copy of a template per job name and options (bullmq builds and parses
        those per job, which a profile of the step path showed). A hash with
        any field a plain job taken from its queue
        does not have (a parent, a return value, a repeat key…) goes through
        bullmq's own ``fromJSON``."""
        if not raw.keys() <= _PLAIN_FIELDS:
            return _BullJob.fromJSON(self, raw, job_id)
        opts = raw.get("opts", "{}")
        # A job of an id of its own (a run's start) has it in its options:
        # without it, such jobs share a template too.
        own = ""
        if '"jobId":' in opts:
            own = f'"jobId":{json.dumps(job_id)}'
            if own in opts:
                opts = opts.replace(own, "", 1)
            else:
                own = ""  # encoded otherwise ("/" as "\/"): a template of its own
        shape = (raw.get("name"), opts)
        template = self._templates.get(shape)
        if template is None:
            parsed = json.loads(raw.get("opts", "{}"))
            if own and parsed.pop("jobId", None) != job_id:
                return _BullJob.fromJSON(self, raw, job_id)
            built = _BullJob(self, shape[0], None, optsFromJSON(parsed))
            if built.parent is not None:  # a parent's options: kept per job by bullmq
                return _BullJob.fromJSON(self, raw, job_id)
            if len(self._templates) >= _TEMPLATES:
                self._templates.clear()
            template = self._templates[shape] = vars(built)
        job = _BullJob.__new__(_BullJob)
        fields = vars(job)
        fields.update(template)
        fields["opts"] = dict(template["opts"])
        if own:
            fields["opts"]["jobId"] = job_id
        fields["stacktrace"] = []
        fields["data"] = json.loads(raw.get("data", "{}"))
        fields["id"] = job_id
        fields["progress"] = json.loads(raw["progress"]) if "progress" in raw else 0
        fields["delay"] = int(raw.get("delay", "0"))
        fields["priority"] = int(raw.get("priority", "0"))
        fields["timestamp"] = int(raw.get("timestamp", "0"))
        if raw.get("processedOn"):
            fields["processedOn"] = int(raw["processedOn"])
        if raw.get("ats"):
            fields["attemptsStarted"] = int(raw["ats"])
        fields["attemptsMade"] = int(raw.get("attemptsMade") or raw.get("atm") or "0")
        fields["stalledCounter"] = int(raw.get("stc") or "0")
        if raw.get("defa"):
            fields["deferredFailure"] = raw["defa"]
        return job

    async def processJob(self, job: Any, token: str) -> None:
        """bullmq's ``processJob``, with the completion batched.

        The job's slot is free once its processor returned: the write
        finishing it takes the next jobs for the room (as bullmq's
        ``moveToFinished`` fetches the next job), so a worker kept busy
        needs no fetch of its own. The job stays tracked (its lock renewed)
        until it is finished."""
        held = True
        try:
            self.jobs.add((job, token))
            self.lockManager.track_job(job.id, token, int(time.time() * 1000))
            if job.deferredFailure:
                await job.moveToFailed(UnrecoverableError(job.deferredFailure), token)
                self.emit("failed", job, UnrecoverableError(job.deferredFailure))
                return
            result = await self.processor(job, token)
            if not self.forceClosing:
                held = False
                self._busy -= 1
                if self.drained or self.closing:
                    # no take goes with the finish: the fetch loop uses the room
                    self._room.set()
                else:
                    self._promised += 1
                if self._finisher is not None:
                    await self._finisher(self, (job, result, token))
                else:
                    await self._finishing.add((job, result, token))
                job.attemptsMade = job.attemptsMade + 1
            self.emit("completed", job, result)
        except (DelayedError, WaitingChildrenError):
            return
        except Exception as err:
            try:
                if not self.forceClosing:
                    await job.moveToFailed(err, token)
                self.emit("failed", job, err)
            except Exception as again:
                self.emit("error", again, job)
        finally:
            if held:
                self._busy -= 1
                self._room.set()
            self.jobs.discard((job, token))
            self.lockManager.untrack_job(job.id)

    async def _finish_and_take(
        self, done: list[tuple[Any, Any, str]]
    ) -> list[BaseException | None]:
        """:meth:`_finish_many`, and in the same round trip a take of the jobs
        this worker has room for (see :meth:`finish_take`)."""
        return await self._finish_many(done, self.finish_take())

    def finish_take(self) -> Reserved | None:
        """The take to send with a write finishing this worker's jobs: the
        slots of finished jobs are free already, and it takes the next jobs
        for them (as bullmq's ``moveToFinished`` fetches the next job), so a
        busy worker needs no fetch of its own. None (and the fetch loop told
        to look at its room): the queue was found dry (the loop waits on its
        marker then), or the worker is closing."""
        # the room promised to this write is its take's (or the loop's, without one)
        self._promised = 0
        take = None if self.drained or self.closing else self.reserve(_TAKE_MAX)
        if take is None:
            self._room.set()
        return take

    def finish_calls(self, done: list[tuple[Any, Any, str]]) -> list[Call]:
        """The calls completing ``done`` (job, return value, token): one
        looped ``moveToFinished`` call per hundred jobs (see :mod:`._looped`)."""
        script = finish_script(Script.of(self.scripts.commands["moveToFinished"]))
        queue_opts, now = self.opts, round(time.time() * 1000)
        calls = []
        for start in range(0, len(done), CALL_MAX):
            jobs = []
            for job, result, token in done[start : start + CALL_MAX]:
                packed = finished_opts(
                    token,
                    job.opts.get("removeOnComplete", False),
                    queue_opts,
                    job.opts,
                    job.attempts,
                    job.attemptsMade,
                )
                value = "null" if result is None else compact_json(result)
                jobs.append((job.id, value, packed))
            calls.append(finish_call(script, self.keys, jobs, now))
        return calls

    def finish_outcomes(
        self, done: list[tuple[Any, Any, str]], replies: list[Any]
    ) -> list[BaseException | None]:
        """Each job's outcome (an error or None) from the replies of
        :meth:`finish_calls`."""
        outcomes: list[BaseException | None] = []
        for start, reply in zip(range(0, len(done), CALL_MAX), replies, strict=True):
            part = done[start : start + CALL_MAX]
            each = reply if isinstance(reply, list) else [reply] * len(part)
            for (job, _, _), one in zip(part, each, strict=True):
                outcomes.append(self._finished(job, one))
        return outcomes

    async def _finish_many(
        self, done: list[tuple[Any, Any, str]], take: Reserved | None = None
    ) -> list[BaseException | None]:
        """Complete the jobs done meanwhile, all in one pipeline (with
        ``take``'s call last, if any)."""
        calls = self.finish_calls(done)
        client = self._batch_client or self.client
        if take is None:
            replies = await run_scripts(client, calls, lane=self._finish_lane)
        else:
            try:
                replies = await run_scripts(client, [*calls, take.call], lane=self._finish_lane)
            except BaseException:
                take.cancel()
                raise
            self.started(take, replies.pop())
        return self.finish_outcomes(done, replies)

    def started(self, take: Reserved, reply: Any) -> None:
        """Start what a take sent with a finish took; a take that found the
        queue dry (fewer jobs than its room) sends the fetch loop to the
        queue's marker instead of another take."""
        room = take.room
        try:
            taken = take.taken(reply)
        except Exception:
            # what it took stays locked until BullMQ's stalled check
            _log.exception("could not start the jobs taken with a finish")
            return
        if not isinstance(reply, BaseException) and taken < room:
            self.drained = True

    def _finished(self, job: Any, reply: Any) -> BaseException | None:
        """A job's ``moveToFinished`` reply as bullmq would read it (an error or None)."""
        if isinstance(reply, BaseException):
            return reply
        if isinstance(reply, int) and reply < 0:
            error: BaseException = self.scripts.finishedErrors(
                {"code": reply, "jobId": job.id, "command": "moveToFinished", "state": "active"}
            )
            return error
        return None
