"""Sticky runs: a suspended turn's parked body, kept in memory for the run's next turn.

Every turn replays the workflow body from the top against the run's whole
history, so a run of K sequential steps replays O(K²) operations in all. A
process that just suspended a run usually takes its next turn too (the step
result, the timer or the signal comes back here). So the turn's body is not
cancelled when it suspends: it stays parked, with its context, its saga and
the history it has seen, in a bounded LRU of :class:`StickyRuns`. The next
turn still leases the run through the store as always (fencing and leases are
unchanged; the cache decides nothing about ownership) and gets the history as
always; if that history is the one the kept body saw, except at the
positions it is parked on, each parked operation runs again from its start
against the new history — exactly what a replay would do once it reached
that point — instead of replaying everything before it.

Anything else drops the entry and the turn replays from scratch: a history
that differs anywhere else (another instance took a turn meanwhile, a child
settled a position the body is not waiting on), a cancel request, another
recovery attempt or version, a body that moved while it was kept, a turn
that used updates, a saga unwind or a park that cannot run again. Letting go
of a kept body (eviction, a drop, a drain) cancels it, as a suspend does
without the cache; a crash loses the cache, and the next turn replays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass

from ._ops.saga import Saga
from ._replay import Turn, TurnOutcome
from .context import WorkflowContext
from .model import Checkpoint, CheckpointStatus, Run
from .stores.base import HistoryTail

__all__ = ["Kept", "Resumed", "StickyRuns", "continues"]

_SETTLED = (CheckpointStatus.COMPLETED, CheckpointStatus.FAILED)


@dataclass(slots=True)
class Kept:
    """A run's suspended turn, parked in memory for its next turn."""

    turn: Turn
    ctx: WorkflowContext
    saga: Saga
    workflow: str
    version: str
    recovery_attempts: int
    created_at: int = 0
    settled: bool = False
    """Whether the turn's suspend was written (only then may it resume)."""
    _read_from: int | None = None
    _merged: tuple[dict[int, Checkpoint], int, HistoryTail] | None = None
    """The history :meth:`whole` made last, the position it merged below and
    the tail it merged."""

    def read_from(self) -> int:
        """The lowest position whose checkpoint the next turn must read from
        the store: every one below is a completed checkpoint the body read
        from the store (never rewritten, so the kept copy is the stored one).

        Not the lowest parked position: a position the body took but has
        not written yet (an operation not started) may have been written by
        another instance's turn since, and must be read to be noticed."""
        if not self.settled:
            return 0
        if self._read_from is None:
            # The body cannot move while kept (Turn.resume checks), so this
            # holds until it resumes, when a new Kept replaces this one.
            seen, written, parked = self.turn.checkpoints, self.turn.written, self.turn.open_seqs
            # Below completed_below the body's history is settled already
            # (it was merged from a kept body): start the scan there.
            position = self.turn.completed_below
            while True:
                cp = seen.get(position)
                if (
                    cp is None
                    or cp.status is not CheckpointStatus.COMPLETED
                    or position in written
                    or position in parked
                ):
                    break
                position += 1
            self._read_from = position
        return self._read_from

    def whole(self, tail: HistoryTail) -> dict[int, Checkpoint] | None:
        """The history ``tail`` continues, with the kept checkpoints below its
        position; ``None`` if this body does not hold all of them (it
        was read for another kept body, or before this one settled)."""
        since = tail.since
        if self.read_from() < since:
            return None
        seen = self.turn.checkpoints
        if (tail and min(tail) < 0) or (seen and min(seen) < 0):
            # Undos (negative positions) first, as a store orders them.
            whole = {seq: cp for seq, cp in tail.items() if seq < 0}
            whole.update((seq, cp) for seq, cp in seen.items() if 0 <= seq < since)
        else:
            # Copy (in C) and drop the few positions at or above ``since``,
            # rather than pick the many below it one by one.
            whole = dict(seen)
            for seq in range(since, max(seen, default=-1) + 1):
                whole.pop(seq, None)
        whole.update(tail)
        self._merged = (whole, since, tail)
        return whole

    def fits(self, run: Run, history: dict[int, Checkpoint]) -> bool:
        """Whether the next turn of ``run``, leased with ``history``, may
        resume this body instead of replaying from the top."""
        if not self.settled or run.cancel_requested is not None:
            return False
        if (run.workflow, run.workflow_version, run.recovery_attempts, run.created_at) != (
            self.workflow,
            self.version,
            self.recovery_attempts,
            self.created_at,
        ):
            return False
        if not self.ctx._updates_idle:
            return False
        expected, parked = self.turn.expected_history()
        merged = self._merged
        if merged is not None and merged[0] is history:
            # Below the tail's position the history holds the very
            # checkpoints the body saw: compare the tail's positions only.
            return continues(expected, parked, history, merged[2])
        return continues(expected, parked, history)


@dataclass(frozen=True, slots=True)
class Resumed:
    """A kept turn taken up again: its next turn's outcome, to await."""

    kept: Kept
    outcome: Awaitable[TurnOutcome]


def continues(
    expected: dict[int, Checkpoint | None],
    parked: frozenset[int],
    history: dict[int, Checkpoint],
    positions: Iterable[int] | None = None,
) -> bool:
    """Whether ``history`` is ``expected`` but for the ``parked`` positions.

    ``expected`` maps each position to what the kept body saw or wrote there
    (``None``: a settled write whose form the store decided). A position the
    body is parked on may hold anything now (that is what it waits for); any
    other difference — a position added, removed or changed — means someone
    else wrote the history, and the body's state may not be a replay's.
    """
    if len(history) != len(expected):
        return False
    for seq in history if positions is None else positions:
        if seq not in expected:
            return False
        cp = history[seq]
        seen = expected[seq]
        if cp is seen or seq in parked:
            continue  # the very checkpoint it saw (kept below a tail's position)
        if seen is None:
            if cp.status not in _SETTLED:
                return False
        elif (
            seen.status != cp.status
            or seen.name != cp.name
            or seen.kind != cp.kind
            or seen.attempts != cp.attempts
            or seen.wake_at != cp.wake_at
            or seen.dispatched_at != cp.dispatched_at
            or seen.redispatches != cp.redispatches
        ):
            return False
    return True


class StickyRuns:
    """At most ``size`` kept turns, least recently kept let go first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self.resumed = 0
        """Turns that resumed a kept body (a cache hit)."""
        self.replayed = 0
        """Turns that found a kept body but replayed (it did not fit)."""

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, run_id: str, kept: Kept) -> None:
        """Keep ``run_id``'s parked turn (unsettled until :meth:`settled`)."""
        old = self._kept.pop(run_id, None)
        if old is not None and old.turn is not kept.turn:
            old.turn.dispose()
        self._kept[run_id] = kept
        while len(self._kept) > self._size:
            _, evicted = self._kept.popitem(last=False)
            evicted.turn.dispose()

    def settled(self, run_id: str, turn: Turn) -> None:
        """The suspend of ``turn`` was written: its body may resume."""
        kept = self._kept.get(run_id)
        if kept is not None and kept.turn is turn:
            kept.settled = True

    def resume(self, run: Run, history: dict[int, Checkpoint]) -> Resumed | None:
        """The next turn of ``run``'s kept body, leased with ``history``, if
        it fits (:meth:`Kept.fits`); else ``None``, the kept body let go,
        and the turn replays."""
        kept = self._kept.pop(run.run_id, None)
        if kept is None:
            return None
        outcome = kept.turn.resume(run, history) if kept.fits(run, history) else None
        if outcome is None:
            kept.turn.dispose()
            self.replayed += 1
            return None
        merged = kept._merged
        if merged is not None and merged[0] is history:
            kept.turn.completed_below = merged[1]
        self.resumed += 1
        return Resumed(kept, outcome)

    def read_from(self, run_id: str) -> int:
        """Where the next lease of ``run_id`` reads its history from (a
        :data:`~durably.stores.base.ReadFrom`): above ``0`` only for a kept
        body whose suspend was written."""
        kept = self._kept.get(run_id)
        return 0 if kept is None else kept.read_from()

    def whole(self, run_id: str, tail: HistoryTail) -> dict[int, Checkpoint] | None:
        """``tail`` completed from ``run_id``'s kept body (:meth:`Kept.whole`);
        ``None`` if it is no longer kept (then read the whole history)."""
        kept = self._kept.get(run_id)
        return None if kept is None else kept.whole(tail)

    def drop(self, run_id: str) -> None:
        """Let go of ``run_id``'s kept turn, if any."""
        kept = self._kept.pop(run_id, None)
        if kept is not None:
            kept.turn.dispose()

    def clear(self) -> None:
        """Let go of every kept turn."""
        kept, self._kept = self._kept, OrderedDict()
        for entry in kept.values():
            entry.turn.dispose()
