"""Prometheus metrics of an engine (``pip install 'durably[prometheus]'``).

::

    import durably.prometheus

    metrics = durably.prometheus.metrics()     # on prometheus_client's default registry
    engine.use(metrics)                        # counters and histograms, from lifecycle events
    metrics.serve(9100)                        # /metrics over HTTP (or mount metrics.asgi_app())
    task = metrics.sample_every(engine, 15.0)  # gauges read from the store and this process

``durably worker --metrics-port [HOST:]PORT`` does all of it. Every metric is
per process: Prometheus sums a fleet. Counters and histograms cost nothing
until an event happens; the gauges cost two small store queries per sample.

Metrics (all prefixed ``durably_``):

- ``runs_started_total{workflow}``: runs whose first turn began here;
  ``turns_total{workflow}``: every turn begun here;
  ``runs_ended_total{workflow,status}``: ``completed``, ``failed``,
  ``cancelled``, ``dead``;
- ``step_duration_seconds{step,kind,status}``: one observation per attempt
  (``kind``: ``local`` or ``served``; ``status``: ``completed``/``failed``);
  ``step_queue_seconds{step}``: a served step's time from dispatch to pickup;
- ``lease_takeovers_total``: turns here that lost their lease to another
  instance; ``recoveries_total``: orphaned runs taken back here;
  ``timer_lag_seconds``: how late due runs were woken;
  ``signals_delivered_total``;
- gauges: ``pending_runs`` (in the store, for this engine's namespace),
  ``flow_waiters{queue}`` (steps waiting for admission), ``turns_executing``
  and ``turns_waiting`` (this process's executor).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_asgi_app,
    start_http_server,
)

from ._intercept import Interceptor
from ._lifecycle_events import EventKind, LifecycleEvent

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Metrics", "metrics"]

_log = logging.getLogger("durably.prometheus")

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
_ENDS = {
    EventKind.RUN_COMPLETED: "completed",
    EventKind.RUN_FAILED: "failed",
    EventKind.RUN_CANCELLED: "cancelled",
    EventKind.RUN_DEAD: "dead",
}
_BY_REGISTRY: dict[int, Metrics] = {}


def metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """The :class:`Metrics` of ``registry`` (prometheus_client's default one
    when ``None``), made on first use: every engine of a process shares them."""
    target = REGISTRY if registry is None else registry
    found = _BY_REGISTRY.get(id(target))
    if found is None or found.registry is not target:
        found = _BY_REGISTRY[id(target)] = Metrics(target)
    return found


class Metrics(Interceptor):
    """The metrics on one registry; register with ``engine.use``. Build it
    through :func:`metrics` (a registry accepts each metric name once)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.runs_started = Counter(
            "durably_runs_started", "Runs whose first turn began here.", ["workflow"], registry=r
        )
        self.turns = Counter("durably_turns", "Turns begun here.", ["workflow"], registry=r)
        self.runs_ended = Counter(
            "durably_runs_ended", "Runs that ended, by status.", ["workflow", "status"], registry=r
        )
        self.step_duration = Histogram(
            "durably_step_duration_seconds",
            "Execution time of one step attempt.",
            ["step", "kind", "status"],
            buckets=_SECONDS,
            registry=r,
        )
        self.step_queue = Histogram(
            "durably_step_queue_seconds",
            "A served step's time from dispatch to pickup.",
            ["step"],
            buckets=_SECONDS,
            registry=r,
        )
        self.lease_takeovers = Counter(
            "durably_lease_takeovers",
            "Turns here that lost their lease to another instance.",
            registry=r,
        )
        self.recoveries = Counter(
            "durably_recoveries",
            "Orphaned runs (their executor died) taken back here.",
            registry=r,
        )
        self.timer_lag = Histogram(
            "durably_timer_lag_seconds",
            "How late due runs were woken.",
            buckets=_SECONDS,
            registry=r,
        )
        self.signals = Counter(
            "durably_signals_delivered", "Signals delivered to a run.", registry=r
        )
        self.pending_runs = Gauge("durably_pending_runs", "Pending runs in the store.", registry=r)
        self.flow_waiters = Gauge(
            "durably_flow_waiters",
            "Steps waiting for flow-control admission.",
            ["queue"],
            registry=r,
        )
        self.turns_executing = Gauge(
            "durably_turns_executing", "Turns executing in this process.", registry=r
        )
        self.turns_waiting = Gauge(
            "durably_turns_waiting", "Turns waiting for a slot in this process.", registry=r
        )
        self._queues: set[str] = set()
        # Labelled children by label values: prometheus_client's labels() takes
        # a lock and builds a key on every call, and events come per step.
        self._children: dict[tuple[Any, ...], Any] = {}
        self._handlers: dict[EventKind, Callable[[LifecycleEvent], None]] = {
            EventKind.RUN_STARTED: self._started,
            EventKind.STEP_COMPLETED: self._step,
            EventKind.STEP_FAILED: self._step,
            EventKind.STEP_STARTED: self._queued,
            EventKind.RUN_FENCED: lambda _: self.lease_takeovers.inc(),
            EventKind.RUN_RECOVERED: lambda _: self.recoveries.inc(),
            EventKind.TIMER_FIRED: self._timer,
            EventKind.SIGNAL_DELIVERED: lambda _: self.signals.inc(),
            **{kind: self._ended for kind in _ENDS},
        }

    def on_event(self, event: LifecycleEvent) -> None:
        """Count one lifecycle event (only this process's: a fleet is summed by Prometheus)."""
        handler = self._handlers.get(event.kind)
        if handler is not None:
            handler(event)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _started(self, event: LifecycleEvent) -> None:
        workflow = event.workflow or ""
        self._child(self.turns, workflow).inc()
        if not event.resumed:
            self._child(self.runs_started, workflow).inc()

    def _ended(self, event: LifecycleEvent) -> None:
        self._child(self.runs_ended, event.workflow or "", _ENDS[event.kind]).inc()

    def _step(self, event: LifecycleEvent) -> None:
        if event.duration_ms is None:
            return
        status = "completed" if event.kind is EventKind.STEP_COMPLETED else "failed"
        kind = "served" if event.served else "local"
        child = self._child(self.step_duration, event.step or "", kind, status)
        child.observe(event.duration_ms / 1000)

    def _queued(self, event: LifecycleEvent) -> None:
        if event.queue_ms is not None:
            self._child(self.step_queue, event.step or "").observe(event.queue_ms / 1000)

    def _timer(self, event: LifecycleEvent) -> None:
        if event.lag_ms is not None:
            self.timer_lag.observe(event.lag_ms / 1000)

    # -- gauges
    async def sample(self, engine: Engine) -> None:
        """Set the gauges from ``engine``'s store and executor (two small queries)."""
        if not engine.is_open:
            return  # not started yet, or closing: nothing to count
        inspector = engine.store
        self.turns_executing.set(engine.turns_executing)
        self.turns_waiting.set(engine.turns_waiting)
        self.pending_runs.set(await inspector.count_pending(engine.drives_namespace))
        waiters = await inspector.count_flow_waiters()
        self._set_queues(waiters.items())

    def _set_queues(self, counts: Iterable[tuple[str, int]]) -> None:
        seen = dict(counts)
        for queue in self._queues - seen.keys():
            self.flow_waiters.labels(queue).set(0)  # drained since the last sample
        for queue, count in seen.items():
            self.flow_waiters.labels(queue).set(count)
        self._queues |= seen.keys()

    def sample_every(self, engine: Engine, interval: float = 15.0) -> asyncio.Task[None]:
        """Sample the gauges every ``interval`` seconds until the task is cancelled;
        a failing sample is logged and the next one tried."""
        return asyncio.ensure_future(self.sampling(engine, interval))

    async def sampling(self, engine: Engine, interval: float = 15.0) -> None:
        """Sample the gauges every ``interval`` seconds, until cancelled."""
        while True:
            try:
                await self.sample(engine)
            except Exception as exc:
                _log.warning("could not sample durably's gauges: %s", exc)
            await asyncio.sleep(interval)

    # -- exposition
    def serve(self, port: int, host: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` of this registry over HTTP on ``host:port`` (a
        daemon thread, prometheus_client's ``start_http_server``); returns its server."""
        server, _thread = start_http_server(port, host, registry=self.registry)
        return server

    def asgi_app(self) -> Any:
        """An ASGI app serving this registry (mount it at ``/metrics``)."""
        return make_asgi_app(registry=self.registry)
