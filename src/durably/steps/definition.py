"""Dispatched steps: definitions (``@engine.step``) and the logger a handler gets.

A step definition is two things at once. For the workflow that calls
``ctx.step(ref, input)`` it is a policy: retries, backoff, liveness window,
flow-control queue. For a worker process it is a handler served by name. The
same module usually registers both, so the defaults agree on every side.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypedDict, TypeVar, overload

from .. import _codec as codec
from .. import _typed as typed
from .._logs import engine_logger
from .._names import check_name, check_priority
from ..clock import wall_ms
from ..durations import Duration, to_ms
from ..errors import FatalError, SchemaValidationError
from ..retry import RetryPolicy
from ..wire import StepEvent

__all__ = ["StepDecorator", "StepDefinition", "StepLogger", "StepPolicy", "StepRef"]

T = TypeVar("T")
R = TypeVar("R")

BEAT_INTERVAL_S = 5.0
"""Seconds between a running handler's heartbeats (the logger's and the server's)."""


class StepPolicy(TypedDict, total=False):
    """The step-policy keywords shared by ``@engine.step``,
    ``engine.register_step`` and ``ctx.step``.

    Each defaults to ``None``, meaning "not set here": a registration then
    takes the engine's default, and a ``ctx.step`` call the step's registered
    policy (or the engine's default for a step registered elsewhere).
    """

    retries: int | None
    """Attempts after the first (``RetryPolicy`` default: 3)."""
    backoff: str | None
    """``"exp"``, ``"linear"`` or ``"fixed"``: how the delay between attempts grows."""
    backoff_base: Duration | None
    """The first retry's delay."""
    backoff_max: Duration | None
    """The longest delay between attempts."""
    jitter: bool | None
    """Randomise each delay, so retries of many runs do not arrive together."""
    timeout: Duration | None
    """Await the result in memory and fail the attempt after this much silence
    (no heartbeat); without it the run suspends durably while the task is out."""
    pickup_timeout: Duration | None
    """With ``timeout``: how long the task may wait for the worker's first beat."""
    queue: str | None
    """The flow-control queue (``engine.register_queue``) each call goes through."""
    priority: int | None
    """The task's priority on the transport, and in its flow-control queue."""


_POLICY_KEYS = StepPolicy.__required_keys__ | StepPolicy.__optional_keys__


def check_policy(where: str, policy: Mapping[str, object]) -> None:
    """Refuse a keyword that is not a step-policy one, as a signature listing
    them would have (``where`` names the callee in the message)."""
    for key in policy:
        if key not in _POLICY_KEYS:
            raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")


@dataclass(frozen=True, slots=True)
class StepDefinition:
    """A step registered with ``@engine.step``: its handler and its policy."""

    name: str
    fn: Callable[..., Any]
    retry: RetryPolicy
    timeout_ms: int | None = None
    """Maximum silence (no heartbeat) while the dispatcher awaits the result
    in memory. ``None``: the run suspends durably instead."""
    pickup_timeout_ms: int | None = None
    """With ``timeout_ms``: how long the task may wait in the queue before the
    worker's first heartbeat."""
    group: str | None = None
    """The worker group serving it (``durably worker --group``)."""
    queue: str | None = None
    """The flow-control queue every call goes through by default."""
    priority: int | None = None
    input_model: Any = None
    output_model: Any = None
    takes_logger: bool = False
    output_type: Any = Any
    """``output=``, else the handler's return annotation, else ``Any``."""
    typed_output: typed.Typed = typed.PLAIN
    """How a result is checked (where the handler runs) and decoded (in the
    workflow awaiting it) as :attr:`output_type`."""
    requires: frozenset[str] = frozenset()
    """Capabilities a worker must advertise to be sent this step (the upstream
    handshake); a run whose step no live capable worker serves is ``blocked``."""

    is_async: bool = field(init=False, compare=False, repr=False)
    """Whether the handler is a coroutine function (run on the loop, not in
    a step thread): asked per served step, so known from the start."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_async", inspect.iscoroutinefunction(self.fn))

    def parse_input(self, data: Any) -> Any:
        """``data`` as the handler's input model (``SchemaValidationError`` if invalid)."""
        if self.input_model is None:
            return data
        try:
            return codec.parse_as(self.input_model, data)
        except Exception as exc:
            raise SchemaValidationError(f"step {self.name!r}: invalid input: {exc}") from exc

    def dump_output(self, value: Any) -> Any:
        """The handler's return value as JSON, checked against the output type."""
        data, _ = self.typed_output.store(value, "step result")  # Misfit: not retried
        return data


@dataclass(frozen=True, slots=True)
class StepRef(Generic[T]):
    """What ``@engine.step`` returns: pass it to ``ctx.step`` (or call the
    handler directly in a unit test via :attr:`fn`).

    ``T`` is the handler's return type (an async handler's awaited one), so
    ``await ctx.step(ref, ...)`` is typed as what the workflow receives.
    """

    definition: StepDefinition

    @property
    def name(self) -> str:
        """The name tasks are routed by."""
        return self.definition.name

    @property
    def fn(self) -> Callable[..., Any]:
        """The handler function itself."""
        return self.definition.fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the handler directly (tests, scripts) — nothing is dispatched."""
        return self.definition.fn(*args, **kwargs)


class StepDecorator(Protocol):
    """What ``@engine.step(...)`` returns: a decorator turning a handler
    returning ``R`` (or an awaitable of ``R``) into a ``StepRef[R]``."""

    @overload
    def __call__(self, fn: Callable[..., Awaitable[R]], /) -> StepRef[R]: ...
    @overload
    def __call__(self, fn: Callable[..., R], /) -> StepRef[R]: ...


def define_step(
    name: str,
    fn: Callable[..., Any],
    *,
    taken: Callable[[str], bool],
    group: str | None,
    input: Any,
    output: Any,
    policy: StepPolicy,
    requires: Collection[str] = (),
) -> StepDefinition:
    """Validate a registration (``engine.register_step``) and build its definition;
    ``taken(name)`` tells whether the name is registered already."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a step needs a non-empty name")
    check_name(name, "step name")
    check_priority(policy.get("priority"), "step priority")
    if not callable(fn):
        raise TypeError(f"step {name!r}: {fn!r} is not callable")
    if taken(name):
        raise ValueError(f"step {name!r} is already registered")
    if isinstance(requires, str):
        raise TypeError(f"step {name!r}: requires must be a list of capability names")
    for capability in requires:
        check_name(capability, "capability")
    timeout, pickup_timeout = policy.get("timeout"), policy.get("pickup_timeout")
    typed.check_declared(output, f"step {name!r}")
    output_type = typed.output_type_of(fn, output)
    return StepDefinition(
        name=name,
        fn=fn,
        retry=RetryPolicy.build(
            policy.get("retries"),
            policy.get("backoff"),
            policy.get("backoff_base"),
            policy.get("backoff_max"),
            policy.get("jitter"),
        ),
        timeout_ms=None if timeout is None else to_ms(timeout, name="step timeout"),
        pickup_timeout_ms=(
            None if pickup_timeout is None else to_ms(pickup_timeout, name="pickup timeout")
        ),
        group=group,
        queue=policy.get("queue"),
        priority=policy.get("priority"),
        input_model=input,
        output_model=output,
        requires=frozenset(requires),
        takes_logger=takes_logger(fn),
        output_type=output_type,
        typed_output=typed.typed_for(output_type, f"the result of step {name!r}"),
    )


def takes_logger(fn: Callable[..., Any]) -> bool:
    """Whether a handler accepts a second (logger) argument."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in positional)


_step_log = engine_logger("durably.step")
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}


@dataclass(eq=False)
class StepLogger:
    """Handed to a step handler as its second argument.

    Lines logged here travel back with the result and are stored on the
    step's checkpoint; each also goes to the ``durably.step`` logger (with
    ``run_id``, ``step``, ``seq``, ``attempt`` and its keywords as ``data``),
    so the application's handlers see it. :meth:`heartbeat` tells the engine the handler is
    alive (and how far along), which keeps a step with a ``timeout`` from
    being failed over. Safe to use from a synchronous handler's thread.
    """

    run_id: str
    seq: int
    name: str
    attempt: int
    context: Any = None
    """The opaque ``context`` the dispatcher attached to the task."""
    events: list[StepEvent] = field(default_factory=list)
    _beat: Callable[[Any], None] | None = None
    # A flag, not a threading.Event: set from the loop, read from a handler's
    # thread (a bool's store is atomic), and an Event (a Condition and its
    # lock) per served step was ~3% of a dispatched step's CPU.
    _cancelled: bool = False
    _last_beat: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def step_id(self) -> str:
        """``<run_id>:<seq>``, stable across attempts: deduplicate side effects on it."""
        return f"{self.run_id}:{self.seq}"

    @property
    def cancelled(self) -> bool:
        """True once the step's run was cancelled: stop early and return."""
        return self._cancelled

    async def wait_cancelled(self) -> None:
        """Return once the run is cancelled (race it against slow work)."""
        # A flag set from the loop, read from handler threads, cannot be
        # awaited; polling it costs nothing measurable.
        while not self._cancelled:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    def debug(self, message: str, **data: Any) -> None:
        """Record a debug line."""
        self._add("debug", message, data)

    def info(self, message: str, **data: Any) -> None:
        """Record an info line."""
        self._add("info", message, data)

    def warn(self, message: str, **data: Any) -> None:
        """Record a warning."""
        self._add("warn", message, data)

    def error(self, message: str, **data: Any) -> None:
        """Record an error line (the step does not fail because of it)."""
        self._add("error", message, data)

    def sub(self, name: str, status: str = "ok", message: str = "", **data: Any) -> None:
        """Record a sub-process event (``status`` ``ok``, ``failed`` or ``skipped``)."""
        if status not in ("ok", "failed", "skipped"):
            raise ValueError("a sub-process status is 'ok', 'failed' or 'skipped'")
        extra: dict[str, Any] = {"name": name, "status": status}
        if data:
            extra["data"] = codec.to_jsonable(data)
        with self._lock:
            self.events.append(StepEvent(wall_ms(), "info", message or name, extra))

    def heartbeat(self, progress: Any = None) -> None:
        """Tell the engine this step is alive. Sent at most every 5 s, except
        that a beat carrying ``progress`` always goes out."""
        now = time.monotonic()
        with self._lock:
            if progress is None and now - self._last_beat < BEAT_INTERVAL_S:
                return
            self._last_beat = now
        if self._beat is not None:
            self._beat(codec.to_jsonable(progress))

    def _add(self, level: str, message: str, data: dict[str, Any]) -> None:
        extra = {"data": codec.to_jsonable(data)} if data else {}
        with self._lock:
            self.events.append(StepEvent(wall_ms(), level, str(message), extra))
        # The application's handlers see the line too (the data under
        # ``record.data``: its keys could clash with a LogRecord's own).
        _step_log.log(
            _LEVELS[level],
            "%s",
            message,
            extra={
                "data": extra.get("data"),
                "run_id": self.run_id,
                "step": self.name,
                "seq": self.seq,
                "attempt": self.attempt,
            },
        )


def failure_of(exc: BaseException) -> dict[str, Any]:
    """A handler's exception as a wire error (``retryable: false`` when fatal)."""
    if isinstance(exc, FatalError):
        error: dict[str, Any] = {"message": exc.message, "code": exc.code, "retryable": False}
        if exc.details is not None:
            error["details"] = codec.to_jsonable(exc.details)
        return error
    if isinstance(exc, SchemaValidationError | codec.EncodeError):
        return {"message": str(exc), "code": "schema_validation", "retryable": False}
    return {"message": str(exc) or type(exc).__name__, "type": type(exc).__name__}
