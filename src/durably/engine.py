"""The Engine: the registry, the client API, turn orchestration and the worker loop.

An application holds one ``Engine``. Client calls (``start``, ``signal``,
``cancel``, ``wait_for_run``…) only read and write the store and hand run ids
to the in-process executor; a *turn* leases a run, replays its body against
one checkpoint snapshot (:mod:`durably.replay`), writes the outcome and
releases the lease in one compare-and-set. The worker loop (``async with
engine:`` or ``durably worker``) runs the periodic phases that keep every run
moving: pending runs, orphan recovery, due timers, execution timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

from . import codec
from ._aio import wait_event
from ._batch import BatchCall
from ._dispatch import FlowQueue, StepDispatcher
from ._executor import RunExecutor
from ._run_queue import RunQueue
from ._step_runtime import StepServer
from ._threads import StepThreads
from ._watch import RunWatcher
from .clock import Clock, SystemClock
from .context import ChildCall, WorkflowContext, _Services
from .durations import Duration, to_ms
from .errors import DurablyError, SchemaValidationError, WorkflowNotRegistered, _TurnClosed
from .events import EventRouter
from .hooks import EvictHook, Handler, Hooks, StalledHook, call_safely, handler_input
from .model import (
    TERMINAL_STATUSES,
    Checkpoint,
    CheckpointStatus,
    ErrorInfo,
    Run,
    RunResult,
    RunStatus,
)
from .registry import Registry, WorkflowDef, takes_input
from .replay import Turn, TurnEnd, TurnOutcome, error_info
from .retry import RetryPolicy
from .schedules import Overlap, Schedule, Scheduler, ScheduleSpec
from .steps import StepDefinition, StepRef, takes_logger
from .stores import RunChanges, RunPage, RunQuery, SettleResult, StateStore, open_store
from .stores.base import Resolution
from .transports import Transport, open_transport
from .transports.base import RunCarrier
from .wire import StepTask, routing_token

__all__ = ["Engine", "RunNotFound"]

Consumers = Literal["auto", "always", "never"]
F = TypeVar("F", bound=Callable[..., Any])

_log = logging.getLogger("durably")
_WAKEABLE = frozenset({RunStatus.PENDING, RunStatus.SUSPENDED})
_SETTLED = frozenset({*TERMINAL_STATUSES, RunStatus.SUSPENDED, RunStatus.BLOCKED})
_RECOVERY_BATCH = 500
_MAX_EXTRA_PASSES = 20
_BACKLOG_LIMIT = 10_000
_LIVE = frozenset({RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.BLOCKED})
_Leased = tuple[Run, dict[int, Checkpoint]]
_CONTINUATION = re.compile(r"^(.*)~(\d+)$")


class RunNotFound(DurablyError, LookupError):
    """No run has the given id."""

    code = "run_not_found"


class Engine:
    """A durable-execution engine embedded in this process.

    Args:
        store: a store URL (``sqlite:///durably.db``, ``memory://``,
            ``postgresql://…``) or a store object. Defaults to the
            ``DURABLY_DATABASE_URL`` environment variable, else ``./durably.db``.
        namespace: the pool this engine's runs belong to; an engine given a
            namespace executes only that pool's runs, one without (runs go to
            ``"default"``) drives every pool sharing the database.
        lease: how long a turn's lease lasts without renewal (renewed every half).
        reconcile: the fallback wake of a run waiting on someone else (a
            signal), so a wake lost to a crash cannot strand it. ``0`` disables.
        max_recovery_attempts: crash recoveries of one run before it is ``dead``.
        max_concurrent_runs: turns executing at once in this process.
        poll_interval: seconds between worker-loop ticks.
        timer_batch_size: due timers loaded per tick.
        track_start: write a ``running`` checkpoint before each local step.
        drive: execute runs in this process; ``False`` only creates them.
        instance_id: this process's lease owner id. Give a stable, unique id
            (e.g. a pod name) and a restarted process reclaims the runs its
            previous incarnation held at once, instead of after the lease.
        clock: the time source (a :class:`durably.testing.VirtualClock` in tests).
        drain_timeout: seconds ``async with`` waits for turns on exit.
        step_threads: worker threads for synchronous step functions.
        retention: delete terminal runs this long after they ended (``None``
            keeps them); :meth:`on_evict` hooks may archive them first.
        stalled_after: how long a live run may make no progress before
            :meth:`on_stalled` hooks hear of it.
        transport: how dispatched steps (``ctx.step``) reach workers: a URL
            (``local://``, the default; ``memory://``; ``db://``, a message
            table in the store's database) or a transport object.
        consumers: ``"auto"`` (default): once :meth:`start_worker` runs, serve
            this engine's step handlers and settle step results here;
            ``"never"``: a pure producer that never executes steps;
            ``"always"``: consume even when only opened.
        step_concurrency: step handlers executing at once in this process.
        serve_groups / serve_steps: serve only the steps of these groups /
            with these names (``durably worker --group/--steps``).
        remote_redispatch: send a dispatched step's task again if no result
            came this long after it went out (a lost dispatch); ``None``
            (default) relies on the transport's own redelivery.
        remote_redispatch_max: re-sends before the step fails with code
            ``remote_step_lost``.
        heartbeat_persist_throttle: at most one heartbeat per step is written
            to the store per this window.
    """

    def __init__(
        self,
        store: str | StateStore | None = None,
        *,
        namespace: str | None = None,
        clock: Clock | None = None,
        lease: Duration = "30s",
        reconcile: Duration = "5m",
        max_recovery_attempts: int = 5,
        max_concurrent_runs: int = 256,
        poll_interval: float = 1.0,
        timer_batch_size: int = 500,
        track_start: bool = True,
        drive: bool = True,
        instance_id: str | None = None,
        drain_timeout: float = 10.0,
        step_threads: int = 32,
        retention: Duration | None = None,
        stalled_after: Duration = "1h",
        transport: str | Transport | None = None,
        consumers: Consumers = "auto",
        step_concurrency: int = 64,
        serve_groups: Sequence[str] | None = None,
        serve_steps: Sequence[str] | None = None,
        remote_redispatch: Duration | None = None,
        remote_redispatch_max: int = 3,
        heartbeat_persist_throttle: Duration = "10s",
    ) -> None:
        target = store if store is not None else os.environ.get("DURABLY_DATABASE_URL")
        self.store: StateStore = open_store(target or "sqlite:///durably.db")
        """The state store runs live in."""
        self.namespace = namespace or "default"
        """The pool this engine's new runs and schedules belong to."""
        self.drives_namespace = namespace
        """The namespace whose runs this engine executes; ``None``: every one."""
        """The pool this engine's runs belong to."""
        self.clock: Clock = clock or SystemClock()
        """The engine's time source."""
        self.instance_id = (
            instance_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        )
        """The lease owner id of this process."""
        self.lease_ms = to_ms(lease, name="lease")
        if self.lease_ms < 100:
            raise ValueError("lease must be at least 100ms")
        self.reconcile_ms = to_ms(reconcile, name="reconcile")
        if max_recovery_attempts < 0 or max_concurrent_runs < 1 or timer_batch_size < 1:
            raise ValueError(
                "max_recovery_attempts must be >= 0, max_concurrent_runs and timer_batch_size >= 1"
            )
        self.max_recovery_attempts = max_recovery_attempts
        self.poll_interval = poll_interval
        self.timer_batch_size = timer_batch_size
        # A pure producer (consumers="never"): no turn, no step, no queued run lands here.
        self.drive = drive and consumers != "never"
        self.drain_timeout = drain_timeout
        self._stable_instance_id = instance_id is not None
        self.retention_ms = None if retention is None else to_ms(retention, name="retention")
        self.stalled_after_ms = to_ms(stalled_after, name="stalled_after")
        if consumers not in ("auto", "always", "never"):
            raise ValueError("consumers must be 'auto', 'always' or 'never'")
        if step_concurrency < 1 or remote_redispatch_max < 0:
            raise ValueError("step_concurrency must be >= 1 and remote_redispatch_max >= 0")
        self.consumers: Consumers = consumers
        self.step_concurrency = step_concurrency
        self.serve_groups = None if serve_groups is None else frozenset(serve_groups)
        self.serve_steps = None if serve_steps is None else frozenset(serve_steps)
        self.transport: Transport = open_transport(transport, self.store)
        """How dispatched steps reach workers."""
        self._consuming = False
        self._run_queue: RunQueue | None = None
        self._starting: set[str] = set()
        self._preleased: dict[str, Run] = {}
        self._promised_slots = 0
        """Starts inserting a run leased to us whose insert has not returned yet."""
        self._more_pending = False
        """The last pending-run poll found a full page: more runs may wait."""
        self._hooks = Hooks()
        self._last_sweep: dict[str, float] = {}
        self._registry = Registry()
        self._threads = StepThreads(step_threads)
        self._steps = StepDispatcher(
            self.store,
            self.transport,
            self.clock,
            self._wake,
            to_ms(heartbeat_persist_throttle, name="heartbeat_persist_throttle"),
        )
        self._step_server = StepServer(self.transport, self._threads, self._ended_runs)
        self._services = _Services(
            store=self.store,
            clock=self.clock,
            threads=self._threads,
            track_start=track_start,
            default_retry=RetryPolicy(),
            logger=logging.getLogger("durably.workflow"),
            spawn_children=self._spawn_children,
            cancel_runs=self._cancel_runs,
            steps=self._steps,
            redispatch_ms=(
                None
                if remote_redispatch is None
                else to_ms(remote_redispatch, name="remote_redispatch")
            ),
            redispatch_max=remote_redispatch_max,
        )
        self._executor: RunExecutor | None = None
        self._executor_limit = max_concurrent_runs
        self._active: dict[str, Turn] = {}
        self._watcher = RunWatcher(self.store.get_runs)
        # Children ending together tell their parents in shared transactions:
        # on PostgreSQL each report locks the parent's row, so 10,000 children
        # reporting one at a time queued behind that lock (fan-out profile:
        # 10,000 resolve_checkpoint calls at ~440 ms each in the pool's queue).
        self._parent_reports: BatchCall[Resolution, int | None] = BatchCall(
            lambda batch: self.store.resolve_checkpoints(batch, self.clock.now_ms())
        )
        # Turns starting together lease their runs in one statement: waking
        # 10,000 sleepers or running a fan's children was 10,000 start_turn
        # round trips queued for the pool (profiles: ~36% of the fan-out's
        # samples, 19,744 calls at 26 ms in the sleepers bench on PostgreSQL).
        self._turn_starts: BatchCall[str, _Leased | None] = BatchCall(self._start_turns, 256)
        self._opened = False
        self._open_lock: asyncio.Lock | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._loop_wake: asyncio.Event | None = None
        self._draining = False
        self._pending_poll: asyncio.Task[None] | None = None
        self._listening = False
        """Whether the store pushes other processes' changes (PostgreSQL)."""
        self._scheduler = Scheduler(self)
        self._events = EventRouter(self)

    # -- registration ---------------------------------------------------------------------

    def workflow(
        self,
        name: str,
        *,
        version: str = "1",
        input: Any = None,
        execution_timeout: Duration | None = None,
        schedule: str | Mapping[str, Any] | None = None,
        on_event: str | Sequence[str] | None = None,
    ) -> Callable[[F], F]:
        """Decorator registering ``async def fn(ctx, input)`` as workflow ``name``.

        ``input`` may be a pydantic model, a dataclass or any callable that
        converts/validates the input; ``start`` rejects invalid input before a
        run exists. ``execution_timeout`` cancels runs older than that.
        ``schedule`` declares a schedule named after the workflow: a cron
        expression (UTC), or a mapping of :meth:`schedule` options
        (``{"every": "15m"}``, ``{"cron": "0 9 * * 1-5", "tz": "Europe/Paris"}``).
        ``on_event`` starts a run (input: the payload) for every publish of
        that event name (or names); see :meth:`on_event`.
        """

        def decorate(fn: F) -> F:
            self.register(
                name, fn, version=version, input=input, execution_timeout=execution_timeout
            )
            if schedule is not None:
                options = {"cron": schedule} if isinstance(schedule, str) else dict(schedule)
                self.schedule(str(options.pop("name", name)), name, **options)
            if on_event is not None:
                self.on_event(on_event, name)
            return fn

        return decorate

    def register(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        version: str = "1",
        input: Any = None,
        execution_timeout: Duration | None = None,
    ) -> None:
        """Register ``fn`` as version ``version`` of workflow ``name``.

        Register several versions side by side during a breaking change: runs
        replay on the version they started with; new runs take the version
        registered last.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("a workflow needs a non-empty name")
        self._registry.add(
            WorkflowDef(
                name=name,
                version=str(version),
                fn=fn,
                input_type=input,
                execution_timeout_ms=(
                    None
                    if execution_timeout is None
                    else to_ms(execution_timeout, name="execution_timeout")
                ),
                takes_input=takes_input(fn),
            )
        )

    @property
    def workflows(self) -> list[str]:
        """Names of the registered workflows."""
        return self._registry.names()

    def on_dead(self, handler: Handler) -> None:
        """Call ``handler`` for every run that goes ``dead`` (crashed its
        executor too often). A workflow name is started as ``dlq:<run_id>``
        with the dead run's id, workflow, error and input."""
        self._hooks.dead.append(_check_handler(handler))

    def on_error(self, code: str, handler: Handler) -> None:
        """Route failed runs whose error ``code`` matches (``"*"``: any) to
        ``handler``. A workflow name is started as ``onerror:<code>:<run_id>``."""
        if not isinstance(code, str) or not code:
            raise ValueError("on_error needs an error code, or '*' for every failure")
        self._hooks.errors.setdefault(code, []).append(_check_handler(handler))

    def on_evict(self, hook: EvictHook) -> None:
        """Archive runs before retention deletes them: ``await hook(run,
        history)``; if it raises, the run is kept and offered again later."""
        if not callable(hook):
            raise TypeError("on_evict takes an async callable (run, history)")
        self._hooks.evict.append(hook)

    def on_stalled(self, hook: StalledHook) -> None:
        """Hear of live runs that made no progress for ``stalled_after``
        (pending or running that long, or a timer that long overdue), once
        per episode: a run that moves and stalls again is reported again."""
        if not callable(hook):
            raise TypeError("on_stalled takes an async callable (run)")
        self._hooks.stalled.append(hook)

    # -- lifecycle ------------------------------------------------------------------------

    def step(
        self,
        name: str,
        *,
        retries: int | None = None,
        backoff: str | None = None,
        backoff_base: Duration | None = None,
        backoff_max: Duration | None = None,
        jitter: bool | None = None,
        timeout: Duration | None = None,
        pickup_timeout: Duration | None = None,
        group: str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        input: Any = None,
        output: Any = None,
    ) -> Callable[[Callable[..., Any]], StepRef[Any]]:
        """Register a step handler served by ``name``; returns a :class:`StepRef`
        for ``ctx.step``.

        The handler takes ``(data)`` or ``(data, log: StepLogger)`` and may be
        sync (run in a thread) or async. ``input`` / ``output`` (a pydantic
        model or dataclass) are validated where the handler runs; a failure
        there is not retried. The other options are the defaults of every
        ``ctx.step`` call of it (see :meth:`WorkflowContext.step`); ``group``
        names the worker group that serves it (``durably worker --group``).
        """

        def decorate(fn: Callable[..., Any]) -> StepRef[Any]:
            return self.register_step(
                name,
                fn,
                retries=retries,
                backoff=backoff,
                backoff_base=backoff_base,
                backoff_max=backoff_max,
                jitter=jitter,
                timeout=timeout,
                pickup_timeout=pickup_timeout,
                group=group,
                queue=queue,
                priority=priority,
                input=input,
                output=output,
            )

        return decorate

    def register_step(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        retries: int | None = None,
        backoff: str | None = None,
        backoff_base: Duration | None = None,
        backoff_max: Duration | None = None,
        jitter: bool | None = None,
        timeout: Duration | None = None,
        pickup_timeout: Duration | None = None,
        group: str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        input: Any = None,
        output: Any = None,
    ) -> StepRef[Any]:
        """The non-decorator form of :meth:`step`."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError("a step needs a non-empty name")
        if not callable(fn):
            raise TypeError(f"step {name!r}: {fn!r} is not callable")
        if name in self._steps.definitions:
            raise ValueError(f"step {name!r} is already registered")
        definition = StepDefinition(
            name=name,
            fn=fn,
            retry=RetryPolicy.build(retries, backoff, backoff_base, backoff_max, jitter),
            timeout_ms=None if timeout is None else to_ms(timeout, name="step timeout"),
            pickup_timeout_ms=(
                None if pickup_timeout is None else to_ms(pickup_timeout, name="pickup timeout")
            ),
            group=group,
            queue=queue,
            priority=priority,
            input_model=input,
            output_model=output,
            takes_logger=takes_logger(fn),
        )
        self._steps.definitions[name] = definition
        return StepRef(definition)

    @property
    def steps(self) -> list[str]:
        """The names of the registered step handlers."""
        return sorted(self._steps.definitions)

    def register_queue(
        self,
        name: str,
        *,
        concurrency: int | None = None,
        rate: tuple[int, Duration] | None = None,
        retry: Duration = "1s",
    ) -> None:
        """Declare a flow-control queue for ``ctx.step(..., queue=name)``.

        ``concurrency`` caps the steps holding a slot at once and ``rate`` =
        ``(count, period)`` the admissions per period, across every process
        sharing the store (declare the queue identically in each). A step not
        admitted suspends durably and asks again after ``retry``; a freed
        slot wakes the next waiter early. A slot is held from dispatch until
        the step's result is settled or its run ends.
        """
        self._steps.queues[name] = FlowQueue.build(name, concurrency, rate, retry)

    @property
    def served_steps(self) -> list[str]:
        """The step handlers this engine serves (after ``serve_groups`` /
        ``serve_steps``; none with ``consumers="never"``)."""
        if self.consumers == "never":
            return []
        return sorted(d.name for d in self._served_tokens().values())

    def _served_tokens(self) -> dict[str, StepDefinition]:
        served: dict[str, StepDefinition] = {}
        for definition in self._steps.definitions.values():
            if self.serve_steps is not None and definition.name not in self.serve_steps:
                continue
            if self.serve_groups is not None and definition.group not in self.serve_groups:
                continue
            served[routing_token(definition.name, self.namespace)] = definition
        return served

    async def open(self) -> None:
        """Connect the store and migrate its schema (done lazily by every call)."""
        if self._opened:
            return
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self.is_open:  # another task opened it while we waited for the lock
                return
            await self.store.open()
            try:
                await self._scheduler.sync()  # upsert the schedules declared in code
            except BaseException:
                await self.store.close()
                raise
            self._executor = RunExecutor(
                self._execute, self._executor_limit, on_room=self._executor_has_room
            )
            self._opened = True
            self._listening = await self.store.subscribe(self._on_store_event)
            await self.transport.open()
            carrier = self.transport.run_queue() if isinstance(self.transport, RunCarrier) else None
            if carrier is not None:
                self._run_queue = RunQueue(
                    carrier,
                    self.instance_id,
                    self.lease_ms,
                    self._run_from_queue,
                    self._enqueue_failed,
                    self._namespaces_of,
                    capacity=self._executor_limit,
                )
            if self.consumers == "always":
                await self._start_consumers()
            if self._stable_instance_id:
                # Our previous incarnation's turns died with it; no one else can
                # hold our id, so reclaim its runs now rather than after the lease.
                await self._expire_own_leases()

    @property
    def listening(self) -> bool:
        """Whether the store pushes other processes' changes to this engine
        (PostgreSQL's LISTEN/NOTIFY); otherwise it learns of them by polling."""
        return self._listening

    @property
    def is_open(self) -> bool:
        """Whether the store is connected."""
        return self._opened

    async def close(self) -> None:
        """Drain, stop the worker loop and close the store."""
        if not self._opened:
            return
        await self.drain(self.drain_timeout)
        await self._watcher.close()
        if self._run_queue is not None:
            await self._run_queue.flush()
            self._run_queue = None
        await self.transport.close()
        self._consuming = False
        self._opened = False
        await self.store.close()
        self._threads.shutdown()

    async def __aenter__(self) -> Engine:
        await self.start_worker()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start_worker(self) -> None:
        """Open the engine and start the background worker loop (and, unless
        ``consumers="never"``, serve step handlers and settle step results)."""
        await self.open()
        if self.consumers != "never":
            await self._start_consumers()
        self._draining = False
        if self._executor is not None:
            self._executor.reopen()
        if self._run_queue is not None and self.drive and not self._run_queue.consuming:
            pools = None if self.drives_namespace is None else [self.drives_namespace]
            await self._run_queue.start(pools)
        if self._loop_task is None and self.drive:
            self._loop_wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._worker_loop(), name="durably-worker")

    async def _start_consumers(self) -> None:
        if self._consuming:
            return
        self._consuming = True
        await self.transport.consume_results(self._steps.on_results, self._steps.on_heartbeat)
        await self._step_server.start(self._served_tokens(), self.step_concurrency)

    async def drain(self, timeout: float | None = None) -> None:
        """Stop taking work, let running turns finish for up to ``timeout``
        seconds, then hand the runs still executing back as ``pending``.
        Step handlers stop taking tasks first; queued ones stay queued."""
        bound = self.drain_timeout if timeout is None else timeout
        if self._run_queue is not None:
            await self._run_queue.stop_claiming()
        await self._step_server.stop(bound)
        self._draining = True
        poll, self._pending_poll = self._pending_poll, None
        if poll is not None:
            poll.cancel()
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._executor is None:
            return
        still_running = await self._executor.close(bound)
        for turn in list(self._active.values()):
            turn.close("drain")
        for run_id in list(self._preleased):
            # Inserted leased to us but dropped before their first turn.
            self._preleased.pop(run_id, None)
            with contextlib.suppress(Exception):
                await self.store.release_run(run_id, self.instance_id, self.clock.now_ms())
        if still_running:
            await asyncio.wait(still_running, timeout=5.0)
        if self._run_queue is not None:
            await self._run_queue.hand_back()

    # -- client API -----------------------------------------------------------------------

    async def start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        start_at: datetime | Duration | None = None,
        tags: list[str] | None = None,
        priority: int = 0,
        version: str | None = None,
    ) -> Run:
        """Create a run and return at once; the body runs on an executor.

        Idempotent by ``run_id``: starting an id that exists returns that run
        (and re-dispatches it if still pending). ``start_at`` (an aware
        datetime, or a delay) creates the run suspended until then. Raises
        :class:`WorkflowNotRegistered` or :class:`SchemaValidationError`
        before anything is stored.
        """
        definition = self._registry.get(workflow, version)
        stored_input = definition.validate_input(input) if definition.takes_input else None
        if definition.takes_input is False and input is not None:
            raise SchemaValidationError(f"workflow {workflow!r} takes no input")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError("run_id must be a non-empty string")
        clean_tags = _check_tags(tags)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError("priority must be an int")
        await self.open()
        now = self.clock.now_ms()
        wake_at = _start_time(start_at, now)
        status = RunStatus.SUSPENDED if wake_at is not None and wake_at > now else RunStatus.PENDING
        # With a free slot here, the run is inserted already leased to this
        # process and its first turn starts without taking the lease (one
        # round trip less on the latency path). A crash before that turn is
        # recovered like any other (after the lease, or at once by a restart
        # with the same instance_id).
        lease_here = status is RunStatus.PENDING and self._has_free_slot()
        run = Run(
            run_id=run_id or _new_run_id(),
            workflow=definition.name,
            workflow_version=definition.version,
            status=status,
            input=stored_input,
            namespace=self.namespace,
            tags=clean_tags,
            priority=priority,
            wake_at=wake_at if status is RunStatus.SUSPENDED else None,
            deadline_at=(
                now + definition.execution_timeout_ms
                if definition.execution_timeout_ms is not None
                else None
            ),
            created_at=now,
            updated_at=now,
        )
        if lease_here:
            run.status = RunStatus.RUNNING
            run.locked_by, run.locked_until = self.instance_id, now + self.lease_ms
        # Our own "new run" notification may arrive before create_run
        # returns; it must not cost a pending-run poll.
        self._starting.add(run.run_id)
        try:
            # The slot is promised until the insert returns and the run is
            # submitted. Otherwise 10,000 starts gathered at once all see an
            # idle executor and all insert their run leased while only 256 can
            # run: the rest wait here with their leases running out, and look
            # like orphans to every instance (the recovery bench's victim left
            # ~9,000 of them).
            if lease_here:
                self._promised_slots += 1
            try:
                stored, created = await self.store.create_run(run)
            finally:
                if lease_here:
                    self._promised_slots -= 1
            if created and lease_here:
                self._preleased[run.run_id] = stored
                self._submit_here(run.run_id)
                if run.run_id in self._preleased and not (
                    self._executor is not None and self._executor.knows(run.run_id)
                ):
                    # Not taken after all (closing): hand it to whoever polls.
                    self._preleased.pop(run.run_id, None)
                    await self.store.release_run(run.run_id, self.instance_id, now)
                # Seen from outside it is a new run waiting for its first turn.
                return stored.replace(status=RunStatus.PENDING, locked_by=None, locked_until=None)
            if stored.status is RunStatus.PENDING:
                self._dispatch(stored.run_id, namespace=stored.namespace, priority=stored.priority)
        finally:
            self._starting.discard(run.run_id)
        return stored

    async def signal(self, token: str, payload: Any = None) -> str | None:
        """Deliver ``payload`` to the run waiting on ``token``.

        Returns the id of the run that received it and is being woken, or
        ``None`` when no run waits yet: then the signal is buffered and the
        first ``wait_for_signal(token)`` consumes it.
        """
        if not isinstance(token, str) or not token:
            raise ValueError("a signal token must be a non-empty string")
        try:
            codec.dumps(payload)
        except (TypeError, ValueError) as exc:
            raise SchemaValidationError(f"signal payload cannot be stored as JSON: {exc}") from exc
        await self.open()
        run_id = await self.store.send_signal(token, payload, self.clock.now_ms())
        if run_id is not None:
            await self._wake(run_id)
        return run_id

    async def cancel(self, run_id: str, *, compensate: bool = False) -> RunStatus:
        """Cancel a run and, recursively, its live children; return the run's
        status from before the call.

        A terminal run is left alone (its status is returned). A turn running
        in this process stops at its next ``ctx`` call; one running elsewhere
        is fenced when it next writes or renews its lease. A waiting parent
        hears of it as a failed child.

        With ``compensate=True`` the cancel is recorded on the run (it
        survives crashes) and the run takes one more turn that replays its
        history without executing anything new, runs the undos of its
        completed saga steps in reverse order, and only then becomes
        ``cancelled``.
        """
        await self.open()
        run = await self._require(run_id)
        if compensate:
            if run.status in TERMINAL_STATUSES:
                return run.status
            if await self.store.update_run_if(
                run_id, _LIVE, {"cancel_requested": "compensate"}, self.clock.now_ms()
            ):
                turn = self._active.get(run_id)
                if turn is not None:
                    turn.close("unwind")
                else:
                    await self._wake(run_id)
            return run.status
        while run.status not in TERMINAL_STATUSES:
            error = {"message": "cancelled", "code": "cancelled", "type": "RunCancelled"}
            if await self._set_terminal(run, RunStatus.CANCELLED, error):
                await self._cancel_children(run_id)
                await self._after_end(run_id, cancelled=True)
                return run.status
            run = await self._require(run_id)
        return run.status

    async def retry(self, run_id: str) -> Run:
        """Run a failed or dead run again from where it failed.

        Failed checkpoints are cleared (so those steps, waits and children run
        again; failed or dead children are retried too), the stored error is
        cleared, and the run goes back to ``pending``. Completed steps are not
        re-executed.
        """
        await self.open()
        run = await self._require(run_id)
        retryable = frozenset({RunStatus.FAILED, RunStatus.DEAD})
        if run.status not in retryable:
            raise DurablyError(f"run {run_id!r} is {run.status}; only failed or dead runs retry")
        history = await self.store.load_checkpoints(run_id)
        stale = [
            cp.seq
            for cp in history.values()
            if cp.status is not CheckpointStatus.COMPLETED or cp.seq < 0
        ]
        for cp in history.values():
            if cp.kind == "child" and cp.status is CheckpointStatus.FAILED:
                child_id = cp.input.get("run_id") if isinstance(cp.input, dict) else None
                child = await self.store.get_run(str(child_id)) if child_id else None
                if child is not None and child.status in retryable:
                    await self.retry(child.run_id)
        await self.store.delete_checkpoints(run_id, stale)
        if not await self.store.update_run_if(
            run_id,
            retryable,
            {
                "status": RunStatus.PENDING.value,
                "error": None,
                "output": None,
                "wake_at": None,
                "recovery_attempts": 0,
                "cancel_requested": None,
            },
            self.clock.now_ms(),
        ):
            raise DurablyError(f"run {run_id!r} changed while being retried; try again")
        self._dispatch(run_id, namespace=run.namespace, priority=run.priority)
        return await self._require(run_id)

    async def retry_with_input(
        self, run_id: str, input: Any, *, new_run_id: str | None = None
    ) -> Run:
        """Start a fresh run of the same workflow (latest version, same tags
        and priority) with corrected ``input``; the original stays as it is.
        The new id defaults to ``<run_id>~retry~<8 hex>``."""
        await self.open()
        run = await self._require(run_id)
        return await self.start(
            run.workflow,
            input,
            run_id=new_run_id or f"{run_id}~retry~{uuid.uuid4().hex[:8]}",
            tags=run.tags,
            priority=run.priority,
        )

    async def wait_for_run(
        self, run_id: str, *, terminal: bool = False, timeout: float | None = None
    ) -> RunResult:
        """Wait until the run settles and return its :class:`RunResult`.

        Settled means terminal or suspended; with ``terminal=True`` only a
        terminal status counts. Never raises for a failed run. ``timeout``
        (seconds) raises :class:`TimeoutError` and leaves the run alone.
        """
        await self.open()
        statuses = TERMINAL_STATUSES if terminal else _SETTLED
        if self._executor is not None and self._executor.knows(run_id):
            # It executes here: its settle hands the outcome over, no read needed.
            return await self._watcher.wait_local(run_id, statuses, timeout)
        return await self._watcher.wait(await self._require(run_id), statuses, timeout)

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        await self.open()
        return await self.store.get_run(run_id)

    async def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        tag: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Runs newest first, filtered; pass ``page.next_cursor`` for the next page."""
        if not 1 <= limit <= 1000:
            raise ValueError("limit must be between 1 and 1000")
        await self.open()
        query = RunQuery(
            status=RunStatus(status) if status is not None else None,
            workflow=workflow,
            tag=tag,
            limit=limit,
            cursor=cursor,
        )
        return await self.store.list_runs(query)

    async def history(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints in seq order: its step timeline."""
        await self.open()
        await self._require(run_id)
        return list((await self.store.load_checkpoints(run_id)).values())

    async def delete_run(self, run_id: str) -> bool:
        """Delete a terminal run and its history; ``False`` if it did not exist."""
        await self.open()
        run = await self.store.get_run(run_id)
        if run is None:
            return False
        if run.status not in TERMINAL_STATUSES:
            raise DurablyError(f"run {run_id!r} is {run.status}; cancel it before deleting it")
        return await self.store.delete_run(run_id)

    # -- schedules (durably.schedules) ----------------------------------------------------

    def schedule(
        self,
        name: str,
        workflow: str,
        *,
        cron: str | None = None,
        every: Duration | None = None,
        tz: str | None = None,
        input: Any = None,
        overlap: Overlap = "skip",
        catchup: bool = False,
        paused: bool = False,
    ) -> None:
        """Declare schedule ``name``: start ``workflow`` with ``input`` on every
        window of ``cron`` (five fields, in IANA time zone ``tz``, default UTC)
        or ``every`` interval (``"15m"``; windows at multiples since the epoch).

        Stored when the engine opens and fired by the worker loop of every
        engine on the store, once per window (run id ``sched:<name>:<ms>``).
        ``overlap``: ``"skip"`` a window while the previous run is live,
        ``"allow"`` it, or ``"cancel_previous"``. After downtime only the most
        recent missed window fires, unless ``catchup=True`` (every missed
        window, oldest first). ``paused`` is the state the schedule is created
        in; later pauses and resumes persist across restarts.
        """
        spec = ScheduleSpec.build(
            workflow, cron=cron, every=every, tz=tz, input=input, overlap=overlap, catchup=catchup
        )
        self._scheduler.declare(name, spec, paused=paused)

    async def add_schedule(
        self,
        name: str,
        workflow: str,
        *,
        cron: str | None = None,
        every: Duration | None = None,
        tz: str | None = None,
        input: Any = None,
        overlap: Overlap = "skip",
        catchup: bool = False,
        paused: bool = False,
    ) -> Schedule:
        """Create (or replace) a schedule at runtime, persisted in the store;
        options as :meth:`schedule`. The workflow must be registered here."""
        spec = ScheduleSpec.build(
            workflow,
            cron=cron,
            every=every,
            tz=tz,
            input=input,
            overlap=overlap,
            catchup=catchup,
            source="runtime",
        )
        await self.open()
        return await self._scheduler.add(name, spec, paused=paused)

    async def remove_schedule(self, name: str) -> bool:
        """Delete a schedule; ``False`` if there was none. Runs it started are
        left alone; a schedule declared in code returns at the next start."""
        await self.open()
        return await self._scheduler.remove(name)

    async def get_schedule(self, name: str) -> Schedule | None:
        """A schedule with its state, or ``None``."""
        await self.open()
        return await self._scheduler.get(name)

    async def list_schedules(self) -> list[Schedule]:
        """This namespace's schedules with their state, by name."""
        await self.open()
        return await self._scheduler.list_all()

    async def pause_schedule(self, name: str) -> Schedule:
        """Stop firing ``name`` (for every engine, across restarts) until resumed.
        Raises :class:`durably.ScheduleNotFound`."""
        await self.open()
        return await self._scheduler.pause(name)

    async def resume_schedule(self, name: str) -> Schedule:
        """Fire ``name`` again from its next window after now; windows missed
        while paused are not fired. Raises :class:`durably.ScheduleNotFound`."""
        await self.open()
        return await self._scheduler.resume(name)

    async def trigger_schedule(self, name: str) -> str:
        """Start a run of schedule ``name`` now (id ``sched:<name>:manual:<ms>``),
        even while paused; return its run id. It counts as the schedule's
        previous run for its overlap policy. An engine without the workflow
        queues it for the next firing pass of one that has it."""
        await self.open()
        return await self._scheduler.trigger(name)

    async def fire_schedules(self) -> int:
        """Worker phase: start the runs of due schedule windows; return how many."""
        await self.open()
        if self._draining:
            return 0
        return await self._scheduler.fire()

    # -- events (durably.events) ------------------------------------------------------------

    def on_event(self, event: str | Sequence[str], workflow: str) -> None:
        """Start a run of ``workflow`` for every publish of ``event`` (or of
        each of several names), with the payload as input and the id
        ``evt:<event id>:<workflow>`` (so a publish with ``id=`` starts it once)."""
        self._events.add_trigger(event, workflow)

    async def publish_event(
        self, name: str, payload: Any = None, *, id: str | None = None, buffer: bool = True
    ) -> int:
        """Publish event ``name``; return how many runs received it.

        Every run in ``ctx.wait_for_event(name, match=…)`` whose match the
        payload satisfies receives it, and every ``on_event`` workflow starts a
        run. If nobody receives it, one copy is kept for the first matching
        wait (unless ``buffer=False``). With ``id`` the publish is idempotent:
        publishing the same id again delivers nothing and returns the first count.
        """
        return await self._events.publish(name, payload, event_id=id, buffer=buffer)

    async def signal_with_start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str,
        token: str,
        payload: Any = None,
        tags: list[str] | None = None,
        priority: int = 0,
    ) -> Run:
        """Start ``run_id`` unless it exists (idempotent, like :meth:`start`),
        then send it signal ``token`` with ``payload``; return the run.

        The signal is buffered until the run waits on ``token``, so entity and
        accumulator workflows can be fed without knowing whether they run yet.
        """
        if not isinstance(token, str) or not token:
            raise ValueError("a signal token must be a non-empty string")
        try:
            codec.dumps(payload)
        except (TypeError, ValueError) as exc:
            raise SchemaValidationError(f"signal payload cannot be stored as JSON: {exc}") from exc
        run = await self.start(workflow, input, run_id=run_id, tags=tags, priority=priority)
        await self.signal(token, payload)
        return run

    # -- worker primitives ----------------------------------------------------------------

    async def run_one(self, run_id: str) -> bool:
        """Lease and execute one turn of ``run_id`` now; ``False`` if it is not
        runnable here (leased elsewhere, terminal, or the engine is draining)."""
        await self.open()
        if self._draining:
            return False
        leased = await self._acquire(run_id, wake=True)
        if leased is None:
            return False
        await self._drive(*leased)
        return True

    async def run_pending(self, limit: int = 1000) -> int:
        """Hand pending runs to the executor; return how many.

        With a run queue this is only the safety net for a start whose
        enqueue failed: while the queue still holds runs for this engine's
        pools they will be delivered, so nothing is re-queued (re-queueing
        a backlog would only duplicate it).
        """
        await self.open()
        if self._run_queue is not None:
            now = asyncio.get_running_loop().time()
            if now - self._last_sweep.get("pending", -1e9) < 1.0:
                return 0
            self._last_sweep["pending"] = now
            if await self._run_queue.has_backlog():
                return 0
        ids = await self.store.list_pending(
            self.clock.now_ms(), limit, namespace=self.drives_namespace
        )
        self._more_pending = len(ids) >= limit and self._run_queue is None
        for run_id in ids:
            self._dispatch(run_id)
        return len(ids)

    async def recover_incomplete(self, limit: int = _RECOVERY_BATCH) -> int:
        """Reclaim runs whose executor died (lease expired while ``running``).

        Each recovery is counted; past ``max_recovery_attempts`` the run is
        ``dead``. Returns how many runs were reclaimed.
        """
        await self.open()
        now = self.clock.now_ms()
        orphans = await self.store.list_orphans(now, limit, namespace=self.drives_namespace)
        if not orphans:
            return 0
        # One conditional write for the page: a wave of 10,000 orphans costs
        # 20 statements, not 10,000 sequential round trips (the profile of the
        # recovery bench: 8,943 recover_orphan calls, 3.8 ms each, were the run).
        recovered = await self.store.recover_orphans(orphans, now, self.max_recovery_attempts)
        for run_id, status in recovered.items():
            if status is RunStatus.PENDING:
                _log.info("recovered orphaned run %s", run_id)
                self._dispatch(run_id)
            else:
                _log.warning("run %s crashed too often; it is now %s", run_id, status)
                self._notify(run_id)
                await self._after_end(run_id, cancelled=False)
                dead = await self.store.get_run(run_id)
                if dead is not None:
                    await self._report_to_parent(dead)
                    await self._after_failure(dead)
        return len(recovered)

    async def resume_due_timers(self) -> int:
        """Wake suspended runs whose timer is due: at most ``timer_batch_size``
        per call, most overdue first, walked in shuffled order, each claimed
        before it is woken so other instances do not wake it too."""
        await self.open()
        now = self.clock.now_ms()
        ids = await self.store.list_due(now, self.timer_batch_size, namespace=self.drives_namespace)
        if not ids:
            return 0
        # Shuffled so instances that loaded the same page hand their wins to
        # their executors in different orders; the claim of the whole page is
        # one conditional write (each run still claimed once, by one instance).
        random.shuffle(ids)
        claimed = set(await self.store.claim_due_batch(ids, now, now + self.lease_ms))
        for run_id in ids:
            if run_id in claimed:
                self._dispatch(run_id)
        return len(claimed)

    async def sweep_timeouts(self, limit: int = 100) -> int:
        """Cancel runs past their workflow's ``execution_timeout``."""
        await self.open()
        swept = 0
        for run_id in await self.store.list_expired(
            self.clock.now_ms(), limit, namespace=self.drives_namespace
        ):
            run = await self.store.get_run(run_id)
            if run is None or run.status in TERMINAL_STATUSES:
                continue
            error = {
                "message": "the run exceeded its execution timeout",
                "code": "execution_timeout",
                "type": "ExecutionTimeout",
            }
            if await self._set_terminal(run, RunStatus.CANCELLED, error):
                await self._cancel_children(run_id)
                swept += 1
        return swept

    async def sweep_retention(self, limit: int = 500, *, force: bool = False) -> int:
        """Delete terminal runs older than ``retention`` (at most one pass a
        minute unless ``force``), offering each to the ``on_evict`` hooks
        first; a run whose hook raises is kept. Returns how many were deleted."""
        if self.retention_ms is None or not self._due_sweep("retention", force):
            return 0
        await self.open()
        cutoff = self.clock.now_ms() - self.retention_ms
        deleted = 0
        for run_id in await self.store.list_finished_before(
            cutoff, limit, namespace=self.drives_namespace
        ):
            run = await self.store.get_run(run_id)
            if run is None or run.status not in TERMINAL_STATUSES:
                continue
            if self._hooks.evict:
                history = list((await self.store.load_checkpoints(run_id)).values())
                kept = False
                for hook in self._hooks.evict:
                    if not await call_safely(hook, run, history):
                        kept = True
                if kept:
                    continue
            if await self.store.delete_run(run_id):
                deleted += 1
        return deleted

    async def sweep_stalled(self, limit: int = 500, *, force: bool = False) -> int:
        """Report stalled runs to the ``on_stalled`` hooks (at most one pass a
        minute unless ``force``); returns how many were reported."""
        if not self._hooks.stalled or not self._due_sweep("stalled", force):
            return 0
        await self.open()
        before = self.clock.now_ms() - self.stalled_after_ms
        reported = 0
        seen = self._hooks.stalled_seen
        current: dict[str, int] = {}
        for run_id in await self.store.list_stalled(before, limit, namespace=self.drives_namespace):
            run = await self.store.get_run(run_id)
            if run is None or run.status in TERMINAL_STATUSES:
                continue
            current[run_id] = run.updated_at
            if seen.get(run_id) == run.updated_at:
                continue  # this episode was reported already
            reported += 1
            for hook in self._hooks.stalled:
                await call_safely(hook, run)
        self._hooks.stalled_seen = current
        return reported

    def _due_sweep(self, name: str, force: bool) -> bool:
        now = asyncio.get_running_loop().time()
        if not force and now - self._last_sweep.get(name, -1e9) < 60:
            return False
        self._last_sweep[name] = now
        return True

    async def _after_failure(self, run: Run) -> None:
        """Route a run that just became failed or dead to its handlers."""
        if run.status is RunStatus.DEAD:
            handlers = self._hooks.dead
            handler_id = f"dlq:{run.run_id}"
        elif run.status is RunStatus.FAILED:
            code = (run.error or {}).get("code")
            handlers = self._hooks.error_handlers(code)
            handler_id = f"onerror:{code}:{run.run_id}"
        else:
            return
        for handler in handlers:
            if isinstance(handler, str):
                try:
                    await self.start(handler, handler_input(run), run_id=handler_id)
                except Exception:
                    _log.exception("could not start handler %s for run %s", handler, run.run_id)
            else:
                await call_safely(handler, run)

    async def tick(self) -> None:
        """One pass of every worker phase; a failing phase never stops the others."""
        for phase in (
            self.recover_incomplete,
            self.resume_due_timers,
            self.run_pending,
            self.sweep_timeouts,
            self.fire_schedules,
            self.sweep_retention,
            self.sweep_stalled,
        ):
            try:
                done = await phase()
                if phase in (self.recover_incomplete, self.resume_due_timers):
                    await self._drain_backlog(phase, done)
            except Exception:
                _log.exception("worker phase %s failed", phase.__name__)

    async def _drain_backlog(self, phase: Callable[[], Awaitable[int]], done: int) -> None:
        """Run more passes of a phase that claims rows (so each pass makes
        progress) while it keeps finding full batches and the executor's
        waiting list is short: a wave of 10,000 orphans or due timers then
        drains in seconds instead of one batch per poll interval."""
        full = self.timer_batch_size if phase == self.resume_due_timers else _RECOVERY_BATCH
        for _ in range(_MAX_EXTRA_PASSES):
            if done < full or self._executor is None or self._executor.waiting > _BACKLOG_LIMIT:
                return
            done = await phase()

    async def join(self) -> None:
        """Wait until this process executes no turn and has none waiting."""
        if self._executor is not None:
            await self._executor.join()

    # -- turns ----------------------------------------------------------------------------

    def _dispatch(self, run_id: str, *, namespace: str | None = None, priority: int = 0) -> None:
        """Give ``run_id`` a turn: through the run queue when the transport
        carries one (any driving instance takes it), else here."""
        self._watcher.forget(run_id)  # what it settled before is no longer current
        if self._run_queue is not None:
            # Even while draining: a drain stops consuming, not producing (a
            # child created by a turn finishing now must reach some instance).
            pool = namespace or self.drives_namespace
            self._run_queue.submit(run_id, wake=False, namespace=pool, priority=priority)
            return
        self._submit_here(run_id)

    def _submit_here(self, run_id: str, *, wake: bool = False) -> None:
        self._watcher.forget(run_id)
        if self.drive and not self._draining and self._executor is not None:
            self._executor.submit(run_id, wake=wake)

    async def _wake(self, run_id: str, *, namespace: str | None = None) -> None:
        """Make sure ``run_id`` takes a turn that sees what the caller just wrote."""
        if run_id in self._active:
            # Our own turn holds it: the stamp makes it run once more.
            await self.store.request_wake(run_id, self.clock.now_ms())
            return
        if self._run_queue is not None:
            # A wake can cross pools (a signal from another namespace's
            # process): unless the caller knows the run's pool, look it up.
            self._run_queue.submit(run_id, wake=True, namespace=namespace)
            return
        if not (self.drive and not self._draining):
            # Nobody here will run it: the stamp makes it due for whoever polls.
            await self.store.request_wake(run_id, self.clock.now_ms())
            return
        self._submit_here(run_id, wake=True)

    async def _run_from_queue(self, run_id: str, wake: bool) -> bool:
        """Execute a queued run here; ``False`` asks the queue to hand its
        message back (this instance is draining) instead of acking it."""
        if self._executor is None or self._draining:
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def finished(ok: bool) -> None:
            if not done.done():
                done.set_result(ok)

        self._executor.submit(run_id, wake=wake, on_done=finished)
        executed: bool = await done
        if not executed and not self._draining:
            # The execution raised (a store error, say): hand the message back
            # for a later delivery rather than ack a run that took no turn.
            raise RuntimeError(f"run {run_id} could not be executed")
        return executed and not self._draining

    async def _namespaces_of(self, run_ids: list[str]) -> dict[str, str]:
        return {run.run_id: run.namespace for run in await self.store.get_runs(run_ids)}

    async def _enqueue_failed(self, run_id: str, wake: bool) -> None:
        """A run could not be queued: a start stays pending for the poll; a
        wake runs here, or is stamped on the run for the timer poll."""
        if not wake:
            return
        if self.drive and not self._draining and self._executor is not None:
            self._executor.submit(run_id, wake=True)
        else:
            await self.store.request_wake(run_id, self.clock.now_ms())

    def _has_free_slot(self) -> bool:
        executor = self._executor
        return (
            self.drive
            and not self._draining
            and self._run_queue is None
            and executor is not None
            and executor.waiting == 0
            and executor.busy + self._promised_slots < self._executor_limit
        )

    async def _execute(self, run_id: str, wake: bool) -> None:
        preleased = self._preleased.pop(run_id, None)
        if preleased is not None:
            await self._drive(preleased, {})
            return
        leased = await self._acquire(run_id, wake=wake)
        if leased is not None:
            await self._drive(*leased)

    async def _start_turns(self, run_ids: list[str]) -> list[_Leased | None]:
        now = self.clock.now_ms()
        leased = await self.store.start_turns(
            run_ids, self.instance_id, now, now + self.lease_ms, _WAKEABLE
        )
        # An id asked twice in one batch gets its turn once: the second asker
        # sees what a second start_turn would (the run is leased: None).
        return [leased.pop(run_id, None) for run_id in run_ids]

    async def _acquire(self, run_id: str, *, wake: bool = False) -> _Leased | None:
        leased = await self._turn_starts(run_id)
        if leased is not None or not wake:
            return leased
        now = self.clock.now_ms()
        current = await self.store.get_run(run_id)
        if current is None or current.status in TERMINAL_STATUSES:
            return None
        # Someone holds the lease: leave a stamp so the holder runs one more
        # turn instead of letting go. If it let go before the stamp landed,
        # the run is free now and the retry below takes it.
        if not await self.store.request_wake(run_id, now):
            return None
        return await self._turn_starts(run_id)

    async def _drive(self, run: Run, checkpoints: dict[int, Checkpoint]) -> None:
        if self.drives_namespace is not None and run.namespace != self.drives_namespace:
            # Woken here by a signal or a child, but it belongs to another
            # pool: hand it back as pending for that pool's instances.
            await self.store.release_run(run.run_id, self.instance_id, self.clock.now_ms())
            if self._run_queue is not None:
                self._dispatch(run.run_id, namespace=run.namespace, priority=run.priority)
            return
        leased: _Leased | None = (run, checkpoints)
        while leased is not None:
            outcome, turn = await self._turn(*leased)
            leased = await self._settle(leased[0], outcome, turn)

    async def _turn(
        self, run: Run, checkpoints: dict[int, Checkpoint]
    ) -> tuple[TurnOutcome, Turn | None]:
        try:
            definition = self._registry.get(run.workflow, run.workflow_version)
            value = definition.parse_input(run.input)
        except (WorkflowNotRegistered, SchemaValidationError) as exc:
            return TurnOutcome(TurnEnd.FAILED, error=error_info(exc)), None
        missing_children = await self._reconcile_children(run, checkpoints)
        self._watcher.forget(run.run_id)
        turn = Turn(
            run, checkpoints, self.instance_id, self.clock.now_ms, self.reconcile_ms, self.lease_ms
        )
        turn.missing_children = missing_children
        ctx = WorkflowContext(turn, self._services)
        self._active[run.run_id] = turn
        renewer = asyncio.create_task(self._renew(turn))
        try:
            if definition.takes_input:
                outcome = await turn.execute(lambda: definition.fn(ctx, value))
            else:
                outcome = await turn.execute(lambda: definition.fn(ctx))
            if outcome.end is TurnEnd.CLOSED:
                return outcome, turn
            unwind = turn.unwinding or (outcome.end is TurnEnd.FAILED and ctx._has_compensations)
            try:
                if unwind or not self.store.ordered_writes:
                    await turn.flush()  # every result is durable before the outcome
                if unwind:
                    outcome = _after_unwind(outcome, await ctx._compensate(), turn.unwinding)
            except _TurnClosed:
                outcome = TurnOutcome(TurnEnd.CLOSED)
            return outcome, turn
        finally:
            renewer.cancel()
            if self._active.get(run.run_id) is turn:
                del self._active[run.run_id]

    async def _renew(self, turn: Turn) -> None:
        interval = self.lease_ms / 2000
        while True:
            await self.clock.sleep(interval)
            if turn.closed:
                return
            until = self.clock.now_ms() + self.lease_ms
            try:
                held = await self.store.renew_lease(turn.run.run_id, self.instance_id, until)
            except Exception:
                _log.exception("renewing the lease of run %s failed", turn.run.run_id)
                continue
            if not held:
                _log.warning("lost the lease of run %s; fencing its turn", turn.run.run_id)
                turn.close("fenced")
                return
            turn.lease_until = until

    async def _settle(self, run: Run, outcome: TurnOutcome, turn: Turn | None) -> _Leased | None:
        """Write the turn's outcome; return the run if it must take another turn."""
        run_id, now = run.run_id, self.clock.now_ms()
        if outcome.end is TurnEnd.CLOSED:
            if turn is not None and turn.close_reason == "unwind":
                # A compensating cancel arrived mid-turn: take one more turn,
                # which reads the intent and unwinds.
                again = await self.store.continue_turn(
                    run_id, self.instance_id, now + self.lease_ms
                )
                if again is not None:
                    return again, await self.store.load_checkpoints(run_id)
                return None
            if self._draining:
                await self.store.release_run(run_id, self.instance_id, now)
            return None
        if outcome.end is TurnEnd.CONTINUED:
            next_run = await self._continue_as_new(run, outcome.output)
            status, changes = RunStatus.COMPLETED, RunChanges(output={"continued_as": next_run})
        elif outcome.end is TurnEnd.COMPLETED:
            status, changes = RunStatus.COMPLETED, RunChanges(output=outcome.output)
        elif outcome.end is TurnEnd.FAILED:
            status, changes = RunStatus.FAILED, RunChanges(error=outcome.error)
        elif outcome.end is TurnEnd.CANCELLED:
            status, changes = RunStatus.CANCELLED, RunChanges(error=outcome.error)
        else:
            status, changes = RunStatus.SUSPENDED, RunChanges(wake_at=outcome.wake_at)
        if status in TERMINAL_STATUSES and run.parent_id is not None:
            # The parent hears first, so no crash can fall between a child
            # ending and its parent knowing (the report stamps the parent's
            # wake in the same write). A fenced or cancelled turn may report
            # an outcome the store then refuses: a replay computes the same
            # one, and a parent's checkpoint is settled once.
            await self._report_to_parent(
                run.replace(status=status, output=changes.output, error=changes.error)
            )
        result = await self.store.settle_run(run_id, self.instance_id, status, changes, now)
        if turn is not None and self.store.ordered_writes:
            # The outcome was queued behind the turn's results, so they are
            # settled too; collect them (a write that failed is only logged:
            # the run's own row already holds its outcome).
            try:
                await turn.flush()
            except _TurnClosed:
                pass
            except Exception:
                _log.exception("a checkpoint write of run %s failed", run_id)
        if result is SettleResult.WAKE_REQUESTED:
            again = await self.store.continue_turn(run_id, self.instance_id, now + self.lease_ms)
            if again is None:
                return None
            return again, await self.store.load_checkpoints(run_id)
        if result is SettleResult.SETTLED:
            if status is RunStatus.FAILED and outcome.error:
                _log.warning(
                    "run %s (%s) failed: %s", run_id, run.workflow, outcome.error.get("message")
                )
            self._notify(run_id, RunResult(run_id, status, changes.output, changes.error))
            if status in TERMINAL_STATUSES:
                await self._after_end(run_id, cancelled=status is RunStatus.CANCELLED)
                ended = run.replace(status=status, output=changes.output, error=changes.error)
                if status is RunStatus.FAILED:
                    await self._after_failure(ended)
                if status is RunStatus.CANCELLED:
                    await self._cancel_children(run_id)
        return None

    async def _continue_as_new(self, run: Run, new_input: Any) -> str:
        match = _CONTINUATION.match(run.run_id)
        base, number = (match.group(1), int(match.group(2))) if match else (run.run_id, 0)
        next_id = f"{base}~{number + 1}"
        definition = self._registry.get(run.workflow)
        now = self.clock.now_ms()
        # Persisted before this run completes, so a crash in between never
        # loses the chain: the next link already exists and is pending.
        await self.store.create_run(
            run.replace(
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
                deadline_at=(
                    now + definition.execution_timeout_ms
                    if definition.execution_timeout_ms is not None
                    else None
                ),
            )
        )
        self._dispatch(next_id, namespace=run.namespace, priority=run.priority)
        return next_id

    async def _set_terminal(self, run: Run, status: RunStatus, error: dict[str, Any]) -> bool:
        changed = await self.store.update_run_if(
            run.run_id,
            frozenset({run.status}),
            {"status": status.value, "error": error, "wake_at": None},
            self.clock.now_ms(),
        )
        if changed:
            turn = self._active.get(run.run_id)
            if turn is not None:
                turn.close(status.value)
            self._notify(run.run_id)
            await self._report_to_parent(run.replace(status=status, error=error, output=None))
        return changed

    # -- children -------------------------------------------------------------------------

    async def _spawn_children(self, parent: Run, calls: list[ChildCall]) -> list[ErrorInfo | None]:
        """Create child runs in bulk; return a start error per child (or ``None``)."""
        now = self.clock.now_ms()
        errors: list[ErrorInfo | None] = [None] * len(calls)
        runs: list[Run] = []
        for i, call in enumerate(calls):
            try:
                definition = self._registry.get(call.workflow)
                stored_input = definition.validate_input(call.input)
            except (WorkflowNotRegistered, SchemaValidationError) as exc:
                errors[i] = _child_error(call.run_id, "failed", error_info(exc))
                continue
            runs.append(
                Run(
                    run_id=call.run_id,
                    workflow=definition.name,
                    workflow_version=definition.version,
                    status=RunStatus.PENDING,
                    input=stored_input,
                    namespace=parent.namespace,
                    parent_id=parent.run_id,
                    parent_seq=call.seq,
                    priority=parent.priority,
                    deadline_at=(
                        now + definition.execution_timeout_ms
                        if definition.execution_timeout_ms is not None
                        else None
                    ),
                    created_at=now,
                    updated_at=now,
                )
            )
        # A child that cannot start reaches its parent as a failed child.
        unstartable = [
            Resolution(parent.run_id, calls[i].seq, CheckpointStatus.FAILED, error=error)
            for i, error in enumerate(errors)
            if error is not None
        ]
        if unstartable:
            await self.store.resolve_checkpoints(unstartable, now)
        created = set(await self.store.create_runs(runs)) if runs else set()
        existing = [run.run_id for run in runs if run.run_id not in created]
        for run in runs:
            if run.run_id in created:
                self._dispatch(run.run_id, namespace=run.namespace, priority=run.priority)
        if existing:
            # Started by an earlier turn that crashed before suspending: any
            # that already finished settle their placeholder now.
            for child in await self.store.get_runs(existing):
                if child.status in TERMINAL_STATUSES:
                    await self._report_to_parent(child)
                elif child.status is RunStatus.PENDING:
                    self._dispatch(child.run_id, namespace=child.namespace)
        return errors

    async def _after_end(self, run_id: str, *, cancelled: bool) -> None:
        """A run ended: free its flow-control slots and stop its step handlers."""
        if self._steps.queues:
            try:
                await self.store.release_slots(run_id, self.clock.now_ms())
            except Exception:
                _log.exception("could not release the flow-control slots of run %s", run_id)
        if cancelled:
            try:
                await self.transport.publish_cancel([run_id])
            except Exception:
                _log.warning("could not publish the cancel of run %s", run_id, exc_info=True)

    async def _ended_runs(self, run_ids: list[str]) -> set[str]:
        """Of ``run_ids``, those that ended or are being cancelled (for step handlers)."""
        runs = await self.store.get_runs(run_ids)
        return {
            run.run_id
            for run in runs
            if run.status in TERMINAL_STATUSES or run.cancel_requested is not None
        }

    async def redispatch_pending(self, run_id: str) -> int:
        """Send again the tasks of every dispatched step of ``run_id`` still
        awaiting a result (after a broker outage, say); return how many. A
        duplicate result is harmless: only a pending step is settled."""
        await self.open()
        run = await self._require(run_id)
        if run.status in TERMINAL_STATUSES:
            return 0
        tasks = [
            StepTask(
                run_id=run_id,
                seq=cp.seq,
                name=cp.name,
                group=routing_token(cp.name, run.namespace),
                input=cp.input,
                attempt=max(1, cp.attempts),
                priority=self._steps.definitions[cp.name].priority
                if cp.name in self._steps.definitions
                else None,
            )
            for cp in (await self.store.load_checkpoints(run_id)).values()
            if cp.kind == "step"
            and cp.status is CheckpointStatus.PENDING
            and cp.dispatched_at is not None
        ]
        if tasks:
            await self._steps.dispatch(tasks)
        return len(tasks)

    async def _cancel_runs(self, run_ids: list[str]) -> None:
        for run_id in run_ids:
            try:
                await self.cancel(run_id)
            except RunNotFound:
                continue

    async def _cancel_children(self, run_id: str) -> None:
        cursor: str | None = None
        while True:
            page = await self.store.list_runs(RunQuery(parent_id=run_id, limit=500, cursor=cursor))
            await self._cancel_runs(
                [r.run_id for r in page.runs if r.status not in TERMINAL_STATUSES]
            )
            cursor = page.next_cursor
            if cursor is None:
                return

    async def _report_to_parent(self, child: Run) -> None:
        """Tell a waiting parent that ``child`` ended, however it ended.

        The child's own terminal state is written first; this delivery is
        retried on store errors (0.25 s, 1 s, 4 s). Should it still be lost,
        the parent's next turn reads its children and settles them.
        """
        if child.parent_id is None or child.parent_seq is None:
            return
        if child.status is RunStatus.COMPLETED:
            status, output, error = CheckpointStatus.COMPLETED, child.output, None
        else:
            status, output = CheckpointStatus.FAILED, None
            error = _child_error(child.run_id, child.status.value, child.error)
        report = Resolution(child.parent_id, child.parent_seq, status, output, error)
        for delay in (0.25, 1.0, 4.0, None):
            try:
                left = await self._parent_reports(report)
                break
            except Exception:
                if delay is None:
                    _log.exception(
                        "could not tell run %s that child %s ended", child.parent_id, child.run_id
                    )
                    return
                await asyncio.sleep(delay)
        # Wake the parent when its fan-out is complete, or on a failure
        # (fail_fast must hear of it); a fan of thousands costs one parent turn.
        if left is not None and (left == 0 or status is CheckpointStatus.FAILED):
            await self._wake(child.parent_id)

    async def _reconcile_children(self, run: Run, checkpoints: dict[int, Checkpoint]) -> set[str]:
        """Settle the children this run waits on that already ended (their
        notification may have been lost to a crash), in batches of 500.
        Returns the ids of waited-on children that do not exist: an earlier
        turn stored their placeholders and died before creating them."""
        waiting = {
            str(cp.input["run_id"]): cp
            for cp in checkpoints.values()
            if cp.kind == "child"
            and cp.status is CheckpointStatus.PENDING
            and isinstance(cp.input, dict)
        }
        if not waiting:
            return set()
        ids = list(waiting)
        missing = set(ids)
        now = self.clock.now_ms()
        for start in range(0, len(ids), 500):
            settled: list[Resolution] = []
            for child in await self.store.get_runs(ids[start : start + 500]):
                missing.discard(child.run_id)
                if child.status not in TERMINAL_STATUSES:
                    continue
                cp = waiting[child.run_id]
                if child.status is RunStatus.COMPLETED:
                    cp.status, cp.output = CheckpointStatus.COMPLETED, child.output
                else:
                    cp.status = CheckpointStatus.FAILED
                    cp.error = _child_error(child.run_id, child.status.value, child.error)
                cp.finished_at = now
                settled.append(Resolution(run.run_id, cp.seq, cp.status, cp.output, cp.error))
            if settled:  # one transaction per page, not one per finished child
                await self.store.resolve_checkpoints(settled, now)
        return missing

    async def _expire_own_leases(self) -> None:
        now = self.clock.now_ms()
        page = await self.store.list_runs(RunQuery(status=RunStatus.RUNNING, limit=1000))
        for run in page.runs:
            if run.locked_by == self.instance_id:
                await self.store.update_run_if(
                    run.run_id, frozenset({RunStatus.RUNNING}), {"locked_until": 0}, now
                )

    async def _worker_loop(self) -> None:
        wake = self._loop_wake
        assert wake is not None
        while True:
            wake.clear()
            await self.tick()
            # A store that notifies (PostgreSQL) cuts the wait short when
            # another process creates a run; polling remains the safety net.
            await wait_event(wake, self.poll_interval)

    def _executor_has_room(self) -> None:
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
        if self._loop_task is None or self._draining or self._run_queue is not None:
            return
        if self._pending_poll is None or self._pending_poll.done():
            self._pending_poll = asyncio.get_running_loop().create_task(self._poll_pending_soon())

    async def _poll_pending_soon(self) -> None:
        await asyncio.sleep(0.005)
        try:
            await self.run_pending()
        except Exception:
            _log.exception("polling pending runs failed")

    def _on_store_event(self, kind: str, run_id: str) -> None:
        """React to another process's change, as the store reports it."""
        if kind == "settled":
            if self._executor is not None and self._executor.knows(run_id):
                # Most likely our own settle, heard before its batch answered:
                # that answer hands the outcome over, and a read now would only
                # delay the waiter (the poll stays the net should it not be ours).
                return
            self._notify(run_id)
        elif kind == "ended":
            turn = self._active.get(run_id)
            if turn is not None:
                turn.close("cancelled")
            self._notify(run_id)
        elif (
            kind == "pending"
            and self._loop_task is not None
            and not self._draining
            and self._run_queue is None  # the queue's own notices wake its consumers
        ):
            if run_id in self._starting or (
                run_id and self._executor is not None and self._executor.knows(run_id)
            ):
                return  # our own start, dispatched here
            # Only the pending-run poll, once for a burst of notifications
            # (our own starts notify us too, and we dispatched those already).
            self._schedule_pending_poll()
        elif (
            kind == "wake"
            and self._executor is not None
            and run_id not in self._active
            and self._run_queue is None  # the waker queued the run itself
        ):
            # Poll semantics: if another process holds the run, the stamp that
            # sent this is already on it; stamping again would ping-pong.
            self._submit_here(run_id)

    # -- helpers --------------------------------------------------------------------------

    def _notify(self, run_id: str, result: RunResult | None = None) -> None:
        """Wake ``wait_for_run`` callers: with the outcome of a turn settled
        here, or (``None``) by having them look at the run now."""
        if result is not None:
            self._watcher.settled(result)
        else:
            self._watcher.changed(run_id)

    async def _require(self, run_id: str) -> Run:
        run = await self.store.get_run(run_id)
        if run is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return run


def _after_unwind(outcome: TurnOutcome, failures: list[ErrorInfo], cancelling: bool) -> TurnOutcome:
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


def _new_run_id() -> str:
    """128 random bits as hex. Not ``uuid4``: on the VMs we measured,
    ``os.urandom`` costs ~0.3 ms a call, a third of a short run's latency;
    ``random`` is seeded from it once (and again after ``fork``)."""
    return f"{random.getrandbits(128):032x}"


def _child_error(run_id: str, status: str, error: ErrorInfo | None) -> ErrorInfo:
    """How a child's failure is recorded on its parent's checkpoint."""
    message = (error or {}).get("message", status)
    return {
        "message": f"child run {run_id} {status}: {message}",
        "code": (error or {}).get("code") or f"child_{status}",
        "type": "ChildFailed",
        "details": {"run_id": run_id, "status": status},
    }


def _check_handler(handler: Handler) -> Handler:
    if isinstance(handler, str) and handler:
        return handler
    if callable(handler):
        return handler
    raise TypeError("a handler is a workflow name or an async callable taking the run")


def _check_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return []
    if isinstance(cast(object, tags), str) or not all(isinstance(t, str) and t for t in tags):
        raise ValueError("tags must be a list of non-empty strings")
    return list(dict.fromkeys(tags))


def _start_time(start_at: datetime | Duration | None, now: int) -> int | None:
    if start_at is None:
        return None
    if isinstance(start_at, datetime):
        if start_at.tzinfo is None:
            raise ValueError("start_at must be a timezone-aware datetime")
        return int(start_at.timestamp() * 1000)
    return now + to_ms(start_at, name="start_at")
