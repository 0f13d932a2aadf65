"""Group concurrent calls of a batch store primitive into few round trips."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["BatchCall"]

T = TypeVar("T")
R = TypeVar("R")


class BatchCall(Generic[T, R]):
    """``await batch(item)`` runs ``call([... item ...])`` and returns its answer for ``item``.

    A lone call goes out at once (no timer, so no added latency when idle);
    calls made while a batch is in flight are collected and go out together
    as the next batch, at most ``max_batch`` per call. Under load, N callers
    then cost about N / (calls per round trip) writes instead of N. ``call``
    must answer one result per item, in order. If it raises, every caller of
    that batch gets the error (and decides itself whether to retry).
    ``max_batch=None`` sends whatever has queued up as one batch (for a
    ``call`` that chunks by itself).
    """

    def __init__(self, call: Callable[[list[T]], Awaitable[list[R]]], max_batch: int | None = 500):
        if max_batch is not None and max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._call = call
        self._max_batch = max_batch
        self._queued: list[tuple[T, asyncio.Future[R]]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def idle(self) -> bool:
        """Nothing queued and no batch in flight."""
        return not self._queued and (self._task is None or self._task.done())

    async def __call__(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queued.append((item, future))
        self._start()
        return await future

    async def many(self, items: list[T]) -> list[R]:
        """Queue ``items`` together (they go out in the same batch when
        ``max_batch`` allows) and return their answers, in order."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[R]] = [loop.create_future() for _ in items]
        self._queued.extend(zip(items, futures, strict=True))
        self._start()
        return list(await asyncio.gather(*futures))

    async def drain(self) -> None:
        """Wait until every batch queued so far has gone out (its callers,
        not this, hear how it went)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        size = self._max_batch
        while self._queued:
            batch = self._queued[:size] if size is not None else self._queued[:]
            del self._queued[: len(batch)]
            try:
                answers = await self._call([item for item, _ in batch])
                if len(answers) != len(batch):
                    raise RuntimeError(f"{len(answers)} answers for {len(batch)} calls")
            except asyncio.CancelledError:
                # The loop is shutting down: nobody may be left awaiting forever.
                for _, future in batch + self._queued:
                    future.cancel()
                self._queued.clear()
                raise
            except Exception as exc:
                for _, future in batch:
                    if not future.done():  # a caller cancelled meanwhile needs nothing
                        future.set_exception(exc)
            else:
                for (_, future), answer in zip(batch, answers, strict=True):
                    if not future.done():
                        future.set_result(answer)
