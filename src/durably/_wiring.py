"""Wiring: build an engine's collaborators, each handed the callables it uses.

Only :class:`~durably.engine.Engine` calls :func:`wire`; what the collaborators
call back on the engine (``open``, ``cancel``, ``start``…) is handed in as
bound methods, so none of them imports the engine, and a method replaced on the
engine (a test's fault injection) is the one they call where they look it up late.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ._children import ChildRuns
from ._entities import Entities
from ._events import EventRouter
from ._hooks import Hooks
from ._intercept import Interceptors
from ._lifecycle import Lifecycle
from ._lifecycle_events import EventHub
from ._logs import engine_logger
from ._notices import StoreNotice
from ._ops.env import Services
from ._options import EngineOptions
from ._queue import MessageStore
from ._registry import Registry
from ._remote.routing import CapabilityRouter
from ._remote.turns import RemoteTurns
from ._routing import RunRouter
from ._start import StartRun
from ._step_faults import StepFaults
from ._threads import StepThreads
from ._turns import TurnDriver
from ._update_calls import UpdateCalls
from ._watch import RunWatcher
from ._worker import Phase, Worker
from .clock import Clock
from .model import Run
from .retry import RetryPolicy
from .schedules import Scheduler
from .steps._dispatcher import StepDispatcher
from .steps._server import StepServer
from .steps.definition import StepDefinition
from .stores import StateStore
from .stores.base import TurnLease
from .transports import Transport
from .transports.base import CheckpointSender, EventCarrier, TurnCarrier

__all__ = ["Parts", "wire"]


@dataclass(frozen=True, slots=True)
class Parts:
    """An engine's collaborators."""

    hooks: Hooks
    registry: Registry
    threads: StepThreads
    watcher: RunWatcher
    router: RunRouter
    steps: StepDispatcher
    children: ChildRuns
    step_server: StepServer
    turns: TurnDriver
    remote: RemoteTurns
    capabilities: CapabilityRouter
    scheduler: Scheduler
    events: EventRouter
    worker: Worker
    lifecycle: Lifecycle
    faults: StepFaults
    hub: EventHub
    intercept: Interceptors
    updates: UpdateCalls
    entities: Entities


def wire(
    options: EngineOptions,
    store: StateStore,
    clock: Clock,
    transport: Transport,
    namespace: str,
    *,
    settings: Callable[[], EngineOptions],
    owner: Callable[[], str],
    open: Callable[[], Awaitable[None]],
    cancel: Callable[[str], Awaitable[Any]],
    start: StartRun,
    after_failure: Callable[[Run], Awaitable[None]],
    phases: Callable[[], list[Phase]],
    served: Callable[[], dict[str, StepDefinition]],
) -> Parts:
    """Build the collaborators. ``options`` are read once (sizes, throttles);
    ``settings()`` and ``owner()`` at each use, for what may change before
    a start."""
    hooks = Hooks()
    hub = events_hub(store, transport, owner, open, publish=options.publish_events)
    intercept = Interceptors()
    registry = Registry()
    threads = StepThreads(options.step_threads)
    # A wrapped store may not forward watch_runs: it then just reads.
    watcher = RunWatcher(
        store.get_runs,
        watch_runs=getattr(store, "watch_runs", None),
        get_statuses=getattr(store, "get_run_statuses", None),
    )
    router = RunRouter(store, clock, watcher, settings)
    watcher.runs_here = router.runs_here  # its turns' settles outrank reads
    updates = UpdateCalls(store, clock, router.wake)
    entities = Entities(store, updates, start)
    steps = StepDispatcher(
        store,
        transport,
        clock,
        router.resume,
        options.heartbeat_throttle_ms,
        step=registry.step,
        queue=registry.queue,
        intercept=intercept,
        events=hub,
        hold_ms=lambda: settings().step_hold_ms,
    )

    holds = steps.holds
    # A holding turn lends its slot, so holds have their own bound: as many
    # idle turns as the slots, or as the kept bodies (the same memory each).
    most_held = max(options.max_concurrent_runs, options.sticky_runs)

    def may_hold() -> bool:
        # None while draining, or where no turns run.
        return router.accepting and router.executor is not None and holds.holding < most_held

    holds.may_hold = may_hold  # lend and reclaim: the executor's, once it exists
    children = ChildRuns(
        store,
        clock,
        registry,
        router,
        transport,
        has_flow_queues=registry.has_queues,
        events=hub,
    )
    faults = StepFaults()
    step_server = StepServer(transport, threads, children.ended_runs, intercept, hub, faults)

    def carrier() -> TurnCarrier | None:
        return transport if isinstance(transport, TurnCarrier) else None

    capabilities = CapabilityRouter(carrier, registry, lambda: namespace)
    services = Services(
        store=store,
        clock=clock,
        threads=threads,
        track_start=options.track_start,
        default_retry=RetryPolicy(),
        logger=engine_logger("durably.workflow"),
        spawn_children=children.spawn,
        cancel_runs=children.cancel_runs,
        steps=steps,
        redispatch_ms=options.redispatch_ms,
        redispatch_max=options.remote_redispatch_max,
        faults=faults,
        webhook_base_url=options.webhook_base_url,
        intercept=intercept,
        events=hub,
        child_output=registry.output_decoder,
        step_guard=capabilities.check_step,
        compensation_retries=options.compensation_retries,
        update_answered=updates.answered,
        entity_call=entities.call,
        entity_signal=entities.signal,
    )
    turns = TurnDriver(
        store,
        clock,
        registry,
        router,
        children,
        services,
        after_failure,
        settings,
        owner,
    )

    remote = RemoteTurns(
        store,
        clock,
        carrier=carrier,
        dispatch=steps.dispatch,
        spawn_children=children.spawn,
        conclude=turns.conclude,
        options=settings,
        owner=owner,
        has_remote=lambda: bool(registry.remote()),
    )
    turns.remote_turn = remote.turn

    def lease_for_results(count: int) -> TurnLease | None:
        # The runs a results batch wakes are leased in its transaction, as
        # many as this process has free turn slots for.
        slots = min(count, router.free_slots())
        return turns.turn_lease(slots) if slots > 0 else None

    steps.lease_turns = lease_for_results
    steps.resume_leased = router.resume_leased
    if isinstance(transport, CheckpointSender):
        steps.send_with_checkpoint = transport.checkpoint_sender(store)
    remote.guard = capabilities.check
    scheduler = Scheduler(store, clock, namespace, registry, start=start, cancel=cancel)
    events = EventRouter(
        store,
        clock,
        registry,
        open=open,
        wake=router.wake,
        start=start,
    )
    worker = Worker(
        store,
        clock,
        router,
        children,
        hooks,
        open=open,
        phases=phases,
        fire_schedules=scheduler.fire,
        after_failure=after_failure,
        options=settings,
        owner=owner,
        executable=registry.executable,
        events=hub,
    )
    turns.timer_set = worker.timer_set
    worker.wake_heard = steps.holds.wake_heard
    # A cancel heard from another instance stops the turn running here.
    transport.on_cancel(worker.heard_cancel)
    lifecycle = Lifecycle(
        store,
        transport,
        clock,
        router=router,
        turns=turns,
        worker=worker,
        steps=steps,
        step_server=step_server,
        consume_turns=remote.start,
        watcher=watcher,
        threads=threads,
        sync_schedules=scheduler.sync,
        served=served,
        options=settings,
        owner=owner,
        close_events=hub.close,
    )
    return Parts(
        hooks=hooks,
        registry=registry,
        threads=threads,
        watcher=watcher,
        router=router,
        steps=steps,
        children=children,
        step_server=step_server,
        turns=turns,
        remote=remote,
        capabilities=capabilities,
        scheduler=scheduler,
        events=events,
        worker=worker,
        lifecycle=lifecycle,
        faults=faults,
        hub=hub,
        intercept=intercept,
        updates=updates,
        entities=entities,
    )


def events_hub(
    store: StateStore,
    transport: Transport,
    owner: Callable[[], str],
    open: Callable[[], Awaitable[None]],
    *,
    publish: bool,
) -> EventHub:
    """The engine's lifecycle events; across processes through the transport's
    fan-out where it has one (Redis pub/sub), else through the store's
    broadcasts when it keeps a message queue (SQLite: this process only)."""
    hub = EventHub(owner, StoreNotice.EVENT)
    if isinstance(transport, EventCarrier):
        carrier = transport
        hub.connect(listen=carrier.listen_events, open=open)
        if publish:
            hub.publish_with(carrier.broadcast_events)
    elif isinstance(store, MessageStore):
        messages = store.messages
        hub.connect(listen=lambda listener: messages().listen(listener), open=open)
        if publish:
            hub.publish_with(lambda kind, notices: messages().broadcast(kind, notices))
    return hub
