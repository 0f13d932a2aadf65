"""RunRouter: where a run's next turn happens.

A run that must take a turn goes to one of three places: the run queue, when
the transport carries one (any driving instance of its pool takes it); this
process's executor; or, when nobody here will run it, a wake stamp on the
run's row that the next poll (here or elsewhere) finds. Every path that gives
a run a turn (a start, a wake, a recovered orphan, a due timer, a child)
asks the router, so that choice is made in one place.

The router also holds what that choice depends on: the executor and run
queue (created when the engine opens), whether the engine is draining, and
the turns executing in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ._logs import engine_logger
from .model import RunStatus
from .stores.base import RunStore, TurnStore

if TYPE_CHECKING:
    from ._executor import RunExecutor
    from ._options import EngineOptions
    from ._replay import Turn
    from ._run_queue import RunQueue
    from ._watch import RunWatcher
    from .clock import Clock
    from .model import Checkpoint, Run, RunResult

__all__ = ["RunRouter"]

_log = engine_logger("durably")


class _Store(RunStore, TurnStore, Protocol):
    """The slice of the store a router uses: inserting runs, waking and releasing them."""


class RunRouter:
    """Hands runs to the run queue, the executor here, or a wake stamp."""

    def __init__(
        self,
        store: _Store,
        clock: Clock,
        watcher: RunWatcher,
        options: Callable[[], EngineOptions],
    ) -> None:
        self._store = store
        self._clock = clock
        self._watcher = watcher
        self._options = options
        self.worker_looping: Callable[[], bool] = lambda: False
        """Whether the worker loop runs here. Only then may a start insert its
        run leased to this process: a script that only calls ``start`` and
        exits would hold the run for a whole lease, and the first turn it
        skipped would count as a recovery."""
        self._warned_idle = False
        self.executor: RunExecutor | None = None
        """Executes turns here; created when the engine opens."""
        self.run_queue: RunQueue | None = None
        """The fleet's run queue, when the transport carries one (set while open)."""
        self.draining = False
        """The engine stopped taking work (``drain``/``close``)."""
        self.active: dict[str, Turn] = {}
        """The turns executing in this process, by run id."""
        self.preleased: dict[str, Run] = {}
        """Runs a start inserted already leased to us, awaiting their first turn."""
        self.driving: set[str] = set()
        """Runs whose turns this process drives now, from lease to the last settle."""
        self.rewake: set[str] = set()
        """Runs driven here that a step result (its wake stamped with it) woke
        while they were: their driver takes one more turn if its settle did
        not already (see :meth:`resume`)."""
        self.resumed: dict[str, tuple[Run, dict[int, Checkpoint]]] = {}
        """Runs leased to us with their histories by the settle of their step
        results (``resolve_and_lease``), awaiting that turn."""
        self.starting: set[str] = set()
        """Runs a start here is inserting (their own notice must not cost a poll)."""
        self.promised_slots = 0
        """Starts inserting a run leased to us whose insert has not returned yet."""

    @property
    def accepting(self) -> bool:
        """Whether this process takes turns now (it drives runs and is not draining)."""
        return self._options().drives and not self.draining

    def runs_here(self, run_id: str) -> bool:
        """Whether ``run_id`` is executing or waiting in this process's executor."""
        return self.executor is not None and self.executor.knows(run_id)

    def forget(self, run_id: str) -> None:
        """Drop what ``run_id`` settled before: a new turn makes it stale."""
        self._watcher.forget(run_id)

    def route(
        self, run_id: str, *, namespace: str | None = None, priority: int = 0, wake: bool = False
    ) -> None:
        """Give ``run_id`` a turn: through the run queue when the transport
        carries one (any driving instance takes it), else here. With ``wake``,
        the turn is owed even if the run is executing now (see ``submit``)."""
        self._watcher.forget(run_id)  # what it settled before is no longer current
        if self.run_queue is not None:
            # Even while draining: a drain stops consuming, not producing (a
            # child created by a turn finishing now must reach some instance).
            pool = namespace or self._options().namespace
            self.run_queue.submit(run_id, wake=wake, namespace=pool, priority=priority)
            return
        self.submit_here(run_id, wake=wake)

    def submit_here(self, run_id: str, *, wake: bool = False) -> None:
        """Queue a turn of ``run_id`` on this process's executor, if it takes turns."""
        self._watcher.forget(run_id)
        if self.accepting and self.executor is not None:
            self.executor.submit(run_id, wake=wake)

    async def insert(
        self, run: Run, owner: str, lease_ms: int, attributes: dict[str, Any] | None = None
    ) -> Run:
        """Store a new run and give it its first turn; return it as seen from outside.

        An id that exists already returns that run (routed again if still
        pending). With a free slot here, the run is inserted already leased to
        ``owner`` and its first turn starts without taking the lease (one round
        trip less on the latency path); with a run queue, only into a slot its
        consumer here lends (``RunQueue.lend``: the run never becomes a message,
        which saves its push, claim, delivery check and ack). A crash before
        that turn is recovered like any other (after the lease, or at once by a
        restart with the same instance_id).
        """
        now = run.created_at
        self._warn_if_no_worker_loop(run.run_id)
        lease_here = run.status is RunStatus.PENDING and self.has_free_slot()
        # With a run queue, only into a slot its consumer here lends (taken
        # last: it is given back once the run's turn here is over).
        lent = lease_here and self.run_queue is not None and self.run_queue.lend(run.namespace)
        lease_here = lease_here and (self.run_queue is None or lent)
        if lease_here:
            run.status = RunStatus.RUNNING
            run.locked_by, run.locked_until = owner, now + lease_ms
        # Our own "new run" notification may arrive before create_run
        # returns; it must not cost a pending-run poll.
        self.starting.add(run.run_id)
        try:
            # The slot is promised until the insert returns and the run is
            # submitted. Otherwise thousands of starts gathered at once all see
            # an idle executor and all insert their run leased while only a few
            # hundred can run: the rest wait here with their leases running
            # out, and look like orphans to every instance.
            if lease_here:
                self.promised_slots += 1
            try:
                # Without attributes, the one-argument call a wrapped or
                # older store also answers.
                stored, created = await (
                    self._store.create_run(run, attributes)
                    if attributes
                    else self._store.create_run(run)
                )
            except BaseException:
                if lent:
                    self._give_back()
                raise
            finally:
                if lease_here:
                    self.promised_slots -= 1
            if lent and not created:
                self._give_back()
            if created and lease_here:
                self.preleased[run.run_id] = stored
                if lent:
                    self._submit_lent(run.run_id)
                else:
                    self.submit_here(run.run_id)
                if run.run_id in self.preleased and not self.runs_here(run.run_id):
                    # Not taken after all (closing): hand it to whoever polls.
                    self.preleased.pop(run.run_id, None)
                    await self._store.release_run(run.run_id, owner, now)
                # Seen from outside it is a new run waiting for its first turn.
                return stored.replace(status=RunStatus.PENDING, locked_by=None, locked_until=None)
            if stored.status is RunStatus.PENDING:
                self.route(stored.run_id, namespace=stored.namespace, priority=stored.priority)
        finally:
            self.starting.discard(run.run_id)
        return stored

    def _give_back(self) -> None:
        if self.run_queue is not None:
            self.run_queue.give_back()

    def _submit_lent(self, run_id: str) -> None:
        """Run here a run born leased into a slot the run queue's consumer
        lent: the slot is given back when its execution ends, as a claimed
        message's would be (or at once if the executor does not take it)."""
        self._watcher.forget(run_id)
        if not self.accepting or self.executor is None:
            self._give_back()
            return

        def finished(_ok: bool) -> None:
            self._give_back()

        self.executor.submit(run_id, on_done=finished)

    def _warn_if_no_worker_loop(self, run_id: str) -> None:
        """Once per engine: a driving engine (``drive=True``, consumers not
        ``"never"``) whose worker loop does not run. Its runs execute here
        only while this process lives, and nothing here wakes their timers or
        recovers them: in a single process, ``async with engine`` (or
        ``start_worker``) was forgotten. A producer on purpose says so with
        ``drive=False`` (or ``consumers="never"``) and hears nothing."""
        if self._warned_idle or self.worker_looping() or not self._options().drives:
            return
        self._warned_idle = True
        _log.warning(
            "run %s was started, but no worker loop runs in this process: its turns run "
            "here only while the process lives, and its timers, retries and recovery wait "
            "for another process's worker. Use `async with engine:` (or `await "
            "engine.start_worker()`) where runs should execute; an engine that only starts "
            "runs should be created with drive=False.",
            run_id,
        )

    async def wake(self, run_id: str, *, namespace: str | None = None) -> None:
        """Make sure ``run_id`` takes a turn that sees what the caller just wrote."""
        if run_id in self.active:
            # Our own turn holds it: the stamp makes it run once more.
            await self._store.request_wake(run_id, self._clock.now_ms())
            return
        if self.run_queue is not None:
            # A wake can cross pools (a signal from another namespace's
            # process): unless the caller knows the run's pool, look it up.
            self.run_queue.submit(run_id, wake=True, namespace=namespace)
            return
        if not self.accepting:
            # Nobody here will run it: the stamp makes it due for whoever polls.
            await self._store.request_wake(run_id, self._clock.now_ms())
            return
        self.submit_here(run_id, wake=True)

    async def resume(self, run_id: str, stamped: bool = False) -> None:
        """A step result for ``run_id`` was settled here: its next turn runs
        here when this instance takes turns (results are already spread over
        the instances by their own queue; a second hop through the run queue
        would add a queue round trip to every step), else as :meth:`wake`.

        ``stamped``: the settle stamped the run's wake in its transaction. If
        this process drives the run now, that is all it needs: a settle after
        the stamp sees it and takes another turn, and a settle that came
        first is followed by one more lease (:attr:`rewake`). A stamp again,
        or a lease attempt against our own lease, would only cost round trips."""
        if stamped and run_id in self.driving:
            self.rewake.add(run_id)
            return
        if run_id in self.active or not self.accepting or self.executor is None:
            await self.wake(run_id)
            return
        self.submit_here(run_id, wake=True)

    def free_slots(self) -> int:
        """How many more turns could start here at once (0 when this process
        takes no turns): how many woken runs a results batch may lease here."""
        executor = self.executor
        if not self.accepting or executor is None:
            return 0
        # Holding turns lent their slots; those taking theirs back need them.
        taken = (
            executor.working
            + executor.reclaiming
            + executor.waiting
            + self.promised_slots
            + len(self.resumed)
        )
        return max(0, self._options().max_concurrent_runs - taken)

    async def resume_leased(self, run: Run, checkpoints: dict[int, Checkpoint], owner: str) -> None:
        """Take the turn of ``run``, leased to ``owner`` (us) with its history by
        the settle of a step result; if this process will not run it after
        all (closing), hand it back as pending for whoever polls."""
        run_id = run.run_id
        self.resumed[run_id] = (run, checkpoints)
        # As a wake: an execution of this run already under way here (one
        # trying to lease it) is followed by one more, which takes this lease.
        self.submit_here(run_id, wake=True)
        if run_id in self.resumed and not self.runs_here(run_id):
            self.resumed.pop(run_id, None)
            await self._store.release_run(run_id, owner, self._clock.now_ms())

    async def run_from_queue(self, run_id: str, wake: bool) -> bool:
        """Execute a queued run here; ``False`` asks the queue to hand its
        message back (this instance is draining) instead of acking it."""
        if self.executor is None or self.draining:
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def finished(ok: bool) -> None:
            if not done.done():
                done.set_result(ok)

        self.executor.submit(run_id, wake=wake, on_done=finished)
        executed: bool = await done
        if not executed and not self.draining:
            # The execution raised (a store error, say): hand the message back
            # for a later delivery rather than ack a run that took no turn.
            raise RuntimeError(f"run {run_id} could not be executed")
        return executed and not self.draining

    async def runs_of(self, run_ids: list[str]) -> dict[str, Run]:
        """The stored runs of ``run_ids`` (their pools and pending states, for the run queue)."""
        return {run.run_id: run for run in await self._store.get_runs(run_ids)}

    async def enqueue_failed(self, run_id: str, wake: bool) -> None:
        """A run could not be queued: a start stays pending for the poll; a
        wake runs here, or is stamped on the run for the timer poll."""
        if not wake:
            return
        if self.accepting and self.executor is not None:
            self.executor.submit(run_id, wake=True)
        else:
            await self._store.request_wake(run_id, self._clock.now_ms())

    def has_free_slot(self) -> bool:
        """Whether a new run's first turn could start here at once."""
        executor = self.executor
        return (
            self.accepting
            and self.worker_looping()
            and executor is not None
            and executor.waiting == 0
            and executor.working + executor.reclaiming + self.promised_slots
            < self._options().max_concurrent_runs
        )

    def notify(self, run_id: str, result: RunResult | None = None) -> None:
        """Wake ``wait_for_run`` callers: with the outcome of a turn settled
        here, or (``None``) by having them look at the run now."""
        if result is not None:
            self._watcher.settled(result)
        else:
            self._watcher.changed(run_id)
