"""Wiring: build an engine's collaborators, each handed the callables it uses.

Only :class:`~durably.engine.Engine` calls :func:`wire`; what the collaborators
call back on the engine (``open``, ``cancel``, ``start``…) is handed in as
bound methods, so none of them imports the engine, and a method replaced on the
engine (a test's fault injection) is the one they call where they look it up late.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ._children import ChildRuns
from ._events import EventRouter
from ._hooks import Hooks
from ._lifecycle import Lifecycle
from ._ops.env import Services
from ._options import EngineOptions
from ._registry import Registry
from ._routing import RunRouter
from ._start import StartRun
from ._threads import StepThreads
from ._turns import TurnDriver
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
from .transports import Transport

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
    scheduler: Scheduler
    events: EventRouter
    worker: Worker
    lifecycle: Lifecycle


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
    registry = Registry()
    threads = StepThreads(options.step_threads)
    watcher = RunWatcher(store.get_runs)
    router = RunRouter(store, clock, watcher, settings)
    steps = StepDispatcher(
        store,
        transport,
        clock,
        router.resume,
        options.heartbeat_throttle_ms,
        step=registry.step,
        queue=registry.queue,
    )
    children = ChildRuns(
        store,
        clock,
        registry,
        router,
        transport,
        has_flow_queues=registry.has_queues,
    )
    step_server = StepServer(transport, threads, children.ended_runs)
    services = Services(
        store=store,
        clock=clock,
        threads=threads,
        track_start=options.track_start,
        default_retry=RetryPolicy(),
        logger=logging.getLogger("durably.workflow"),
        spawn_children=children.spawn,
        cancel_runs=children.cancel_runs,
        steps=steps,
        redispatch_ms=options.redispatch_ms,
        redispatch_max=options.remote_redispatch_max,
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
    )
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
        watcher=watcher,
        threads=threads,
        sync_schedules=scheduler.sync,
        served=served,
        options=settings,
        owner=owner,
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
        scheduler=scheduler,
        events=events,
        worker=worker,
        lifecycle=lifecycle,
    )
