"""``TestEnv``: an engine on a virtual clock that a test moves forward in big steps.

``await env.advance("14d")`` walks time to every moment something is due in
that span (a durable timer, a wait's timeout, an execution deadline, a
schedule window, an in-process backoff), in order, and after each runs the
work it woke until nothing is left to do, so what a timer at day 3 schedules
for day 5 also fires before a timer due at day 10.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from ..durations import Duration, to_ms
from ..engine import Engine
from ..model import TERMINAL_STATUSES, Checkpoint, CheckpointStatus, Run, RunStatus
from ..stores import RunQuery, StateStore, open_store
from .clock import VirtualClock

__all__ = ["TestEnv"]

Setup = Callable[[Engine], object]
"""Registers an application's workflows and steps on the engine it is given."""

_MISSING: Any = object()
# Polls of the executor (5 ms apart) during which the virtual clock's sleepers
# must stay the same before executing turns count as waiting on the clock.
_STILL_POLLS = 20
_MAX_ROUNDS = 10_000
_SETTLE_TIMEOUT = 30.0
_CONFIRM_S = 0.01


class TestEnv:
    """A time-skipping test environment around an engine on a :class:`VirtualClock`.

    ``TestEnv()`` builds an engine on ``memory://`` (or ``store=``); pass a
    function that registers your workflows on the engine it is given (so
    :meth:`restart` can build a fresh one after a simulated crash), or an
    engine created with ``clock=VirtualClock()``::

        async with TestEnv(register) as env:
            run_id = await env.start("trial", {"user": "ada"})
            await env.advance("14d")
            await env.assert_completed(run_id, output="converted")

    The engine it builds has ``reconcile=0`` (no fallback wake every 5 minutes
    of virtual time while a run waits for a signal; give an engine you pass
    ``reconcile=0`` too, or ``advance`` stops at each of those wakes) and a
    stable instance id.
    Nothing here sleeps for real: runs advance only through the calls below.
    """

    __test__ = False  # pytest: this is no test class, whatever its name

    def __init__(
        self,
        app: Engine | Setup | None = None,
        *,
        store: str | StateStore = "memory://",
        start: datetime | int | None = None,
        **engine_options: Any,
    ) -> None:
        self._setup: Setup | None = None
        self._builds = not isinstance(app, Engine)
        if isinstance(app, Engine):
            if not isinstance(app.clock, VirtualClock):
                raise TypeError(
                    "TestEnv needs an engine created with clock=VirtualClock(); "
                    "or pass a function that registers your workflows on an engine"
                )
            if engine_options or start is not None:
                raise TypeError("engine options and start= apply only to an engine TestEnv builds")
            self.clock: VirtualClock = app.clock
            """The virtual clock every engine of this environment reads."""
            self.engine: Engine = app
            """The engine runs execute on (a fresh one after :meth:`restart`)."""
        elif app is None or callable(app):
            self._setup = app
            self.clock = VirtualClock(start)
            # One store object for every engine of the test: a memory store is
            # the process's, a file is shared anyway.
            self._store: StateStore | str = open_store(store) if store == "memory://" else store
            self._options = {
                "reconcile": 0,
                "instance_id": "durably-test-env",
                # Real seconds: the worker loop runs (starts take the fast path),
                # but this environment, not its timer, decides when work happens.
                "poll_interval": 3600.0,
                **engine_options,
            }
            self.engine = self._build()
        else:
            raise TypeError(f"TestEnv takes an Engine or a setup function, not {app!r}")
        self._engines = [self.engine]

    def _build(self) -> Engine:
        engine = Engine(self._store, clock=self.clock, **self._options)
        if self._setup is not None:
            if inspect.iscoroutinefunction(self._setup):
                raise TypeError("the setup function must be synchronous (it only registers)")
            self._setup(engine)
        return engine

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> TestEnv:
        await self.engine.start_worker()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every engine this environment used."""
        for engine in self._engines:
            await engine.close()

    @property
    def now(self) -> datetime:
        """The virtual time, an aware UTC datetime."""
        return datetime.fromtimestamp(self.clock.now_ms() / 1000, tz=UTC)

    # -- driving -----------------------------------------------------------------------

    async def start(self, workflow: str, input: Any = None, **options: Any) -> str:
        """Start a run (:meth:`Engine.start`'s arguments), run until idle, return its id."""
        run = await self.engine.start(workflow, input, **options)
        await self.run_until_idle()
        return run.run_id

    async def signal(self, token: str, payload: Any = None) -> str | None:
        """Send a signal (:meth:`Engine.signal`) and run until idle."""
        receiver = await self.engine.signal(token, payload)
        await self.run_until_idle()
        return receiver

    async def publish_event(self, name: str, payload: Any = None, **options: Any) -> int:
        """Publish an event (:meth:`Engine.publish_event`) and run until idle."""
        received = await self.engine.publish_event(name, payload, **options)
        await self.run_until_idle()
        return received

    async def advance(self, duration: Duration) -> None:
        """Move the clock forward by ``duration``, stopping at every moment
        something is due on the way and running what it wakes until idle."""
        target = self.clock.now_ms() + to_ms(duration, name="advance")
        await self.run_until_idle()
        while (due := await self._next_due()) is not None and due <= target:
            self.clock.advance((due - self.clock.now_ms()) / 1000)
            await self.run_until_idle()
        if target > self.clock.now_ms():
            self.clock.advance((target - self.clock.now_ms()) / 1000)
            await self.run_until_idle()

    async def run_until_idle(self) -> None:
        """Run the worker's phases (recovery, due timers, pending runs,
        timeouts, schedules) and the turns they start, until a pass finds
        nothing to do and nothing executes. A turn that waits on the virtual
        clock (a retry's backoff) counts as idle: :meth:`advance` moves it on."""
        engine = self.engine
        quiet = 0
        for _ in range(_MAX_ROUNDS):
            worked = 0
            for phase in (
                engine.recover_incomplete,
                engine.resume_due_timers,
                engine.run_pending,
                engine.sweep_timeouts,
                engine.fire_schedules,
            ):
                worked += await phase()
            executing = await self._settle()
            if worked:
                quiet = 0
            elif executing:
                return  # every executing turn waits on the virtual clock
            elif await self._steps_out():
                quiet = 0
            else:
                # Quiet twice, a moment apart: a step result saved just now
                # wakes its run a few loop iterations (or a round trip) later.
                quiet += 1
                if quiet == 2:
                    return
                await asyncio.sleep(_CONFIRM_S)
        raise RuntimeError(f"still busy after {_MAX_ROUNDS} rounds: a run keeps waking itself")

    async def _settle(self) -> bool:
        """Wait until no turn executes; ``True`` if some still execute, waiting on the clock."""
        join = asyncio.ensure_future(self.engine.join())
        still, last = 0, None
        give_up = asyncio.get_running_loop().time() + _SETTLE_TIMEOUT
        try:
            while not join.done():
                if asyncio.get_running_loop().time() > give_up:
                    raise TimeoutError(
                        f"turns still executing after {_SETTLE_TIMEOUT:.0f}s of real time "
                        "(a step that never returns?)"
                    )
                await asyncio.wait({join}, timeout=0.005)
                shape = tuple(self.clock.deadlines)
                still = still + 1 if shape and shape == last else 0
                last = shape
                if still >= _STILL_POLLS:
                    return True
            return False
        finally:
            join.cancel()

    async def _steps_out(self) -> bool:
        """Whether a dispatched step this engine serves is still out (its result
        is on the way); then there is more to do, so wait a moment."""
        served = set(self.engine.served_steps)
        if not served:
            return False
        for run in await self._runs():
            if run.status is RunStatus.SUSPENDED:
                for checkpoint in await self.engine.history(run.run_id):
                    if (
                        checkpoint.kind == "step"
                        and checkpoint.name in served
                        and checkpoint.status is CheckpointStatus.PENDING
                        and checkpoint.wake_at is None
                    ):
                        await asyncio.sleep(0.005)
                        return True
        return False

    async def _next_due(self) -> int | None:
        now = self.clock.now_ms()
        times = [deadline for deadline in self.clock.deadlines if deadline > now]
        for run in await self._runs():
            if run.status in TERMINAL_STATUSES:
                continue
            if run.status is RunStatus.SUSPENDED and run.wake_at is not None:
                times.append(run.wake_at)
            if run.deadline_at is not None:
                times.append(run.deadline_at)
        for schedule in await self.engine.list_schedules():
            if not schedule.paused and schedule.next_fire_at is not None:
                times.append(schedule.next_fire_at)
        later = [t for t in times if t > now]
        return min(later) if later else None

    async def _runs(self) -> list[Run]:
        runs: list[Run] = []
        cursor: str | None = None
        while True:
            page = await self.engine.store.list_runs(RunQuery(limit=1000, cursor=cursor))
            runs.extend(page.runs)
            if page.next_cursor is None:
                return runs
            cursor = page.next_cursor

    # -- faults ------------------------------------------------------------------------

    def fail_step(self, name: str, *, times: int = 1, error: BaseException | None = None) -> None:
        """Make the next ``times`` executions of step ``name`` (local or
        dispatched) raise ``error`` (an :class:`InjectedFault` by default);
        the step's retry policy then decides what happens."""
        self.engine._step_faults.fail(name, times, error)

    def crash_after(self, name: str) -> None:
        """Simulate a crash of the process once local step ``name`` next
        completes: its result is saved, then the engine writes nothing more and
        the run stays leased to it. :meth:`restart` brings up a fresh engine."""
        self.engine._step_faults.crash_after(name)

    @property
    def crashed(self) -> list[str]:
        """The steps after which a simulated crash happened, in order."""
        return list(self.engine._step_faults.crashed)

    async def restart(self, engine: Engine | None = None) -> Engine:
        """Replace the engine with a fresh one on the same store, as a process
        restarted after a crash: the runs the old one held are recovered at
        once (same instance id) and resume from their last checkpoint.

        Pass ``engine`` when this environment was given an engine rather than
        a setup function (it must use this environment's clock and store).
        """
        old = self.engine
        if engine is None:
            if not self._builds:
                raise TypeError("restart() needs a fresh engine: pass restart(engine=...)")
            engine = self._build()
        elif engine.clock is not self.clock:
            raise TypeError("the fresh engine must use this environment's clock")
        engine._step_faults.adopt(old._step_faults)
        # The old process is gone: it takes no more turns and hands nothing back.
        await old.close()
        self.engine = engine
        self._engines.append(engine)
        await engine.start_worker()
        await self.run_until_idle()
        return engine

    # -- assertions --------------------------------------------------------------------

    def step_calls(self, name: str) -> int:
        """How many times step ``name`` executed (every attempt, every engine)."""
        return self.engine._step_faults.calls[name]

    async def steps_ran(self, run_id: str) -> list[str]:
        """The names of the run's completed operations, in position order."""
        return [
            checkpoint.name
            for checkpoint in await self.engine.history(run_id)
            if checkpoint.status is CheckpointStatus.COMPLETED
        ]

    async def history(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints in position order."""
        return await self.engine.history(run_id)

    async def assert_status(self, run_id: str, status: RunStatus | str) -> Run:
        """Fail unless the run is in ``status``; return it."""
        run = await self.engine.get_run(run_id)
        assert run is not None, f"no run {run_id!r}"
        expected = RunStatus(status)
        assert run.status is expected, f"run {run_id!r} is {run.status}, expected {expected}" + (
            f"; error: {run.error.get('message')}" if run.error else ""
        )
        return run

    async def assert_completed(self, run_id: str, output: Any = _MISSING) -> Run:
        """Fail unless the run completed (with ``output``, when given); return it."""
        run = await self.assert_status(run_id, RunStatus.COMPLETED)
        if output is not _MISSING:
            assert run.output == output, f"run {run_id!r} returned {run.output!r}, not {output!r}"
        return run

    async def assert_failed(self, run_id: str, match: str | None = None) -> Run:
        """Fail unless the run failed (with ``match`` in its error message); return it."""
        run = await self.assert_status(run_id, RunStatus.FAILED)
        message = (run.error or {}).get("message", "")
        if match is not None:
            assert match in message, f"run {run_id!r} failed with {message!r}, not {match!r}"
        return run
