"""OpenTelemetry tracing: one trace per run, a span per turn and per step attempt.

Install the extra (``pip install 'durably[otel]'``) and register the
interceptor on every engine and worker of the fleet::

    import durably.otel
    engine.use(durably.otel.tracing())   # the global TracerProvider, or tracer_provider=

What it records:

- ``durably.start <workflow>`` when ``engine.start`` creates a run, a child of
  the application's current span. Its W3C ``traceparent`` is stored on the
  run (``Run.trace_context``), and children inherit their parent's.
- ``durably.turn <workflow>`` for every turn, in whichever process executes
  it, parented to that stored context: every turn of a run joins one trace,
  across crashes, deploys and processes. A run created without the
  interceptor gets a trace id derived from its run id, so its turns still
  share one trace.
- ``durably.step <name>`` for every attempt of a local step (inside its
  turn's span) and of a served step (where its handler runs, continuing the
  ``traceparent`` its task carried on the wire).

Attributes: ``durably.run_id``, ``durably.workflow``, ``durably.step``,
``durably.seq``, ``durably.attempt``, and ``durably.outcome`` on a turn. A
failed attempt's span records the exception and an error status. Nothing is
recorded for steps replayed from history. Without this interceptor durably
makes no OpenTelemetry call at all.
"""

from __future__ import annotations

import hashlib
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from . import __version__
from ._intercept import CallNext, Interceptor, StepInfo, TurnInfo
from .model import Run
from .wire import StepTask

__all__ = ["Tracing", "run_trace_id", "tracing"]

_PROPAGATOR = TraceContextTextMapPropagator()


def tracing(tracer_provider: trace.TracerProvider | None = None) -> Tracing:
    """The tracing interceptor, for ``engine.use`` (the global provider by default)."""
    return Tracing(tracer_provider)


def run_trace_id(run_id: str) -> int:
    """The trace id of a run created without a stored trace context: derived
    from its id, so every process agrees on it."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:16], "big") or 1


class Tracing(Interceptor):
    """Spans for runs, turns and step attempts; see the module docstring."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer("durably", __version__, tracer_provider=tracer_provider)

    def start_context(self, run: Run) -> str | None:
        """Open and close the run's start span; return its ``traceparent``."""
        with self._tracer.start_as_current_span(
            f"durably.start {run.workflow}",
            kind=SpanKind.PRODUCER,
            attributes={"durably.run_id": run.run_id, "durably.workflow": run.workflow},
        ):
            return _traceparent()

    async def intercept_turn(self, info: TurnInfo, call_next: CallNext) -> Any:
        """Execute the turn inside its span, continuing the run's trace."""
        with self._tracer.start_as_current_span(
            f"durably.turn {info.workflow}",
            context=_parent(info.trace_context, info.run_id),
            attributes={
                "durably.run_id": info.run_id,
                "durably.workflow": info.workflow,
                "durably.workflow_version": info.workflow_version,
                "durably.resumed": info.resumed,
            },
        ) as span:
            result = await call_next()
            if info.outcome is not None:
                span.set_attribute("durably.outcome", info.outcome)
            return result

    async def intercept_step(self, info: StepInfo, call_next: CallNext) -> Any:
        """Execute one attempt inside its span (a served one continues its task's trace)."""
        attributes: dict[str, Any] = {
            "durably.run_id": info.run_id,
            "durably.step": info.step,
            "durably.seq": info.seq,
            "durably.attempt": info.attempt,
            "durably.step_kind": info.kind,
        }
        if info.workflow is not None:
            attributes["durably.workflow"] = info.workflow
        served = info.kind == "served"
        parent = None
        if served and info.traceparent:
            parent = _PROPAGATOR.extract({"traceparent": info.traceparent})
        with self._tracer.start_as_current_span(
            f"durably.step {info.step}",
            context=parent,
            kind=SpanKind.CONSUMER if served else SpanKind.INTERNAL,
            attributes=attributes,
        ):
            return await call_next()

    def outbound_task(self, task: StepTask) -> None:
        """Carry the current span (the dispatching turn's) on the task."""
        if task.traceparent is None:
            task.traceparent = _traceparent()


def _traceparent() -> str | None:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def _parent(trace_context: str | None, run_id: str) -> otel_context.Context:
    if trace_context:
        found = _PROPAGATOR.extract({"traceparent": trace_context})
        if trace.get_current_span(found).get_span_context().is_valid:
            return found
    trace_id = run_trace_id(run_id)
    root = SpanContext(
        trace_id,
        trace_id & 0xFFFFFFFFFFFFFFFF or 1,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(root), otel_context.Context())
