"""A narrow typed view of the untyped ``bullmq`` package, and the consumer
(one BullMQ worker and its loop) the ``redis://`` transport serves queues with."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from bullmq import DelayedError
from bullmq import Queue as _BullQueue
from bullmq import Worker as _BullWorker

from ..._logs import engine_logger

_log = engine_logger("durably.transport")


class _Job(Protocol):
    id: str
    data: Any


class _QueueBackend(Protocol):
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
        give_back: Callable[[str, _Job, str], Awaitable[None]],
    ):
        # autorun off: bullmq's own ensure_future(run()) is untracked, and a
        # run() that starts after close() reconnects and leaks a connection.
        self.queue = queue
        self.worker: _Worker = _BullWorker(
            queue, processor, {"connection": url, **options, "autorun": False}
        )
        self.worker.on("error", _worker_error(queue))
        self._give_back = give_back
        self._loop = asyncio.create_task(self._run(queue), name=f"durably-{queue}")

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
