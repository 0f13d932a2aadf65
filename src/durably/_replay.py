"""One turn: run a workflow body against a checkpoint snapshot until it ends or parks.

A turn executes the body as an asyncio task. Every ``ctx`` operation takes its
position (seq) the moment it is called, then either resolves from the snapshot,
does its work (a local step), or *parks* on a future that this turn never
resolves. The turn is over when the body returns or raises, or when it is
*quiescent*: something is parked, nothing is in flight, and the body makes no
further progress for a few event-loop iterations. Then every parked operation
has already written its own checkpoint, so the turn only has to suspend the
run with the earliest wake time and cancel the body.

Parking instead of raising a "suspend" exception is what makes
``asyncio.gather`` of ``ctx`` calls correct: every branch parks and is
recorded, and none keeps running detached after the turn ends.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from . import _codec as codec
from ._faults import is_infrastructure_error
from .errors import NondeterminismError, _ContinueAsNew, _TurnClosed
from .model import CancelMode, Checkpoint, CheckpointKind, ErrorInfo, Run

__all__ = ["FINAL", "CloseReason", "Turn", "TurnEnd", "TurnOutcome", "error_info"]

T = TypeVar("T")

# Event-loop iterations without progress before a turn with parked operations
# counts as quiescent. Pure scheduling (gather's child tasks, nested gathers)
# settles within a handful of iterations; real work is counted as in flight.
_QUIESCENCE_YIELDS = 20
_MAX_TRACEBACK_CHARS = 8000


FINAL = None
"""What :meth:`Turn.wrote` records for a position settled by a write whose exact
form the store decides (a delivered signal, a transaction): the next history
must hold it, settled."""


class _Resumed(BaseException):
    """Raised at a parked operation when a kept turn resumes: the operation
    runs again from its start against the new history (see :meth:`Turn.resumable`)."""


class TurnEnd(StrEnum):
    """How a turn ended."""

    COMPLETED = "completed"
    FAILED = "failed"
    SUSPENDED = "suspended"
    CONTINUED = "continued"
    CANCELLED = "cancelled"
    """A compensating cancel finished unwinding."""
    CLOSED = "closed"
    """Stopped from outside (cancelled, fenced, drained): nothing to write."""
    BLOCKED = "blocked"
    """No live worker can take the turn (a remote workflow): parked, polled again."""


class CloseReason(StrEnum):
    """Why a turn was closed; a closed turn's next ``ctx`` call raises."""

    FENCED = "fenced"
    """A write or renewal found the lease held by someone else."""
    DRAIN = "drain"
    """The engine is draining: the run is handed back as ``pending``."""
    UNWIND = "unwind"
    """A compensating cancel: the run takes one more turn to undo its saga."""
    CANCELLED = "cancelled"
    """The run was ended from outside its turn (a cancel, a timeout), here or
    by another process."""
    SUSPENDED = "suspended"
    """The body parked for good; the turn ends with the run suspended."""
    DONE = "done"
    """The body returned or raised."""
    STORE = "store"
    """The store could not answer (an outage, a dropped connection): the run is
    left as it was and takes the turn again once the store answers."""
    HALTED = "halted"
    """The determinism guard fired: the run fails whatever the body does next."""


@dataclass(slots=True)
class TurnOutcome:
    """The result of :meth:`Turn.execute`."""

    end: TurnEnd
    output: Any = None
    error: ErrorInfo | None = None
    wake_at: int | None = None
    after_settle: Callable[[], Awaitable[None]] | None = None
    """Called once the outcome is written (a remote turn is sent only then)."""


class Turn:
    """The state of one turn of one run: snapshot, positions, parked operations."""

    def __init__(
        self,
        run: Run,
        checkpoints: dict[int, Checkpoint],
        owner: str,
        now_ms: Callable[[], int],
        reconcile_ms: int,
        lease_ms: int,
    ) -> None:
        self.run = run
        self.checkpoints = checkpoints
        self.owner = owner
        self._now_ms = now_ms
        self._reconcile_ms = reconcile_ms
        self._lease_ms = lease_ms
        self.lease_until = run.locked_until
        """When the lease as last confirmed by the store runs out (engine clock)."""
        self._next_seq = 0
        self._history_end = max(checkpoints, default=-1) + 1
        self.completed_below = 0
        """Every position below this is a completed checkpoint of
        :attr:`checkpoints` as the store holds it (see :mod:`durably._sticky`)."""
        self._parked: dict[int, tuple[int | None, bool]] = {}
        self._park_futures: list[asyncio.Future[bool]] = []
        self._in_flight = 0
        self._generation = 0
        self._wakeup: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unflushed: list[asyncio.Future[bool]] = []
        self.unordered_writes = False
        """Whether a write went around the store's ordered writes (its own
        transaction): the turn's outcome must then wait for it, not just
        queue behind the ordered ones."""
        self.closed = False
        self.close_reason: CloseReason | None = None
        self.fenced = False
        self.failure: BaseException | None = None
        """Why the run must fail whatever the body does (the determinism guard)."""
        self.store_error: BaseException | None = None
        """The infrastructure error that stopped this turn (see :meth:`store_failed`)."""
        self.store_calls = _StoreGuard(self)
        """``with turn.store_calls:`` around a store call made for the body turns
        an outage into :meth:`store_failed` (a signal the body cannot catch)."""
        self.missing_children: set[str] = set()
        """Children waited on whose runs were never created (see the engine)."""
        self.may_have_waiters = bool(checkpoints)
        """Whether the run may hold signal or event waiters: it had a history when
        this turn began (a waiter is written with its wait's checkpoint), or this
        turn registered a wait. Only a lease holder registers one, so a turn whose
        terminal settle holds the lease knows this for sure (see ``RunChanges``)."""
        self.attached_children: set[str] = set()
        """Children this run may leave running that must not outlive it (all but
        ``detached`` ones): cancelled when the run ends."""
        self.blocked: ErrorInfo | None = None
        """Why a step of this turn found no live capable worker (see :meth:`block`)."""
        self.unwinding = run.cancel_requested == CancelMode.COMPENSATE
        """A compensating cancel: replay only, park anything new, then undo."""
        self._phase: Turn | None = None
        self._held = 0
        self.on_quiescent: Callable[[], Awaitable[bool]] | None = None
        """Called when the body is quiescent, before the turn suspends (the
        updates of :mod:`durably._ops.updates`): ``True`` if it let the body
        or the history move on, so the turn goes on instead of suspending."""
        self.gate: Callable[[Iterable[int]], Awaitable[None] | None] = _no_gate
        """``gate(seqs)``: what an operation at one of ``seqs`` awaits before
        it resolves (``None``: nothing); see :mod:`durably._ops.updates`."""
        self.in_handler = False
        """An update's handler or validator is running: ``ctx`` calls are refused."""
        self.written: dict[int, Checkpoint | None] = {}
        """What this turn wrote, by position (:data:`FINAL`: settled, form unknown):
        with the snapshot, the history a kept turn expects to find next time."""
        self._open: dict[int, tuple[int, ...]] = {}
        """The positions of each operation running under :meth:`resumable` now."""
        self._open_seqs: dict[int, int] = {}
        self._open_ids = 0
        self._closed_calls = 0
        self._unresumable_parks = 0
        self._body: asyncio.Future[Any] | None = None
        self._kept_at: tuple[int, int, int] | None = None

    # -- used by the context's operations ----------------------------------------------

    @property
    def next_seq(self) -> int:
        """The position the next operation will take."""
        return self._next_seq

    @property
    def replaying(self) -> bool:
        """Whether the body is re-executing code a previous turn ran: positions
        recorded before this turn lie ahead of it."""
        return self._next_seq < self._history_end

    def allocate(self, name: str, kind: CheckpointKind) -> tuple[int, Checkpoint | None]:
        """Take the next position and return it with its recorded checkpoint.

        Called synchronously when a ``ctx`` method is *called*, so positions
        follow call order even when the awaits happen later or concurrently.
        """
        self.ensure_open()
        if self.in_handler:
            raise RuntimeError(
                "ctx operations cannot be called from an update handler or validator: "
                "a handler changes the workflow's own state; the body reacts to it"
            )
        seq = self._next_seq
        self._next_seq += 1
        recorded = self.checkpoints.get(seq)
        if recorded is not None and (recorded.kind != kind or recorded.name != name):
            raise self.halt(
                NondeterminismError(
                    f"run {self.run.run_id!r}: position {seq} holds {recorded.kind} "
                    f"{recorded.name!r} in history, but the workflow now calls {kind} "
                    f"{name!r}. Register changed workflows under a new version or guard "
                    "the change with ctx.patched().",
                    seq=seq,
                    history=(str(recorded.kind), recorded.name),
                    found=(str(kind), name),
                )
            )
        return seq, recorded

    def skip(self, seq: int) -> None:
        """Move past ``seq``, a recorded position the turn itself replayed (an
        update re-applied), not one the body calls."""
        self._next_seq = max(self._next_seq, seq + 1)

    @property
    def parked_seqs(self) -> list[int]:
        """The positions parked right now, in order."""
        return sorted(self._parked)

    async def hold(self, future: asyncio.Future[Any]) -> Any:
        """Await ``future``, resolved by the turn itself (an update applied, a
        condition met), counting as parked meanwhile: the turn may be
        quiescent, and then :attr:`on_quiescent` is what resolves it."""
        self.ensure_open()
        self._held += 1
        self._generation += 1
        self._poke()
        try:
            return await future
        finally:
            self._held -= 1
            self._generation += 1

    def halt(self, failure: BaseException) -> _TurnClosed:
        """Fail the run with ``failure`` whatever the body does next.

        Returns the signal to raise: it derives from ``BaseException``, so a
        body's ``except Exception`` cannot swallow the determinism guard and go
        on executing side effects against a history that is not its own; the
        turn is closed, so any later ``ctx`` call raises too.
        """
        if self.failure is None:
            self.failure = failure
        self.close(CloseReason.HALTED)
        return _TurnClosed(CloseReason.HALTED)

    def store_failed(self, error: BaseException) -> _TurnClosed:
        """Stop the turn because the store could not answer; return the signal to raise.

        An outage is never the workflow's failure: the body cannot catch the
        signal, the engine writes no outcome, and the run takes this turn
        again once the store answers (replay makes that safe).
        """
        if self.store_error is None:
            self.store_error = error
        self.close(CloseReason.STORE)
        # Even a turn that already ended (the body returned, then flushing
        # its results failed) must not settle: it runs again instead.
        self.close_reason = CloseReason.STORE
        return _TurnClosed(CloseReason.STORE)

    def write_later(self, write: Awaitable[bool], *, ordered: bool = True) -> None:
        """Start a checkpoint write without waiting for it.

        Used for results (a step's output, a recorded ``now``): nothing
        outside the run depends on them until the next side effect or the
        end of the turn, and both :meth:`flush` first. A sequential
        workflow thus pays one store round trip per step, not two.
        """
        self.unordered_writes = self.unordered_writes or not ordered
        self._unflushed.append(asyncio.ensure_future(write))

    def write_after_earlier(self, write: Callable[[], Awaitable[bool]]) -> asyncio.Future[bool]:
        """Start ``write()`` once every write started before it is done (a
        side effect made at a call, such as creating a child, must not exist
        before the results it was built on are durable); returned, and
        collected by the next :meth:`flush` like any write."""
        earlier = list(self._unflushed)

        async def after() -> bool:
            results = await asyncio.gather(*earlier, return_exceptions=True)
            if any(result is False or isinstance(result, BaseException) for result in results):
                return True  # the flush reports the earlier write's failure or fence
            return await write()

        future = asyncio.ensure_future(after())
        self.unordered_writes = True
        self._unflushed.append(future)
        return future

    def needs_fence(self) -> bool:
        """Whether a side effect must first await a write to be safe.

        It must when earlier results are not durable yet, or when the lease
        was last confirmed more than half a lease ago (another instance may
        have taken the run over: the fenced write is what finds out). Right
        after the lease was taken or renewed, and with nothing unflushed, a
        write would only confirm what is known, so the step's ``running``
        record can go out with its result instead of before the effect.
        """
        if self._unflushed or self.lease_until is None:
            return True
        return self.lease_until - self._now_ms() < self._lease_ms // 2

    async def flush(self) -> None:
        """Wait for every write started by :meth:`write_later`.

        Called before anything that depends on earlier results being
        durable: a step's side effect, a park, the turn's outcome. A write
        refused by the lease fence closes the turn.
        """
        while self._unflushed:
            pending, self._unflushed = self._unflushed, []
            if all(write.done() for write in pending):
                # Usually so at the end of a turn (its settle was committed
                # with them): read them here, not a loop turn later.
                results: list[Any] = [_outcome(write) for write in pending]
            else:
                results = await asyncio.gather(*pending, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    if isinstance(result, Exception) and is_infrastructure_error(result):
                        raise self.store_failed(result) from result
                    raise result
                if result is False:
                    self.fenced = True
                    self.close(CloseReason.FENCED)
        if self.fenced:
            raise _TurnClosed(CloseReason.FENCED)

    def ensure_open(self) -> None:
        """Raise :class:`_TurnClosed` once the turn has ended."""
        if self.closed:
            self._closed_calls += 1  # a kept body that moved: it is not resumed
            raise _TurnClosed(self.close_reason)

    def in_flight(self) -> _InFlight:
        """Mark real work (I/O, a step function) so the turn is not quiescent:
        ``with turn.in_flight():``."""
        return _InFlight(self)

    def _landed(self) -> None:
        """Work marked by :meth:`in_flight` ended."""
        self._in_flight -= 1
        self._generation += 1
        if self._in_flight == 0 and (self._parked or self._held):
            self._poke()

    async def park(self, seq: int, wake_at: int | None, *, reconcile: bool) -> Any:
        """Wait for something that cannot happen during this turn.

        ``wake_at`` is when the run must be woken for this operation; with
        ``reconcile`` the run also gets the fallback wake, because the thing it
        waits for (a signal, a child) is delivered by someone else and that
        delivery could be lost to a crash.
        """
        self.ensure_open()
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._parked[seq] = (wake_at, reconcile)
        self._park_futures.append(future)
        if seq not in self._open_seqs:
            self._unresumable_parks += 1  # nothing could run it again: the turn is not kept
        self._generation += 1
        self._poke()
        try:
            resumed = await future
        except BaseException:
            # Cancelled from inside the body (a timeout of its own): a kept
            # body that moved this way is not resumed (see :meth:`_mark`).
            self._generation += 1
            raise
        if resumed:
            raise _Resumed
        raise _TurnClosed(self.close_reason)  # pragma: no cover - futures resolve only to resume

    async def resumable(self, seqs: tuple[int, ...], op: Callable[[bool], Awaitable[T]]) -> T:
        """Run ``op(again=False)``: the operation at ``seqs``; if it parks and
        the turn is kept and resumed (:meth:`resume`), run ``op(again=True)``,
        which reads its positions from the new history, as a replay would.

        Only a turn whose every park is inside one of these can be kept.
        """
        self._open_ids += 1
        key = self._open_ids
        self._open[key] = seqs
        counts = self._open_seqs
        for seq in seqs:
            counts[seq] = counts.get(seq, 0) + 1
        try:
            again = False
            while True:
                try:
                    return await op(again)
                except _Resumed:
                    again = True
        finally:
            del self._open[key]
            for seq in seqs:
                if counts[seq] == 1:
                    del counts[seq]
                else:
                    counts[seq] -= 1

    def resumable_at(
        self, seq: int, recorded: Checkpoint | None, op: Callable[[Checkpoint | None], Awaitable[T]]
    ) -> Awaitable[T]:
        """:meth:`resumable` for an operation at one position: ``op(recorded)``,
        then ``op(<the new history's checkpoint at seq>)`` after a resume."""

        def attempt(again: bool) -> Awaitable[T]:
            return op(self.checkpoints.get(seq) if again else recorded)

        return self.resumable((seq,), attempt)

    def wrote(self, seq: int, checkpoint: Checkpoint | None = FINAL) -> None:
        """Note that this turn wrote ``checkpoint`` at ``seq`` (see :attr:`written`)."""
        self.written[seq] = checkpoint

    async def block(self, seq: int, reason: ErrorInfo, poll_at: int) -> Any:
        """Park ``seq`` because no live worker can take it: once the turn
        suspends, the run is settled ``blocked`` with ``reason`` (and polled
        again) instead of ``suspended``."""
        if self.blocked is None:
            self.blocked = reason
        return await self.park(seq, poll_at, reconcile=False)

    def unwind_phase(self) -> Turn:
        """A fresh turn over the same snapshot and lease, for the saga's unwind
        after the body ended: it parks like any turn (a dispatched undo that is
        out), and closing this turn (a cancel, a fence, a drain) closes it too."""
        phase = Turn(
            self.run,
            self.checkpoints,
            self.owner,
            self._now_ms,
            self._reconcile_ms,
            self._lease_ms,
        )
        phase.lease_until = self.lease_until
        phase.unwinding = False  # the undos execute; nothing of the body runs again
        self._phase = phase
        return phase

    @property
    def holds_lease(self) -> bool:
        """Whether the turn still works under its lease: open, or its body
        ended of itself (its results and saga unwind may follow), or its
        unwind phase is open — so a long unwind keeps the lease renewed."""
        if self._phase is not None:
            return not self._phase.closed
        return not self.closed or self.close_reason in (CloseReason.DONE, CloseReason.SUSPENDED)

    def close(self, reason: CloseReason) -> None:
        """Stop the turn from outside (cancel, fence, drain)."""
        if self._phase is not None:
            self._phase.close(reason)
        if not self.closed:
            self.closed = True
            self.close_reason = reason
            for write in self._unflushed:
                # A closed turn may never flush again: a write that fails is
                # still collected, so asyncio does not log it as unretrieved.
                write.add_done_callback(_consume)
            self._poke()

    # -- the driver ---------------------------------------------------------------------

    def execute(
        self, body: Callable[[], Awaitable[Any]], *, keep: bool = False
    ) -> Awaitable[TurnOutcome]:
        """Run ``body`` until it returns, raises, parks for good, or the turn is closed.

        With ``keep``, a body that parked for good is left parked rather than
        cancelled when the turn can be resumed later (:attr:`kept`): the
        caller then resumes it (:meth:`resume`) or lets it go (:meth:`dispose`).
        """
        task = asyncio.ensure_future(self._poking(body()))
        return self._run(task, keep=keep)

    async def _poking(self, body: Awaitable[Any]) -> Any:
        """``body``, poking the turn from the body task's own last step: the
        turn wakes one loop turn after the body ends, where a done callback
        takes two (the callback, then the turn's wake-up it schedules). The
        task is done by the time the turn looks (nothing awaits after this
        ``finally``); :meth:`_finish` drops this frame from a failure's traceback."""
        try:
            return await body
        finally:
            self._poke()

    async def _run(self, task: asyncio.Future[Any], *, keep: bool) -> TurnOutcome:
        while True:
            await self._wakeup
            self._wakeup = asyncio.get_running_loop().create_future()
            if task.done() or self.closed:
                break
            if (
                (self._parked or self._held)
                and self._in_flight == 0
                and await self._quiescent(task)
            ):
                if await self._moved_on():
                    continue
                break
        if task.done():
            return self._finish(task)
        if self.failure is not None and self.store_error is None:
            outcome = TurnOutcome(TurnEnd.FAILED, error=error_info(self.failure))
        elif self.closed:
            outcome = TurnOutcome(TurnEnd.CLOSED)
        elif self.blocked is not None:
            outcome = TurnOutcome(TurnEnd.BLOCKED, error=self.blocked, wake_at=self._wake_at())
        else:
            outcome = TurnOutcome(TurnEnd.SUSPENDED, wake_at=self._wake_at())
        self.close(self.close_reason or CloseReason.SUSPENDED)
        if keep and outcome.end is TurnEnd.SUSPENDED and self._resumable():
            self._body = task
            self._kept_at = self._mark()
            return outcome
        await _cancel(task)
        return outcome

    @property
    def kept(self) -> bool:
        """Whether the body is parked in memory, for :meth:`resume` or :meth:`dispose`."""
        return self._body is not None

    def _resumable(self) -> bool:
        """Whether the parked body can be resumed by resolving its parks:
        every park runs again from its operation's start, nothing else is
        held, and nothing of the turn is still being written."""
        if self._unresumable_parks or self._held or self.unwinding or self._phase is not None:
            return False
        if self.fenced or self.failure is not None or self.store_error is not None:
            return False
        parked = set(self._parked)
        # Every running operation is parked (none waits on something else
        # that would not run it again from its start).
        return all(parked.intersection(seqs) for seqs in self._open.values())

    def _mark(self) -> tuple[int, int, int]:
        """What must not have moved while the body is kept."""
        return (self._generation, self._next_seq, self._closed_calls)

    @property
    def open_seqs(self) -> dict[int, int]:
        """The positions of the operations running now (parked ones among them)."""
        return self._open_seqs

    def expected_history(self) -> tuple[dict[int, Checkpoint | None], frozenset[int]]:
        """The history this kept turn expects the store to hold now, and the
        positions of its parked operations (which anything may have settled)."""
        expected: dict[int, Checkpoint | None] = dict(self.checkpoints)
        expected.update(self.written)
        return expected, frozenset(self._open_seqs)

    def resume(self, run: Run, checkpoints: dict[int, Checkpoint]) -> Awaitable[TurnOutcome] | None:
        """Take the next turn of the kept body against ``checkpoints`` (the
        history the lease returned, checked by the caller to continue the one
        this turn saw): every parked operation runs again from its start, as a
        replay would reach it. ``None`` if the body moved while it was kept
        (it is disposed of then: replay instead)."""
        task = self._body
        if task is None or task.done() or self._kept_at != self._mark():
            self.dispose()
            return None
        self._body = None
        self._kept_at = None
        self.run = run
        self.checkpoints = checkpoints
        self.completed_below = 0
        self.lease_until = run.locked_until
        self._history_end = max(checkpoints, default=-1) + 1
        self.written = {}
        self.closed = False
        self.close_reason = None
        self.blocked = None
        self.unordered_writes = False
        self._unflushed = []
        self._wakeup = asyncio.get_running_loop().create_future()
        parks, self._park_futures = self._park_futures, []
        self._parked = {}
        self._generation += 1
        for park in parks:
            if not park.done():
                park.set_result(True)
        return self._run(task, keep=True)  # kept again if it parks again

    def dispose(self) -> None:
        """Let go of a kept body as a suspend does: cancel it (the turn is
        closed already, so a ``ctx`` call it makes meanwhile raises)."""
        task, self._body, self._kept_at = self._body, None, None
        if task is not None and not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)

    async def _quiescent(self, task: asyncio.Future[Any]) -> bool:
        """Whether the body stays still for :data:`_QUIESCENCE_YIELDS` loop
        iterations with something parked or held.

        The iterations are counted by a callback that schedules itself
        (:class:`_QuietWatch`), not by this coroutine sleeping: a sleep
        resumes the whole chain of frames from the run's task down to here
        each iteration (~20 per park, most of a parked step's CPU with
        hundreds of turns on the loop), the callback one small function."""
        while True:
            watch = _QuietWatch(self, task)
            if not await watch.future:
                return False
            # The iteration this coroutine resumed in: look once more, as
            # a count ending here would.
            if task.done() or self.closed or self._in_flight:
                return False
            if self._generation == watch.generation:
                return bool(self._parked or self._held)
            # Progress without a wake-up of its own (a held operation
            # released, then replayed ones): count the quiet again rather
            # than wait for a poke that may not come.

    async def _moved_on(self) -> bool:
        """Ask :attr:`on_quiescent` whether the quiescent body can go on."""
        if self.on_quiescent is None or self.closed:
            return False
        try:
            with self.in_flight():
                moved = await self.on_quiescent()
        except _TurnClosed:
            return False
        except Exception as exc:
            if is_infrastructure_error(exc):
                self.store_failed(exc)
                return False
            raise
        if moved:
            self._poke()
        return moved

    def _finish(self, task: asyncio.Future[Any]) -> TurnOutcome:
        self.close(self.close_reason or CloseReason.DONE)
        exc = None if task.cancelled() else task.exception()  # retrieved: asyncio logs it else
        if exc is not None:
            _drop_poking_frame(exc)
        if self.store_error is not None:
            # Whatever the body made of it (it may have swallowed the signal
            # with a bare except), the turn stopped on an outage: no outcome.
            return TurnOutcome(TurnEnd.CLOSED)
        if self.failure is not None:
            return TurnOutcome(TurnEnd.FAILED, error=error_info(self.failure))
        if task.cancelled():
            return TurnOutcome(TurnEnd.CLOSED)
        if exc is None:
            try:
                return TurnOutcome(
                    TurnEnd.COMPLETED, output=codec.to_jsonable(task.result(), "workflow output")
                )
            except (TypeError, ValueError) as encode_error:
                return TurnOutcome(TurnEnd.FAILED, error=error_info(encode_error))
        if isinstance(exc, _ContinueAsNew):
            return TurnOutcome(TurnEnd.CONTINUED, output=exc.input)
        if isinstance(exc, _TurnClosed | asyncio.CancelledError):
            return TurnOutcome(TurnEnd.CLOSED)
        return TurnOutcome(TurnEnd.FAILED, error=error_info(exc))

    def _wake_at(self) -> int | None:
        times = [when for when, _ in self._parked.values() if when is not None]
        # A held wait (a condition on update handlers' state) is met by an
        # update, whose delivery wakes the run: reconcile in case it is lost.
        if self._reconcile_ms > 0 and (
            self._held or any(reconcile for _, reconcile in self._parked.values())
        ):
            times.append(self._now_ms() + self._reconcile_ms)
        return min(times) if times else None

    def _poke(self) -> None:
        if not self._wakeup.done():
            self._wakeup.set_result(None)


class _QuietWatch:
    """Counts event-loop iterations in which a turn's body makes no progress
    (:meth:`Turn._quiescent`): :attr:`future` is ``True`` after
    :data:`_QUIESCENCE_YIELDS` quiet ones in a row, ``False`` as soon as the
    body ended, the turn closed or an operation is in flight. Progress (the
    turn's generation moving) starts the count again."""

    __slots__ = ("_loop", "_quiet", "_task", "_turn", "future", "generation")

    def __init__(self, turn: Turn, task: asyncio.Future[Any]) -> None:
        self._turn = turn
        self._task = task
        self._quiet = 0
        self.generation = turn._generation
        """The turn's generation when the count ended."""
        self._loop = asyncio.get_running_loop()
        self.future: asyncio.Future[bool] = self._loop.create_future()
        self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        future = self.future
        if future.done():
            return  # the awaiting turn was cancelled: stop counting
        turn = self._turn
        if self._task.done() or turn.closed or turn._in_flight:
            future.set_result(False)
            return
        if turn._generation != self.generation:
            self.generation, self._quiet = turn._generation, 0
        else:
            self._quiet += 1
            if self._quiet >= _QUIESCENCE_YIELDS:
                future.set_result(True)
                return
        self._loop.call_soon(self._tick)


class _InFlight:
    """:meth:`Turn.in_flight`'s context manager. A class, not a
    ``@contextmanager`` generator: it is entered once per step attempt, and
    the generator costs a frame, a wrapper and four more calls each time."""

    __slots__ = ("_turn",)

    def __init__(self, turn: Turn) -> None:
        self._turn = turn

    def __enter__(self) -> None:
        turn = self._turn
        turn._in_flight += 1
        turn._generation += 1

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self._turn._landed()


class _StoreGuard:
    """Turns an infrastructure error raised inside it into :meth:`Turn.store_failed`."""

    __slots__ = ("_turn",)

    def __init__(self, turn: Turn) -> None:
        self._turn = turn

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Exception) and is_infrastructure_error(exc):
            raise self._turn.store_failed(exc) from exc


def error_info(exc: BaseException) -> ErrorInfo:
    """A failure as stored on a run or checkpoint.

    Any exception encodes: a ``__str__`` that raises, a ``code`` or
    ``details`` that is no JSON value, each falls back to something that is,
    so a hostile exception fails its run instead of crashing the turn.
    """
    kind = _safe(lambda: type(exc).__name__, "Exception")
    details = getattr(exc, "details", None)
    try:
        details = codec.to_jsonable(details, "error details")
    except Exception:
        details = codec.storable_text(_safe(lambda: repr(details), "<unrepresentable details>"))
    code = getattr(exc, "code", None)
    if code is not None and not isinstance(code, str):
        code = _safe(lambda: str(code) if isinstance(code, int) else repr(code), None)
    # A failure is stored whatever its text holds: a message quoting an
    # undecodable file name must not make the failure itself unstorable.
    text = codec.storable_text(_safe(lambda: "".join(traceback.format_exception(exc)), ""))
    message = _safe(lambda: str(exc), None)
    if message is None:
        message = f"<{kind}: str() raised>"
    return {
        "message": codec.storable_text(message or kind),
        "type": kind,
        "code": codec.storable_text(code) if code else "error",
        "details": details,
        "traceback": text[-_MAX_TRACEBACK_CHARS:],
    }


def _drop_poking_frame(exc: BaseException) -> None:
    """Start ``exc``'s traceback at the body, as it did before the body ran
    under :meth:`Turn._poking` (a stored failure shows no engine frame)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _POKING_CODE:
        exc.__traceback__ = tb.tb_next


_POKING_CODE = Turn._poking.__code__


def _no_gate(_seqs: Iterable[int]) -> None:
    return None


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel a parked body and give it a bounded moment to unwind."""
    task.cancel()
    # A body that swallows cancellation can only reach the engine through
    # ctx, which now raises _TurnClosed; it is not awaited past this bound.
    await asyncio.wait({task}, timeout=1.0)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved so asyncio does not log it


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _outcome(write: asyncio.Future[bool]) -> Any:
    """A finished write's result, or its exception, as ``gather(return_exceptions=True)``."""
    if write.cancelled():
        return asyncio.CancelledError()
    error = write.exception()
    return error if error is not None else write.result()


def _consume(write: asyncio.Future[bool]) -> None:
    if not write.cancelled():
        write.exception()


def _safe(compute: Callable[[], Any], fallback: Any) -> Any:
    try:
        return compute()
    except Exception:
        return fallback
