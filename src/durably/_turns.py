"""TurnDriver: one turn of a run, from lease to settled outcome.

A turn leases the run (many turns starting together share one statement),
replays the workflow body against its checkpoint snapshot
(:mod:`durably._replay`) while a renewer keeps the lease, and settles the
outcome and the lease in one compare-and-set. A wake that arrived during the
turn makes the run take another turn at once; a run that ended tells its
parent, its waiters and its failure handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ._batch import BatchCall
from ._children import next_link_id
from ._faults import FailureLog, is_infrastructure_error
from ._intercept import TurnInfo
from ._lifecycle_events import RUN_OUTCOMES, EventKind
from ._logs import RUN_CONTEXT, LogContext, engine_logger
from ._ops.saga import Saga
from ._replay import CloseReason, Turn, TurnEnd, TurnOutcome, error_info
from ._sticky import Kept, StickyRuns
from .clock import SystemClock
from .context import WorkflowContext
from .errors import SchemaValidationError, WorkflowNotRegistered, _TurnClosed
from .model import TERMINAL_STATUSES, Checkpoint, ErrorInfo, Run, RunResult, RunStatus
from .stores import RunChanges, SettleResult
from .stores.base import HistoryTail, ReadFrom, TurnLease

if TYPE_CHECKING:
    from ._children import ChildRuns
    from ._ops.env import Services
    from ._options import EngineOptions
    from ._registry import Registry, WorkflowDef
    from ._routing import RunRouter
    from .clock import Clock
    from .stores import StateStore

__all__ = ["Leased", "TurnDriver"]

_log = engine_logger("durably")

Leased = tuple[Run, dict[int, Checkpoint]]
"""A run leased for a turn, with the checkpoints that turn replays."""

RemoteTurn = Callable[[Run, dict[int, Checkpoint], "WorkflowDef", set[str]], Awaitable[TurnOutcome]]
"""A remote workflow's turn (:meth:`durably._remote.turns.RemoteTurns.turn`)."""

_WAKEABLE = frozenset({RunStatus.PENDING, RunStatus.SUSPENDED})
# Waits between attempts to take a turn back after the store failed mid-turn
# (seconds, real time: the store's recovery is not on the engine's clock).
_RESUME_BACKOFF = (0.05, 0.1, 0.25, 0.5, 1.0)


class TurnDriver:
    """Leases runs, executes their turns and settles the outcomes."""

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        registry: Registry,
        router: RunRouter,
        children: ChildRuns,
        services: Services,
        after_failure: Callable[[Run], Awaitable[None]],
        options: Callable[[], EngineOptions],
        owner: Callable[[], str],
    ) -> None:
        """``after_failure(run)`` routes a run that just failed to its handlers;
        ``owner()`` is this process's lease owner id."""
        self._store = store
        self._clock = clock
        self._registry = registry
        self._router = router
        self._children = children
        self._services = services
        self._after_failure = after_failure
        self._options = options
        self._owner = owner
        # Turns starting together lease their runs in one statement, not one
        # round trip each: waking thousands of sleepers, or a fan's children,
        # would otherwise queue one start per run for the store's pool.
        self._turn_starts: BatchCall[str, Leased | None] = BatchCall(self._start_turns, 256)
        self._failures = FailureLog(_log)
        size = options().sticky_runs
        self.sticky: StickyRuns | None = StickyRuns(size) if size > 0 else None
        """Suspended turns kept in memory for their run's next turn (see :mod:`durably._sticky`)."""
        self.tails_reread = 0
        """Histories leased from a kept body's position whose body was gone
        by the turn (let go meanwhile), so read again in full."""
        self.remote_turn: RemoteTurn | None = None
        """Takes the turns of remote workflows (set by the wiring)."""
        self.timer_set: Callable[[int], None] | None = None
        """Told the wake time of each run a turn here suspends on a timer
        (set by the wiring: the worker ticks then, not a poll later)."""

    async def conclude(self, run: Run, outcome: TurnOutcome) -> None:
        """Settle ``outcome`` for ``run``, leased here outside a replayed turn
        (a remote workflow's decision), and drive any turn that follows."""
        leased = await self._settle(run, outcome, None)
        if leased is not None:
            await self.drive(*leased)

    async def execute(self, run_id: str, wake: bool) -> None:
        """The executor's handler: lease ``run_id`` (unless a start already
        did) and drive its turns until it lets go."""
        # The executor's task copied its submitter's context: a run started
        # by another run's turn must not log under that run's id.
        RUN_CONTEXT.set(LogContext(run_id))
        preleased = self._router.preleased.pop(run_id, None)
        if preleased is not None:
            await self.drive(preleased, {})
            return
        resumed = self._router.resumed.pop(run_id, None)
        if resumed is not None:  # leased by the settle of its step results
            await self.drive(*resumed)
            return
        try:
            leased = await self.acquire(run_id, wake=wake)
        except Exception as exc:
            if not is_infrastructure_error(exc):
                raise
            # The lease may have been taken before the answer was lost: if
            # the run is ours once the store answers, its turn runs here now
            # (not a lease later, through recovery).
            leased = await self._resume(run_id, exc)
        if leased is not None:
            await self.drive(*leased)

    async def acquire(self, run_id: str, *, wake: bool = False) -> Leased | None:
        """Lease ``run_id`` for a turn; ``None`` if it is not runnable now.

        With ``wake``, a run leased elsewhere gets a wake stamp, so its holder
        takes one more turn (or, if it let go meanwhile, the lease is ours).
        """
        leased = await self._turn_starts(run_id)
        if leased is not None or not wake:
            return leased
        now = self._clock.now_ms()
        current = await self._store.get_run(run_id)
        if current is None or current.status in TERMINAL_STATUSES:
            return None
        # Someone holds the lease: leave a stamp so the holder runs one more
        # turn instead of letting go. If it let go before the stamp landed,
        # the run is free now and the retry below takes it.
        if not await self._store.request_wake(run_id, now):
            return None
        return await self._turn_starts(run_id)

    async def drive(self, run: Run, checkpoints: dict[int, Checkpoint]) -> None:
        """Execute turns of a leased run until one settles without a wake."""
        context = RUN_CONTEXT.set(LogContext(run.run_id, run.workflow))
        driving = self._router.driving
        nested = run.run_id in driving
        driving.add(run.run_id)
        try:
            await self._drive(run, checkpoints)
        finally:
            if not nested:
                driving.discard(run.run_id)
                self._router.rewake.discard(run.run_id)
            RUN_CONTEXT.reset(context)

    async def _drive(self, run: Run, checkpoints: dict[int, Checkpoint]) -> None:
        pool = self._options().namespace
        if pool is not None and run.namespace != pool:
            # Woken here by a signal or a child, but it belongs to another
            # pool: hand it back as pending for that pool's instances.
            await self._store.release_run(run.run_id, self._owner(), self._clock.now_ms())
            if self._router.run_queue is not None:
                self._router.route(run.run_id, namespace=run.namespace, priority=run.priority)
            return
        leased: Leased | None = (run, checkpoints)
        while leased is not None:
            try:
                outcome, turn = await self._intercepted_turn(*leased)
                # A hold in it lent the turn's slot and ended without taking
                # one back (its body cancelled or failed meanwhile): the
                # settle and any next turn work with one again.
                back = self._slot_back(run.run_id)
                if back is not None:
                    await back
                if turn is not None and turn.store_error is not None:
                    leased = await self._resume(run.run_id, turn.store_error)
                    continue
                # A result heard from now on either lands before this
                # settle (which then sees its wake stamp) or leaves the flag.
                self._router.rewake.discard(run.run_id)
                leased = await self._settle(leased[0], outcome, turn)
                if leased is None and run.run_id in self._router.rewake:
                    # A step result settled after our settle: lease once more.
                    self._router.rewake.discard(run.run_id)
                    leased = await self._turn_starts(run.run_id)
            except Exception as exc:
                if not is_infrastructure_error(exc):
                    raise
                leased = await self._resume(run.run_id, exc)

    def _slot_back(self, run_id: str) -> Awaitable[None] | None:
        """What to await until ``run_id``'s execution holds a turn slot again
        (``None``: it has one)."""
        executor = self._router.executor
        return None if executor is None else executor.reclaim(run_id)

    async def _resume(self, run_id: str, error: BaseException) -> Leased | None:
        """Take the turn of ``run_id`` again once the store answers.

        The store failed mid-turn (or while settling): the run was left as it
        was, still leased to us, so this process — not a recovery pass a
        lease later, counting a crash — runs the turn again. ``None`` if the
        run is no longer ours (settled after all, or taken over meanwhile) or
        the engine is draining (the lease then expires into recovery).
        """
        self._failures.failed("a turn's store call", error)
        attempt = 0
        while not self._router.draining:
            await asyncio.sleep(_RESUME_BACKOFF[min(attempt, len(_RESUME_BACKOFF) - 1)])
            attempt += 1
            try:
                again = await self._store.continue_turn(
                    run_id, self._owner(), self._clock.now_ms() + self._options().lease_ms
                )
                leased = None if again is None else (again, await self._history(run_id))
            except Exception as exc:
                if not is_infrastructure_error(exc):
                    raise
                self._failures.failed("a turn's store call", exc)
                continue
            self._failures.succeeded("a turn's store call")
            return leased
        return None

    def turn_lease(self, limit: int) -> TurnLease:
        """The lease a results batch takes its woken runs' turns with: the one
        :meth:`acquire` would take (``resolve_and_lease``)."""
        now = self._clock.now_ms()
        return TurnLease(
            self._owner(),
            now + self._options().lease_ms,
            _WAKEABLE,
            limit,
            workflows=self._registry.executable(),
            read_from=self._read_from(),
        )

    def _read_from(self) -> ReadFrom | None:
        """Where a lease reads each run's history from: a kept body holds
        the settled start of its run's history (:mod:`durably._sticky`)."""
        return None if self.sticky is None else self.sticky.read_from

    async def _history(self, run_id: str) -> dict[int, Checkpoint]:
        """``run_id``'s history for a turn leased by ``continue_turn``."""
        since = 0 if self.sticky is None else self.sticky.read_from(run_id)
        return await self._store.load_checkpoints(run_id, since)

    async def _whole(self, run_id: str, history: dict[int, Checkpoint]) -> dict[int, Checkpoint]:
        """The whole history of a turn leased with ``history``: a tail (read
        from a kept body's position) completed from that body, or else read
        again in full. The kept body is an optimization; the turn never
        depends on it being there still."""
        if not isinstance(history, HistoryTail):
            return history
        whole = None if self.sticky is None else self.sticky.whole(run_id, history)
        if whole is None:
            self.tails_reread += 1
            return await self._store.load_checkpoints(run_id)
        return whole

    async def _start_turns(self, run_ids: list[str]) -> list[Leased | None]:
        now = self._clock.now_ms()
        # Only runs of workflows registered here are leased: a wake or a queued
        # message for another release's run leaves that run untouched.
        leased = await self._store.start_turns(
            run_ids,
            self._owner(),
            now,
            now + self._options().lease_ms,
            _WAKEABLE,
            workflows=self._registry.executable(),
            read_from=self._read_from(),
        )
        # An id asked twice in one batch gets its turn once: the second asker
        # sees what a second start_turn would (the run is leased: None).
        return [leased.pop(run_id, None) for run_id in run_ids]

    async def replay_only(
        self, run: Run, checkpoints: dict[int, Checkpoint]
    ) -> tuple[TurnOutcome, Turn]:
        """Replay ``run``'s history against the body registered for it, executing
        nothing new: every operation past the history parks (as in a
        compensating cancel's replay), no undo runs and no outcome is written.
        The turn's ``failure`` holds a :class:`NondeterminismError` where the
        body and the history differ (``durably.testing.assert_replayable``)."""
        definition = self._registry.get(run.workflow, run.workflow_version)
        value = definition.parse_input(run.input)
        turn = Turn(
            run, checkpoints, self._owner(), self._clock.now_ms, 0, self._options().lease_ms
        )
        turn.unwinding = True
        ctx = WorkflowContext(turn, self._services, Saga())
        if definition.takes_input:
            outcome = await turn.execute(lambda: definition.fn(ctx, value))
        else:
            outcome = await turn.execute(lambda: definition.fn(ctx))
        return outcome, turn

    async def _intercepted_turn(
        self, run: Run, checkpoints: dict[int, Checkpoint]
    ) -> tuple[TurnOutcome, Turn | None]:
        # A tail holds every checkpoint not settled before it (those below
        # are completed): the children to reconcile are among its positions.
        unsettled = checkpoints
        checkpoints = await self._whole(run.run_id, checkpoints)
        intercept = self._services.intercept
        if not intercept.turns:
            return await self._turn(run, checkpoints, unsettled)
        info = TurnInfo(
            run.run_id, run.workflow, run.workflow_version, run.trace_context, bool(checkpoints)
        )

        called: list[bool] = []
        done: list[tuple[TurnOutcome, Turn | None]] = []

        async def call() -> tuple[TurnOutcome, Turn | None]:
            called.append(True)
            result = await self._turn(run, checkpoints, unsettled)
            info.outcome = result[0].end.value
            done.append(result)
            return result

        try:
            outcome: tuple[TurnOutcome, Turn | None] = await intercept.run_turn(info, call)
            return outcome
        except Exception:
            if called and not done:
                raise  # the turn's own failure (a store outage), not an interceptor's
            # An interceptor's bug must not strand the run under our lease: the
            # turn runs (or its outcome stands) as if it were not there.
            _log.exception("a turn interceptor failed on run %s", run.run_id)
            return done[0] if done else await self._turn(run, checkpoints, unsettled)

    async def _turn(
        self, run: Run, checkpoints: dict[int, Checkpoint], unsettled: dict[int, Checkpoint]
    ) -> tuple[TurnOutcome, Turn | None]:
        try:
            definition = self._registry.get(run.workflow, run.workflow_version)
        except WorkflowNotRegistered:
            # Leased without the filter (a start here inserted it leased): not
            # ours to fail. Another release's instance executes it.
            return TurnOutcome(TurnEnd.CLOSED), None
        if not run.workflow_version or (
            run.deadline_at is None and definition.execution_timeout_ms is not None
        ):
            await self._pin(run, definition)
        try:
            value = definition.parse_input(run.input)
            singleton = definition.singleton
            if singleton is not None:
                key = singleton.key(definition.name, value)
                admission = singleton.admission(definition.name, key, run.run_id, run.created_at)
                ask_again = await self._store.try_admit(admission, self._clock.now_ms())
                if ask_again is not None:
                    # The key has its ``limit`` live runs: wait, executing
                    # nothing; the end of one of them wakes the first waiter.
                    return TurnOutcome(TurnEnd.SUSPENDED, wake_at=ask_again), None
        except SchemaValidationError as exc:
            return TurnOutcome(TurnEnd.FAILED, error=error_info(exc)), None
        missing_children = await self._children.reconcile(run, unsettled)
        self._router.forget(run.run_id)
        if definition.remote is not None and self.remote_turn is not None:
            return await self.remote_turn(run, checkpoints, definition, missing_children), None
        options = self._options()
        sticky = self.sticky
        # A turn interceptor (tracing) wraps each turn in a context of its own,
        # which a body kept from an earlier turn would not run under.
        keep = (
            sticky is not None and not self._services.intercept.turns and not self._router.draining
        )
        resumed = None
        if keep and sticky is not None:
            resumed = sticky.resume(run, checkpoints)
        elif sticky is not None:
            sticky.drop(run.run_id)
        if resumed is not None:
            turn, ctx, saga = resumed.kept.turn, resumed.kept.ctx, resumed.kept.saga
        else:
            turn = Turn(
                run,
                checkpoints,
                self._owner(),
                self._clock.now_ms,
                options.reconcile_ms,
                options.lease_ms,
            )
            saga = Saga()
            ctx = WorkflowContext(turn, self._services, saga)
        turn.missing_children = missing_children
        events = self._services.events
        if events.active:
            events.event(
                EventKind.RUN_STARTED,
                run.run_id,
                self._clock.now_ms(),
                workflow=run.workflow,
                resumed=bool(checkpoints),
            )
        active = self._router.active
        active[run.run_id] = turn
        renewer = self._renewer(turn)
        try:
            if resumed is not None:
                outcome = await resumed.outcome
            else:
                outcome = await turn.execute(lambda: definition.call(ctx, value), keep=keep)
            if turn.kept and not ctx._updates_idle:
                turn.dispose()  # updates re-apply by replaying: nothing to resume
            if sticky is not None and turn.kept:
                sticky.keep(
                    run.run_id,
                    Kept(
                        turn,
                        ctx,
                        saga,
                        run.workflow,
                        run.workflow_version,
                        run.recovery_attempts,
                        run.created_at,
                    ),
                )
            if outcome.end is TurnEnd.CLOSED:
                return outcome, turn
            unwind = turn.unwinding or (outcome.end is TurnEnd.FAILED and bool(saga))
            try:
                if unwind or not self._store.ordered_writes or turn.unordered_writes:
                    await turn.flush()  # every result is durable before the outcome
                if unwind:
                    undone = await saga.compensate(turn, self._services)
                    # A TurnOutcome: a dispatched undo is out; the run suspends mid-unwind.
                    outcome = (
                        undone
                        if isinstance(undone, TurnOutcome)
                        else after_unwind(outcome, undone, turn.unwinding)
                    )
            except _TurnClosed:
                outcome = TurnOutcome(TurnEnd.CLOSED)
            return outcome, turn
        finally:
            renewer.cancel()
            if active.get(run.run_id) is turn:
                del active[run.run_id]

    def let_go_kept(self) -> None:
        """Let go of every kept turn (a drain: their bodies are cancelled, as
        a suspend without the cache cancels them)."""
        if self.sticky is not None:
            self.sticky.clear()

    async def _pin(self, run: Run, definition: WorkflowDef) -> None:
        """Pin an unpinned run (a client started it without a version) to the
        version this turn executes, before anything is recorded: every later
        turn, here or on an instance of another release, replays that
        version's body, never the default of whoever takes the run next.

        A run started by name (a client, the CLI) got no deadline either, as
        its starter knew no registration: the workflow's ``execution_timeout``
        is set here, counted from the run's creation."""
        changes: dict[str, Any] = {"workflow_version": definition.version}
        deadline = definition.deadline_from(run.created_at)
        if deadline is not None and run.deadline_at is None:
            changes["deadline_at"] = deadline
        await self._store.update_run_if(
            run.run_id, frozenset({RunStatus.RUNNING}), changes, self._clock.now_ms()
        )
        run.workflow_version = definition.version
        run.deadline_at = changes.get("deadline_at", run.deadline_at)

    def _renewer(self, turn: Turn) -> asyncio.Task[None] | _DueRenewal:
        """Keep ``turn``'s lease renewed until cancelled.

        On the system clock the renewing task is only created when the first
        renewal is due (half a lease in): most turns end long before, and a
        task started at once would take a loop turn of its own between the
        turn's start and its body, and another to be cancelled. A test's
        clock keeps the task, which sleeps on that clock."""
        if type(self._clock) is SystemClock:
            delay = self._options().lease_ms / 2000
            return _DueRenewal(delay, lambda: self._renew(turn, due=True))
        return asyncio.create_task(self._renew(turn))

    async def _renew(self, turn: Turn, *, due: bool = False) -> None:
        lease_ms = self._options().lease_ms
        interval = lease_ms / 2000
        while True:
            if not due:
                await self._clock.sleep(interval)
            due = False
            if not turn.holds_lease:
                return
            until = self._clock.now_ms() + lease_ms
            try:
                held = await self._store.renew_lease(turn.run.run_id, self._owner(), until)
            except Exception as exc:
                self._failures.failed("renewing leases", exc)
                continue
            self._failures.succeeded("renewing leases")
            if not held:
                _log.warning("lost the lease of run %s; fencing its turn", turn.run.run_id)
                turn.close(CloseReason.FENCED)
                return
            turn.lease_until = until

    async def _settle(self, run: Run, outcome: TurnOutcome, turn: Turn | None) -> Leased | None:
        """Write the turn's outcome; return the run if it must take another turn."""
        run_id, now = run.run_id, self._clock.now_ms()
        owner, lease_ms = self._owner(), self._options().lease_ms
        if outcome.end is TurnEnd.CLOSED:
            if turn is not None and turn.fenced and self._services.events.active:
                self._services.events.event(
                    EventKind.RUN_FENCED, run_id, now, workflow=run.workflow
                )
            if turn is None:
                # Not executable here: hand it back as pending for an instance
                # that registers its workflow and version.
                await self._store.release_run(run_id, owner, now)
                return None
            if turn.close_reason is CloseReason.UNWIND:
                # A compensating cancel arrived mid-turn: take one more turn,
                # which reads the intent and unwinds.
                again = await self._store.continue_turn(run_id, owner, now + lease_ms)
                if again is not None:
                    return again, await self._history(run_id)
                return None
            if self._router.draining:
                await self._store.release_run(run_id, owner, now)
            return None
        if outcome.end is TurnEnd.CONTINUED:
            if turn is not None:
                # The next link is built on this link's results and starts at
                # once: they must be durable before it exists, or a crash before
                # this link's settle re-runs steps whose results it consumed.
                try:
                    await turn.flush()
                except _TurnClosed:
                    return None  # fenced: the lease's new owner hands over
            next_run = await self._continue_as_new(run, outcome.output)
            status, changes = RunStatus.COMPLETED, RunChanges(output={"continued_as": next_run})
        elif outcome.end is TurnEnd.COMPLETED:
            status, changes = RunStatus.COMPLETED, RunChanges(output=outcome.output)
        elif outcome.end is TurnEnd.FAILED:
            status, changes = RunStatus.FAILED, RunChanges(error=outcome.error)
        elif outcome.end is TurnEnd.CANCELLED:
            status, changes = RunStatus.CANCELLED, RunChanges(error=outcome.error)
        elif outcome.end is TurnEnd.BLOCKED:
            status = RunStatus.BLOCKED
            changes = RunChanges(error=outcome.error, wake_at=outcome.wake_at)
        else:
            status, changes = RunStatus.SUSPENDED, RunChanges(wake_at=outcome.wake_at)
        if turn is not None and not turn.may_have_waiters:
            changes.waiters = False  # the store may skip clearing waiters it has none of
        if (
            status in TERMINAL_STATUSES
            and run.parent_id is not None
            and run.parent_seq is not None
            and outcome.end is not TurnEnd.CONTINUED  # the chain's last link reports
        ):
            # The child's ending and its parent's placeholder are one write, so
            # a cancel landing meanwhile either wins (and the parent hears
            # "cancelled") or loses, and no crash falls between the two. That
            # write is not queued behind the turn's results: collect them first.
            if turn is not None and self._store.ordered_writes:
                await self._collect(turn, run_id)
            won = await self._children.end_child(_ended(run, status, changes), owner=owner)
            result = SettleResult.SETTLED if won else SettleResult.LOST
        else:
            result = await self._store.settle_run(run_id, owner, status, changes, now)
        if turn is not None and self._store.ordered_writes:
            # The outcome was queued behind the turn's results, so they are
            # settled too; collect them (a write that failed is only logged:
            # the run's own row already holds its outcome).
            await self._collect(turn, run_id)
        if turn is not None and turn.kept and self.sticky is not None:
            if result is SettleResult.LOST or turn.fenced:
                self.sticky.drop(run_id)  # not ours any more: the next turn replays
            else:
                self.sticky.settled(run_id, turn)
        if result is SettleResult.LOST and outcome.end is TurnEnd.CONTINUED:
            current = await self._store.get_run(run_id)
            if current is not None and current.status is RunStatus.CANCELLED:
                # Cancelled as it continued: the next link, created already,
                # must not live on as a chain nobody waits for.
                await self._children.cancel_runs([next_link_id(run_id)])
        if result is SettleResult.WAKE_REQUESTED:
            again = await self._store.continue_turn(run_id, owner, now + lease_ms)
            if again is None:
                return None
            return again, await self._history(run_id)
        if result is SettleResult.SETTLED:
            if (
                status is RunStatus.SUSPENDED
                and outcome.wake_at is not None
                and self.timer_set is not None
            ):
                self.timer_set(outcome.wake_at)
            if self._services.events.active:
                self._services.events.event(
                    RUN_OUTCOMES[status],
                    run_id,
                    now,
                    workflow=run.workflow,
                    duration_ms=now - run.created_at if status in TERMINAL_STATUSES else None,
                    error=outcome.error if status is not RunStatus.COMPLETED else None,
                )
            if outcome.after_settle is not None:
                await outcome.after_settle()
            if status is RunStatus.FAILED and outcome.error:
                _log.warning(
                    "run %s (%s) failed: %s", run_id, run.workflow, outcome.error.get("message")
                )
            self._router.notify(run_id, RunResult(run_id, status, changes.output, changes.error))
            if status in TERMINAL_STATUSES:
                await self._children.after_end(run_id, cancelled=status is RunStatus.CANCELLED)
                if turn is not None and status is not RunStatus.CANCELLED:
                    await self._children.cancel_attached(run_id, turn.attached_children)
                if status is RunStatus.FAILED:
                    await self._after_failure(_ended(run, status, changes))
                if status is RunStatus.CANCELLED:
                    await self._children.cancel_children(run_id)
        return None

    async def _collect(self, turn: Turn, run_id: str) -> None:
        """Wait for the turn's queued writes; a failed one is only logged."""
        try:
            await turn.flush()
        except _TurnClosed:
            pass
        except Exception:
            _log.exception("a checkpoint write of run %s failed", run_id)

    async def _continue_as_new(self, run: Run, new_input: Any) -> str:
        next_id = next_link_id(run.run_id)
        definition = self._registry.get(run.workflow)
        now = self._clock.now_ms()
        # The next link is found by the same search attributes (written with
        # it, so a crash never leaves it without them).
        attributes = await self._store.get_attributes(run.run_id)
        # Persisted before this run completes, so a crash in between never
        # loses the chain: the next link already exists and is pending.
        link = run.replace(
            run_id=next_id,
            workflow_version=definition.version,
            status=RunStatus.PENDING,
            input=new_input,
            output=None,
            error=None,
            wake_at=None,
            wake_requested_at=None,
            locked_by=None,
            locked_until=None,
            recovery_attempts=0,
            created_at=now,
            updated_at=now,
            deadline_at=definition.deadline_from(now),
        )
        # Without attributes, the one-argument call a wrapped store also answers.
        await (
            self._store.create_run(link, attributes) if attributes else self._store.create_run(link)
        )
        # Updates this link did not take wait for the next one (a caller
        # waiting on them follows: their answer here says where they went).
        await self._store.move_updates(run.run_id, next_id, now)
        self._router.route(next_id, namespace=run.namespace, priority=run.priority)
        return next_id


class _DueRenewal:
    """A turn's lease renewal on the system clock: a timer that starts the
    renewing task when the first renewal is due; :meth:`cancel` stops either."""

    __slots__ = ("_handle", "_task")

    def __init__(self, delay: float, renew: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._task: asyncio.Task[None] | None = None
        self._handle = asyncio.get_running_loop().call_later(delay, self._start, renew)

    def _start(self, renew: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._task = asyncio.ensure_future(renew())

    def cancel(self) -> None:
        """Stop renewing (the turn ended)."""
        self._handle.cancel()
        if self._task is not None:
            self._task.cancel()


def _ended(run: Run, status: RunStatus, changes: RunChanges) -> Run:
    """``run`` as its settle leaves it (a copy: most settles never need one)."""
    return run.replace(status=status, output=changes.output, error=changes.error)


def after_unwind(outcome: TurnOutcome, failures: list[ErrorInfo], cancelling: bool) -> TurnOutcome:
    """The outcome of a turn whose saga compensations just ran."""
    if cancelling:
        error: ErrorInfo = {
            "message": "cancelled; completed steps were compensated",
            "code": "cancelled",
            "type": "RunCancelled",
            "details": {"compensation_failures": failures} if failures else None,
        }
        return TurnOutcome(TurnEnd.CANCELLED, error=error)
    error = dict(outcome.error or {})
    if failures:
        error["details"] = {"original": error.get("details"), "compensation_failures": failures}
    return TurnOutcome(TurnEnd.FAILED, error=error)
