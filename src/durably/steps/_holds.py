"""Holding a turn across a dispatched step: how long, and when to let go.

A dispatched step without ``timeout`` used to park its run as soon as its
task was out: the turn settled the run ``suspended``, the result's settle
woke (leased) it, and a new turn resumed the body. For a fast worker that is
a whole turn per result. Instead the turn now waits in memory for a window
(a *hold*); a result heard within it continues the same turn
(the receiver settles the checkpoint in the store, as for a step with a
``timeout``). When the window runs out the turn parks exactly as before, so
a hold only ever saves work: the store stays the truth, and a result that
lands after the hold let go wakes the run through the usual path.

The window is the engine's ``step_hold`` (the *cap*) for every step, except
a step known to answer slower than the cap: one whose latency (an
exponentially weighted average, per step name, of what its holds heard, a
miss counting as twice its window) is above the cap. Such a step is not held
(a hold would only occupy the turn's slot), except one call in
:data:`_PROBE_EVERY`, so a step that got faster is noticed: a probe heard
within the cap resets the average to its latency, and the step is held again
at once.

The average decides only *whether* to hold, never for how long. A window
sized to a fast step's usual latency runs out when the machine is loaded, or
in a burst of starts (the window starts before the task's commit, which
queues behind the burst's writes): for the machine's sake, not the step's,
and a miss costs a whole turn where waiting on costs only the hold (its slot
is lent, below, and a result ends it at once). The reset on a probe hit, not
a nudge: the misses that put a fast step above the cap may have been a
loaded moment's, and nudging it back takes several probes 16 calls apart,
all parks in between, which keep the load (and the probes' latency) high.

A result this process's receiver hands to a hold is settled with no wake
stamp (``Resolution.held_by``: none while the holder's lease lives), since
the held turn takes it itself; while such a settle is under way the hold
does not let go (``StepDispatcher.let_go``: a park then would see no stamp
and nothing would wake the run), and if the hand-over fails all the same
(the turn cancelled or fenced) the receiver wakes the run.

No result may reach the holder at all: on ``db://`` any instance's receiver
may take it, settle the step and stamp the run's wake (it cannot lease a run
held here). On PostgreSQL that stamp's notice reaches the holder, which then
reads the step's checkpoint instead of waiting out its window
(:meth:`LiveHolds.wake_heard`). The stamps of this process's own receiver
notify it too; they are counted (:meth:`LiveHolds.own_stamp`) and skipped,
and a notice is acted on a moment late, so one that overtook the hand-over
of its own result is not taken for another instance's (holds themselves
are no longer stamped: these are the stamps of steps with ``timeout``,
awaited in memory the same way).

A held turn lends its turn slot (``max_concurrent_runs``) to the next run
waiting for one while it waits, and takes a slot back, ahead of the runs
waiting, before its body does anything more (:attr:`LiveHolds.lend`,
:attr:`LiveHolds.reclaim`): a waiting turn is an idle coroutine, the same
memory as a parked kept body, so many runs hold at once without making
another run wait, and at most ``max_concurrent_runs`` turns work at once.
Holds have their own bound instead (the wiring's :attr:`LiveHolds.may_hold`:
``max(max_concurrent_runs, sticky_runs)`` turns holding); past it a step parks
its run as without holds. A drain releases every hold (:meth:`LiveHolds.release`).
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .._aio import EarliestTimer
from ..wire import StepResult

__all__ = ["LiveHolds", "LiveStep"]

_ALPHA = 0.25
"""The weight of the newest observation in a step's average latency."""
_PROBE_EVERY = 16
"""A step slower than the cap is still held once in this many calls."""
_MAX_NAMES = 4096
"""Step names with a remembered latency (names can come from callers)."""
_NOTICE_DELAY_S = 0.01
"""How late a wake notice for a held run is acted on (see the module docstring)."""
_MAX_OWN = 10_000
"""Runs whose own stamps are counted (a notice that never came is forgotten)."""


class Changed:
    """What a :class:`LiveStep`'s waiter awaits: ``asyncio.Event``'s flag and
    methods, for one waiter at a time (its dispatcher's turn).

    An ``Event`` per dispatched step cost more than the wait it serves: a
    deque made for its waiters, the global lock taken on its first wait to
    bind its loop, an append and a remove per wait. A second concurrent
    :meth:`wait` replaces the first's future (a cancelled wait that has not
    unwound yet is the only case: the steps await one at a time)."""

    __slots__ = ("_future", "_value")

    def __init__(self) -> None:
        self._value = False
        self._future: asyncio.Future[bool] | None = None

    def is_set(self) -> bool:
        """Whether it is set."""
        return self._value

    def set(self) -> None:
        """Set it, waking its waiter."""
        if not self._value:
            self._value = True
            future = self._future
            if future is not None and not future.done():
                future.set_result(True)

    def clear(self) -> None:
        """Unset it."""
        self._value = False

    async def wait(self) -> bool:
        """Until it is set (at once if it is)."""
        if self._value:
            return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._future = future
        try:
            return await future
        finally:
            if self._future is future:
                self._future = None


@dataclass(eq=False)
class LiveStep:
    """A dispatched step whose dispatcher awaits it in memory (a step with
    ``timeout``, or a hold)."""

    heard_at: int | None = None
    """When this process last heard a heartbeat for it."""
    result: StepResult | None = None
    changed: Changed = field(default_factory=Changed)
    recheck: bool = False
    """A result was heard that settled nothing in the store (settled already,
    by another instance's receiver or an earlier copy), or another instance
    may have settled it: the store is the truth, so the waiter reads the
    checkpoint instead of trusting what it heard."""
    released: bool = False
    """A hold told to let go now (:meth:`LiveHolds.release`)."""
    owner: str | None = None
    """The lease owner of the held turn (set while holding): a result for it
    is settled with no wake stamp while that owner holds the run's lease."""
    settling: int = 0
    """Settles of a result for it under way without a stamp: it holds on."""
    gone: bool = False
    """It stopped waiting: a result from now on is settled with a stamp."""


class _Latency:
    __slots__ = ("avg_ms", "skipped")

    def __init__(self, avg_ms: float) -> None:
        self.avg_ms = avg_ms
        self.skipped = 0


class LiveHolds:
    """The holds of one engine: their windows, and who holds now."""

    def __init__(self, cap_ms: Callable[[], int]) -> None:
        """``cap_ms()``: the longest hold now (``0`` disables holds; the
        engine's current ``step_hold``)."""
        self.cap_ms = cap_ms
        self.may_hold: Callable[[], bool] = lambda: True
        """Whether a hold may start now (set by the wiring: this process
        takes turns, is not draining, and fewer turns hold than its bound)."""
        self.lend: Callable[[str], bool] = _no_slot
        """Lend the turn slot of ``run_id``'s execution while its turn holds;
        whether it was lent (set when the engine opens: its executor's ``lend``)."""
        self.reclaim: Callable[[str], Awaitable[None] | None] = _no_claim
        """Take a slot back for ``run_id``'s execution before its turn goes
        on: ``None`` if it has one now, else what to await (set when the
        engine opens: its executor's ``reclaim``)."""
        self._latency: OrderedDict[str, _Latency] = OrderedDict()
        self._held: OrderedDict[int, LiveStep] = OrderedDict()
        self._runs: dict[str, list[LiveStep]] = {}
        self._own: OrderedDict[str, int] = OrderedDict()
        self._ids = 0
        self._alarms: list[tuple[float, int, LiveStep]] = []
        self._alarm_seq = 0
        self._timer = EarliestTimer(self._ring)
        self.hits = 0
        """Holds that heard their result (a turn saved each)."""
        self.misses = 0
        """Holds whose window ran out (the run parked as without them)."""
        self.released = 0
        """Holds let go early for another run or a drain."""
        self.rechecks = 0
        """Wake notices that made holds read the store."""

    @property
    def holding(self) -> int:
        """Turns holding now."""
        return len(self._held)

    def window_ms(self, name: str) -> float:
        """How long a call of step ``name`` may hold its turn now: the cap, or
        ``0`` (park at once) while holds may not start or the step is known
        slower than the cap (but for its probes)."""
        cap = self.cap_ms()
        if cap <= 0 or not self.may_hold():
            return 0.0
        seen = self._latency.get(name)
        if seen is not None:
            self._latency.move_to_end(name)
            if seen.avg_ms > cap:
                seen.skipped += 1
                if seen.skipped % _PROBE_EVERY:
                    return 0.0
        return float(cap)

    def heard(self, name: str, latency_ms: float) -> None:
        """A hold of step ``name`` heard its result ``latency_ms`` after it began."""
        self.hits += 1
        seen = self._latency.get(name)
        if seen is None:
            self._observe(name, latency_ms)
            return
        if seen.avg_ms > self.cap_ms() >= latency_ms:
            # A probe of a step held one call in _PROBE_EVERY answered within
            # the cap: it is fast again. The average is reset, not nudged: the
            # misses that put it above the cap may have been the load's (holds
            # that ran out at the cap while the loop was busy), and a nudge
            # takes several probes, each _PROBE_EVERY calls apart, all but
            # one of them parks whose turns keep the load, and so the
            # latency the probes see, high.
            seen.avg_ms = latency_ms
            seen.skipped = 0
            return
        seen.avg_ms += _ALPHA * (latency_ms - seen.avg_ms)

    def missed(self, name: str, window_ms: float) -> None:
        """A hold of step ``name`` saw no result within ``window_ms``."""
        self.misses += 1
        # The latency is above the window (the cap): move the average well
        # past it, so a step that keeps missing stops being held after a few
        # calls.
        self._observe(name, 2 * window_ms)

    def _observe(self, name: str, ms: float) -> None:
        seen = self._latency.get(name)
        if seen is None:
            self._latency[name] = _Latency(ms)
            while len(self._latency) > _MAX_NAMES:
                self._latency.popitem(last=False)
            return
        seen.avg_ms += _ALPHA * (ms - seen.avg_ms)

    def hold(self, waiter: LiveStep, run_id: str) -> _Holding:
        """Count ``waiter``'s turn (of ``run_id``) as holding while inside, so
        it can be released or told to read the store; its turn slot is lent
        from entering on, until :attr:`reclaim`."""
        return _Holding(self, waiter, run_id)

    def alarm(self, waiter: LiveStep, at_ms: float) -> None:
        """Set ``waiter.changed`` once the loop's time (ms) reaches ``at_ms``.

        One timer for every hold, not one each: holds end by their result
        far more often than by their window, and a timer per hold (made,
        then cancelled) was ~3% of a dispatched step's CPU. A stale alarm
        (its hold over, or woken already) only wakes its waiter to look."""
        self._alarm_seq += 1
        heapq.heappush(self._alarms, (at_ms, self._alarm_seq, waiter))
        self._timer.arm(at_ms / 1000)

    def _ring(self) -> None:
        alarms = self._alarms
        now = loop_time_ms()
        while alarms and alarms[0][0] <= now:
            waiter = heapq.heappop(alarms)[2]
            if not waiter.gone:
                waiter.changed.set()
        if alarms:
            self._timer.arm(alarms[0][0] / 1000)

    def own_stamp(self, run_id: str) -> None:
        """This process's receiver stamped ``run_id``'s wake while handing a
        result to its holder: the notice that stamp sends is not news."""
        self._own[run_id] = self._own.get(run_id, 0) + 1
        self._own.move_to_end(run_id)
        while len(self._own) > _MAX_OWN:
            self._own.popitem(last=False)

    def wake_heard(self, run_id: str) -> None:
        """A wake notice for ``run_id``, which this process may be holding:
        unless the stamp was our own, its holds read the store (another
        instance may have settled their step), a moment from now."""
        if self._take_own(run_id) or run_id not in self._runs:
            return
        asyncio.get_running_loop().call_later(_NOTICE_DELAY_S, self._recheck, run_id)

    def _take_own(self, run_id: str) -> bool:
        count = self._own.get(run_id, 0)
        if count <= 0:
            return False
        if count == 1:
            del self._own[run_id]
        else:
            self._own[run_id] = count - 1
        return True

    def _recheck(self, run_id: str) -> None:
        if self._take_own(run_id):
            return  # our own stamp after all: its result was handed over meanwhile
        for waiter in self._runs.get(run_id, ()):
            self.rechecks += 1
            waiter.recheck = True
            waiter.changed.set()

    def release(self, count: int | None = None) -> None:
        """Let the oldest ``count`` holds (all by default) go now: their
        turns park as if their window had run out."""
        while self._held and (count is None or count > 0):
            _, waiter = self._held.popitem(last=False)
            waiter.released = True
            waiter.changed.set()
            self.released += 1
            if count is not None:
                count -= 1


class _Holding:
    """:meth:`LiveHolds.hold`'s context (a class: a generator-based one per
    step was measurable)."""

    __slots__ = ("_holds", "_key", "_of_run", "_run_id", "_waiter")

    def __init__(self, holds: LiveHolds, waiter: LiveStep, run_id: str) -> None:
        self._holds = holds
        self._waiter = waiter
        self._run_id = run_id

    def __enter__(self) -> None:
        holds = self._holds
        holds._ids += 1
        self._key = holds._ids
        holds._held[self._key] = self._waiter
        self._of_run = holds._runs.setdefault(self._run_id, [])
        self._of_run.append(self._waiter)
        holds.lend(self._run_id)

    def __exit__(self, *exc: object) -> None:
        holds = self._holds
        holds._held.pop(self._key, None)
        self._of_run.remove(self._waiter)
        if not self._of_run:
            del holds._runs[self._run_id]


def loop_time_ms() -> float:
    """The event loop's monotonic time in ms: holds measure real latency,
    not the engine's (possibly virtual) clock."""
    return asyncio.get_running_loop().time() * 1000


def _no_slot(run_id: str) -> bool:
    return False


def _no_claim(run_id: str) -> None:
    return None
