"""The ``memory://`` transport: a task runs inline, inside ``dispatch``.

Deterministic, for tests: by the time ``dispatch`` returns the handler has run
and its result has been handed to the results consumer (or buffered until one
starts). A task for a group nobody serves gets a non-retryable failure, so a
test with a missing handler fails fast instead of waiting forever.
"""

from __future__ import annotations

from collections.abc import Collection

from .._logs import engine_logger
from ..wire import Heartbeat, StepResult, StepTask
from .base import CancelHandler, HeartbeatHandler, ResultHandler, TaskHandler

__all__ = ["MemoryTransport"]

_log = engine_logger("durably.transport")
_RESULT_BATCH = 256


class MemoryTransport:
    """Runs every task inline; see the module docstring."""

    url = "memory://"

    def __init__(self) -> None:
        self._groups: frozenset[str] = frozenset()
        self._on_task: TaskHandler | None = None
        self._on_results: ResultHandler | None = None
        self._on_heartbeat: HeartbeatHandler | None = None
        self._cancel_handlers: list[CancelHandler] = []
        self._held_results: list[StepResult] = []
        self._held_beats: list[Heartbeat] = []

    async def open(self) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Forget every consumer."""
        self._on_task = self._on_results = self._on_heartbeat = None
        self._groups = frozenset()

    async def dispatch(self, tasks: list[StepTask]) -> None:
        """Run each task's handler now, in order."""
        for task in tasks:
            if self._on_task is None or task.group not in self._groups:
                await self.send_result(StepResult.no_handler(task))
                continue
            try:
                await self._on_task(task)
            except Exception:
                # The engine's redispatch net owns a task whose handler
                # wrapper itself broke; retrying inline could loop forever.
                _log.exception("task %s could not be handled", task.step_id)

    async def serve(
        self, groups: Collection[str], on_task: TaskHandler, *, concurrency: int
    ) -> None:
        """Serve ``groups`` (inline, so ``concurrency`` is moot)."""
        self._groups, self._on_task = frozenset(groups), on_task

    async def stop_serving(self) -> None:
        """Stop running tasks; nothing is ever held."""
        self._groups, self._on_task = frozenset(), None

    async def consume_results(
        self, on_results: ResultHandler, on_heartbeat: HeartbeatHandler
    ) -> None:
        """Deliver results and beats inline from now on (and those held so far)."""
        self._on_results, self._on_heartbeat = on_results, on_heartbeat
        held, self._held_results = self._held_results, []
        beats, self._held_beats = self._held_beats, []
        for beat in beats:
            await on_heartbeat(beat)
        for start in range(0, len(held), _RESULT_BATCH):
            await on_results(held[start : start + _RESULT_BATCH])

    async def send_result(self, result: StepResult) -> None:
        """Hand ``result`` to the consumer, or hold it until one starts."""
        if self._on_results is None:
            self._held_results.append(result)
        else:
            await self._on_results([result])

    async def send_heartbeat(self, beat: Heartbeat) -> None:
        """Hand ``beat`` to the consumer, or hold it until one starts."""
        if self._on_heartbeat is None:
            self._held_beats.append(beat)
        else:
            await self._on_heartbeat(beat)

    async def publish_cancel(self, run_ids: list[str]) -> None:
        """Tell the cancel handlers at once."""
        for handler in self._cancel_handlers:
            handler(run_ids)

    def on_cancel(self, handler: CancelHandler) -> None:
        """Register a cancel-notice handler."""
        self._cancel_handlers.append(handler)
