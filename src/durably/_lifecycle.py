"""An engine's life: open (connect, migrate, subscribe, wire the run queue),
start the worker, drain, close.

The engine's ``open``/``start_worker``/``drain``/``close``/``join`` delegate
here; :class:`Lifecycle` is handed the collaborators it starts and stops,
never the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ._executor import RunExecutor
from ._replay import CloseReason
from ._run_queue import RunQueue
from .errors import WrongEventLoop
from .transports.base import RunCarrier, SettlingConsumer

if TYPE_CHECKING:
    from ._options import EngineOptions
    from ._routing import RunRouter
    from ._threads import StepThreads
    from ._turns import TurnDriver
    from ._watch import RunWatcher
    from ._worker import Worker
    from .clock import Clock
    from .steps._dispatcher import StepDispatcher
    from .steps._server import StepServer
    from .steps.definition import StepDefinition
    from .stores import StateStore
    from .transports import Transport

__all__ = ["Lifecycle"]


class Lifecycle:
    """Opens, starts, drains and closes what the engine wired."""

    def __init__(
        self,
        store: StateStore,
        transport: Transport,
        clock: Clock,
        *,
        router: RunRouter,
        turns: TurnDriver,
        worker: Worker,
        steps: StepDispatcher,
        step_server: StepServer,
        consume_turns: Callable[[], Awaitable[None]],
        watcher: RunWatcher,
        threads: StepThreads,
        sync_schedules: Callable[[], Awaitable[None]],
        served: Callable[[], dict[str, StepDefinition]],
        options: Callable[[], EngineOptions],
        owner: Callable[[], str],
        close_events: Callable[[], Awaitable[None]],
    ) -> None:
        """``close_events()`` broadcasts the lifecycle events still queued and
        ends every subscription, before the store closes; ``sync_schedules()``
        upserts the schedules declared in code once the store is open;
        ``served()`` names the step handlers to serve; ``options()`` and
        ``owner()`` are read at each use, so settings changed before a start
        (``durably worker`` flags) take effect; ``consume_turns()`` starts
        taking remote workflows' decisions."""
        self._store = store
        self._transport = transport
        self._clock = clock
        self._router = router
        self._turns = turns
        self._worker = worker
        self._steps = steps
        self._step_server = step_server
        self._consume_turns = consume_turns
        self._watcher = watcher
        self._threads = threads
        self._sync_schedules = sync_schedules
        self._served = served
        self._options = options
        self._owner = owner
        self._close_events = close_events
        self._opened = False
        self.listening = False
        """Whether the store pushes other processes' changes (PostgreSQL)."""
        self._consuming = False
        self._open_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def opened(self) -> bool:
        """Whether the store is connected."""
        return self._opened

    async def open(self) -> None:
        """Connect the store, migrate, subscribe and open the transport. Idempotent."""
        if self._opened:
            return
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self.opened:  # another task opened it while we waited for the lock
                return
            options = self._options()
            await self._store.open()
            self._loop = asyncio.get_running_loop()
            try:
                await self._sync_schedules()  # upsert the schedules declared in code
            except BaseException:
                await self._store.close()
                raise
            router = self._router
            router.executor = executor = RunExecutor(
                self._turns.execute,
                options.max_concurrent_runs,
                on_room=self._worker.executor_has_room,
            )
            # A holding turn lends its slot (see durably.steps._holds).
            self._steps.holds.lend, self._steps.holds.reclaim = executor.lend, executor.reclaim
            self._opened = True
            self.listening = await self._store.subscribe(self._worker.on_store_event)
            self._watcher.announced = self.listening
            transport = self._transport
            await transport.open()
            carrier = transport.run_queue() if isinstance(transport, RunCarrier) else None
            if carrier is not None:
                router.run_queue = RunQueue(
                    carrier,
                    self._owner(),
                    options.lease_ms,
                    router.run_from_queue,
                    router.enqueue_failed,
                    router.runs_of,
                    capacity=options.max_concurrent_runs,
                )
            if options.consumers == "always":
                await self.start_consumers()
            if options.instance_id is not None:
                # Our previous incarnation's turns died with it; no one else can
                # hold our id, so reclaim its runs now rather than after the lease.
                await self._worker.expire_own_leases()

    def check_loop(self) -> None:
        """Raise :class:`WrongEventLoop` unless called on the loop the engine opened on."""
        # One identity check per call: an engine's connections and tasks
        # belong to the loop it was opened on, and a call from another loop
        # would fail deep in a driver ("Event loop is closed") or hang.
        if asyncio.get_running_loop() is not self._loop:
            raise WrongEventLoop(
                "this Engine was opened on another event loop (its connections and "
                "tasks belong to that loop); use one loop (e.g. `async with engine` in "
                "your app's lifespan) or one Engine per loop"
            )

    async def start_worker(self) -> None:
        """Open, then start the worker loop and (unless ``consumers="never"``)
        the step consumers."""
        await self.open()
        options = self._options()
        if options.consumers != "never":
            await self.start_consumers()
        router = self._router
        router.draining = False
        if router.executor is not None:
            router.executor.reopen()
        if router.run_queue is not None and options.drives and not router.run_queue.consuming:
            pools = None if options.namespace is None else [options.namespace]
            await router.run_queue.start(pools)
        if options.drives:
            self._worker.start()

    async def start_consumers(self) -> None:
        """Settle step results here and serve this engine's step handlers. Idempotent."""
        if self._consuming:
            return
        self._consuming = True
        steps, transport = self._steps, self._transport
        if not isinstance(transport, SettlingConsumer) or not await transport.consume_settling(
            steps.store, steps.settle_taken, steps.on_results, steps.on_heartbeat
        ):
            await transport.consume_results(steps.on_results, steps.on_heartbeat)
        await self._consume_turns()
        await self._step_server.start(self._served(), self._options().step_concurrency)

    async def drain(self, timeout: float) -> None:
        """Stop taking work, let running turns finish for up to ``timeout``
        seconds, then hand the runs still executing back as ``pending``."""
        router = self._router
        if router.run_queue is not None:
            await router.run_queue.stop_claiming()
        await self._step_server.stop(timeout)
        router.draining = True
        self._steps.holds.release()  # held turns park now, not at the end of their window
        await self._worker.stop()
        if router.executor is None:
            return
        still_running = await router.executor.close(timeout)
        for turn in list(router.active.values()):
            turn.close(CloseReason.DRAIN)
        self._turns.let_go_kept()
        for run_id in [*router.preleased, *router.resumed]:
            # Leased to us (inserted, or woken by a step result) but dropped
            # before their turn.
            router.preleased.pop(run_id, None)
            router.resumed.pop(run_id, None)
            with contextlib.suppress(Exception):
                await self._store.release_run(run_id, self._owner(), self._clock.now_ms())
        if still_running:
            await asyncio.wait(still_running, timeout=5.0)
        if router.run_queue is not None:
            await router.run_queue.hand_back()

    async def close(self, drain_timeout: float) -> None:
        """Drain, stop the worker loop, close the transport and the store."""
        if not self.opened:
            return
        self.check_loop()
        await self.drain(drain_timeout)
        await self._watcher.close()
        if self._router.run_queue is not None:
            await self._router.run_queue.flush()
            self._router.run_queue = None
        await self._transport.close()
        await self._steps.drain()
        await self._close_events()
        self._consuming = False
        self._opened = False
        await self._store.close()
        self._threads.shutdown()
