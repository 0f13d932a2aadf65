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
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol

from .._batch import BatchCall
from .._intercept import Interceptors
from .._lifecycle_events import EventHub, EventKind
from .._logs import engine_logger
from ..clock import Clock
from ..model import TERMINAL_STATUSES, Checkpoint, CheckpointKind, CheckpointStatus, Run
from ..stores._rows import is_row_error
from ..stores.base import BeatRecord, CheckpointStore, FlowStore, Resolution, TurnLease
from ..transports.base import SendWithCheckpoint, TakeResults, Transport
from ..wire import Heartbeat, StepResult, StepTask, routing_token
from ._flow import FlowQueue
from ._holds import LiveHolds, LiveStep
from .definition import StepDefinition

__all__ = ["LiveStep", "StepDispatcher"]

_log = engine_logger("durably.dispatch")
_MAX_THROTTLE_ENTRIES = 50_000


class _Store(CheckpointStore, FlowStore, Protocol):
    """The slice of the store a dispatcher uses: settling steps and recording beats."""


ResumeLeased = Callable[[Run, dict[int, Checkpoint], str], Awaitable[None]]
"""Takes the turn of a run leased to the owner (third argument) with its history."""

Leased = dict[str, tuple[Run, dict[int, Checkpoint]]]

_TAKE_LEASE = 256
"""The batch size a taken batch's lease is asked for (the slots bound it)."""


Marks = list[tuple[str, LiveStep]]
"""The held waiters a settle marked (step id, waiter): see :meth:`StepDispatcher._resolutions`."""


class _Live:
    """:meth:`StepDispatcher.live`'s context: the waiter registered while
    inside (a class: a generator-based one per step was measurable)."""

    __slots__ = ("_dispatcher", "_step_id", "_waiter")

    def __init__(self, dispatcher: StepDispatcher, step_id: str) -> None:
        self._dispatcher = dispatcher
        self._step_id = step_id

    def __enter__(self) -> LiveStep:
        waiter = self._waiter = LiveStep()
        self._dispatcher._live[self._step_id] = waiter
        return waiter

    def __exit__(self, *exc: object) -> None:
        waiter, live = self._waiter, self._dispatcher._live
        with self._dispatcher._hand:
            waiter.gone = True
        if live.get(self._step_id) is waiter:
            del live[self._step_id]


class StepDispatcher:
    """Sends tasks and settles results; see the module docstring."""

    def __init__(
        self,
        store: _Store,
        transport: Transport,
        clock: Clock,
        wake: Callable[[str, bool], Awaitable[None]],
        heartbeat_throttle_ms: int,
        step: Callable[[str], StepDefinition | None],
        queue: Callable[[str], FlowQueue | None],
        intercept: Interceptors,
        events: EventHub,
        hold_ms: Callable[[], int] = lambda: 0,
    ) -> None:
        """``hold_ms()``: the longest a turn holds across a step without
        ``timeout`` now (:mod:`durably.steps._holds`; ``0`` disables)."""
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
        # Marking a held waiter (maybe on a store's thread, inside a settle's
        # decode) and the waiter letting go must not interleave.
        self._hand = threading.Lock()
        self.holds = LiveHolds(hold_ms)
        """The turns holding across a dispatched step (see :mod:`durably.steps._holds`)."""
        self._persisted: OrderedDict[str, int] = OrderedDict()
        # Beats are persisted off the results path, many in one statement:
        # the transports hand beats over one at a time, and a result waiting
        # behind a round trip per beat (one per task, at pickup) was the
        # results consumer's main cost under load.
        self._beat_writes: BatchCall[BeatRecord, bool] = BatchCall(self._write_beats, 500)
        self._beat_tasks: set[asyncio.Task[None]] = set()
        self.lease_turns: Callable[[int], TurnLease | None] = lambda _count: None
        """How many of a results batch's woken runs may be leased here for
        their next turn, as a lease (``None``: none; set by the wiring)."""
        self.resume_leased: ResumeLeased | None = None
        """Takes the turn of a run the settle leased to us (set by the wiring)."""
        self.send_with_checkpoint: SendWithCheckpoint | None = None
        """The transport's way to send tasks in the transaction that writes
        their checkpoint (``CheckpointSender``; set by the wiring), if any."""

    def save_and_send(
        self, checkpoint: Checkpoint, owner: str, tasks: list[StepTask]
    ) -> Awaitable[bool]:
        """Write ``checkpoint`` under ``owner``'s lease and send ``tasks`` in the
        same transaction (only with :attr:`send_with_checkpoint`); whether the
        lease held. Called synchronously, the write is queued at once."""
        assert self.send_with_checkpoint is not None
        if self._intercept.outbound:
            self._intercept.prepare(tasks)
        return self.send_with_checkpoint(checkpoint, owner, tasks)

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

    def live(self, step_id: str) -> _Live:
        """Register an in-memory waiter for ``step_id`` (before dispatching it,
        so an inline result cannot slip past), as a context manager."""
        return _Live(self, step_id)

    def let_go(self, waiter: LiveStep) -> bool:
        """Whether a held ``waiter`` may stop waiting (and its turn park): not
        while a result is being settled for it without a wake stamp, which
        only its hand-over could then deliver."""
        with self._hand:
            if waiter.settling:
                return False
            waiter.gone = True
            return True

    def _resolutions(self, results: list[StepResult], marks: Marks) -> list[Resolution]:
        """The settle of ``results``. One whose step a held turn here awaits
        is marked ``held_by`` its owner (no wake stamp while that owner holds
        the run's lease: the hand-over delivers it) and its waiter in
        ``marks``, which cannot let go until :meth:`_unmark`. May run on a
        store's thread."""
        resolutions = []
        for result in results:
            held_by = None
            events = result.events
            waiter = self._live.get(result.step_id)
            if waiter is not None and waiter.owner is not None:
                with self._hand:
                    if not waiter.gone:
                        waiter.settling += 1
                        marks.append((result.step_id, waiter))
                        held_by = waiter.owner
            resolutions.append(
                Resolution(
                    result.run_id,
                    result.seq,
                    CheckpointStatus.COMPLETED if result.ok else CheckpointStatus.FAILED,
                    result.output if result.ok else None,
                    None if result.ok else (result.error or {"message": "step failed"}),
                    # No list built for none (most results carry no events).
                    [event.to_wire() for event in events] if events else None,
                    held_by,
                )
            )
        return resolutions

    def _unmark(self, marks: Marks) -> None:
        """The settles of ``marks`` are over (handed over, or failed)."""
        if not marks:
            return
        with self._hand:
            for _, waiter in marks:
                waiter.settling -= 1
        for _, waiter in marks:
            if waiter.result is None:
                # Not handed over: the settle failed (maybe after committing)
                # or someone settled first; the store is the truth.
                waiter.recheck = True
            waiter.changed.set()

    async def on_results(self, results: list[StepResult]) -> None:
        """Settle a batch of results and wake the runs that can move on."""
        now = self.clock.now_ms()
        lease = self.lease_turns(len(results)) if self.resume_leased is not None else None
        marks: Marks = []
        try:
            answers, leased = await self._settle(self._resolutions(results, marks), now, lease)
            await self._settled(results, answers, leased, lease, marks)
        finally:
            self._unmark(marks)

    async def settle_taken(self, take: TakeResults) -> None:
        """Settle the batch ``take`` takes off the transport in the settle's
        own transaction (``SettlingConsumer``), then wake or resume its runs."""
        # As many woken runs as there are free turn slots, whatever the batch's size.
        lease = self.lease_turns(_TAKE_LEASE) if self.resume_leased is not None else None
        marks: Marks = []
        try:
            results, answers, leased = await take(
                lambda taken: self._resolutions(taken, marks),
                self.clock.now_ms(),
                lease if lease and lease.limit > 0 else None,
            )
            if results:
                await self._settled(results, answers, leased, lease, marks)
        finally:
            self._unmark(marks)

    async def _settled(
        self,
        results: list[StepResult],
        answers: list[int | None],
        leased: Leased,
        lease: TurnLease | None,
        marks: Marks,
    ) -> None:
        """After a settle: resume the runs it leased, hand results to their
        in-memory waiters, wake the runs that can move on (and those whose
        held turn let go of a result settled without a stamp)."""
        if leased:
            # Settled and leased in one transaction: their turns start here
            # now, with the histories read there (no wake, no second lease).
            assert lease is not None and self.resume_leased is not None
            for run, checkpoints in leased.values():
                try:
                    await self.resume_leased(run, checkpoints, lease.owner)
                except Exception:
                    _log.exception("could not resume run %s after a step result", run.run_id)
        to_wake: dict[str, bool] = {}  # run id -> its wake was stamped by this settle
        held = dict(marks)
        for result, left in zip(results, answers, strict=True):
            step_id = result.step_id
            self._persisted.pop(step_id, None)
            waiter = self._live.get(step_id)
            marked = held.get(step_id)
            if waiter is not None and (marked is None or waiter is marked):
                # Its dispatcher holds the run's turn here; it returns the
                # value itself, a wake would only cost another turn.
                if left is None:
                    # This copy settled nothing: what the store holds (settled
                    # by whom it was, maybe with another output) is the truth.
                    waiter.recheck = True
                elif waiter.result is None:
                    waiter.result = result
                if left is not None and (left == 0 or not result.ok) and marked is None:
                    # The settle stamped the held run's wake (it could not
                    # lease it): the notice of that stamp is not news here.
                    self.holds.own_stamp(result.run_id)
                waiter.changed.set()
                continue
            if (left is None or left == 0 or not result.ok) and result.run_id not in leased:
                # left is None: already settled, or a duplicate; resuming
                # again is harmless and covers a settler that died before
                # waking the run.
                # A marked one (its held turn gone, cancelled or fenced) was
                # maybe not stamped: the wake stamps it now.
                stamped = left is not None and marked is None
                to_wake[result.run_id] = to_wake.get(result.run_id, False) or stamped
        for run_id, stamped in to_wake.items():
            try:
                await self._wake(run_id, stamped)
            except Exception:
                _log.exception("could not wake run %s after a step result", run_id)

    async def _settle(
        self, resolutions: list[Resolution], now: int, lease: TurnLease | None
    ) -> tuple[list[int | None], Leased]:
        """Settle (and lease, with ``lease``) in one store call; a result the
        store refuses fails alone, never the batch it came in."""
        try:
            if lease is not None and lease.limit > 0:
                return await self.store.resolve_and_lease(resolutions, now, lease)
            return await self.store.resolve_checkpoints(resolutions, now), {}
        except Exception as exc:
            if not is_row_error(exc):
                raise  # the store is down: the transport delivers the batch again
            if len(resolutions) > 1:
                # One row undid the transaction: settle each alone.
                answers: list[int | None] = []
                leased: Leased = {}
                for resolution in resolutions:
                    if lease is not None:
                        lease = replace(lease, limit=lease.limit - len(leased))
                    one, got = await self._settle([resolution], now, lease)
                    answers.extend(one)
                    leased.update(got)
                return answers, leased
            return await self._refused(resolutions[0], now, lease, exc)

    async def _refused(
        self, resolution: Resolution, now: int, lease: TurnLease | None, exc: Exception
    ) -> tuple[list[int | None], Leased]:
        """A result the store cannot take (an output it cannot encode, an id it
        refuses): settle the step as failed instead, or drop it (it names no
        step that could exist)."""
        if resolution.status is CheckpointStatus.COMPLETED:
            _log.error(
                "the result of %s:%d could not be stored: %s",
                resolution.run_id,
                resolution.seq,
                exc,
            )
            failed = Resolution(
                resolution.run_id,
                resolution.seq,
                CheckpointStatus.FAILED,
                error={
                    "message": f"the step's result could not be stored: {exc}",
                    "code": "result_not_stored",
                    "retryable": False,
                },
            )
            # A refusal of this one too ends below, in the same way.
            return await self._settle([failed], now, lease)
        _log.error("dropping a step result the store refuses: %s", exc)
        return [None], {}

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
