"""The ``StateStore`` protocol: everything the engine persists, and nothing else.

A store keeps runs, checkpoints, signal waiters and buffered signals. The engine
never composes multi-statement transactions itself; instead each method that
must be atomic is one call here, and its docstring says what it guarantees.
Implementations: :mod:`durably.stores.memory`, :mod:`durably.stores.sqlite` and
:mod:`durably.stores.postgres`, all proven by the conformance suite shipped as
:mod:`durably.testing.conformance`.

``StateStore`` is the union of small role protocols (``RunStore``,
``TurnStore``, ``SweepStore``, ``CheckpointStore``, ``FlowStore``,
``WaitStore``, ``ScheduleStore``, plus ``StoreConnection`` and
``StoreInspector``), one per concern, so that a collaborator can declare the
slice it uses (a scheduler needs ``ScheduleStore`` and ``RunStore``, not the
worker loop's sweeps) and a reader meets at most nine methods at a time. A
store implements all of them; the protocol holds only what the engine or an
inspector calls.

All times are integer epoch milliseconds supplied by the caller, so the engine's
clock (real or virtual) is the only clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from .._attributes import AttributeFilter
from ..model import Checkpoint, CheckpointStatus, ErrorInfo, Run, RunStatus

__all__ = [
    "Admission",
    "BeatRecord",
    "CheckpointStore",
    "ChildEnd",
    "DecisionStore",
    "EventDelivery",
    "Executable",
    "FlowStore",
    "HistoryTail",
    "ReadFrom",
    "Resolution",
    "RunChanges",
    "RunPage",
    "RunQuery",
    "RunStatusStore",
    "RunStore",
    "ScheduleRecord",
    "ScheduleStore",
    "SettleResult",
    "SignalWait",
    "StateStore",
    "StoreConnection",
    "StoreInspector",
    "SweepStore",
    "TransactionStore",
    "TurnLease",
    "TurnStore",
    "UpdateRecord",
    "UpdateStore",
    "WaitStore",
    "read_tail",
]


Executable = frozenset[tuple[str, str]]
"""The ``(workflow, version)`` pairs an engine registers: the runs it can
execute. A claim given one takes no run outside it (``None``: any run), so an
engine of an older release never takes, and so never fails, a run of a
workflow or version only a newer release has (a rolling deploy)."""


@dataclass(frozen=True, slots=True)
class RunQuery:
    """Filters for :meth:`StateStore.list_runs`; results are newest first."""

    status: RunStatus | None = None
    workflow: str | None = None
    tag: str | None = None
    namespace: str | None = None
    parent_id: str | None = None
    limit: int = 50
    cursor: str | None = None
    run_id_prefix: str | None = None
    """Runs whose id starts with this text (the dashboard's search by id)."""
    created_after: int | None = None
    """Runs created at or after this time (epoch ms)."""
    created_before: int | None = None
    """Runs created before this time (epoch ms)."""
    statuses: tuple[RunStatus, ...] | None = None
    """Runs in any of these statuses (ANDed with ``status`` when both are given)."""
    attributes: tuple[AttributeFilter, ...] = ()
    """Search-attribute conditions, all of which must hold (see
    :mod:`durably._attributes`): served by the attributes index table."""


@dataclass(frozen=True, slots=True)
class QueueState:
    """A flow-control queue as the store sees it now."""

    queue: str
    held: int
    """Slots held by dispatched steps (released slots kept for the rate window
    do not count)."""
    waiting: int
    """Steps refused a slot and waiting for one."""
    oldest_wait_at: int | None = None
    """When the longest-waiting step first asked (epoch ms)."""


@dataclass(frozen=True, slots=True)
class RunPage:
    """One page of runs and the cursor of the next page (``None`` at the end)."""

    runs: list[Run]
    next_cursor: str | None = None


class SettleResult(StrEnum):
    """What :meth:`StateStore.settle_run` did."""

    SETTLED = "settled"
    """The outcome was written and the lease released."""
    WAKE_REQUESTED = "wake_requested"
    """A wake arrived during the turn: nothing was written, the lease is still ours."""
    LOST = "lost"
    """We no longer hold the lease (cancelled, fenced, taken over): nothing was written."""


@dataclass(frozen=True, slots=True)
class SignalWait:
    """What :meth:`StateStore.wait_signal` found."""

    delivered: bool
    payload: Any = None


@dataclass(frozen=True, slots=True)
class EventDelivery:
    """What :meth:`StateStore.publish_event` did."""

    run_ids: list[str]
    """The runs whose waits the event completed (wake them)."""
    recipients: int
    """Runs that received it, plus the ``triggered`` count the caller passed;
    for a duplicate, the count recorded by the first publish."""
    buffered: bool = False
    """Nobody received it and one copy was kept for the first matching waiter."""
    duplicate: bool = False
    """An event with this id was published before: nothing was delivered."""


@dataclass(slots=True)
class ScheduleRecord:
    """One row of the schedules table (see :mod:`durably.schedules`)."""

    name: str
    spec: dict[str, Any]
    """What fires: workflow, cron or interval, time zone, input, policies (JSON)."""
    namespace: str = "default"
    paused: bool = False
    next_fire_at: int | None = None
    """The next window not yet fired (epoch ms)."""
    last_fired_at: int | None = None
    """The window of the last run started by the schedule."""
    last_run_id: str | None = None
    """The last run started by the schedule (its overlap policy looks at it)."""
    firing_run_id: str | None = None
    """A run claimed for start whose start is not yet confirmed; any instance
    (re)starts it, idempotently, so a crash after the claim loses no window."""
    revision: int = 0
    """Bumped by every update; :meth:`StateStore.update_schedule` can compare-and-set on it."""
    created_at: int = 0
    updated_at: int = 0


@dataclass(slots=True)
class RunChanges:
    """Fields :meth:`StateStore.settle_run` writes along with the new status."""

    output: Any = None
    error: ErrorInfo | None = None
    wake_at: int | None = None
    waiters: bool = True
    """Whether the run may hold signal or event waiters that a terminal status
    must clear. ``False`` is the settling turn's promise that it holds none
    (its run had no history when the turn began and the turn registered no
    wait), so a store may skip that step; clearing anyway is always correct."""


@dataclass(frozen=True, slots=True)
class Resolution:
    """One outcome for :meth:`StateStore.resolve_checkpoints` (a step result)."""

    run_id: str
    seq: int
    status: CheckpointStatus
    output: Any = None
    error: ErrorInfo | None = None
    events: list[dict[str, Any]] | None = None
    """The handler's log lines and sub-process events (upstream wire shape),
    stored as the checkpoint's ``events``; ``None``: it sent none."""
    held_by: str | None = None
    """The lease owner whose turn awaits this result in memory (a held turn,
    to which the receiver hands it): while that owner holds the run's lease
    (``locked_by``, ``locked_until`` after ``now``) this entry stamps no wake,
    since that turn takes the result itself; otherwise it stamps as usual."""


@dataclass(frozen=True, slots=True)
class BeatRecord:
    """One step heartbeat for :meth:`FlowStore.record_heartbeats`."""

    run_id: str
    seq: int
    at: int
    """When the beat was heard (epoch ms, the receiver's clock)."""
    progress: Any = None
    """The handler's progress report; ``None`` keeps the stored one."""


ReadFrom = Callable[[str], int]
"""The position from which a lease call reads a run's history: every
checkpoint at that position or above, and every negative one (compensation
undos); ``0`` reads it all. A position above ``0`` gets a
:class:`HistoryTail` instead of the whole history. The caller (a kept
turn, :mod:`durably._sticky`) holds the settled checkpoints below it, which
a store never rewrites."""


class HistoryTail(dict[int, Checkpoint]):
    """A run's history read from :attr:`since` (and its negative positions):
    what a lease call returns for a run its ``read_from`` placed above ``0``."""

    __slots__ = ("since",)

    def __init__(self, since: int, checkpoints: Iterable[tuple[int, Checkpoint]] = ()) -> None:
        super().__init__(checkpoints)
        self.since = since


def read_tail(since: int, checkpoints: Iterable[tuple[int, Checkpoint]]) -> dict[int, Checkpoint]:
    """``checkpoints`` as a lease call returns them: a :class:`HistoryTail`
    when read from above ``0``, else the whole history as a plain dict."""
    return HistoryTail(since, checkpoints) if since > 0 else dict(checkpoints)


@dataclass(frozen=True, slots=True)
class TurnLease:
    """How :meth:`CheckpointStore.resolve_and_lease` leases the runs it wakes:
    as :meth:`TurnStore.start_turns` would with these arguments."""

    owner: str
    lease_until: int
    statuses: frozenset[RunStatus]
    """The statuses a run may be leased from (a woken run: pending or suspended)."""
    limit: int
    """At most this many runs are leased (the free turn slots of the caller)."""
    workflows: Executable | None = None
    read_from: ReadFrom | None = None
    """Where each leased run's history is read from (see :data:`ReadFrom`)."""


@dataclass(frozen=True, slots=True)
class ChildEnd:
    """A child run's terminal write and its report to its parent, for
    :meth:`StateStore.end_child_runs`: both happen, or neither."""

    run_id: str
    status: RunStatus
    """The terminal status written."""
    changes: RunChanges
    report: Resolution
    """The parent's placeholder checkpoint, settled with the child's outcome."""
    owner: str | None = None
    """A turn's settle: only while the child is ``running`` under ``owner``."""
    statuses: frozenset[RunStatus] = frozenset()
    """An ending from outside a turn (``owner`` is ``None``): only while the
    child's status is one of these."""


@dataclass(frozen=True, slots=True)
class Admission:
    """A dispatched step asking a flow-control queue for a slot."""

    queue: str
    step_id: str
    """``<run_id>:<seq>`` of the asking step: the slot's (and the waiter's) key."""
    run_id: str
    concurrency: int | None
    """Slots held at once across the fleet; ``None``: unlimited."""
    rate_limit: int | None
    """Admissions per ``rate_period_ms`` across the fleet; ``None``: unlimited."""
    rate_period_ms: int = 1000
    priority: int = 0
    """Higher is admitted first."""
    fairness_key: str | None = None
    """Waiters are taken round-robin across keys (the run id when ``None``)."""
    retry_ms: int = 1000
    """When a refused step asks again; a waiter not seen for three of these is dropped."""
    enqueued_at: int | None = None
    """Its place in line (epoch ms; ``None``: when it first asks). A singleton run
    gives its creation time, so runs are admitted in the order they were created."""


@runtime_checkable
class StoreConnection(Protocol):
    """How a store is opened, closed and heard from."""

    url: str
    """The URL this store was opened from (``memory://``, ``sqlite:///path`` …)."""

    async def open(self) -> None:
        """Connect and create or upgrade the schema. Idempotent."""

    async def close(self) -> None:
        """Release connections. Idempotent."""

    async def subscribe(self, on_event: Callable[[str, str], None]) -> bool:
        """Deliver other processes' changes as they happen: ``on_event(kind,
        run_id)`` with kind a :class:`~durably._notices.StoreNotice` value:
        ``"settled"``, ``"pending"`` (a new run, or ``""``: new runs exist),
        ``"wake"`` or ``"ended"``. ``False`` when the store
        has no such channel (the engine then relies on polling alone)."""


@runtime_checkable
class RunStore(Protocol):
    """Runs as rows: create, read, list, delete, and the guarded updates any
    instance may make without holding the lease."""

    async def create_run(
        self, run: Run, attributes: dict[str, Any] | None = None
    ) -> tuple[Run, bool]:
        """Insert ``run`` unless its id exists. *Atomic*: of two racing creates
        exactly one returns ``created=True``; both return the stored run. A
        created run's search ``attributes`` (checked values) are written in the
        same transaction; an existing run's are left alone."""

    async def create_runs(self, runs: list[Run]) -> list[str]:
        """Insert many runs at once, skipping ids that exist; return the ids
        inserted. A fan-out's children are created in a few statements."""

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""

    async def get_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs that exist among ``run_ids``, in any order."""

    async def watch_runs(self, run_ids: list[str]) -> list[Run]:
        """As :meth:`get_runs`, for a process waiting on runs it does not
        execute: from now on, whoever settles one of them announces it to other
        processes (PostgreSQL ``NOTIFY``), which a settle skips for runs nobody
        watches. *Atomic* with a racing settle: either the settle sees the run
        watched, or the run returned is the settled one. A store whose notices
        do not cross processes just reads the runs.
        """

    async def list_runs(self, query: RunQuery) -> RunPage:
        """Runs matching ``query``, newest first, paged by an opaque cursor."""

    async def delete_run(self, run_id: str) -> bool:
        """Delete a run with its checkpoints, waiters and search attributes;
        ``False`` if absent."""

    async def get_attributes(self, run_id: str) -> dict[str, Any]:
        """The run's search attributes, each as the type it was set as
        (``{}`` for an unknown run)."""

    async def upsert_attributes(
        self, checkpoint: Checkpoint, attributes: dict[str, Any], owner: str
    ) -> bool:
        """*Atomic*, under ``owner``'s lease of the checkpoint's run: write the
        checkpoint recording ``ctx.upsert_attributes`` and merge ``attributes``
        (checked values) into the run's, key by key. ``False`` (nothing
        written) if ``owner`` no longer holds the lease."""

    async def update_run_if(
        self, run_id: str, statuses: frozenset[RunStatus], changes: dict[str, Any], now: int
    ) -> bool:
        """*Atomic*: apply ``changes`` (column → value) only while the run's status
        is in ``statuses``. Moving to a terminal status clears the lease and
        deletes the run's signal waiters."""

    async def request_wake(self, run_id: str, now: int) -> bool:
        """Stamp ``wake_requested_at`` on a non-terminal run so that the holder
        of its lease runs one more turn; ``False`` if the run is terminal."""


@runtime_checkable
class TurnStore(Protocol):
    """Leases and turns: what an instance holding a run's lease writes."""

    async def start_turns(
        self,
        run_ids: list[str],
        owner: str,
        now: int,
        lease_until: int,
        statuses: frozenset[RunStatus],
        *,
        workflows: Executable | None = None,
        read_from: ReadFrom | None = None,
    ) -> dict[str, tuple[Run, dict[int, Checkpoint]]]:
        """Start the turns of many runs in one round trip. *Atomic* for each
        run: if its status is in ``statuses``, its ``(workflow, version)`` is
        in ``workflows`` (when given) and it is unleased (or its lease
        expired before ``now``), mark it ``running`` under ``owner`` until
        ``lease_until``, clear ``wake_requested_at`` and ``wake_at``, and load
        every checkpoint it has (the one snapshot of its history per turn),
        or, with ``read_from``, those from the position it gives the run
        (a :class:`HistoryTail`, see :data:`ReadFrom`).

        Returns the runs leased here with their histories; a run not leasable
        (another instance holds it, wrong status, a workflow outside
        ``workflows``, missing) is absent and untouched, and an id
        given twice is leased once. When nothing contends this is one
        statement or transaction for the whole batch."""

    async def continue_turn(self, run_id: str, owner: str, lease_until: int) -> Run | None:
        """*Atomic*: while ``owner`` holds the lease of a running run, clear its
        ``wake_requested_at``, extend the lease and return the run."""

    async def renew_lease(self, run_id: str, owner: str, lease_until: int) -> bool:
        """Extend ``owner``'s lease of a running run; ``False`` means the lease
        is gone (cancelled, released or taken over) and the turn is fenced."""

    def settle_run(
        self,
        run_id: str,
        owner: str,
        status: RunStatus,
        changes: RunChanges,
        now: int,
    ) -> Awaitable[SettleResult]:
        """*Atomic* compare-and-set ending a turn: only while the run is
        ``running`` under ``owner``, write ``status`` with ``changes`` and
        release the lease in the same statement. A non-terminal ``status`` is
        refused with ``WAKE_REQUESTED`` while ``wake_requested_at`` is set. A
        terminal status also deletes the run's signal waiters."""

    async def release_run(self, run_id: str, owner: str, now: int) -> bool:
        """Hand a running run back as ``pending`` (drain); fences ``owner``."""

    async def end_child_runs(self, ends: list[ChildEnd], now: int) -> list[tuple[bool, int | None]]:
        """*Atomic* for each entry, one transaction for all: end child runs and
        tell their parents in the same write, so a parent always hears exactly
        the outcome its child's own row records and no crash falls between.

        Each entry is written only while its condition holds (``owner``: the
        run is ``running`` under that lease, as :meth:`settle_run`; else its
        status is in ``statuses``, as :meth:`update_run_if`): its ``status``
        and ``changes`` are written, the lease released and its signal and
        event waiters deleted; then its ``report`` settles the parent's
        checkpoint exactly as :meth:`resolve_checkpoints` would (stamping the
        parent's wake). Entries are applied in order (a run named twice is
        ended by its first). An answer per entry: ``(ended, left)``, where
        ``ended`` is ``False`` if the condition did not hold (nothing
        written), and ``left`` is the report's answer as
        :meth:`resolve_checkpoints` gives it (``None``: nothing was settled:
        the child did not end here, or the placeholder was settled already or
        is missing).

        Not ordered with :meth:`save_checkpoint`: the caller makes a turn's
        checkpoints durable first."""


@runtime_checkable
class SweepStore(Protocol):
    """The worker loop's queries and claims (``namespace=None``: every namespace)."""

    async def list_pending(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Ids of ``pending`` runs (of ``workflows``, when given), most urgent
        priority first, then oldest."""

    async def list_orphans(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Ids of ``running`` runs (of ``workflows``, when given) whose lease
        expired before ``now``."""

    async def recover_orphans(
        self, run_ids: list[str], now: int, max_attempts: int
    ) -> dict[str, RunStatus]:
        """*Atomic* for each run, one transaction for all: every run of
        ``run_ids`` that is still an orphan (``running``, its lease expired
        before ``now``) has its recovery counted and becomes ``pending`` or,
        past ``max_attempts``, ``dead`` (with the ``max_recovery_attempts``
        error; its signal and event waiters are deleted). Returns the new
        status of each run recovered here; a run that is no orphan any more
        (recovered or leased by another instance in between, finished,
        missing) is absent, so no run is ever recovered twice. A store may
        also pass over a run another transaction is writing at that moment:
        it stays an orphan for the next pass."""

    async def list_due(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Ids of ``suspended`` runs (of ``workflows``, when given) due now
        (``wake_at <= now`` or a stamped ``wake_requested_at``), most overdue
        first."""

    async def next_wake_at(
        self,
        after: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> int | None:
        """The earliest ``wake_at`` later than ``after`` among ``suspended``
        runs (of ``workflows``, when given), or ``None``: when the next timer
        :meth:`list_due` would list falls due. One indexed read (the
        ``(status, wake_at)`` index), so a worker can sleep until then instead
        of a whole poll interval. Timers due at ``after`` or earlier are left
        out: the poll at ``after`` saw them (a run another instance holds is
        claimed with its wake moved to the lease's end, which counts)."""

    async def list_unclaimed(
        self,
        before: int,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Ids of runs *outside* ``workflows`` that nobody took since
        ``before``: ``pending`` and last updated before then, or
        ``suspended`` and due (``wake_at`` or ``wake_requested_at``) before
        then. Oldest first. (An engine marks them ``blocked``.)"""

    async def list_blocked(
        self,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Ids of ``blocked`` runs of ``workflows`` (an engine that can
        execute them takes them back), most urgent priority first, then
        oldest."""

    async def claim_due_batch(self, run_ids: list[str], now: int, next_wake_at: int) -> list[str]:
        """*Atomic* for each run, one transaction for all: every run of
        ``run_ids`` that is still suspended, unleased and due (``wake_at <=
        now`` or a stamped ``wake_requested_at``) gets ``wake_at =
        next_wake_at`` and its stamp cleared, so no other poll claims it until
        then. Returns the ids claimed here, in any order; a run another
        instance claimed (or leased) in between is not among them. A store may
        also pass over a run another transaction is writing at that moment:
        it stays due for the next poll."""

    async def list_finished_before(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Ids of terminal runs last updated before ``before`` (retention)."""

    async def list_stalled(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Ids of live runs showing the stranded signature since ``before``,
        least recently updated first. Either:

        - a suspended run that nothing of its own can wake: every pending
          checkpoint is a signal or event wait without a deadline (no timer,
          no child, no step), no checkpoint started or finished since
          ``before``, and it has such a wait or no wake time at all (then it
          is updated before ``before``). The run's ``wake_at`` is ignored when
          it waits: with no timer of its own that is the reconcile fallback,
          which re-checks but never progresses; or
        - a suspended or running run with a pending dispatched step sent
          before ``before`` whose heartbeat is absent or older than ``before``.

        A long sleep, a wait with a deadline, a pending child, a beating step,
        a pending (queued) run and a running turn are never listed."""

    async def list_expired(
        self, now: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Ids of non-terminal runs whose ``deadline_at`` passed."""

    async def expire_buffered(self, before: int, limit: int) -> int:
        """Delete up to ``limit`` buffered signals and events (sent or published
        with nobody waiting) created before ``before``, oldest first within each kind; return how
        many. A token or event name then no longer delivers them to a later wait."""


@runtime_checkable
class CheckpointStore(Protocol):
    """A run's history: checkpoints saved by its turns and resolved from outside."""

    ordered_writes: bool
    """True when writes are applied in the order their calls were *made*
    (one connection, FIFO). The engine then skips waiting for an earlier
    write before issuing the next one, since the later completing implies
    the earlier did."""

    async def load_checkpoints(self, run_id: str, since: int = 0) -> dict[int, Checkpoint]:
        """Every checkpoint of a run, by seq (the one snapshot per turn); with
        ``since`` above ``0``, only those at ``since`` or above and the
        negative ones, as a :class:`HistoryTail` (see :data:`ReadFrom`)."""

    def save_checkpoint(self, checkpoint: Checkpoint, owner: str) -> Awaitable[bool]:
        """Upsert a checkpoint, fenced: only while ``owner`` holds the run's
        lease, and never replacing a ``completed`` checkpoint.

        A save never writes ``events`` (only a resolve does): it keeps what a
        result stored, even across a retry's new attempt, and a new row has none.

        The hot path of every step. With :attr:`ordered_writes` the write is
        queued when this is *called* (a plain function returning a future)."""

    async def save_checkpoints(self, checkpoints: list[Checkpoint], owner: str) -> bool:
        """:meth:`save_checkpoint` for many checkpoints of one run, in one
        transaction; ``False`` (and nothing written) if ``owner`` lost the lease."""

    async def delete_checkpoints(self, run_id: str, seqs: list[int]) -> None:
        """Forget checkpoints (``retry`` clears failed ones so they run again)."""

    async def get_checkpoint(self, run_id: str, seq: int) -> Checkpoint | None:
        """One checkpoint, or ``None``."""

    async def resolve_checkpoints(
        self, resolutions: list[Resolution], now: int
    ) -> list[int | None]:
        """Settle pending checkpoints from outside their runs (step results,
        a child reporting to its parent), in one transaction; one answer per
        entry, in order. Not fenced: the run's own turn never settles them.

        An answer is ``None`` if there was nothing to settle (already
        settled, or missing); otherwise how many checkpoints of the same
        parallel group are still pending (``0`` when it has no group). When
        that is ``0``, or the checkpoint failed, the run's
        ``wake_requested_at`` is stamped in the same transaction, so the wake
        survives the caller dying right after: the run is due for every
        instance's timer poll.

        Each settled checkpoint stores its entry's ``events`` with the
        outcome (``None`` clears events an earlier attempt left). A settled
        checkpoint also releases the flow-control slot it holds (its
        ``queue``) and stamps ``wake_requested_at`` on the run of that queue's
        first waiter, so a freed slot wakes the next step."""

    async def resolve_and_lease(
        self, resolutions: list[Resolution], now: int, lease: TurnLease
    ) -> tuple[list[int | None], dict[str, tuple[Run, dict[int, Checkpoint]]]]:
        """:meth:`resolve_checkpoints`, and in the same transaction lease the
        runs it wakes for their next turn, returning them with their
        histories (the results just settled included, each read from
        ``lease.read_from``) as :meth:`TurnStore.start_turns` does.

        Of the runs the batch would stamp a wake on, at most ``lease.limit``
        (in run id order) are leased to ``lease.owner`` if
        ``start_turns`` would lease them (status in ``lease.statuses``, no
        live lease, workflow in ``lease.workflows``); a leased run gets no
        wake stamp (its turn starts now, and a crash before it is recovered
        with the lease). The others are stamped as ``resolve_checkpoints``
        does. One round trip for results and turn starts together."""


@runtime_checkable
class FlowStore(Protocol):
    """Dispatched steps while they run: heartbeats and flow-control slots."""

    async def record_heartbeat(self, run_id: str, seq: int, at: int, progress: Any) -> bool:
        """Persist a step's heartbeat: on a *pending* checkpoint set
        ``last_heartbeat_at`` to the later of the stored value and ``at``, and
        ``progress`` when it is not ``None``. Not fenced (any instance that
        hears the beat may write it). ``False`` if missing or settled."""

    async def record_heartbeats(self, beats: list[BeatRecord]) -> list[bool]:
        """:meth:`record_heartbeat` for many beats in one round trip; one
        answer per entry, in order. Beats of the same step apply in order (the
        later time wins, the last non-``None`` progress stays). A beat the
        store refuses (a malformed id, a progress it cannot encode) answers
        ``False`` and costs the others nothing."""

    async def try_admit(self, request: Admission, now: int) -> int | None:
        """*Atomic* across processes: give ``request.step_id`` a slot in
        ``request.queue`` and return ``None``, or register it as a waiter and
        return when to ask again (epoch ms).

        Admitted only when the queue holds fewer than ``concurrency`` slots,
        fewer than ``rate_limit`` admissions started within the last
        ``rate_period_ms``, and no waiter is ahead of it: higher priority
        first, then the fairness key holding the fewest slots, then the oldest.
        Asking again for a step that already holds a slot returns ``None``
        (idempotent under replay). Waiters not seen for ``3 * retry_ms`` are
        dropped (their run moved on or died)."""

    async def release_slots(self, run_id: str, now: int) -> int:
        """The run ended: free every slot its steps hold and drop its waiters;
        stamp the wake of each affected queue's first waiter. Returns how many
        slots were freed."""


@runtime_checkable
class WaitStore(Protocol):
    """Signal and event waits, and their deliveries."""

    async def wait_signal(
        self, checkpoint: Checkpoint, token: str, owner: str, now: int
    ) -> SignalWait | None:
        """*Atomic* with :meth:`send_signal` for the same token: take the oldest
        buffered signal for ``token`` and complete ``checkpoint`` with it, or
        else register a waiter ``(token, run, seq)`` at the end of the token's
        line and save ``checkpoint`` as pending. Registering the same waiter
        again keeps its place. Fenced like :meth:`save_checkpoint` (``None``
        if fenced)."""

    async def send_signal(self, token: str, payload: Any, now: int) -> str | None:
        """*Atomic* with :meth:`wait_signal` and with itself: if waiters hold
        ``token``, remove the one registered first, complete its checkpoint
        with ``payload`` and return its run id; otherwise buffer ``payload``
        (FIFO per token) and return ``None``. Concurrent calls never deliver
        to one waiter twice nor skip one."""

    async def cancel_signal_wait(
        self, run_id: str, seq: int, token: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """*Atomic*: a wait timed out. If a signal already completed the
        checkpoint, return it; otherwise remove exactly this waiter, mark the
        checkpoint failed with ``error`` and return ``None``."""

    async def wait_event(
        self,
        checkpoint: Checkpoint,
        name: str,
        match: dict[str, Any] | None,
        owner: str,
        now: int,
    ) -> SignalWait | None:
        """*Atomic* with :meth:`publish_event` for the same ``name``: take the
        oldest buffered event on ``name`` whose payload matches ``match`` (see
        :mod:`durably.stores._match`) and complete ``checkpoint`` with it, or
        else register a waiter ``(run, seq)`` on ``(name, match)`` and save
        ``checkpoint`` as pending. Fenced like :meth:`save_checkpoint`
        (``None`` if fenced). Many runs may wait on one name at once."""

    async def publish_event(
        self,
        name: str,
        payload: Any,
        now: int,
        *,
        event_id: str | None = None,
        buffer: bool = True,
        triggered: int = 0,
    ) -> EventDelivery:
        """*Atomic* with :meth:`wait_event`: complete the checkpoint of every
        waiter on ``name`` whose match the payload satisfies (removing those
        waiters; a waiter whose run ended is dropped, not counted) and return
        their runs. When none received it and ``buffer`` is set, keep one copy
        for the first matching :meth:`wait_event`. With ``event_id``, the
        publish is recorded and a later one with the same id does nothing but
        return ``duplicate=True`` and the recorded ``recipients``.
        ``triggered`` (runs the caller started for the event) is added to the
        recorded count."""

    async def cancel_event_wait(
        self, run_id: str, seq: int, name: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """*Atomic*: an event wait timed out. If an event already completed the
        checkpoint, return it; otherwise remove exactly this waiter, mark the
        checkpoint failed with ``error`` and return ``None``."""


@dataclass(slots=True)
class UpdateRecord:
    """One update sent to a run (``engine.update``): its request and, once
    handled, its answer.

    ``answer`` is ``None`` while the update waits in the run's inbox; then a
    JSON object with ``outcome`` (``accepted``, ``failed``, ``rejected``,
    ``ended`` or ``moved``) and, by outcome, ``result``, ``reason``, ``error``
    or ``run_id`` (``moved``: the update now waits in that run, the next link
    of a continue-as-new chain).
    """

    run_id: str
    update_id: str
    name: str
    payload: Any
    created_at: int
    answer: dict[str, Any] | None = None
    answered_at: int | None = None


@runtime_checkable
class UpdateStore(Protocol):
    """Each run's inbox of updates and their answers (see :mod:`durably._ops.updates`)."""

    async def put_update(self, record: UpdateRecord) -> UpdateRecord:
        """*Atomic*: add ``record`` to its run's inbox unless an update with
        the same ``(run_id, update_id)`` is there already; return the stored
        one (so a retried delivery sees the first one and its answer)."""

    async def get_update(self, run_id: str, update_id: str) -> UpdateRecord | None:
        """The update ``update_id`` sent to ``run_id``, or ``None``."""

    async def pending_updates(self, run_id: str, limit: int) -> list[UpdateRecord]:
        """The run's unanswered updates, oldest first (at most ``limit``)."""

    async def answer_update(
        self,
        run_id: str,
        update_id: str,
        answer: dict[str, Any],
        now: int,
        *,
        checkpoint: Checkpoint | None = None,
        owner: str | None = None,
    ) -> bool:
        """*Atomic*: answer the update if it is still unanswered.

        With ``owner``, under that owner's lease of the run (``False``,
        nothing written, if it no longer holds it), and ``checkpoint`` (the
        handled update as recorded in history) is written in the same
        transaction: history and answer are both there or neither. Without
        ``owner``, ``False`` if the update was answered already (or unknown)."""

    async def move_updates(self, from_run: str, to_run: str, now: int) -> int:
        """*Atomic*: hand the unanswered updates of ``from_run`` to ``to_run``
        (same ids, same order, an id already there kept), answering each
        original ``{"outcome": "moved", "run_id": to_run}``; return how many.
        An update put in ``from_run`` meanwhile is either moved or left
        unanswered there, never answered ``moved`` without being moved."""


@runtime_checkable
class ScheduleStore(Protocol):
    """The schedules table (see :mod:`durably.schedules`)."""

    async def create_schedule(self, record: ScheduleRecord) -> tuple[ScheduleRecord, bool]:
        """Insert ``record`` unless its name exists. *Atomic*: of racing creates
        exactly one returns ``created=True``; all return the stored record."""

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        """The schedule, or ``None``."""

    async def list_schedules(self, namespace: str | None = None) -> list[ScheduleRecord]:
        """Every schedule (of ``namespace``, when given), by name."""

    async def list_due_schedules(
        self, namespace: str, now: int, limit: int, workflows: list[str] | None = None
    ) -> list[ScheduleRecord]:
        """Schedules of ``namespace`` with work to do: unpaused with
        ``next_fire_at <= now``, or with a ``firing_run_id`` set (even paused);
        earliest ``next_fire_at`` first. With ``workflows``, only schedules
        starting one of them (``spec["workflow"]``), so schedules no engine
        here can fire never crowd out those it can."""

    async def update_schedule(
        self, name: str, changes: dict[str, Any], now: int, *, revision: int | None = None
    ) -> ScheduleRecord | None:
        """*Atomic*: apply ``changes`` (column → value; see
        ``UPDATABLE_SCHEDULE_COLUMNS``), bump ``revision`` and stamp
        ``updated_at``, only if the schedule exists and, when ``revision`` is
        given, is still at that revision. Returns the updated record or ``None``."""

    async def delete_schedule(self, name: str) -> bool:
        """Delete a schedule; ``False`` if absent."""


@runtime_checkable
class StoreInspector(Protocol):
    """Read-only views of what a store holds but no run is waiting for.

    No engine path calls them: they exist so that tests, the CLI and a
    dashboard can see buffered deliveries without knowing a store's tables.
    They stay in :class:`StateStore` (every store answers them, and the
    conformance suite checks that buffering really buffered), but apart, so a
    collaborator of the engine never needs to type them."""

    async def list_buffered_signals(self, token: str) -> list[Any]:
        """Payloads buffered for ``token``, oldest first (for inspection)."""

    async def list_buffered_events(self, name: str) -> list[Any]:
        """Payloads buffered on event ``name``, oldest first (for inspection)."""

    async def count_runs(self, query: RunQuery, cap: int) -> dict[str, int]:
        """How many runs match ``query`` per status, each count stopping at
        ``cap`` (so its cost is bounded whatever the table holds: ``cap``
        means "at least"); statuses with none are left out. ``query.status``, ``statuses``,
        ``limit`` and ``cursor`` are ignored."""

    async def list_changed(self, after: int, limit: int) -> list[Run]:
        """Up to ``limit`` runs whose ``updated_at`` is after ``after`` (epoch
        ms), oldest change first: what changed since a poll."""

    async def list_queues(self) -> list[QueueState]:
        """Flow-control queues holding slots or waiters, by name."""

    async def count_pending(self, namespace: str | None = None) -> int:
        """How many runs are ``pending`` (in ``namespace``; ``None``: all)."""

    async def count_flow_waiters(self) -> dict[str, int]:
        """How many steps wait for admission, by flow-control queue (queues
        without a waiter are left out)."""


@runtime_checkable
class RunStatusStore(Protocol):
    """Runs' statuses alone, cheaper than :meth:`RunStore.get_runs` (no input,
    output or error read and decoded). Optional: the engine's wait for runs
    polls every waited run each interval as a safety net for a lost notice,
    and with this reads whole only the runs whose status a waiter wants."""

    async def get_run_statuses(self, run_ids: list[str]) -> dict[str, RunStatus]:
        """The status of each run that exists among ``run_ids``."""
        ...


@runtime_checkable
class TransactionStore(Protocol):
    """A store on a database the app can write to: ``ctx.transaction`` commits the
    app's writes and the step's checkpoint together (SQLite, PostgreSQL).

    Not part of :class:`StateStore`: a store without a database of its own
    (``memory://``) cannot offer it, and ``ctx.transaction`` says so.
    """

    async_transactions: bool
    """Whether the function given the connection is a coroutine function
    (asyncpg) or a plain one (sqlite3, run on the store's thread)."""

    async def transact(
        self,
        run_id: str,
        owner: str,
        fn: Callable[[Any], Any],
        checkpoint_for: Callable[[Any], Checkpoint],
    ) -> tuple[bool, Any]:
        """In one transaction: check ``owner`` holds ``run_id``'s lease, run
        ``fn(connection)``, write ``checkpoint_for(its result)``; commit.

        Returns ``(False, None)`` without running ``fn`` when the lease is not
        held, else ``(True, the checkpoint's output)``. If ``fn`` or
        ``checkpoint_for`` raises, nothing of the transaction is kept and the
        exception propagates. Atomic.
        """
        ...


@runtime_checkable
class DecisionStore(Protocol):
    """Remote workflow turns: the decision a suspended run awaits from a worker."""

    async def mark_awaiting(self, run_id: str, owner: str, task_id: str | None) -> bool:
        """Record ``task_id`` as the turn a run leased by ``owner`` awaits
        (``None`` clears it); ``False`` if the lease is not ``owner``'s."""
        ...

    async def take_decision(
        self,
        run_id: str,
        task_id: str,
        owner: str,
        lease_until: int,
        now: int,
        checkpoints: list[Checkpoint],
    ) -> Run | None:
        """*Atomic*: if the run is ``suspended`` awaiting ``task_id``, lease it
        to ``owner``, clear the awaited id and insert ``checkpoints`` (a seq
        that has one already keeps it), as one write; else change nothing and
        return ``None``. A duplicate or late decision therefore changes nothing."""
        ...

    async def mark_dispatched(self, run_id: str, seqs: list[int], at: int) -> None:
        """Stamp ``dispatched_at = at`` on those of the run's checkpoints at
        ``seqs`` still ``pending`` and not stamped (a result that settled one
        meanwhile is never undone)."""
        ...

    async def extend_decision_wait(self, run_id: str, wake_at: int, now: int) -> bool:
        """Push the re-drive time of a ``suspended`` run awaiting a decision
        out to ``wake_at`` (never earlier); ``False`` if it awaits none."""
        ...


@runtime_checkable
class StateStore(
    StoreConnection,
    RunStore,
    TurnStore,
    SweepStore,
    CheckpointStore,
    FlowStore,
    WaitStore,
    ScheduleStore,
    StoreInspector,
    DecisionStore,
    UpdateStore,
    Protocol,
):
    """Persistence for runs and their history: every role protocol at once.

    Every method is a coroutine and safe to call concurrently from many tasks.
    Methods documented as *atomic* must behave as one indivisible step even
    against other processes sharing the same database.
    """
