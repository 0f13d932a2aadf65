"""Worker: the periodic phases that keep every run moving, and the loop that runs them.

Each tick hands pending runs to the router, reclaims orphans (runs whose
executor died), wakes due timers, cancels runs past their execution timeout,
fires due schedules, and runs the housekeeping sweeps (retention, stalled
runs). A phase failing never stops the others. Between ticks the loop waits
for the poll interval, or less when a timer falls due sooner (the store's
next wake time, read after each tick, and the wake times of runs suspending
here); the store's notices (PostgreSQL) and the executor asking for more work
while a backlog drains start a pending-run poll in between.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING

from ._aio import wait_event
from ._faults import FailureLog
from ._hooks import call_safely
from ._lifecycle_events import EventHub, EventKind
from ._logs import engine_logger
from ._notices import StoreNotice
from ._replay import CloseReason
from .model import TERMINAL_STATUSES, Run, RunStatus
from .stores import RunQuery
from .stores._rows import is_row_error

if TYPE_CHECKING:
    from ._children import ChildRuns
    from ._hooks import Hooks
    from ._options import EngineOptions
    from ._routing import RunRouter
    from .clock import Clock
    from .stores import StateStore

__all__ = ["PENDING_GRACE_MS", "RECOVERY_BATCH", "Phase", "Worker"]

_log = engine_logger("durably")

Phase = tuple[Callable[[], Awaitable[int]], int]
"""A worker phase and the batch one pass of it claims when full (``0``: it
claims nothing, so one pass per tick)."""

RECOVERY_BATCH = 500
"""Orphans reclaimed per pass of ``recover_incomplete``."""
PENDING_GRACE_MS = 5_000
"""With a run queue, how long (engine clock, ms, from the run's last write) a
run stays ``pending`` before the sweep queues it. A younger one is most likely
still being pushed by the instance that wrote it (a start, a retry, a
recovery): queued by the sweep too, it would cost a second message, claim and
delivery check. The sweep exists for a push that failed or a crash between the
write and the push; such a run waits at most this long more."""
# Extra passes of a phase that keeps finding full batches, while the
# executor's waiting list stays under the limit (so a backlog drains at the
# executor's pace without holding every id in memory).
_MAX_EXTRA_PASSES = 20
_BACKLOG_LIMIT = 10_000
# Rows a sweep passed over, remembered so each is logged once, not every tick;
# forgotten wholesale past this many (a bound, not a cache policy).
_MAX_BAD_ROWS = 10_000
# The shortest wait between two ticks of the loop, whatever timers say: a
# burst of timers a few ms apart is taken in one tick, never one tick each.
_MIN_WAIT = 0.005


class Worker:
    """The worker phases, the loop that ticks them, and the store's notices."""

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        router: RunRouter,
        children: ChildRuns,
        hooks: Hooks,
        *,
        open: Callable[[], Awaitable[None]],
        phases: Callable[[], Sequence[Phase]],
        fire_schedules: Callable[[], Awaitable[int]],
        after_failure: Callable[[Run], Awaitable[None]],
        options: Callable[[], EngineOptions],
        owner: Callable[[], str],
        executable: Callable[[], frozenset[tuple[str, str]]],
        events: EventHub,
    ) -> None:
        """``open()`` connects the engine (each phase may be called before
        it is); ``phases()`` lists what a tick runs, in order;
        ``fire_schedules()`` starts due schedule windows; ``after_failure(run)``
        routes a dead run to its handlers; ``owner()`` is this process's lease
        owner id; ``executable()`` the ``(workflow, version)`` pairs
        registered here, the only runs this worker's claims take."""
        self._store = store
        self._clock = clock
        self._router = router
        self.wake_heard: Callable[[str], None] = lambda _run_id: None
        """Told of a wake notice for a run whose turn runs here (set by the
        wiring: a hold across a step then reads the store)."""
        self._children = children
        self._hooks = hooks
        self._open = open
        self._phases = phases
        self._fire_schedules = fire_schedules
        self._after_failure = after_failure
        self._options = options
        self._owner = owner
        self._executable = executable
        self._events = events
        self._blocked_checked_at = -(2**62)
        """When (engine clock, ms) ``sweep_blocked`` last looked for runs to mark."""
        self._last_sweep: dict[str, float] = {}
        self._bad_rows: set[tuple[str, str]] = set()
        # A store outage fails every phase on every tick: one line when a
        # phase starts failing and one when it recovers, not one per tick.
        self._failures = FailureLog(_log)
        self._gone: str | None = None
        self._more_pending = False
        """The last pending-run poll found a full page: more runs may wait."""
        self._loop_task: asyncio.Task[None] | None = None
        self._loop_wake: asyncio.Event | None = None
        self._pending_poll: asyncio.Task[None] | None = None
        self._pending_again = False  # asked for again while a poll was in flight
        self._tick_at = math.inf
        """When (event-loop time) the loop ticks next; ``inf`` while it ticks."""
        self.ticks = 0
        """Ticks the loop started (a count tests read: no busy loop)."""
        self._reclaim_wait: float | None = None
        """Set when a claim left a due run free (its row was being written):
        how soon to look again, doubling while that repeats."""

    # -- the phases -----------------------------------------------------------------------

    async def tick(self) -> None:
        """One pass of every worker phase; a failing phase never stops the others."""
        if self._store_gone():
            return
        for phase, batch in self._phases():
            name = f"worker phase {phase.__name__}"
            try:
                done = await phase()
                if batch:
                    await self._drain_backlog(phase, done, batch)
            except Exception as exc:
                self._failures.failed(name, exc)
            else:
                self._failures.succeeded(name)

    def _store_gone(self) -> bool:
        """Whether the store's file was deleted under us (SQLite): then one
        line says so, and the worker stops (a store without files has no
        ``check_file``)."""
        check = getattr(self._store, "check_file", None)
        if check is None:
            return False
        if self._gone is None:
            self._gone = check()
            if self._gone is not None:
                _log.critical("%s", self._gone)
        return self._gone is not None

    async def run_pending(self, limit: int = 1000) -> int:
        """Hand pending runs to the router; return how many (see ``Engine.run_pending``)."""
        await self._open()
        run_queue = self._router.run_queue
        if run_queue is not None:
            now = asyncio.get_running_loop().time()
            if now - self._last_sweep.get("pending", -1e9) < 1.0:
                return 0
            self._last_sweep["pending"] = now
            if await run_queue.has_backlog():
                return 0
        now_ms = self._clock.now_ms()
        ids = await self._store.list_pending(
            now_ms,
            limit,
            namespace=self._options().namespace,
            workflows=self._executable(),
        )
        self._more_pending = len(ids) >= limit and run_queue is None
        if run_queue is not None:
            return await self._queue_settled(ids, now_ms)
        for run_id in ids:
            self._router.route(run_id)
        return len(ids)

    async def _queue_settled(self, ids: list[str], now: int) -> int:
        """Queue the pending runs of ``ids`` (in their order) last written at
        least :data:`PENDING_GRACE_MS` ago, each to its own pool and priority;
        return how many. Only when the sweep finds runs does it read them."""
        if not ids:
            return 0
        runs = await self._router.runs_of(ids)
        settled_by = now - PENDING_GRACE_MS
        queued = 0
        for run_id in ids:
            run = runs.get(run_id)
            if run is None or run.status is not RunStatus.PENDING or run.updated_at > settled_by:
                continue
            self._router.route(run_id, namespace=run.namespace, priority=run.priority)
            queued += 1
        return queued

    async def recover_incomplete(self, limit: int = RECOVERY_BATCH) -> int:
        """Reclaim runs whose executor died; return how many (see ``Engine.recover_incomplete``)."""
        await self._open()
        now = self._clock.now_ms()
        options = self._options()
        # Only orphans of workflows registered here: another release's run
        # waits for an instance that can execute it, its recoveries uncounted.
        orphans = await self._store.list_orphans(
            now, limit, namespace=options.namespace, workflows=self._executable()
        )
        executor = self._router.executor
        if executor is not None:
            # A run this process is executing is no orphan: its lease ran out
            # during a store outage, and its turn takes it back here as soon
            # as the store answers. Recovering it would count a crash.
            orphans = [run_id for run_id in orphans if not executor.executing(run_id)]
        if not orphans:
            return 0
        # One conditional write for the page, not one round trip per orphan:
        # a wave of thousands of orphans is then a few statements.
        attempts = options.max_recovery_attempts
        try:
            recovered = await self._store.recover_orphans(orphans, now, attempts)
        except Exception as exc:
            if not is_row_error(exc):
                raise
            # One row undid the page: take the orphans one by one, so that
            # row is passed over and every other run is still recovered.
            recovered = {}
            for run_id in orphans:
                try:
                    recovered.update(await self._store.recover_orphans([run_id], now, attempts))
                except Exception as row_exc:
                    self._pass_over("recovery", run_id, row_exc)
        for run_id, status in recovered.items():
            try:
                await self._recovered(run_id, status)
            except Exception as exc:
                self._pass_over("recovery", run_id, exc)
        return len(recovered)

    async def _recovered(self, run_id: str, status: RunStatus) -> None:
        if self._events.active:
            self._events.event(
                EventKind.RUN_RECOVERED if status is RunStatus.PENDING else EventKind.RUN_DEAD,
                run_id,
                self._clock.now_ms(),
            )
        if status is RunStatus.PENDING:
            _log.info("recovered orphaned run %s", _short(run_id))
            self._router.route(run_id)
            return
        _log.warning("run %s crashed too often; it is now %s", _short(run_id), status)
        self._router.notify(run_id)
        # An ending from outside a turn, like a cancel: the children it did
        # not start detached must not outlive it.
        await self._children.cancel_children(run_id)
        await self._children.after_end(run_id, cancelled=False)
        dead = await self._store.get_run(run_id)
        if dead is not None:
            await self._children.report_to_parent(dead)
            await self._after_failure(dead)

    def _pass_over(self, sweep: str, run_id: str, exc: Exception) -> None:
        """Log (once per sweep and run) a row a sweep could not process, and
        let the sweep go on with the others; an error about the store rather
        than the row ends the pass as before (the tick logs it)."""
        if not is_row_error(exc):
            raise exc
        key = (sweep, run_id)
        if key in self._bad_rows:
            return
        if len(self._bad_rows) >= _MAX_BAD_ROWS:
            self._bad_rows.clear()
        self._bad_rows.add(key)
        _log.error(
            "the %s sweep passed over run %s, which it could not process: %s: %s",
            sweep,
            _short(run_id),
            type(exc).__name__,
            exc,
        )

    async def resume_due_timers(self) -> int:
        """Claim and wake suspended runs whose timer is due; return how many."""
        await self._open()
        # Planned again below, from this pass alone (a failing store plans nothing).
        again, self._reclaim_wait = self._reclaim_wait, None
        now = self._clock.now_ms()
        options = self._options()
        ids = await self._store.list_due(
            now,
            options.timer_batch_size,
            namespace=options.namespace,
            workflows=self._executable(),
        )
        if not ids:
            return 0
        # Shuffled so instances that loaded the same page hand their wins to
        # their executors in different orders; the claim of the whole page is
        # one conditional write (each run still claimed once, by one instance).
        random.shuffle(ids)
        # Read only when someone listens: the claim moves the wake times on.
        due = await self._store.get_runs(ids) if self._events.active else None
        lease_until = now + options.lease_ms
        try:
            claimed = set(await self._store.claim_due_batch(ids, now, lease_until))
        except Exception as exc:
            if not is_row_error(exc):
                raise
            claimed = set()
            for run_id in ids:  # pass over the row that undid the page
                try:
                    claimed.update(await self._store.claim_due_batch([run_id], now, lease_until))
                except Exception as row_exc:
                    self._pass_over("timer", run_id, row_exc)
        if claimed and due is not None:
            self._timers_fired(due, claimed, now)
        await self._left_free([run_id for run_id in ids if run_id not in claimed], now, again)
        for run_id in ids:
            if run_id in claimed:
                # A wake: the claim moved the run's wake time to the claim's
                # lease end, so a turn merged into one still finishing here
                # (settled, not yet returned) would leave the run asleep until then.
                self._router.route(run_id, wake=True)
        return len(claimed)

    async def _left_free(self, unclaimed: list[str], now: int, again: float | None) -> None:
        """Plan another look soon if a listed run is still due and free.

        A claim takes nothing from a run another instance claimed or holds
        (its wake moved past ``now``, or its lease runs on): the poll is the
        net for those. But PostgreSQL's claim also skips a row that is being
        written at that moment (a settle, a watch), and that run stays due and
        free: the next timer the loop plans counts only timers later than its
        tick, so without another look it would sleep until the poll. ``again``:
        the wait planned after the previous pass, if it left such a run too."""
        if not unclaimed:
            return
        free = any(
            run.status is RunStatus.SUSPENDED
            and (
                run.wake_requested_at is not None
                or (run.wake_at is not None and run.wake_at <= now)
            )
            and (run.locked_by is None or run.locked_until is None or run.locked_until < now)
            for run in await self._store.get_runs(unclaimed)
        )
        if free:
            # The row staying busy (a long transaction holds it): look less often.
            wait = _MIN_WAIT if again is None else 2 * again
            self._reclaim_wait = min(wait, self._options().poll_interval)

    def _timers_fired(self, due: list[Run], claimed: set[str], now: int) -> None:
        for run in due:
            if run.run_id in claimed:
                self._events.event(
                    EventKind.TIMER_FIRED,
                    run.run_id,
                    now,
                    workflow=run.workflow,
                    lag_ms=None if run.wake_at is None else max(0, now - run.wake_at),
                )

    async def sweep_timeouts(self, limit: int = 100) -> int:
        """Cancel runs past their workflow's ``execution_timeout``; return how many."""
        await self._open()
        swept = 0
        for run_id in await self._store.list_expired(
            self._clock.now_ms(), limit, namespace=self._options().namespace
        ):
            try:
                swept += await self._time_out(run_id)
            except Exception as exc:
                self._pass_over("timeout", run_id, exc)
        return swept

    async def _time_out(self, run_id: str) -> int:
        run = await self._store.get_run(run_id)
        if run is None or run.status in TERMINAL_STATUSES:
            return 0
        error = {
            "message": "the run exceeded its execution timeout",
            "code": "execution_timeout",
            "type": "ExecutionTimeout",
        }
        return 1 if await self._children.end_from_outside(run, error) else 0

    async def sweep_blocked(self, limit: int = 100) -> int:
        """Mark ``blocked`` the runs this engine cannot execute that no
        instance took for a lease, and take back the blocked runs it can
        execute; return how many runs changed.

        A run of a workflow (or version) registered on no live instance is
        never failed: it stays in the store, shown as ``blocked`` with the
        reason in its ``error``, until an instance that registers it takes it
        back here (as ``pending``, then routed like any pending run). One
        lease is the patience: an instance that can execute the run claims it
        within a poll interval, so a run untaken that long has nobody (or a
        backlog: marking it then costs only the detour through this sweep).
        """
        await self._open()
        options = self._options()
        executable = self._executable()
        now = self._clock.now_ms()
        changed = 0
        if not options.drives:
            return 0  # only an instance that executes runs judges who can
        if not self._router.draining:
            for run_id in await self._store.list_blocked(
                limit, workflows=executable, namespace=options.namespace
            ):
                taken = await self._store.update_run_if(
                    run_id,
                    frozenset({RunStatus.BLOCKED}),
                    {"status": RunStatus.PENDING, "error": None},
                    now,
                )
                if taken:
                    changed += 1
                    self._router.route(run_id)
        # Marking scans the old unclaimed runs (a backlog here included, then
        # filtered out), so it runs a few times a lease, not every tick.
        if not executable or now - self._blocked_checked_at < options.lease_ms // 4:
            # Without workflows this is a steps-only worker, not a release of
            # the app: it has no say in which runs wait for one.
            return changed
        unclaimed = await self._store.list_unclaimed(
            now - options.lease_ms, limit, workflows=executable, namespace=options.namespace
        )
        for run in await self._store.get_runs(unclaimed):
            if run.status not in (RunStatus.PENDING, RunStatus.SUSPENDED):
                continue
            reason = {
                "message": (
                    f"no instance that registers workflow {run.workflow!r} version "
                    f"{run.workflow_version!r} took this run; it waits for one"
                ),
                "code": "workflow_not_registered",
                "type": "Blocked",
                "details": {"workflow": run.workflow, "version": run.workflow_version},
            }
            if await self._store.update_run_if(
                run.run_id,
                # Only from the status just read: a run that moved on since
                # (taken, or woken and suspended again) is not marked.
                frozenset({run.status}),
                {"status": RunStatus.BLOCKED, "error": reason},
                now,
            ):
                changed += 1
                self._router.notify(run.run_id)
        # Stamped once the pass is over: a tick that overlaps it (an explicit
        # ``tick()`` beside the loop's) makes its own pass, so when either
        # returns, every run the pass found is marked (or was taken meanwhile).
        self._blocked_checked_at = now
        return changed

    async def fire_schedules(self) -> int:
        """Start the runs of due schedule windows; return how many."""
        await self._open()
        if self._router.draining:
            return 0
        return await self._fire_schedules()

    async def sweep_retention(self, limit: int = 500, *, force: bool = False) -> int:
        """Delete terminal runs past retention, after the evict hooks; return how many."""
        retention_ms = self._options().retention_ms
        if retention_ms is None or not self._due_sweep("retention", force):
            return 0
        await self._open()
        cutoff = self._clock.now_ms() - retention_ms
        deleted = 0
        for run_id in await self._store.list_finished_before(
            cutoff, limit, namespace=self._options().namespace
        ):
            try:
                deleted += await self._evict(run_id)
            except Exception as exc:
                self._pass_over("retention", run_id, exc)
        return deleted

    async def _evict(self, run_id: str) -> int:
        run = await self._store.get_run(run_id)
        if run is None or run.status not in TERMINAL_STATUSES:
            return 0
        if self._hooks.evict:
            history = list((await self._store.load_checkpoints(run_id)).values())
            kept = False
            for hook in self._hooks.evict:
                if not await call_safely(hook, run, history):
                    kept = True
            if kept:
                return 0
        return 1 if await self._store.delete_run(run_id) else 0

    async def sweep_buffered(self, limit: int = 1000, *, force: bool = False) -> int:
        """Delete buffered signals and events past ``buffer_ttl``; return how many.

        A signal sent to a token nobody waits on is kept for a later wait on
        that token only this long: strays do not pile up forever, and a late
        signal for a wait that timed out is not handed to an unrelated wait
        years later (tokens name one wait: build them from the run id).
        """
        ttl_ms = self._options().buffer_ttl_ms
        if ttl_ms is None or not self._due_sweep("buffered", force):
            return 0
        await self._open()
        return await self._store.expire_buffered(self._clock.now_ms() - ttl_ms, limit)

    async def sweep_stalled(self, limit: int = 500, *, force: bool = False) -> int:
        """Report stranded runs to the ``on_stalled`` hooks; return how many.

        A run is stranded (``StateStore.list_stalled``) once it made no
        progress for ``stalled_after`` and either nothing of its own can wake
        it (suspended on no timer, child or step: at most waits without a
        deadline; the reconcile fallback re-checks, it is no wake of its own)
        or it is parked on a dispatched step whose worker has been silent that
        long. One report per episode: a run is reported again only after it
        progressed (a checkpoint started, finished or was dispatched) or left
        the stranded set in between."""
        if not self._hooks.stalled or not self._due_sweep("stalled", force):
            return 0
        await self._open()
        before = self._clock.now_ms() - self._options().stalled_after_ms
        reported = 0
        seen = self._hooks.stalled_seen
        current: dict[str, tuple[int, int]] = {}
        for run_id in await self._store.list_stalled(
            before, limit, namespace=self._options().namespace
        ):
            try:
                run = await self._store.get_run(run_id)
            except Exception as exc:
                self._pass_over("stalled", run_id, exc)
                continue
            if run is None or run.status in TERMINAL_STATUSES:
                continue
            episode = await self._episode(run)
            current[run_id] = episode
            if seen.get(run_id) == episode:
                continue  # this episode was reported already
            reported += 1
            for hook in self._hooks.stalled:
                await call_safely(hook, run)
        self._hooks.stalled_seen = current
        return reported

    async def _episode(self, run: Run) -> tuple[int, int]:
        """What marks a stranded run's episode: its latest progress. A
        reconcile turn bumps ``updated_at`` without progressing, so that
        counts only for a run no timer wakes."""
        progress = 0
        for cp in (await self._store.load_checkpoints(run.run_id)).values():
            for at in (cp.started_at, cp.finished_at, cp.dispatched_at):
                if at is not None and at > progress:
                    progress = at
        return progress, run.updated_at if run.wake_at is None else 0

    def _due_sweep(self, name: str, force: bool) -> bool:
        now = asyncio.get_running_loop().time()
        if not force and now - self._last_sweep.get(name, -1e9) < 60:
            return False
        self._last_sweep[name] = now
        return True

    async def _drain_backlog(
        self, phase: Callable[[], Awaitable[int]], done: int, full: int
    ) -> None:
        """Run more passes of a phase that claims rows (so each pass makes
        progress) while it keeps finding full batches and the executor's
        waiting list is short: a wave of 10,000 orphans or due timers then
        drains in seconds instead of one batch per poll interval."""
        for _ in range(_MAX_EXTRA_PASSES):
            executor = self._router.executor
            if done < full or executor is None or executor.waiting > _BACKLOG_LIMIT:
                return
            done = await phase()

    async def expire_own_leases(self) -> None:
        """Make the runs leased to this owner id reclaimable now: our previous
        incarnation's turns died with it, and no one else can hold our id."""
        now = self._clock.now_ms()
        owner = self._owner()
        page = await self._store.list_runs(RunQuery(status=RunStatus.RUNNING, limit=1000))
        for run in page.runs:
            if run.locked_by == owner:
                await self._store.update_run_if(
                    run.run_id, frozenset({RunStatus.RUNNING}), {"locked_until": 0}, now
                )

    # -- the loop -------------------------------------------------------------------------

    @property
    def looping(self) -> bool:
        """Whether the worker loop runs."""
        return self._loop_task is not None

    def start(self) -> None:
        """Start the worker loop (once)."""
        if self._loop_task is None:
            self._loop_wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._worker_loop(), name="durably-worker")

    async def stop(self) -> None:
        """Stop the worker loop and any pending-run poll, and wait for the loop to end."""
        poll, self._pending_poll = self._pending_poll, None
        if poll is not None:
            poll.cancel()
        task, self._loop_task = self._loop_task, None
        if task is not None:
            # A client library may swallow a cancellation (redis-py inside a
            # SCAN a phase makes): the loop then carries on and a single cancel
            # would leave the close waiting forever. Ask again until it ends;
            # the loop also sees the task is gone at its next iteration.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            await asyncio.gather(task, return_exceptions=True)

    async def _worker_loop(self) -> None:
        wake = self._loop_wake
        assert wake is not None
        me = asyncio.current_task()
        loop = asyncio.get_running_loop()
        poll_at = -math.inf
        while self._loop_task is me:
            # While the tick runs, a hint (``timer_set``) can only bring the
            # next tick forward from "not planned yet"; the plan made after
            # the tick folds it in.
            self._tick_at = math.inf
            started = self._clock.now_ms()
            self.ticks += 1
            if loop.time() >= poll_at:
                poll_at = loop.time() + self._options().poll_interval
                await self.tick()
            else:
                # Woken for a timer between polls: only the timer phase. The
                # other phases keep the poll's pace, so timers due every few
                # ms cost a claim each, not every sweep each.
                await self._timer_tick()
            due_in = await self._next_timer(started)
            if self._reclaim_wait is not None:
                due_in = min(self._reclaim_wait, math.inf if due_in is None else due_in)
            planned = poll_at if due_in is None else min(poll_at, loop.time() + due_in)
            self._tick_at = min(self._tick_at, planned)
            # Wait for the planned tick; a hint moving it earlier sets the
            # event, and the wait starts over towards the new time.
            while self._loop_task is me:
                wake.clear()
                left = self._tick_at - loop.time()
                if left <= 0:
                    break
                await wait_event(wake, left)

    async def _timer_tick(self) -> None:
        """Wake the due timers (and drain a backlog of them), as a tick's
        timer phase does."""
        if self._store_gone():
            return
        name = "worker phase resume_due_timers"
        try:
            done = await self.resume_due_timers()
            await self._drain_backlog(
                self.resume_due_timers, done, self._options().timer_batch_size
            )
        except Exception as exc:
            self._failures.failed(name, exc)
        else:
            self._failures.succeeded(name)

    async def _next_timer(self, started: int) -> float | None:
        """Seconds until the next timer of a suspended run this worker could
        wake falls due (``None``: none known; the poll stays the net).

        Only timers later than ``started`` (the tick's own clock reading)
        count: one due by then was the tick's to claim, and if it could not
        (another instance holds it, its wake moved to that lease's end) the
        poll takes it up. So a due run never makes the loop spin, and the
        wait is never under ``_MIN_WAIT``."""
        if self._gone is not None or not self._options().drives:
            return None
        try:
            due = await self._store.next_wake_at(
                started, namespace=self._options().namespace, workflows=self._executable()
            )
        except Exception as exc:
            self._failures.failed("worker next wake", exc)
            return None
        self._failures.succeeded("worker next wake")
        if due is None:
            return None
        return max(_MIN_WAIT, (due - self._clock.now_ms()) / 1000)

    def timer_set(self, wake_at: int) -> None:
        """A turn here suspended its run until ``wake_at`` (engine clock, ms):
        if that comes before the next planned tick, plan the tick for then
        (no store call; the poll after each tick finds other processes'
        timers). Never sooner than ``_MIN_WAIT`` from now."""
        wake = self._loop_wake
        if self._loop_task is None or wake is None:
            return
        delay = max(_MIN_WAIT, (wake_at - self._clock.now_ms()) / 1000)
        at = asyncio.get_running_loop().time() + delay
        if at < self._tick_at:
            self._tick_at = at
            wake.set()

    def executor_has_room(self) -> None:
        """A run ended and nothing waits for a slot here. If the last poll
        found a full page, poll again now instead of at the next tick: a
        backlog of 10,000 pending runs (the survivors of a crashed process)
        then drains at the executor's pace, not 1,000 runs per poll interval.
        Asked on every such end while the flag holds (one poll in flight at
        a time): a page whose runs were all still starting here hands
        nothing over, and the next end must ask again."""
        if self._more_pending:
            self._schedule_pending_poll()

    def _schedule_pending_poll(self) -> None:
        """One pending-run poll soon, however many ask for it meanwhile."""
        if self._loop_task is None or self._router.draining or self._router.run_queue is not None:
            return
        if self._pending_poll is None or self._pending_poll.done():
            self._pending_poll = asyncio.get_running_loop().create_task(self._poll_pending_soon())
        else:
            # The poll in flight may have read its page already: a run this
            # ask is about would be missed until the next regular poll.
            self._pending_again = True

    async def _poll_pending_soon(self) -> None:
        await asyncio.sleep(0.005)
        while True:
            self._pending_again = False
            try:
                await self.run_pending()
            except Exception as exc:
                self._failures.failed("worker phase run_pending", exc)
                return  # the regular poll retries; no loop against a failing store
            if not self._pending_again:
                return

    def heard_cancel(self, run_ids: Collection[str]) -> None:
        """The transport's cancel notice (Redis pub/sub; PostgreSQL ``NOTIFY``
        on ``db://``): the same as the store's "ended" notice, for stores whose
        notices do not cross processes (SQLite) or arrive later."""
        for run_id in run_ids:
            self.on_store_event(StoreNotice.ENDED, run_id)

    def on_store_event(self, kind: str, run_id: str) -> None:
        """React to another process's change, as the store reports it."""
        if not run_id and kind != "pending":
            # A notice for an id too long to carry (stored before ids were
            # bounded): the run is found by polling, as any missed notice is.
            return
        router = self._router
        if kind == StoreNotice.SETTLED:
            if router.runs_here(run_id):
                # Most likely our own settle, heard before its batch answered:
                # that answer hands the outcome over, and a read now would only
                # delay the waiter (the poll stays the net should it not be ours).
                return
            router.notify(run_id)
        elif kind == StoreNotice.ENDED:
            turn = router.active.get(run_id)
            if turn is not None:
                turn.close(CloseReason.CANCELLED)
            router.notify(run_id)
        elif (
            kind == StoreNotice.PENDING
            and self._loop_task is not None
            and not router.draining
            and router.run_queue is None  # the queue's own notices wake its consumers
        ):
            if run_id in router.starting or (run_id and router.runs_here(run_id)):
                return  # our own start, dispatched here
            # Only the pending-run poll, once for a burst of notifications
            # (our own starts notify us too, and we dispatched those already).
            self._schedule_pending_poll()
        elif kind == StoreNotice.WAKE and run_id in router.active:
            # Held here across a step, maybe settled by another instance.
            self.wake_heard(run_id)
        elif (
            kind == StoreNotice.WAKE
            and router.executor is not None
            and run_id not in router.active
            and router.run_queue is None  # the waker queued the run itself
        ):
            # Poll semantics: if another process holds the run, the stamp that
            # sent this is already on it; stamping again would ping-pong.
            router.submit_here(run_id)


def _short(run_id: str) -> str:
    """A run id for a log line: an over-long one (stored before ids were
    bounded) would otherwise fill it."""
    return run_id if len(run_id) <= 300 else f"{run_id[:300]}… ({len(run_id)} characters)"
