"""Lifecycle events: what happened to runs and steps, told to whoever listens.

The engine emits a :class:`LifecycleEvent` at each point of a run's life (a
turn starts, a run parks or ends, a step attempt starts and ends, a timer
fires, a signal is delivered). :class:`EventHub` fans each one out to
synchronous listeners (``engine.use`` interceptors, the Prometheus metrics)
and to :class:`Subscription` s (``engine.subscribe()``).

Isolation is the promise: a listener that raises is logged and skipped, and a
subscription is a bounded buffer that drops (and counts) what a slow reader
has no room for, so no listener ever blocks or fails a turn. Every call site
checks :attr:`EventHub.active` before it builds an event, so an engine nobody
listens to pays one attribute read per emission point.

Events of runs executing in other processes arrive as store broadcasts
(PostgreSQL ``NOTIFY``) from engines made with ``publish_events=True``: each
event is sent as compact JSON, at most :data:`NOTICE_ARGUMENT_BYTES` long
(larger fields are left out and ``partial`` is set: read the run or its
checkpoint for the rest).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ._faults import FailureLog
from .model import ErrorInfo

__all__ = [
    "NOTICE_ARGUMENT_BYTES",
    "RUN_OUTCOMES",
    "EventHub",
    "EventKind",
    "LifecycleEvent",
    "Subscription",
]

_log = logging.getLogger("durably.events")

NOTICE_ARGUMENT_BYTES = 1024
"""The most a broadcast event may take: the stores' notice argument bound
(``stores._pg_sql.NOTICE_ARGUMENT_BYTES``), far under PostgreSQL's 8,000."""
_PUBLISH_BACKLOG = 10_000
"""Events waiting to be broadcast before new ones are dropped (a store outage)."""


class EventKind(StrEnum):
    """What a :class:`LifecycleEvent` announces."""

    RUN_STARTED = "run.started"
    """A turn of the run began executing here (``resumed``: not its first)."""
    RUN_SUSPENDED = "run.suspended"
    """A turn ended with the run parked (a timer, a signal, a step, a child)."""
    RUN_COMPLETED = "run.completed"
    RUN_FAILED = "run.failed"
    RUN_CANCELLED = "run.cancelled"
    RUN_DEAD = "run.dead"
    """Recovery gave up on a run that crashed its executor too often."""
    RUN_RECOVERED = "run.recovered"
    """An orphaned run (its executor's lease ran out) was taken back."""
    RUN_FENCED = "run.fenced"
    """A turn here lost its lease to another instance and stopped unsettled."""
    STEP_STARTED = "step.started"
    """An attempt of a local or served step began (one per attempt)."""
    STEP_COMPLETED = "step.completed"
    STEP_FAILED = "step.failed"
    """An attempt failed (``final``: no retry follows in this turn)."""
    STEP_PROGRESS = "step.progress"
    """A dispatched step's heartbeat carried progress."""
    TIMER_FIRED = "timer.fired"
    """A due run was woken (``lag_ms``: how late)."""
    SIGNAL_DELIVERED = "signal.delivered"
    """A signal reached the run waiting on ``token``."""


RUN_OUTCOMES: dict[str, EventKind] = {
    "suspended": EventKind.RUN_SUSPENDED,
    "completed": EventKind.RUN_COMPLETED,
    "failed": EventKind.RUN_FAILED,
    "cancelled": EventKind.RUN_CANCELLED,
    "dead": EventKind.RUN_DEAD,
}
"""The event announcing a run settled in each status (keyed by status value)."""


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """One thing that happened; fields a kind does not carry are ``None``.

    Times are epoch ms on the emitting engine's clock (a served step's: the
    serving process's wall clock).
    """

    kind: EventKind
    run_id: str
    at: int
    workflow: str | None = None
    step: str | None = None
    seq: int | None = None
    attempt: int | None = None
    duration_ms: int | None = None
    """A step attempt's execution time; a run's age when it ended."""
    queue_ms: int | None = None
    """A served step: from dispatch to pickup."""
    error: ErrorInfo | None = None
    """``message``, ``code`` and ``type`` of a failure (no traceback)."""
    progress: Any = None
    lag_ms: int | None = None
    token: str | None = None
    resumed: bool | None = None
    final: bool | None = None
    served: bool | None = None
    """A step attempt executed by a step handler (``ctx.step``), not in the turn."""
    origin: str | None = None
    """The instance id of the engine that emitted it."""
    local: bool = True
    """``False``: heard from another process's broadcast."""
    partial: bool = False
    """Broadcast without a field that did not fit; read the store for it."""

    def to_notice(self) -> str:
        """Compact JSON for a broadcast, within :data:`NOTICE_ARGUMENT_BYTES`."""
        body: dict[str, Any] = {
            name: value
            for name in _WIRE_FIELDS
            if (value := getattr(self, name)) is not None and value is not False
        }
        body["kind"] = self.kind.value
        if self.error is not None:
            body["error"] = {k: self.error.get(k) for k in ("message", "code", "type")}
        text = _dump(body)
        for bulky in ("progress", "error", "token", "step", "workflow"):
            if len(text.encode()) <= NOTICE_ARGUMENT_BYTES:
                break
            if body.pop(bulky, None) is not None:
                body["partial"] = True
                text = _dump(body)
        return text if len(text.encode()) <= NOTICE_ARGUMENT_BYTES else ""

    @classmethod
    def from_notice(cls, text: str) -> LifecycleEvent | None:
        """The event a broadcast carried, heard from elsewhere; ``None`` if malformed."""
        try:
            body = json.loads(text)
            kind = EventKind(body.pop("kind"))
            values = {k: v for k, v in body.items() if k in _WIRE_FIELDS}
            event = cls(kind=kind, local=False, **values)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        # Anyone on the database may NOTIFY: pass on only well-typed events.
        typed = all(
            getattr(event, name) is None or isinstance(getattr(event, name), kinds)
            for name, kinds in _WIRE_TYPES.items()
        )
        return event if typed and isinstance(event.run_id, str) else None


_WIRE_FIELDS = frozenset(
    f for f in LifecycleEvent.__dataclass_fields__ if f not in ("kind", "local")
)


_INT = (int,)
_TEXT = (str,)
_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "at": _INT,
    "workflow": _TEXT,
    "step": _TEXT,
    "seq": _INT,
    "attempt": _INT,
    "duration_ms": _INT,
    "queue_ms": _INT,
    "error": (dict,),
    "lag_ms": _INT,
    "token": _TEXT,
    "resumed": (bool,),
    "final": (bool,),
    "served": (bool,),
    "origin": _TEXT,
    "partial": (bool,),
}


def _dump(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"), default=str)


Listener = Callable[[LifecycleEvent], None]


class Subscription:
    """An ``engine.subscribe()`` stream: an async iterator of events, and an
    async context manager that unsubscribes on exit.

    Events are buffered up to ``maxsize``; while the buffer is full new events
    are dropped and counted in :attr:`dropped`, so a slow reader loses events
    rather than slowing the engine.
    """

    def __init__(
        self,
        hub: EventHub,
        *,
        run_id: str | None,
        kinds: Collection[EventKind | str] | None,
        maxsize: int,
        remote: bool,
    ) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self._hub = hub
        self.run_id = run_id
        self.kinds = None if kinds is None else frozenset(EventKind(k) for k in kinds)
        self.remote = remote
        self.maxsize = maxsize
        self.dropped = 0
        """Events dropped because the buffer was full."""
        self._buffer: deque[LifecycleEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False

    def wants(self, event: LifecycleEvent) -> bool:
        """Whether this subscription's filters take ``event``."""
        return (
            (self.run_id is None or event.run_id == self.run_id)
            and (self.kinds is None or event.kind in self.kinds)
            and (event.local or self.remote)
        )

    def offer(self, event: LifecycleEvent) -> None:
        """Buffer ``event`` if there is room (never blocks)."""
        if self.closed or not self.wants(event):
            return
        if len(self._buffer) >= self.maxsize:
            self.dropped += 1
            return
        self._buffer.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Stop receiving; a reader waiting for an event stops iterating."""
        if self.closed:
            return
        self.closed = True
        self._hub.remove(self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> LifecycleEvent:
        if self.remote:
            await self._hub.hear_remote()
        while not self._buffer:
            if self.closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._buffer.popleft()

    async def __aenter__(self) -> Subscription:
        if self.remote:
            await self._hub.hear_remote()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.close()


Listen = Callable[[Callable[[str, str], None]], Awaitable[Callable[[], None]]]
"""Hear the store's broadcasts: ``listen(listener)`` returns its removal."""
Broadcast = Callable[[str, list[str]], Awaitable[None]]
"""Broadcast ``(kind, arguments)`` on the store's channel."""


@dataclass
class _Remote:
    listen: Listen
    open: Callable[[], Awaitable[None]]
    unlisten: Callable[[], None] | None = None
    starting: asyncio.Lock = field(default_factory=asyncio.Lock)


class EventHub:
    """Fans events out to listeners and subscriptions; see the module docstring."""

    def __init__(self, origin: Callable[[], str], notice_kind: str) -> None:
        """``origin()`` is this engine's instance id; ``notice_kind`` the store
        notice kind events are broadcast under."""
        self._origin = origin
        self._notice_kind = notice_kind
        self._listeners: list[Listener] = []
        self._subscriptions: list[Subscription] = []
        self.active = False
        """Whether anyone listens: call sites build no event otherwise."""
        self._remote: _Remote | None = None
        self._broadcast: Broadcast | None = None
        self._outbox: list[str] = []
        self._flushing: asyncio.Task[None] | None = None
        self.unpublished = 0
        """Events not broadcast (a full backlog, or a store that refused them)."""
        self._failures = FailureLog(_log)

    # -- wiring
    def connect(self, *, listen: Listen | None, open: Callable[[], Awaitable[None]]) -> None:
        """Hear other processes' events through ``listen`` (after ``open()``)."""
        self._remote = None if listen is None else _Remote(listen, open)

    def publish_with(self, broadcast: Broadcast | None) -> None:
        """Broadcast this engine's events for other processes (``None``: stop)."""
        self._broadcast = broadcast
        self._refresh()

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` for every event emitted here; returns its removal."""
        self._listeners.append(listener)
        self._refresh()

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)
                self._refresh()

        return remove

    def subscribe(
        self,
        *,
        run_id: str | None = None,
        kinds: Collection[EventKind | str] | None = None,
        maxsize: int = 1000,
        remote: bool = True,
    ) -> Subscription:
        """A new :class:`Subscription`, receiving from now on."""
        subscription = Subscription(
            self, run_id=run_id, kinds=kinds, maxsize=maxsize, remote=remote
        )
        self._subscriptions.append(subscription)
        self._refresh()
        return subscription

    def remove(self, subscription: Subscription) -> None:
        """Forget ``subscription`` (its :meth:`Subscription.close` calls this)."""
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)
            self._refresh()
        if not any(s.remote for s in self._subscriptions):
            self._stop_hearing()

    def _refresh(self) -> None:
        self.active = bool(self._listeners or self._subscriptions or self._broadcast)

    # -- emitting
    def emit(self, event: LifecycleEvent) -> None:
        """Hand ``event`` to every listener and subscription; never raises."""
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                _log.exception("a lifecycle event listener failed on %s", event.kind)
        for subscription in self._subscriptions:
            subscription.offer(event)
        if self._broadcast is not None:
            self._publish(event)

    def event(self, kind: EventKind, run_id: str, at: int, **fields: Any) -> None:
        """Build and :meth:`emit` an event from this engine."""
        self.emit(LifecycleEvent(kind, run_id, at, origin=self._origin(), **fields))

    # -- across processes
    def _publish(self, event: LifecycleEvent) -> None:
        if len(self._outbox) >= _PUBLISH_BACKLOG:
            self.unpublished += 1
            return
        notice = event.to_notice()
        if not notice:
            self.unpublished += 1
            return
        self._outbox.append(notice)
        if self._flushing is None or self._flushing.done():
            # Sent off the turn's path, many events per statement.
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)
        while self._outbox and self._broadcast is not None:
            batch, self._outbox = self._outbox, []
            try:
                await self._broadcast(self._notice_kind, batch)
            except Exception as exc:
                self.unpublished += len(batch)
                self._failures.failed("broadcasting lifecycle events", exc)
            else:
                self._failures.succeeded("broadcasting lifecycle events")

    async def flush(self) -> None:
        """Wait until the events emitted so far were broadcast (or given up)."""
        flushing = self._flushing
        if flushing is not None:
            await asyncio.gather(flushing, return_exceptions=True)

    async def hear_remote(self) -> None:
        """Start hearing other processes' broadcasts (once; a no-op without a channel)."""
        remote = self._remote
        if remote is None or remote.unlisten is not None:
            return
        async with remote.starting:
            if remote.unlisten is None:
                await remote.open()
                remote.unlisten = await remote.listen(self._heard)

    def _heard(self, kind: str, argument: str) -> None:
        if kind != self._notice_kind or not self._subscriptions:
            return
        event = LifecycleEvent.from_notice(argument)
        if event is None or event.origin == self._origin():
            return  # ours: delivered when emitted
        for subscription in list(self._subscriptions):
            subscription.offer(event)

    def _stop_hearing(self) -> None:
        remote = self._remote
        if remote is not None and remote.unlisten is not None:
            unlisten, remote.unlisten = remote.unlisten, None
            unlisten()

    async def close(self) -> None:
        """Broadcast what is queued, stop hearing, and end every subscription."""
        await self.flush()
        for subscription in list(self._subscriptions):
            subscription.close()
        self._stop_hearing()
