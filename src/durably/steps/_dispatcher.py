"""The engine side of dispatched steps: sending tasks, and settling what comes back.

Whichever instance receives a result settles the step's checkpoint (only a
*pending* one: at-least-once delivery makes duplicates normal) and wakes the
run. A dispatcher awaiting a step with a ``timeout`` in memory registers a
:class:`LiveStep` here first, so results and heartbeats it hears reach it at
once; beats are also persisted (throttled) so a dispatcher elsewhere, that did
not hear them, does not fail over a live worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from .._batch import BatchCall
from .._intercept import Interceptors
from .._lifecycle_events import EventHub, EventKind
from .._logs import engine_logger
from ..clock import Clock
from ..model import TERMINAL_STATUSES, CheckpointKind, CheckpointStatus, Run
from ..stores.base import BeatRecord, CheckpointStore, FlowStore, Resolution
from ..transports.base import Transport
from ..wire import Heartbeat, StepResult, StepTask, routing_token
from ._flow import FlowQueue
from .definition import StepDefinition

__all__ = ["LiveStep", "StepDispatcher"]

_log = engine_logger("durably.dispatch")
_MAX_THROTTLE_ENTRIES = 50_000


@dataclass(eq=False)
class LiveStep:
    """A dispatched step whose dispatcher awaits it in memory."""

    heard_at: int | None = None
    """When this process last heard a heartbeat for it."""
    result: StepResult | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class _Store(CheckpointStore, FlowStore, Protocol):
    """The slice of the store a dispatcher uses: settling steps and recording beats."""


class StepDispatcher:
    """Sends tasks and settles results; see the module docstring."""

    def __init__(
        self,
        store: _Store,
        transport: Transport,
        clock: Clock,
        wake: Callable[[str], Awaitable[None]],
        heartbeat_throttle_ms: int,
        step: Callable[[str], StepDefinition | None],
        queue: Callable[[str], FlowQueue | None],
        intercept: Interceptors,
        events: EventHub,
    ) -> None:
        self.store = store
        self.transport = transport
        self.clock = clock
        self._wake = wake
        self.heartbeat_throttle_ms = heartbeat_throttle_ms
        self._step = step
        self._queue = queue
        self._intercept = intercept
        self._events = events
        self._live: dict[str, LiveStep] = {}
        self._persisted: OrderedDict[str, int] = OrderedDict()
        # Beats are persisted off the results path, many in one statement:
        # the transports hand beats over one at a time, and a result waiting
        # behind a round trip per beat (one per task, at pickup) was the
        # results consumer's main cost under load.
        self._beat_writes: BatchCall[BeatRecord, bool] = BatchCall(self._write_beats, 500)
        self._beat_tasks: set[asyncio.Task[None]] = set()

    async def dispatch(self, tasks: list[StepTask]) -> None:
        """Send tasks; raises :class:`~durably.transports.TransportError` if not sent."""
        if self._intercept.outbound:
            self._intercept.prepare(tasks)
        await self.transport.dispatch(tasks)

    async def redispatch(self, run: Run) -> int:
        """Send again the task of every dispatched step of ``run`` still awaiting
        a result; return how many (none for a terminal run)."""
        if run.status in TERMINAL_STATUSES:
            return 0
        tasks = [
            StepTask(
                run_id=run.run_id,
                seq=cp.seq,
                name=cp.name,
                group=routing_token(cp.name, run.namespace),
                input=cp.input,
                attempt=max(1, cp.attempts),
                sent_at=self.clock.now_ms(),
                priority=definition.priority
                if (definition := self._step(cp.name)) is not None
                else None,
            )
            for cp in (await self.store.load_checkpoints(run.run_id)).values()
            if cp.kind == CheckpointKind.STEP
            and cp.status is CheckpointStatus.PENDING
            and cp.dispatched_at is not None
        ]
        if tasks:
            await self.dispatch(tasks)
        return len(tasks)

    @contextlib.contextmanager
    def live(self, step_id: str) -> Iterator[LiveStep]:
        """Register an in-memory waiter for ``step_id`` (before dispatching it,
        so an inline result cannot slip past)."""
        waiter = LiveStep()
        self._live[step_id] = waiter
        try:
            yield waiter
        finally:
            if self._live.get(step_id) is waiter:
                del self._live[step_id]

    async def on_results(self, results: list[StepResult]) -> None:
        """Settle a batch of results and wake the runs that can move on."""
        now = self.clock.now_ms()
        resolutions = [
            Resolution(
                result.run_id,
                result.seq,
                CheckpointStatus.COMPLETED if result.ok else CheckpointStatus.FAILED,
                result.output if result.ok else None,
                None if result.ok else (result.error or {"message": "step failed"}),
                [event.to_wire() for event in result.events] or None,
            )
            for result in results
        ]
        answers = await self.store.resolve_checkpoints(resolutions, now)
        to_wake: dict[str, None] = {}
        for result, left in zip(results, answers, strict=True):
            self._persisted.pop(result.step_id, None)
            waiter = self._live.get(result.step_id)
            if waiter is not None:
                # Its dispatcher holds the run's turn here; it returns the
                # value itself, a wake would only cost another turn.
                waiter.result = result
                waiter.changed.set()
                continue
            if left is None or left == 0 or not result.ok:
                # left is None: already settled, or a duplicate; resuming
                # again is harmless and covers a settler that died before
                # waking the run.
                to_wake[result.run_id] = None
        for run_id in to_wake:
            try:
                await self._wake(run_id)
            except Exception:
                _log.exception("could not wake run %s after a step result", run_id)

    async def on_heartbeat(self, beat: Heartbeat) -> None:
        """Re-arm a live waiter here; persist the beat at most once per throttle window."""
        # The receiver's clock, not the worker's: every deadline compared
        # with it is on the engine's clock.
        now = self.clock.now_ms()
        waiter = self._live.get(beat.step_id)
        if waiter is not None:
            waiter.heard_at = max(waiter.heard_at or 0, now)
            waiter.changed.set()
        if beat.progress is not None and self._events.active:
            self._events.event(
                EventKind.STEP_PROGRESS, beat.run_id, now, seq=beat.seq, progress=beat.progress
            )
        last = self._persisted.get(beat.step_id)
        first_progress = last is None and beat.progress is not None
        if last is not None and now - last < self.heartbeat_throttle_ms and not first_progress:
            return
        self._persisted[beat.step_id] = now
        self._persisted.move_to_end(beat.step_id)
        while len(self._persisted) > _MAX_THROTTLE_ENTRIES:
            self._persisted.popitem(last=False)
        persist = asyncio.create_task(
            self._persist(BeatRecord(beat.run_id, beat.seq, now, beat.progress), beat.step_id)
        )
        self._beat_tasks.add(persist)
        persist.add_done_callback(self._beat_tasks.discard)

    async def _persist(self, record: BeatRecord, step_id: str) -> None:
        try:
            await self._beat_writes(record)
        except Exception:
            _log.warning("could not persist a heartbeat of %s", step_id, exc_info=True)

    async def _write_beats(self, records: list[BeatRecord]) -> list[bool]:
        return await self.store.record_heartbeats(records)

    async def drain(self) -> None:
        """Wait for the beats being persisted (before the store closes)."""
        while self._beat_tasks:
            await asyncio.gather(*list(self._beat_tasks), return_exceptions=True)

    def definition(self, name: str) -> StepDefinition | None:
        """The step registered on this engine under ``name``, if any."""
        return self._step(name)

    def queue(self, name: str) -> FlowQueue | None:
        """The flow-control queue declared on this engine as ``name``, if any."""
        return self._queue(name)
