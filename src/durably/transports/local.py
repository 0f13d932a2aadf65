"""The ``local://`` transport (the default): in-process queues.

Behaves like a broker inside one process: ``dispatch`` only enqueues, a
consumer task hands tasks to the served handlers (at most ``concurrency`` at
once, highest priority first), and results come back on a later loop
iteration, batched. A task for a group nobody serves waits in its queue
(as with a broker, it looks like a lost dispatch until someone serves it).
Nothing survives the process: a run waiting on a task that was in flight is
rescued by the engine's redispatch net or its reconcile wake.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Collection, Coroutine
from typing import Any

from .._logs import engine_logger
from ..wire import Heartbeat, StepResult, StepTask
from .base import CancelHandler, HeartbeatHandler, ResultHandler, TaskHandler

__all__ = ["LocalTransport"]

_log = engine_logger("durably.transport")
_RESULT_BATCH = 256
_REDELIVER_DELAY_S = 1.0


class LocalTransport:
    """In-process queues; see the module docstring."""

    url = "local://"

    def __init__(self) -> None:
        self._order = itertools.count()
        self._queues: dict[str, list[tuple[int, int, StepTask]]] = {}
        self._groups: frozenset[str] = frozenset()
        self._on_task: TaskHandler | None = None
        self._concurrency = 1
        self._running: dict[asyncio.Future[None], StepTask] = {}
        self._task_ready = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._results: list[StepResult] = []
        self._beats: list[Heartbeat] = []
        self._result_ready = asyncio.Event()
        self._consumer: asyncio.Task[None] | None = None
        self._cancel_handlers: list[CancelHandler] = []
        self._retrying: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Stop both consumers (running handlers are left to finish)."""
        await self.stop_serving()
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        for task in list(self._retrying):
            task.cancel()

    async def dispatch(self, tasks: list[StepTask]) -> None:
        """Enqueue the tasks; a serving consumer picks them up."""
        self._enqueue(tasks)

    def _enqueue(self, tasks: list[StepTask]) -> None:
        for task in tasks:
            queue = self._queues.setdefault(task.group, [])
            heapq.heappush(queue, (-(task.priority or 0), next(self._order), task))
        self._task_ready.set()

    async def serve(
        self, groups: Collection[str], on_task: TaskHandler, *, concurrency: int
    ) -> None:
        """Hand tasks of ``groups`` to ``on_task``, ``concurrency`` at once."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._groups, self._on_task, self._concurrency = frozenset(groups), on_task, concurrency
        if self._pump is None:
            self._pump = asyncio.create_task(self._serve_loop(), name="durably-local-tasks")
        self._task_ready.set()

    async def stop_serving(self) -> None:
        """Stop taking tasks; queued ones stay queued for the next server."""
        pump, self._pump = self._pump, None
        self._on_task = None
        if pump is not None:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    async def _serve_loop(self) -> None:
        while True:
            await self._task_ready.wait()
            self._task_ready.clear()
            while len(self._running) < self._concurrency:
                handler = self._on_task
                task = self._next_task() if handler is not None else None
                if handler is None or task is None:
                    break
                # The handler's own coroutine is the task (no wrapper: a frame
                # per served step); a failure is seen in its done callback.
                runner: asyncio.Future[None]
                try:
                    runner = asyncio.ensure_future(handler(task))
                except Exception as exc:
                    # A handler that raises before returning an awaitable fails
                    # like one whose await raised: delivered again from the
                    # done callback, on a later loop iteration (not a spin here).
                    runner = asyncio.get_running_loop().create_future()
                    runner.set_exception(exc)
                self._running[runner] = task
                runner.add_done_callback(self._handler_done)

    def _next_task(self) -> StepTask | None:
        best: tuple[int, int, StepTask] | None = None
        best_group = ""
        for group in self._groups:
            queue = self._queues.get(group)
            if queue and (best is None or queue[0] < best):
                best, best_group = queue[0], group
        if best is None:
            return None
        heapq.heappop(self._queues[best_group])
        return best[2]

    def _handler_done(self, runner: asyncio.Future[None]) -> None:
        task = self._running.pop(runner)
        if not runner.cancelled() and (failure := runner.exception()) is not None:
            _log.error(
                "task %s failed in its handler wrapper; delivering it again",
                task.step_id,
                exc_info=failure,
            )
            self._enqueue([task])
        self._task_ready.set()

    async def consume_results(
        self, on_results: ResultHandler, on_heartbeat: HeartbeatHandler
    ) -> None:
        """Deliver results (in batches of up to 256) and beats from now on."""
        if self._consumer is not None:
            raise RuntimeError("this transport already has a results consumer")
        self._consumer = asyncio.create_task(
            self._consume_loop(on_results, on_heartbeat), name="durably-local-results"
        )

    async def _consume_loop(
        self, on_results: ResultHandler, on_heartbeat: HeartbeatHandler
    ) -> None:
        while True:
            await self._result_ready.wait()
            self._result_ready.clear()
            beats, self._beats = self._beats, []
            # Only when there are beats to sift: most batches bring none, and
            # a step id built per result for nothing was a cost per step.
            finished = {result.step_id for result in self._results} if beats else set()
            for beat in beats:
                if beat.step_id in finished:
                    continue  # its result is here already: the beat says nothing new
                try:
                    await on_heartbeat(beat)
                except Exception:
                    _log.exception("heartbeat of %s could not be handled", beat.step_id)
            while self._results:
                batch = self._results[:_RESULT_BATCH]
                del self._results[:_RESULT_BATCH]
                try:
                    await on_results(batch)
                except Exception:
                    # Delivered again later: a result is the last copy of the work.
                    _log.exception("a batch of %d step results could not be settled", len(batch))
                    self._later(self._requeue(batch))

    def _later(self, action: Coroutine[Any, Any, None]) -> None:
        async def delayed() -> None:
            await asyncio.sleep(_REDELIVER_DELAY_S)
            await action

        task = asyncio.create_task(delayed())
        self._retrying.add(task)
        task.add_done_callback(self._retrying.discard)

    async def _requeue(self, results: list[StepResult]) -> None:
        self._results.extend(results)
        self._result_ready.set()

    async def send_result(self, result: StepResult) -> None:
        """Queue ``result`` for the results consumer."""
        self._results.append(result)
        self._result_ready.set()

    async def send_heartbeat(self, beat: Heartbeat) -> None:
        """Queue ``beat`` for the results consumer."""
        self._beats.append(beat)
        self._result_ready.set()

    async def publish_cancel(self, run_ids: list[str]) -> None:
        """Tell the cancel handlers at once."""
        for handler in self._cancel_handlers:
            handler(run_ids)

    def on_cancel(self, handler: CancelHandler) -> None:
        """Register a cancel-notice handler."""
        self._cancel_handlers.append(handler)
