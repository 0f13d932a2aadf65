"""Interceptors: code of the application's wrapped around step executions and turns.

``engine.use(interceptor)`` registers an :class:`Interceptor` (override the
methods you need) or a bare ``async def intercept_step(info, call_next)``.
They form an onion: the first registered is the outermost, so it sees every
attempt first and its ``call_next`` runs the ones registered after it, then
the step itself.

Interceptors wrap *executions* only: a step whose result is replayed from
history runs no interceptor. :class:`Interceptors` holds the chains; each
call site checks whether a chain is empty before building anything, so an
engine without interceptors pays one attribute read per step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from ._lifecycle_events import LifecycleEvent
from .model import Run
from .wire import StepTask

__all__ = ["CallNext", "Interceptor", "Interceptors", "StepInfo", "StepInterceptor", "TurnInfo"]

_log = logging.getLogger("durably")

CallNext = Callable[[], Awaitable[Any]]
"""Runs the rest of the chain (the next interceptor, then the step or turn itself)."""
StepInterceptor = Callable[["StepInfo", CallNext], Awaitable[Any]]
"""A bare step interceptor: ``async def intercept_step(info, call_next)``."""


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One attempt of a step about to execute here."""

    run_id: str
    step: str
    seq: int
    attempt: int
    kind: Literal["local", "served", "transaction"]
    """``"local"``: ``ctx.local_step`` in the turn; ``"served"``: a handler of
    ``@engine.step`` serving a dispatched task; ``"transaction"``:
    ``ctx.transaction``, wrapped around its commit (the body gets what was
    committed: a value an interceptor returns instead is not used)."""
    workflow: str | None = None
    """The run's workflow (``None`` for a served step: tasks do not carry it)."""
    traceparent: str | None = None
    """A served step: the W3C trace context its task carried."""


@dataclass(slots=True)
class TurnInfo:
    """One turn of a run about to execute here."""

    run_id: str
    workflow: str
    workflow_version: str
    trace_context: str | None
    """What was stored on the run when it was created (see :meth:`Interceptor.start_context`)."""
    resumed: bool
    """Not the run's first turn: it has history."""
    outcome: str | None = None
    """Set once the turn ended: ``completed``, ``failed``, ``suspended``,
    ``continued``, ``cancelled`` or ``closed`` (stopped unsettled)."""


class Interceptor:
    """Hooks an application registers with ``engine.use``; each default passes through.

    Override only what you need: a method left as defined here is not called.
    """

    async def intercept_step(self, info: StepInfo, call_next: CallNext) -> Any:
        """Wrap one attempt of a step: return (or change) what ``call_next()``
        returns, or raise. Runs where the step executes, never on replay; an
        exception raised here fails the attempt as the step's own would."""
        return await call_next()

    async def intercept_turn(self, info: TurnInfo, call_next: CallNext) -> Any:
        """Wrap one turn; return what ``call_next()`` returns, unchanged. The
        turn's workflow code, and so its steps' interceptors, run inside it.
        An exception raised here is logged, and the turn runs (or its outcome
        stands) as if this interceptor were not there."""
        return await call_next()

    def start_context(self, run: Run) -> str | None:
        """Return a trace context to store on ``run`` as ``engine.start``
        creates it (children inherit their parent's), or ``None``."""
        return None

    def outbound_task(self, task: StepTask) -> None:
        """Adjust a dispatched step's task before it is sent (its ``traceparent``)."""

    def on_event(self, event: LifecycleEvent) -> None:
        """Hear every lifecycle event emitted in this process (synchronously:
        keep it quick; an exception is logged and ignored)."""


def _overrides(obj: object, name: str) -> bool:
    method = getattr(type(obj), name, None)
    return method is not None and method is not getattr(Interceptor, name)


class Interceptors:
    """The registered interceptors' chains, outermost first."""

    __slots__ = ("outbound", "starts", "steps", "turns")

    def __init__(self) -> None:
        self.steps: list[Callable[[StepInfo, CallNext], Awaitable[Any]]] = []
        self.turns: list[Callable[[TurnInfo, CallNext], Awaitable[Any]]] = []
        self.starts: list[Callable[[Run], str | None]] = []
        self.outbound: list[Callable[[StepTask], None]] = []

    def add(self, interceptor: Any) -> Callable[[LifecycleEvent], None] | None:
        """Register ``interceptor``'s hooks; return its event listener, if it has one."""
        if not isinstance(interceptor, Interceptor):
            if not callable(interceptor):
                raise TypeError(
                    "engine.use takes a durably.Interceptor or an "
                    "async def intercept_step(info, call_next)"
                )
            self.steps.append(interceptor)
            return None
        if _overrides(interceptor, "intercept_step"):
            self.steps.append(interceptor.intercept_step)
        if _overrides(interceptor, "intercept_turn"):
            self.turns.append(interceptor.intercept_turn)
        if _overrides(interceptor, "start_context"):
            self.starts.append(interceptor.start_context)
        if _overrides(interceptor, "outbound_task"):
            self.outbound.append(interceptor.outbound_task)
        return interceptor.on_event if _overrides(interceptor, "on_event") else None

    async def run_step(self, info: StepInfo, call: CallNext) -> Any:
        """Run ``call`` inside every step interceptor."""
        return await _onion(self.steps, info, call)

    async def run_turn(self, info: TurnInfo, call: CallNext) -> Any:
        """Run ``call`` inside every turn interceptor."""
        return await _onion(self.turns, info, call)

    def stamp(self, run: Run) -> None:
        """Let the start hooks set the trace context of a run being created
        (one that raises is logged: a tracing bug must not refuse a start)."""
        for hook in self.starts:
            try:
                found = hook(run)
            except Exception:
                _log.exception("an interceptor's start_context failed")
                continue
            if found is not None:
                run.trace_context = found

    def prepare(self, tasks: list[StepTask]) -> None:
        """Let the outbound hooks adjust tasks about to be sent (one that
        raises is logged: the task goes out as it is)."""
        for hook in self.outbound:
            for task in tasks:
                try:
                    hook(task)
                except Exception:
                    _log.exception("an interceptor's outbound_task failed")


def _onion(
    handlers: list[Callable[[Any, CallNext], Awaitable[Any]]], info: Any, call: CallNext
) -> Any:
    for handler in reversed(handlers):
        call = functools.partial(handler, info, call)
    return call()
