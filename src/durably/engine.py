"""The Engine: the façade an application holds, and the wiring behind it.

An application holds one ``Engine``: it registers workflows and steps, and
calls the client API (``start``, ``signal``, ``cancel``, ``wait_for_run``…),
which only reads and writes the store and hands run ids on. The work is done
by collaborators the engine builds and wires, each handed the callables it
uses rather than the engine itself, so none of them imports this module:
:class:`~durably._routing.RunRouter` (where a run's next turn happens),
:class:`~durably._children.ChildRuns` (children, parents, cascading cancels),
:class:`~durably._turns.TurnDriver` (lease, replay, renew, settle),
:class:`~durably._worker.Worker` (the periodic phases and their loop, started
by ``async with engine:`` or ``durably worker``) and
:class:`~durably._lifecycle.Lifecycle` (open, start, drain, close).
:func:`durably._wiring.wire` builds them; registrations live in one
:class:`~durably._registry.Registry`; dispatched steps in :mod:`durably.steps`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar, Unpack, cast, overload

from ._attributes import check_attributes
from ._attributes import check_filters as check_attributes_filters
from ._children import RunNotFound
from ._entities import entity_body
from ._hooks import EvictHook, Handler, StalledHook
from ._intercept import Interceptor, StepInterceptor
from ._lifecycle_events import EventKind, Subscription
from ._names import check_name
from ._ops.entities import EntityDef, EntityHandler, entity_workflow
from ._options import Consumers, EngineOptions, Option, SettableOption
from ._outside import OutsideCalls, task_failure, task_result
from ._registry import WorkflowDef
from ._run_queue import RunQueue
from ._singletons import Singleton, count_live, join_line, singleton_tag
from ._start import check_signal, check_start, check_tags, new_run
from ._wiring import wire
from ._worker import RECOVERY_BATCH, Phase
from .clock import Clock, SystemClock
from .durations import Duration
from .errors import (
    DurablyError,
    SchemaValidationError,
    SingletonQueueFull,
    WorkflowNotRegistered,
)
from .handle import RunHandle
from .model import (
    TERMINAL_STATUSES,
    BulkCancel,
    Checkpoint,
    Run,
    RunResult,
    RunStatus,
    UpdateResult,
)
from .schedules import Overlap, Schedule, ScheduleSpec
from .steps._flow import FlowQueue
from .steps._server import served_tokens
from .steps.definition import (
    StepDecorator,
    StepDefinition,
    StepPolicy,
    StepRef,
    check_policy,
    define_step,
)
from .stores import RunPage, RunQuery, StateStore, open_store
from .transports import Transport, open_transport
from .transports.base import TurnCarrier

__all__ = ["Engine", "RunNotFound"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_SETTLED = frozenset({*TERMINAL_STATUSES, RunStatus.SUSPENDED, RunStatus.BLOCKED})
# In the order cancel_where takes them: queued first, then those executing or waiting.
_LIVE = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.BLOCKED)


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
        max_concurrent_runs: turns executing at once in this process (a turn
            holding for a dispatched step lends its slot; see ``step_hold``).
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
        buffer_ttl: how long a signal or event that nobody waited for stays
            buffered for a later wait (default 7 days; ``None`` keeps it).
        stalled_after: how long a stranded run (see :meth:`on_stalled`) may
            make no progress before :meth:`on_stalled` hooks hear of it.
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
        webhook_base_url: where :func:`durably.webhooks.app` is reachable from
            outside (``https://api.example.com/hooks``); ``ctx.webhook()`` then
            gives a full ``url`` besides the token.
        publish_events: broadcast this engine's lifecycle events on the
            store's channel (PostgreSQL ``NOTIFY``), so :meth:`subscribe` in
            other processes sees them.
        remote_advance_silence: a remote workflow turn (:meth:`remote_workflow`)
            that sent no decision and no run heartbeat for this long is sent
            again under a fresh task id (its worker died or the turn was lost).
        compensation_retries: how many times a failing saga undo is retried
            before it is skipped and logged (default 2: three attempts); a
            ``compensate=`` step may set its own.
        sticky_runs: how many suspended runs keep their workflow body parked
            in memory (default 1,000; ``0`` disables it), so the run's next
            turn in this process resumes it instead of replaying its history
            from the top. Purely a cache: the turn still leases the run and
            reads its history, and replays whenever that history is not the
            one the kept body saw (see docs/workflows.md, "Sticky runs").
        step_hold: the longest a turn waits in memory for the result of a
            dispatched step without ``timeout`` before it parks the run
            (default 250 ms; ``0`` or ``None``: park at once). A step whose
            results' average latency is above it is held once in 16 calls
            only (to notice it got faster); a holding
            turn lends its ``max_concurrent_runs`` slot to a waiting run, and
            at most ``max(max_concurrent_runs, sticky_runs)`` turns hold at
            once. A result heard in time continues the same turn instead of
            a park, a wake and a new turn (see docs/workflows.md, "Holding
            the turn").
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
        buffer_ttl: Duration | None = "7d",
        stalled_after: Duration = "1h",
        transport: str | Transport | None = None,
        consumers: Consumers = "auto",
        step_concurrency: int = 64,
        serve_groups: Sequence[str] | None = None,
        serve_steps: Sequence[str] | None = None,
        remote_redispatch: Duration | None = None,
        remote_redispatch_max: int = 3,
        heartbeat_persist_throttle: Duration = "10s",
        webhook_base_url: str | None = None,
        publish_events: bool = False,
        remote_advance_silence: Duration = "30s",
        compensation_retries: int = 2,
        sticky_runs: int = 1000,
        step_hold: Duration | None = "250ms",
    ) -> None:
        # Taken first, while the locals are exactly the parameters: the keywords
        # are EngineOptions' fields, by name.
        keywords = {k: v for k, v in locals().items() if k != "self"}
        target = store if store is not None else os.environ.get("DURABLY_DATABASE_URL")
        self.store: StateStore = open_store(target or "sqlite:///durably.db")
        """The state store runs live in."""
        self._options = EngineOptions(**keywords)
        self._generated_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.clock: Clock = clock or SystemClock()
        """The engine's time source."""
        self.transport: Transport = open_transport(transport, self.store)
        """How dispatched steps reach workers."""
        self._wire()

    def _wire(self) -> None:
        """Build the collaborators (:func:`durably._wiring.wire`), each handed what it calls."""
        parts = wire(
            self._options,
            self.store,
            self.clock,
            self.transport,
            self.namespace,
            settings=self._current_options,
            owner=self._owner,
            open=self.open,
            cancel=self.cancel,
            start=self._start_late,
            after_failure=self._after_failure,
            phases=self._phases,
            served=self._served_tokens,
        )
        self._hooks, self._registry, self._threads = parts.hooks, parts.registry, parts.threads
        self._watcher, self._router, self._steps = parts.watcher, parts.router, parts.steps
        self._children, self._step_server = parts.children, parts.step_server
        self._turns, self._scheduler, self._events = parts.turns, parts.scheduler, parts.events
        self._remote, self._capabilities = parts.remote, parts.capabilities
        self._worker, self._lifecycle = parts.worker, parts.lifecycle
        self._step_faults = parts.faults  # what durably.testing.TestEnv arranges
        self._outside = OutsideCalls(self.store, self.signal, self._router.wake)
        self._updates, self._entities = parts.updates, parts.entities
        self._hub, self._intercept = parts.hub, parts.intercept
        self._router.worker_looping = lambda: self._worker.looping

    # -- options
    @property
    def options(self) -> EngineOptions:
        """The constructor's keywords, validated (see :class:`EngineOptions`)."""
        return self._options

    def _current_options(self) -> EngineOptions:
        return self._options

    def _owner(self) -> str:
        return self.instance_id

    @property
    def namespace(self) -> str:
        """The pool this engine's new runs and schedules belong to."""
        return self._options.namespace or "default"

    @property
    def instance_id(self) -> str:
        """The lease owner id of this process.

        Assign it before the engine opens (``durably worker --instance-id``):
        an id set here counts as stable, like one given to the constructor, so
        opening reclaims the runs a previous process with that id held.
        """
        return self._options.instance_id or self._generated_id

    @instance_id.setter
    def instance_id(self, value: str) -> None:
        self._options = dataclasses.replace(self._options, instance_id=value)

    drives_namespace = Option[str | None]("namespace")
    """The namespace whose runs this engine executes; ``None``: every one."""
    drive = SettableOption[bool]("drives", keyword="drive")
    """Whether runs execute in this process (never with ``consumers="never"``)."""
    poll_interval = SettableOption[float]("poll_interval")
    """Seconds between worker-loop ticks."""
    drain_timeout = SettableOption[float]("drain_timeout")
    """Seconds ``async with`` (and :meth:`close`) waits for turns on exit."""
    step_concurrency = SettableOption[int]("step_concurrency")
    """Step handlers executing at once here (set before :meth:`start_worker`)."""
    serve_groups = SettableOption[frozenset[str] | None]("serve_groups")
    """Serve only the steps of these groups (set before :meth:`start_worker`)."""
    serve_steps = SettableOption[frozenset[str] | None]("serve_steps")
    """Serve only the steps with these names (set before :meth:`start_worker`)."""
    consumers = Option[Consumers]("consumers")
    """Whether this engine serves step handlers: ``"auto"``, ``"always"`` or ``"never"``."""
    lease_ms = Option[int]("lease_ms")
    """How long a turn's lease lasts without renewal, in ms."""
    reconcile_ms = Option[int]("reconcile_ms")
    """The fallback wake of a run waiting on someone else, in ms (``0``: off)."""
    max_recovery_attempts = Option[int]("max_recovery_attempts")
    """Crash recoveries of one run before it is ``dead``."""
    timer_batch_size = Option[int]("timer_batch_size")
    """Due timers loaded per tick."""
    retention_ms = Option[int | None]("retention_ms")
    """How long terminal runs are kept, in ms (``None``: forever)."""
    buffer_ttl_ms = Option[int | None]("buffer_ttl_ms")
    """How long an unconsumed signal or event stays buffered, in ms (``None``: forever)."""
    stalled_after_ms = Option[int]("stalled_after_ms")
    """How long a live run may make no progress before it counts as stalled, in ms."""

    @property
    def _run_queue(self) -> RunQueue | None:
        # The fleet tests inspect the run queue this engine pushes to.
        return self._router.run_queue

    # -- registration ---------------------------------------------------------------------

    def workflow(
        self,
        name: str,
        *,
        version: str = "1",
        input: Any = None,
        output: Any = None,
        execution_timeout: Duration | None = None,
        schedule: str | Mapping[str, Any] | None = None,
        on_event: str | Sequence[str] | None = None,
        singleton: Callable[[Any], Any] | None = None,
        limit: int = 1,
        max_queue: int | None = None,
        tags: list[str] | None = None,
    ) -> Callable[[F], F]:
        """Decorator registering ``async def fn(ctx, input)`` as workflow ``name``.

        ``input`` may be a pydantic model, a dataclass or any callable that
        converts/validates the input; ``start`` rejects invalid input before a
        run exists. ``output`` (else the function's return annotation) is
        the type its output is decoded into (see docs/workflows.md, "Typed
        values"); an output that does not fit fails the run.
        ``execution_timeout`` cancels runs older than that. ``schedule``
        declares a schedule named after the workflow: a cron expression
        (UTC), or a mapping of :meth:`schedule` options (``{"every": "15m"}``,
        ``{"cron": "0 9 * * 1-5", "tz": "Europe/Paris"}``).
        ``on_event`` starts a run (input: the payload) for every publish of
        that event name (or names); see :meth:`on_event`.

        ``singleton`` (a function of the input returning a key) allows at most
        ``limit`` live runs per key across every engine on the store; later
        runs wait, ``suspended``, and start in order as earlier ones end.
        With ``max_queue``, ``start`` raises :class:`SingletonQueueFull` when
        the key already has ``limit + max_queue`` live runs, before creating
        anything.

        ``tags`` are static tags every run started here carries, merged
        (first, without duplicates) with the tags ``start`` is given.
        """

        def decorate(fn: F) -> F:
            self.register(
                name,
                fn,
                version=version,
                input=input,
                output=output,
                execution_timeout=execution_timeout,
                singleton=singleton,
                limit=limit,
                max_queue=max_queue,
                tags=tags,
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
        output: Any = None,
        execution_timeout: Duration | None = None,
        singleton: Callable[[Any], Any] | None = None,
        limit: int = 1,
        max_queue: int | None = None,
        tags: list[str] | None = None,
    ) -> None:
        """Register ``fn`` as version ``version`` of workflow ``name``.

        Register several versions side by side during a breaking change: runs
        replay on the version they started with; new runs take the version
        registered last. ``input``, ``output``, ``execution_timeout`` and
        ``tags`` are those of :meth:`workflow`.
        """
        self._registry.add(
            WorkflowDef.build(
                name,
                fn,
                version=version,
                input=input,
                output=output,
                execution_timeout=execution_timeout,
                singleton=Singleton.build(singleton, limit, max_queue),
                tags=check_tags(tags),
            )
        )

    def remote_workflow(
        self,
        name: str,
        *,
        version: str = "1",
        requires: Sequence[str] = (),
        group: str | None = None,
        execution_timeout: Duration | None = None,
    ) -> None:
        """Register workflow ``name`` as *remote*: its body runs in a worker
        elsewhere (``durable-worker`` in Python, the upstream TypeScript
        runtimes), served by name over a transport that carries turns
        (``redis://``). Start it like any workflow; the engine sends it one
        turn at a time with its history and applies each decision the worker
        sends back. ``requires``: capabilities its worker must advertise
        (a run with no live capable worker is parked ``blocked``). ``group``:
        the group of a worker serving workflows by group (upstream
        ``WorkflowWorker(group=…)``); by default turns go to the workflow's
        own queue, which a unified ``Worker`` consumes.
        """
        if isinstance(requires, str):
            raise TypeError("requires must be a list of capability names, not one string")
        if not isinstance(self.transport, TurnCarrier):
            raise ValueError(
                f"remote workflow {name!r} needs a transport that carries turns "
                f"(transport='redis://…'), not {self.transport.url}"
            )
        self._registry.add_remote(
            name,
            version=str(version),
            requires=frozenset(requires),
            execution_timeout=execution_timeout,
            group=group,
        )

    async def worker_health(self) -> dict[str, Any]:
        """The fleet's remote workers as seen on the transport (``redis://``):
        ``workers`` (instance, runtime, SDK, routing tokens, workflows, steps,
        capabilities, whether its descriptor hash checks out), ``queues``
        (tasks waiting per routing token) and ``starving`` (tokens with work
        waiting and no live worker). Empty on a transport without workers."""
        await self.open()
        return await self._capabilities.health()

    @property
    def workflows(self) -> list[str]:
        """Names of the registered workflows."""
        return self._registry.names()

    def on_dead(self, handler: Handler) -> None:
        """Call ``handler`` for every run that goes ``dead`` (crashed its
        executor too often). A workflow name is started as ``dlq:<run_id>``
        with the dead run's id, workflow, error and input."""
        self._hooks.add_dead(handler)

    def on_error(self, code: str, handler: Handler) -> None:
        """Route failed runs whose error ``code`` matches (``"*"``: any) to
        ``handler``. A workflow name is started as ``onerror:<code>:<run_id>``."""
        self._hooks.add_error(code, handler)

    def on_evict(self, hook: EvictHook) -> None:
        """Archive runs before retention deletes them: ``await hook(run,
        history)``; if it raises, the run is kept and offered again later."""
        self._hooks.add_evict(hook)

    def on_stalled(self, hook: StalledHook) -> None:
        """Hear of stranded runs, once per episode (a run that progresses and
        strands again is reported again).

        A live run is stranded once it made no progress for ``stalled_after``
        and either nothing of its own can wake it — suspended on waits
        without a deadline only (a signal or event nobody sends), or on
        nothing at all — or it is parked on a dispatched step whose worker has
        sent no heartbeat for ``stalled_after``. The ``reconcile`` fallback
        does not count as a wake: it re-checks a run, it never progresses it.
        A long sleep, a wait with a timeout, a pending child, a step that
        beats, a queued run and a long in-process step are never stranded."""
        self._hooks.add_stalled(hook)

    # -- steps (durably.steps) ------------------------------------------------------------

    def step(
        self,
        name: str,
        *,
        group: str | None = None,
        input: Any = None,
        output: Any = None,
        requires: Sequence[str] = (),
        **policy: Unpack[StepPolicy],
    ) -> StepDecorator:
        """Register a step handler served by ``name``; returns a :class:`StepRef`
        for ``ctx.step``.

        The handler takes ``(data)`` or ``(data, log: StepLogger)`` and may be
        sync (run in a thread) or async. ``input`` / ``output`` (a pydantic
        model or dataclass; ``output`` defaults to the handler's return
        annotation) are validated where the handler runs; a failure there is
        not retried. A workflow awaiting the step receives its result decoded
        into the output type. The other options are the defaults of every
        ``ctx.step`` call of it (see :meth:`WorkflowContext.step`); ``group``
        names the worker group that serves it (``durably worker --group``).
        The policy keywords (:class:`~durably.steps.StepPolicy`: ``retries``,
        ``backoff``, ``backoff_base``, ``backoff_max``, ``jitter``,
        ``timeout``, ``pickup_timeout``, ``queue``, ``priority``) each default
        to ``None``: not set. ``requires``: capabilities a remote worker must
        advertise (the upstream handshake) to be sent this step; with live
        workers on its queue and none of them capable, the run is parked
        ``blocked`` and polled again.
        """
        check_policy("Engine.step", policy)

        def decorate(fn: Callable[..., Any]) -> StepRef[Any]:
            return self.register_step(
                name, fn, group=group, input=input, output=output, requires=requires, **policy
            )

        return cast(StepDecorator, decorate)

    def register_step(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        group: str | None = None,
        input: Any = None,
        output: Any = None,
        requires: Sequence[str] = (),
        **policy: Unpack[StepPolicy],
    ) -> StepRef[Any]:
        """The non-decorator form of :meth:`step`."""
        check_policy("Engine.register_step", policy)
        registry = self._registry
        definition = define_step(
            name,
            fn,
            taken=lambda n: registry.step(n) is not None,
            group=group,
            input=input,
            output=output,
            policy=policy,
            requires=requires,
        )
        registry.add_step(definition)
        return StepRef(definition)

    @property
    def steps(self) -> list[str]:
        """The names of the registered step handlers."""
        return sorted(d.name for d in self._registry.steps())

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
        check_name(name, "queue name")
        self._registry.add_queue(FlowQueue.build(name, concurrency, rate, retry))

    @property
    def served_steps(self) -> list[str]:
        """The step handlers this engine serves (after ``serve_groups`` /
        ``serve_steps``; none with ``consumers="never"``)."""
        if self.consumers == "never":
            return []
        return sorted(d.name for d in self._served_tokens().values())

    def _served_tokens(self) -> dict[str, StepDefinition]:
        return served_tokens(
            self._registry.steps(), self.namespace, self.serve_steps, self.serve_groups
        )

    # -- observing (durably._lifecycle_events, durably._intercept) ---------------------------

    def subscribe(
        self,
        *,
        run_id: str | None = None,
        kinds: Collection[EventKind | str] | None = None,
        maxsize: int = 1000,
        remote: bool = True,
    ) -> Subscription:
        """Receive this engine's lifecycle events from now on.

        Iterate it (``async for event in engine.subscribe(): ...``), inside
        ``async with`` to unsubscribe on exit (or call ``close()``); it ends
        when the engine closes. Filter by ``run_id`` and by ``kinds``
        (:class:`EventKind` values such as ``"step.completed"``). At most
        ``maxsize`` events wait for a slow reader; the ones that find no room
        are dropped and counted in ``dropped``, so a reader never slows a run.
        With ``remote`` (the default) it also hears the events other
        processes' engines publish (``publish_events=True``) on a PostgreSQL
        store.
        """
        return self._hub.subscribe(run_id=run_id, kinds=kinds, maxsize=maxsize, remote=remote)

    def use(self, interceptor: Interceptor | StepInterceptor) -> None:
        """Register an :class:`Interceptor` (or a bare ``async def
        intercept_step(info, call_next)``).

        Interceptors form an onion: the first registered is the outermost.
        Step interceptors wrap each attempt of a local step (in the turn) and
        of a served step (where its handler runs), never a step replayed from
        history; turn interceptors wrap each turn; an ``on_event`` method
        hears every lifecycle event of this process. Register them before the
        engine starts.
        """
        listener = self._intercept.add(interceptor)
        if listener is not None:
            self._hub.add_listener(listener)

    @property
    def turns_executing(self) -> int:
        """Turns executing in this process now."""
        executor = self._router.executor
        return 0 if executor is None else executor.busy

    @property
    def turns_waiting(self) -> int:
        """Turns waiting here for a slot (``max_concurrent_runs`` are busy)."""
        executor = self._router.executor
        return 0 if executor is None else executor.waiting

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect the store and migrate its schema (done lazily by every call)."""
        lifecycle = self._lifecycle
        if lifecycle.opened:
            lifecycle.check_loop()
        else:
            await lifecycle.open()

    @property
    def listening(self) -> bool:
        """Whether the store pushes other processes' changes to this engine
        (PostgreSQL's LISTEN/NOTIFY); otherwise it learns of them by polling."""
        return self._lifecycle.listening

    @property
    def is_open(self) -> bool:
        """Whether the store is connected."""
        return self._lifecycle.opened

    async def close(self) -> None:
        """Drain, stop the worker loop and close the store."""
        await self._updates.close()
        await self._lifecycle.close(self.drain_timeout)

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
        await self._lifecycle.start_worker()

    async def drain(self, timeout: float | None = None) -> None:
        """Stop taking work, let running turns finish for up to ``timeout``
        seconds, then hand the runs still executing back as ``pending``.
        Step handlers stop taking tasks first; queued ones stay queued."""
        await self._lifecycle.drain(self.drain_timeout if timeout is None else timeout)

    async def join(self) -> None:
        """Wait until this process executes no turn and has none waiting."""
        if self._router.executor is not None:
            await self._router.executor.join()

    # -- client API -----------------------------------------------------------------------

    @overload
    async def start(
        self,
        workflow: Callable[..., Awaitable[T]],
        input: Any = None,
        *,
        run_id: str | None = None,
        start_at: datetime | Duration | None = None,
        tags: list[str] | None = None,
        priority: int = 0,
        version: str | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> RunHandle[T]: ...

    @overload
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
        attributes: dict[str, Any] | None = None,
    ) -> RunHandle[Any]: ...

    async def start(
        self,
        workflow: str | Callable[..., Awaitable[Any]],
        input: Any = None,
        *,
        run_id: str | None = None,
        start_at: datetime | Duration | None = None,
        tags: list[str] | None = None,
        priority: int = 0,
        version: str | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> RunHandle[Any]:
        """Create a run and return its :class:`RunHandle` at once; the body
        runs on an executor.

        ``workflow`` is a registered name, or the decorated function itself
        (then ``await handle.result()`` is typed as its return type, and
        the run takes that function's version). Idempotent by ``run_id``:
        starting an id that exists returns a handle on that run (and
        re-dispatches it if still pending). ``start_at`` (an aware datetime,
        or a delay) creates the run suspended until then. ``attributes``
        are its search attributes (str, int, float, bool or aware datetime
        values; see ``list_runs``), written with the run (a start that finds
        the id taken leaves that run's attributes as they are). Raises
        :class:`WorkflowNotRegistered` or :class:`SchemaValidationError`
        before anything is stored.
        """
        clean_attributes = check_attributes(attributes)
        if isinstance(workflow, str):
            definition = self._registry.get(workflow, version)
        elif not callable(workflow):
            raise TypeError(
                "workflow must be a workflow name or the function @engine.workflow decorated, "
                f"not {type(workflow).__name__}"
            )
        else:
            definition = self._registry.of_function(workflow)
            if version is not None and version != definition.version:
                raise ValueError(
                    f"version {version!r} given for the function of workflow "
                    f"{definition.name!r} version {definition.version!r}"
                )
        stored_input = definition.validate_input(input) if definition.takes_input else None
        if definition.takes_input is False and input is not None:
            raise SchemaValidationError(f"workflow {definition.name!r} takes no input")
        if definition.tags:
            # Static tags first; check_tags drops a repeated one.
            tags = [*definition.tags, *check_tags(tags)]
        singleton_key: str | None = None
        if definition.singleton is not None:
            check_start(run_id, priority)
            await self.open()
            tags, singleton_key = await self._singleton_tags(
                definition, stored_input, run_id, check_tags(tags)
            )
        run = await self._create_run(
            definition.name,
            definition.version,
            stored_input,
            execution_timeout_ms=definition.execution_timeout_ms,
            run_id=run_id,
            start_at=start_at,
            tags=tags,
            priority=priority,
            attributes=clean_attributes,
        )
        if definition.singleton is not None and singleton_key is not None and start_at is None:
            now = self.clock.now_ms()
            await join_line(
                self.store, definition.singleton, definition.name, singleton_key, run, now
            )
        # The result decodes as the output type of the version the run took
        # (the one just started, unless the id existed).
        if (
            run.workflow_version
            and run.workflow_version == definition.version
            and run.workflow == definition.name
        ):
            return RunHandle(run, self, definition.typed_output.decode)
        return RunHandle(run, self, self._output_decoder(run))

    async def _create_run(
        self,
        workflow: str,
        version: str,
        stored_input: Any,
        *,
        execution_timeout_ms: int | None = None,
        run_id: str | None,
        start_at: datetime | Duration | None,
        tags: list[str] | None,
        priority: int,
        attributes: dict[str, Any] | None = None,
    ) -> Run:
        # What start and durably.Client share once the input is checked: the
        # client knows no registrations, so it passes the name and version
        # (UNPINNED: the first engine that executes the run pins it).
        check_start(run_id, priority)
        clean_tags = check_tags(tags)
        clean_attributes = check_attributes(attributes)
        await self.open()
        run = new_run(
            workflow,
            version,
            stored_input,
            execution_timeout_ms=execution_timeout_ms,
            run_id=run_id,
            namespace=self.namespace,
            tags=clean_tags,
            priority=priority,
            start_at=start_at,
            now=self.clock.now_ms(),
        )
        if self._intercept.starts:
            self._intercept.stamp(run)
        return await self._router.insert(run, self.instance_id, self.lease_ms, clean_attributes)

    def _output_decoder(self, run: Run) -> Callable[[Any], Any]:
        """How a handle decodes ``run``'s output: its workflow version's output
        type when registered here, else plain data."""
        try:
            definition = self._registry.get(run.workflow, run.workflow_version or None)
        except WorkflowNotRegistered:
            return lambda value: value
        return definition.typed_output.decode

    async def _singleton_tags(
        self, definition: WorkflowDef, stored_input: Any, run_id: str | None, tags: list[str]
    ) -> tuple[list[str], str]:
        """Tag a singleton run with its key, refusing it if the key's queue is full;
        return the tags and the key."""
        singleton = definition.singleton
        assert singleton is not None
        key = singleton.key(definition.name, definition.parse_input(stored_input))
        tag = singleton_tag(definition.name, key)
        if singleton.max_queue is not None and (
            run_id is None or await self.store.get_run(run_id) is None
        ):
            bound = singleton.limit + singleton.max_queue
            live = await count_live(self.store, definition.name, tag, bound)
            if live >= bound:
                raise SingletonQueueFull(definition.name, key, live)
        return ([*tags, tag] if tag not in tags else tags), key

    async def signal(self, token: str, payload: Any = None) -> str | None:
        """Deliver ``payload`` to the run waiting on ``token``.

        When several waits share the token, the signal goes to exactly one of
        them: the wait registered first (oldest first); the next signal goes to
        the next. Returns the id of the run that received it and is being
        woken, or ``None`` when no run waits yet: then the signal is buffered
        (in order, for ``buffer_ttl``, 7 days by default) and the first
        ``wait_for_signal(token)`` consumes it. Signals sent concurrently, from
        any number of engines, are each delivered or buffered exactly once. A
        token names *one* wait: build it from the run id
        (``f"approve:{run_id}"``), so a late signal for a wait that timed out
        never reaches a later run reusing the token.
        """
        check_signal(token, payload)
        await self.open()
        run_id = await self.store.send_signal(token, payload, self.clock.now_ms())
        if run_id is not None:
            if self._hub.active:
                self._hub.event(
                    EventKind.SIGNAL_DELIVERED, run_id, self.clock.now_ms(), token=token
                )
            await self._router.wake(run_id)
        return run_id

    async def get_value(self, run_id: str, key: str, default: Any = None) -> Any:
        """The last value the run published with ``ctx.set_value(key, ...)``, or ``default``.

        Reads history only: no effect on the run, and it works while the run
        waits and after it ended. Raises :class:`RunNotFound` for an unknown run.
        """
        if not isinstance(key, str) or not key:
            raise ValueError("get_value needs a non-empty key")
        await self.open()
        return await self._outside.get_value(run_id, key, default)

    async def update(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Send update ``name`` with ``payload`` to the run's ``ctx.on_update``
        handler and wait for its answer (:class:`UpdateResult`): accepted with
        the handler's result, rejected by its validator with a reason, failed
        (the handler raised), or ended (the run ended before handling it).

        An update that arrives before the run registers its handler waits in
        the run's inbox; one whose name the run never registers waits until
        the run ends. Sending again with the same ``update_id`` (say, after a
        lost connection) handles it once and returns the same answer. With
        ``timeout`` (seconds) a :class:`TimeoutError` is raised and the update
        stays in the inbox. Raises :class:`RunNotFound` for an unknown run.
        """
        await self.open()
        return await self._updates.update(
            run_id, name, payload, update_id=update_id, timeout=timeout
        )

    # -- entities -------------------------------------------------------------------------

    def entity(
        self,
        name: str,
        *,
        handlers: Mapping[str, EntityHandler],
        initial_state: Any = None,
        ops_per_run: int = 100,
    ) -> None:
        """Register entity ``name``: a durable object per key, whose operations
        ``handlers[op](state, payload) -> (new_state, reply)`` (sync or async)
        are applied one at a time, exactly once, each recorded with the state
        and reply it produced. Key ``k`` lives in run ``entity:<name>:<k>``,
        created by its first call, starting from ``initial_state`` (JSON data;
        a handler gets a copy). After ``ops_per_run`` operations the run
        continues as new with the state, so its history stays bounded.
        """
        definition = EntityDef.build(name, initial_state, handlers, ops_per_run)
        self.register(entity_workflow(name), entity_body(definition))
        self._entities.define(definition)

    async def call_entity(
        self,
        name: str,
        key: str,
        op: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Apply ``op`` with ``payload`` to entity ``name``'s key ``key`` and return
        the handler's reply. A handler that raises leaves the state unchanged
        and raises :class:`EntityError` here (as does an unknown op, or a key
        whose run was cancelled). Pass ``update_id`` to retry a call that may
        have been applied: it is applied once, and the same reply returned.
        """
        await self.open()
        return await self._entities.call(
            name, key, op, payload, update_id=update_id, timeout=timeout
        )

    async def signal_entity(
        self, name: str, key: str, op: str, payload: Any = None, *, update_id: str | None = None
    ) -> str:
        """Send ``op`` to the entity without waiting for its reply; return the
        operation's update id. Applied exactly once (per ``update_id``)."""
        await self.open()
        return await self._entities.signal(name, key, op, payload, update_id=update_id)

    async def get_entity_state(self, name: str, key: str) -> Any:
        """The entity's state after its last applied operation (its initial
        state before any). Reads history only; creates nothing."""
        await self.open()
        return await self._entities.state(name, key)

    async def complete_task(self, token: str, result: Any = None) -> bool:
        """Complete the ``ctx.task`` whose dispatch was given ``token``: its await returns
        ``result``.

        Returns ``False``, changing nothing, when the task was already
        completed or failed, or its run ended (a duplicate completion is a
        no-op). Raises ``ValueError`` for a token no task was given.
        """
        check_signal(token, result)
        await self.open()
        return await self._outside.complete_task(token, task_result(result))

    async def fail_task(
        self, token: str, message: str, *, code: str | None = None, details: Any = None
    ) -> bool:
        """Fail the ``ctx.task`` whose dispatch was given ``token``: its await raises
        :class:`FatalError` (``message``, ``code``, ``details``).

        Returns ``False`` when the task was already answered or its run ended.
        """
        if not isinstance(message, str):
            raise TypeError("fail_task: message must be a string")
        payload = task_failure(message, code, details)
        check_signal(token, payload)
        await self.open()
        return await self._outside.complete_task(token, payload)

    async def deliver_webhook(self, token: str, body: Any = None) -> bool:
        """Hand ``body`` to the ``ctx.webhook()`` whose token is ``token``.

        For your own HTTP route (or use :func:`durably.webhooks.app`). Returns
        ``False``, delivering nothing, for a token no live run's webhook has;
        the secret in it is compared in constant time.
        """
        await self.open()
        return await self._outside.deliver_webhook(token, body)

    async def resume(self, run_id: str) -> bool:
        """Release the run from its ``ctx.breakpoint`` and wake it now.

        A run not at a breakpoint is just woken (a sleeping run checks its
        timer again and sleeps on). Returns ``False`` for an ended run, which
        is left alone; raises :class:`RunNotFound` for an unknown one.
        """
        await self.open()
        return await self._outside.resume(run_id)

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
        return await self._children.cancel(run_id, compensate=compensate)

    async def retry(self, run_id: str) -> Run:
        """Run a failed or dead run again from where it failed.

        Failed checkpoints are cleared (so those steps, waits and children run
        again; failed or dead children are retried too), the stored error is
        cleared, and the run goes back to ``pending``. Completed steps are not
        re-executed.
        """
        await self.open()
        return await self._children.retry(run_id)

    async def retry_with_input(
        self, run_id: str, input: Any, *, new_run_id: str | None = None
    ) -> RunHandle[Any]:
        """Start a fresh run of the same workflow (latest version, same tags
        and priority) with corrected ``input``; the original stays as it is.
        The new id defaults to ``<run_id>~retry~<8 hex>``."""
        await self.open()
        run = await self._children.require(run_id)
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
        if self._router.runs_here(run_id):
            # It executes here: its settle hands the outcome over, no read needed.
            return await self._watcher.wait_local(run_id, statuses, timeout)
        # Read and marked watched: its settles elsewhere are announced here.
        run = await self._watcher.watch(run_id)
        if run is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return await self._watcher.wait(run, statuses, timeout)

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        await self.open()
        return await self.store.get_run(run_id)

    async def get_handle(self, run_id: str) -> RunHandle[Any]:
        """A :class:`RunHandle` on an existing run (raises :class:`RunNotFound`)."""
        await self.open()
        run = await self._children.require(run_id)
        return RunHandle(run, self, self._output_decoder(run))

    async def list_runs(
        self,
        *,
        status: RunStatus | str | list[RunStatus | str] | None = None,
        workflow: str | None = None,
        tag: str | None = None,
        parent_id: str | None = None,
        attributes: list[tuple[str, str, Any]] | dict[str, Any] | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Runs newest first, filtered; pass ``page.next_cursor`` for the next page.

        ``status`` is one status or a list of them; ``parent_id`` keeps the
        children of that run. ``attributes`` are search-attribute conditions
        ``(key, op, value)``, all of which must hold: ``op`` is ``eq``, ``ne``,
        ``lt``, ``lte``, ``gt`` or ``gte`` (a bool takes only ``eq``/``ne``);
        a run without the key never matches, not even ``ne``; a value only
        matches one of its own type (int and float compare together). A dict
        is shorthand for equalities.
        """
        if not 1 <= limit <= 1000:
            raise ValueError("limit must be between 1 and 1000")
        filters = check_attributes_filters(attributes)
        one, several = _status_filter(status)
        await self.open()
        query = RunQuery(
            status=one,
            statuses=several,
            workflow=workflow,
            tag=tag,
            parent_id=parent_id,
            attributes=filters,
            limit=limit,
            cursor=cursor,
        )
        return await self.store.list_runs(query)

    async def get_attributes(self, run_id: str) -> dict[str, Any]:
        """The run's search attributes (a datetime comes back in UTC); raises
        :class:`RunNotFound` for an unknown run."""
        await self.open()
        await self._children.require(run_id)
        return await self.store.get_attributes(run_id)

    async def cancel_where(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        tag: str | None = None,
        attributes: list[tuple[str, str, Any]] | dict[str, Any] | None = None,
        limit: int = 500,
        compensate: bool = False,
    ) -> BulkCancel:
        """Cancel the live runs matching every given filter, newest first, at most
        ``limit`` (1 to 500) per call; ``.more`` says whether matching runs were left.

        Each run is cancelled as :meth:`cancel` does (children too); a run that
        ended meanwhile is not counted in ``cancelled``. ``attributes`` are
        search-attribute conditions, as in :meth:`list_runs`.
        """
        if not 1 <= limit <= 500:
            raise ValueError("limit must be between 1 and 500")
        wanted = [RunStatus(status)] if status is not None else list(_LIVE)
        statuses: list[RunStatus | str] = [s for s in wanted if s not in TERMINAL_STATUSES]
        if not statuses:
            return BulkCancel(0, 0, False)
        # One read for every live status: a page one longer than ``limit`` says
        # whether matching runs are left for the next call.
        page = await self.list_runs(
            status=statuses, workflow=workflow, tag=tag, attributes=attributes, limit=limit + 1
        )
        matched = [run.run_id for run in page.runs[:limit]]
        more = len(page.runs) > limit
        cancelled = 0
        for run_id in matched:
            before = await self.cancel(run_id, compensate=compensate)
            cancelled += 0 if before in TERMINAL_STATUSES else 1
        return BulkCancel(len(matched), cancelled, more)

    async def history(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints in seq order: its step timeline."""
        await self.open()
        await self._children.require(run_id)
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
        max_catchup: int | None = None,
        jitter: Duration | None = None,
    ) -> None:
        """Declare schedule ``name``: start ``workflow`` with ``input`` on every
        window of ``cron`` (five fields, in IANA time zone ``tz``, default UTC)
        or ``every`` interval (``"15m"``; windows at multiples since the epoch).

        Stored when the engine opens and fired by the worker loop of every
        engine on the store, once per window (run id ``sched:<name>:<ms>``).
        ``overlap``: ``"skip"`` a window while the previous run is live,
        ``"allow"`` it, or ``"cancel_previous"``. After downtime only the most
        recent missed window fires, unless ``catchup=True`` (every missed
        window, oldest first; with ``max_catchup=N`` only the N latest of them).
        ``jitter`` starts each window's run up to that much later (a delay
        fixed per window, the same on every instance), so many schedules on
        one boundary do not all start at once. ``paused`` is the state the
        schedule is created in; later pauses and resumes persist across restarts.
        """
        spec = ScheduleSpec.build(
            workflow,
            cron=cron,
            every=every,
            tz=tz,
            input=input,
            overlap=overlap,
            catchup=catchup,
            max_catchup=max_catchup,
            jitter=jitter,
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
        max_catchup: int | None = None,
        jitter: Duration | None = None,
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
            max_catchup=max_catchup,
            jitter=jitter,
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
        return await self._worker.fire_schedules()

    # -- events (durably._events) ------------------------------------------------------------

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
    ) -> RunHandle[Any]:
        """Start ``run_id`` unless it exists (idempotent, like :meth:`start`),
        then send it signal ``token`` with ``payload``; return its handle.

        The signal is buffered until the run waits on ``token``, so entity and
        accumulator workflows can be fed without knowing whether they run yet.
        It is delivered like :meth:`signal`: if other runs wait on ``token``
        too, the oldest wait takes it, so give each run a token of its own.
        """
        check_signal(token, payload)
        handle = await self.start(workflow, input, run_id=run_id, tags=tags, priority=priority)
        await self.signal(token, payload)
        return handle

    # -- worker primitives ----------------------------------------------------------------

    async def run_one(self, run_id: str) -> bool:
        """Lease and execute one turn of ``run_id`` now; ``False`` if it is not
        runnable here (leased elsewhere, terminal, or the engine is draining)."""
        await self.open()
        if self._router.draining:
            return False
        leased = await self._turns.acquire(run_id, wake=True)
        if leased is None:
            return False
        await self._turns.drive(*leased)
        return True

    async def run_pending(self, limit: int = 1000) -> int:
        """Hand pending runs to the executor; return how many.

        With a run queue this is only the safety net for a start whose
        enqueue failed: while the queue still holds runs for this engine's
        pools they will be delivered, so nothing is re-queued (re-queueing
        a backlog would only duplicate it), and a run last written less than
        5 s ago is left for the instance that wrote it, which is most likely
        pushing it now.
        """
        return await self._worker.run_pending(limit)

    async def recover_incomplete(self, limit: int = RECOVERY_BATCH) -> int:
        """Reclaim runs whose executor died (lease expired while ``running``).

        Each recovery is counted; past ``max_recovery_attempts`` the run is
        ``dead``. Returns how many runs were reclaimed.
        """
        return await self._worker.recover_incomplete(limit)

    async def resume_due_timers(self) -> int:
        """Wake suspended runs whose timer is due: at most ``timer_batch_size``
        per call, most overdue first, walked in shuffled order, each claimed
        before it is woken so other instances do not wake it too."""
        return await self._worker.resume_due_timers()

    async def sweep_timeouts(self, limit: int = 100) -> int:
        """Cancel runs past their workflow's ``execution_timeout``."""
        return await self._worker.sweep_timeouts(limit)

    async def sweep_retention(self, limit: int = 500, *, force: bool = False) -> int:
        """Delete terminal runs older than ``retention`` (at most one pass a
        minute unless ``force``), offering each to the ``on_evict`` hooks
        first; a run whose hook raises is kept. Returns how many were deleted."""
        return await self._worker.sweep_retention(limit, force=force)

    async def sweep_buffered(self, limit: int = 1000, *, force: bool = False) -> int:
        """Delete buffered signals and events older than ``buffer_ttl`` (at most
        one pass a minute unless ``force``); returns how many were deleted."""
        return await self._worker.sweep_buffered(limit, force=force)

    async def sweep_stalled(self, limit: int = 500, *, force: bool = False) -> int:
        """Report stalled runs to the ``on_stalled`` hooks (at most one pass a
        minute unless ``force``); returns how many were reported."""
        return await self._worker.sweep_stalled(limit, force=force)

    async def tick(self) -> None:
        """One pass of every worker phase; a failing phase never stops the others."""
        await self._worker.tick()

    def _phases(self) -> list[Phase]:
        # Looked up on the engine at each tick, so a phase replaced on it (a
        # test making one fail) is the one that runs.
        return [
            (self.recover_incomplete, RECOVERY_BATCH),
            (self.resume_due_timers, self.timer_batch_size),
            (self.run_pending, 0),
            (self.sweep_timeouts, 0),
            (self._worker.sweep_blocked, 0),
            (self.fire_schedules, 0),
            (self.sweep_retention, 0),
            (self.sweep_buffered, 0),
            (self.sweep_stalled, 0),
        ]

    def _start_late(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        tags: list[str] | None = None,
        start_at: datetime | None = None,
    ) -> Awaitable[RunHandle[Any]]:
        # Looked up on each call rather than bound once, so schedules, events
        # and failure handlers start through whatever ``start`` this engine has
        # now (a test's fault injection wraps it).
        return self.start(workflow, input, run_id=run_id, tags=tags, start_at=start_at)

    async def _after_failure(self, run: Run) -> None:
        await self._hooks.after_failure(run, self._start_late)

    async def redispatch_pending(self, run_id: str) -> int:
        """Send again the tasks of every dispatched step of ``run_id`` still
        awaiting a result (after a broker outage, say); return how many. A
        duplicate result is harmless: only a pending step is settled."""
        await self.open()
        return await self._steps.redispatch(await self._children.require(run_id))


def _status_filter(
    status: RunStatus | str | list[RunStatus | str] | None,
) -> tuple[RunStatus | None, tuple[RunStatus, ...] | None]:
    # One status keeps its own index-friendly equality; a list is an IN.
    if status is None:
        return None, None
    if isinstance(status, str):
        return RunStatus(status), None
    return None, tuple(dict.fromkeys(RunStatus(one) for one in status))
