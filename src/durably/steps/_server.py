"""The worker side of dispatched steps: run a task's handler, send its result.

One :class:`StepServer` per engine serves the handlers registered with
``@engine.step`` over the engine's transport. It turns every handler outcome
into a result message (an exception never escapes, so a task is only
delivered again when this process dies), beats at pickup and while the
handler runs, and tells handlers when their run was cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any

from .._aio import EarliestTimer, wait_event
from .._intercept import Interceptors, StepInfo
from .._lifecycle_events import EventHub, EventKind
from .._logs import RUN_CONTEXT, LogContext, engine_logger
from .._step_faults import StepFaults
from .._threads import StepThreads
from ..clock import wall_ms
from ..transports.base import Transport, TransportError
from ..wire import Heartbeat, StepResult, StepTask, routing_token
from .definition import BEAT_INTERVAL_S, StepDefinition, StepLogger, failure_of

__all__ = ["StepServer", "served_tokens"]

_log = engine_logger("durably.worker")
_CANCEL_POLL_S = 1.0
_PICKUP_BEAT_DELAY_S = 0.005
"""The pickup beat goes out once the handler has run this long: a handler
done sooner sends its result about as soon, and that says the same (its
``started_at`` travels with it). Under load the beat of every short step was a
message of its own for the transport and a write for the engine."""

CancelCheck = Callable[[list[str]], Awaitable[dict[str, bool]]]
"""Given run ids, return those that ended or are being cancelled (read from
the store), each mapped to whether it ended (``False``: a compensating cancel
is unwinding it)."""


class _Served:
    """A handler running here: what its beats need."""

    __slots__ = ("began", "log", "next_at", "picked", "started", "task")

    def __init__(self, task: StepTask, log: StepLogger, started: int, began: float) -> None:
        self.task = task
        self.log = log
        self.started = started
        """Wall ms at pickup (the pickup beat's time)."""
        self.began = began
        """Loop time at pickup."""
        self.picked = False
        """Whether its pickup beat went out."""
        self.next_at = began + _PICKUP_BEAT_DELAY_S
        """Loop time of its next beat check."""


def served_tokens(
    definitions: Iterable[StepDefinition],
    namespace: str,
    serve_steps: Collection[str] | None,
    serve_groups: Collection[str] | None,
) -> dict[str, StepDefinition]:
    """The steps a worker serves (after ``serve_steps`` / ``serve_groups``),
    by the routing token their tasks arrive under in ``namespace``."""
    served: dict[str, StepDefinition] = {}
    for definition in definitions:
        if serve_steps is not None and definition.name not in serve_steps:
            continue
        if serve_groups is not None and definition.group not in serve_groups:
            continue
        served[routing_token(definition.name, namespace)] = definition
    return served


def _ended(events: EventHub, kind: EventKind, task: StepTask, started: int, **fields: Any) -> None:
    """Emit the event of a served step's attempt that ended (``kind``) now."""
    now = wall_ms()
    events.event(
        kind,
        task.run_id,
        now,
        step=task.name,
        seq=task.seq,
        attempt=task.attempt,
        served=True,
        duration_ms=now - started,
        **fields,
    )


class StepServer:
    """Serves step handlers by routing token; see the module docstring."""

    def __init__(
        self,
        transport: Transport,
        threads: StepThreads,
        cancelled_runs: CancelCheck,
        intercept: Interceptors,
        events: EventHub,
        faults: StepFaults | None = None,
    ) -> None:
        self._transport = transport
        self._faults = StepFaults() if faults is None else faults
        self._threads = threads
        self._cancelled_runs = cancelled_runs
        self._intercept = intercept
        self._events = events
        self._by_token: dict[str, StepDefinition] = {}
        self._running: dict[str, _Served] = {}
        self._sweep = EarliestTimer(self._sweep_now)
        self._watch: asyncio.Task[None] | None = None
        # Made by the first stop that finds handlers running, set when the
        # last ends: an event set and cleared per served step was a cost of each.
        self._idle: asyncio.Event | None = None
        self._beats: set[asyncio.Future[None]] = set()
        transport.on_cancel(self._cancel)

    async def start(self, by_token: dict[str, StepDefinition], concurrency: int) -> None:
        """Serve these definitions (keyed by routing token)."""
        self._by_token = dict(by_token)
        if not self._by_token:
            return
        await self._transport.serve(list(self._by_token), self.handle, concurrency=concurrency)
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_cancellations(), name="durably-cancels")

    async def stop(self, timeout: float) -> None:
        """Stop taking tasks and give running handlers up to ``timeout`` seconds."""
        if self._by_token:
            await self._transport.stop_serving()
        if self._running:
            if self._idle is None:
                self._idle = asyncio.Event()
            self._idle.clear()
            await wait_event(self._idle, timeout)
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def handle(self, task: StepTask) -> None:
        """Run one task and send its result (never raises for a handler failure)."""
        definition = self._by_token.get(task.group)
        if definition is None or definition.name != task.name:
            await self._transport.send_result(StepResult.no_handler(task))
            return
        # One coroutine from here to the handler where there were three: a
        # frame per layer per served step was measurable.
        context = RUN_CONTEXT.set(LogContext(task.run_id, None, task.name))
        try:
            await self._transport.send_result(await self._run(definition, task))
        finally:
            RUN_CONTEXT.reset(context)

    async def _run(self, definition: StepDefinition, task: StepTask) -> StepResult:
        loop = asyncio.get_running_loop()
        log = StepLogger(task.run_id, task.seq, task.name, task.attempt, task.context)

        def beat(progress: Any) -> None:
            message = Heartbeat(task.run_id, task.seq, task.group, wall_ms(), progress)
            loop.call_soon_threadsafe(self._send_beat, message)

        log._beat = beat
        started = wall_ms()
        step_id = task.step_id
        began = loop.time()
        self._running[step_id] = _Served(task, log, started, began)
        # No timer of its own: most handlers end before their pickup beat is
        # due, and a timer per step (two, with the ticker) was ~6% of a
        # dispatched step's CPU; one sweep timer serves every running handler.
        self._sweep.arm(began + _PICKUP_BEAT_DELAY_S)
        try:
            return await self._execute(definition, task, log, started)
        finally:
            self._running.pop(step_id, None)
            if not self._running and self._idle is not None:
                self._idle.set()

    async def _execute(
        self, definition: StepDefinition, task: StepTask, log: StepLogger, started: int
    ) -> StepResult:
        events = self._events
        if events.active:
            events.event(
                EventKind.STEP_STARTED,
                task.run_id,
                started,
                step=task.name,
                seq=task.seq,
                attempt=task.attempt,
                served=True,
                queue_ms=None if task.sent_at is None else max(0, started - task.sent_at),
            )
        try:
            self._faults.starting(task.name)
            data = definition.parse_input(task.input)
            args = (data, log) if definition.takes_logger else (data,)
            if self._intercept.steps:
                info = StepInfo(
                    task.run_id,
                    task.name,
                    task.seq,
                    task.attempt,
                    "served",
                    traceparent=task.traceparent,
                )
                value = await self._intercept.run_step(info, lambda: self._call(definition, args))
            elif definition.is_async:
                value = await definition.fn(*args)
            else:
                value = await self._call(definition, args)
            output = definition.dump_output(value)
        except Exception as exc:
            _log.info(
                "step %s (%s) attempt %d failed: %s", task.name, task.step_id, task.attempt, exc
            )
            failure = failure_of(exc)
            if events.active:
                _ended(events, EventKind.STEP_FAILED, task, started, error=failure)
            return StepResult(
                task.run_id,
                task.seq,
                ok=False,
                error=failure,
                started_at=started,
                events=list(log.events),
            )
        if events.active:
            _ended(events, EventKind.STEP_COMPLETED, task, started)
        return StepResult(
            task.run_id,
            task.seq,
            ok=True,
            output=output,
            started_at=started,
            events=list(log.events),
        )

    async def _call(self, definition: StepDefinition, args: tuple[Any, ...]) -> Any:
        if definition.is_async:
            return await definition.fn(*args)
        value = await self._threads.call(definition.fn, args)
        if inspect.isawaitable(value):
            value = await value
        return value

    def _sweep_now(self) -> None:
        """Send the pickup beat of each handler that has run
        ``_PICKUP_BEAT_DELAY_S``, and beat every ``BEAT_INTERVAL_S`` for one
        that has not beaten itself for an interval (a long handler that never
        calls ``log.heartbeat()`` would look dead to a dispatcher with a
        timeout); come back when the next of these is due."""
        now = asyncio.get_running_loop().time()
        due = float("inf")
        for served in self._running.values():
            if served.next_at > now:
                due = min(due, served.next_at)
                continue
            task = served.task
            if not served.picked:
                served.picked = True
                self._send_beat(Heartbeat(task.run_id, task.seq, task.group, served.started))
                served.next_at = served.began + BEAT_INTERVAL_S
            else:
                if time.monotonic() - served.log._last_beat >= BEAT_INTERVAL_S:
                    self._send_beat(Heartbeat(task.run_id, task.seq, task.group, wall_ms()))
                served.next_at = now + BEAT_INTERVAL_S
            due = min(due, served.next_at)
        if due != float("inf"):
            self._sweep.arm(due)

    def _send_beat(self, beat: Heartbeat) -> None:
        sending = asyncio.ensure_future(self._send_beat_now(beat))
        self._beats.add(sending)
        sending.add_done_callback(self._beats.discard)

    async def _send_beat_now(self, beat: Heartbeat) -> None:
        try:
            await self._transport.send_heartbeat(beat)
        except TransportError as exc:
            # The broker is down: one line per beat, not a traceback each
            # (a lost beat costs at most one silence window).
            _log.warning("could not send a heartbeat for %s: %s", beat.step_id, exc)
        except Exception:
            _log.warning("could not send a heartbeat for %s", beat.step_id, exc_info=True)

    def _cancel(self, run_ids: Collection[str], unwinding: Collection[str] = ()) -> None:
        """Tell the handlers of ``run_ids`` (runs that ended) that their run is
        cancelled, and those of ``unwinding`` (runs a compensating cancel is
        unwinding) but their undos (``seq < 0``): those are the unwind itself."""
        ended, undoing = set(run_ids), set(unwinding)
        for served in self._running.values():
            log = served.log
            if log.run_id in ended or (log.run_id in undoing and log.seq >= 0):
                log._cancelled = True

    async def _watch_cancellations(self) -> None:
        # The store is the source of truth: a cancel notice lost on the
        # transport still reaches the handler within a poll.
        while True:
            await asyncio.sleep(_CANCEL_POLL_S)
            run_ids = sorted({served.log.run_id for served in self._running.values()})
            if not run_ids:
                continue
            try:
                found = await self._cancelled_runs(run_ids)
                self._cancel(
                    [run for run, ended in found.items() if ended],
                    [run for run, ended in found.items() if not ended],
                )
            except Exception:
                _log.warning("could not check runs for cancellation", exc_info=True)
