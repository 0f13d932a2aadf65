"""``WorkflowContext``: the operations a workflow body uses for everything
that is not pure computation.

Each public method is a plain (non-async) function that takes the operation's
position at call time and returns an awaitable; see :mod:`durably.replay` for
why. An operation whose checkpoint is completed returns the recorded value
without executing anything.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random as _random
import uuid as _uuid
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from . import codec
from ._dispatch import StepDispatcher
from ._step_call import StepCall, StepRunner
from ._threads import StepThreads
from .clock import Clock
from .durations import Duration, to_ms
from .errors import (
    ChildFailed,
    FatalError,
    GatherFailed,
    NondeterminismError,
    RunCancelled,
    SignalTimeout,
    StepFailed,
    _ContinueAsNew,
    _TurnClosed,
    is_control_flow,
)
from .model import Checkpoint, CheckpointStatus, ErrorInfo, Run
from .replay import Turn, error_info
from .retry import RetryPolicy
from .steps import StepDefinition, StepRef
from .stores.base import StateStore

__all__ = ["ChildCall", "Settled", "WorkflowContext"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Services:
    """What the operations need from the engine, passed in explicitly."""

    store: StateStore
    clock: Clock
    threads: StepThreads
    track_start: bool
    default_retry: RetryPolicy
    logger: logging.Logger
    spawn_children: Callable[[Run, list[ChildCall]], Awaitable[list[ErrorInfo | None]]]
    cancel_runs: Callable[[list[str]], Awaitable[None]]
    steps: StepDispatcher
    redispatch_ms: int | None
    redispatch_max: int


@dataclass(frozen=True, slots=True)
class Settled:
    """One outcome of ``ctx.all_settled``: a value, or the error that ended it."""

    ok: bool
    value: Any = None
    error: BaseException | None = None


class ChildCall:
    """A child run, created by :meth:`WorkflowContext.child`.

    Await it alone, or pass many to :meth:`WorkflowContext.all` so they are
    created together (one bulk insert) and awaited with one suspension.
    """

    __slots__ = ("_ctx", "input", "recorded", "run_id", "seq", "workflow")

    def __init__(
        self,
        ctx: WorkflowContext,
        seq: int,
        run_id: str,
        workflow: str,
        input: Any,
        recorded: Checkpoint | None,
    ) -> None:
        self._ctx = ctx
        self.seq = seq
        self.run_id = run_id
        self.workflow = workflow
        self.input = input
        self.recorded = recorded

    def __await__(self) -> Generator[Any, None, Any]:
        return self._ctx._await_child(self).__await__()


@dataclass(slots=True)
class _Compensation:
    seq: int
    name: str
    fn: Callable[..., Any]
    output: Any


class WorkflowContext:
    """The handle a workflow body receives as its first argument.

    All I/O, time and randomness in a body must go through it; everything it
    returns is recorded, so a replay after a crash sees the same values.
    """

    def __init__(self, turn: Turn, services: _Services) -> None:
        self._turn = turn
        self._services = services
        self._compensations: list[_Compensation] = []
        self.log: logging.LoggerAdapter[logging.Logger] = logging.LoggerAdapter(
            services.logger, {"run_id": turn.run.run_id, "workflow": turn.run.workflow}
        )
        """A logger that tags every record with the run id and workflow."""

    # -- identity ------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """This run's id."""
        return self._turn.run.run_id

    @property
    def workflow(self) -> str:
        """The workflow's registered name."""
        return self._turn.run.workflow

    @property
    def version(self) -> str:
        """The workflow version this run is pinned to."""
        return self._turn.run.workflow_version

    @property
    def attempt(self) -> int:
        """1 on the first execution; +1 for every crash recovery of this run."""
        return self._turn.run.recovery_attempts + 1

    # -- steps ---------------------------------------------------------------------------

    def local_step(
        self,
        name: str,
        fn: Callable[..., T | Awaitable[T]],
        *args: Any,
        retries: int | None = None,
        backoff: str | None = None,
        backoff_base: Duration | None = None,
        backoff_max: Duration | None = None,
        jitter: bool | None = None,
        track_start: bool | None = None,
        compensate: Callable[..., Any] | None = None,
    ) -> Awaitable[T]:
        """Run ``fn(*args)`` in this process and checkpoint its result.

        ``fn`` may be a coroutine function or a plain function (run in a worker
        thread so it cannot block the event loop). Its return value must be
        JSON-serialisable (dataclasses and pydantic models are converted).

        On failure it is retried ``retries`` more times (default 0) with
        ``backoff`` ``"exp"`` (default), ``"linear"`` or ``"fixed"`` from
        ``backoff_base`` (default 1 s) capped at ``backoff_max`` (default 60 s),
        with ``jitter``. A :class:`FatalError` is never retried. When attempts
        run out the await raises :class:`StepFailed`.

        With ``track_start`` (the engine default) each attempt records a
        ``running`` checkpoint, so history shows a step that is running or was
        interrupted by a crash (it is re-run on replay). When the turn must
        first make earlier results durable or prove a lease taken more than
        half a lease ago, that write is awaited before ``fn`` runs; otherwise
        it goes out while ``fn`` runs, and a quick step's result supersedes it
        in the same commit.

        ``compensate(output)`` registers an undo (a saga step): if the run
        later fails, or is cancelled with ``compensate=True``, the undos of the
        completed steps run in reverse order, each exactly once even across
        crashes.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("a local step needs a non-empty name")
        if not callable(fn):
            raise TypeError(f"local step {name!r}: {fn!r} is not callable")
        policy = RetryPolicy.build(
            retries,
            backoff,
            backoff_base,
            backoff_max,
            jitter,
            default=self._services.default_retry,
        )
        if compensate is not None and not callable(compensate):
            raise TypeError(f"local step {name!r}: compensate must be callable")
        track = self._services.track_start if track_start is None else track_start
        seq, recorded = self._turn.allocate(name, "local")
        step = self._local_step(seq, name, fn, args, policy, track, recorded)
        if compensate is None:
            return step
        return self._with_compensation(seq, name, compensate, step)

    async def _with_compensation(
        self, seq: int, name: str, compensate: Callable[..., Any], step: Awaitable[Any]
    ) -> Any:
        output = await step
        self._compensations.append(_Compensation(seq, name, compensate, output))
        return output

    async def _local_step(
        self,
        seq: int,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        policy: RetryPolicy,
        track: bool,
        recorded: Checkpoint | None,
    ) -> Any:
        if recorded is not None:
            if recorded.status is CheckpointStatus.COMPLETED:
                return recorded.output
            if recorded.status is CheckpointStatus.FAILED:
                raise StepFailed.from_error(name, recorded.error, recorded.attempts)
        turn, services = self._turn, self._services
        if turn.unwinding:
            return await turn.park(seq, None, reconcile=False)
        run_id = turn.run.run_id
        attempts = recorded.attempts if recorded is not None else 0
        started = services.clock.now_ms()
        with turn.in_flight():
            for retry_number in range(policy.retries + 1):
                attempts += 1
                if track:
                    running = Checkpoint(
                        run_id,
                        seq,
                        name,
                        "local",
                        CheckpointStatus.RUNNING,
                        attempts=attempts,
                        started_at=started,
                    )
                    if turn.needs_fence():
                        # Awaited: it also makes every earlier result durable
                        # and proves the lease before the side effect happens.
                        await self._save(running)
                    else:
                        # A quick step's result supersedes it in the same
                        # commit (one write per step, not two).
                        self._save_later(running)
                else:
                    await turn.flush()
                try:
                    result = await self._call(fn, args)
                    output = codec.to_jsonable(result)
                except Exception as exc:
                    turn.ensure_open()
                    fatal = isinstance(exc, FatalError | codec.EncodeError)
                    if fatal or retry_number == policy.retries:
                        failure = error_info(exc)
                        await self._save(
                            Checkpoint(
                                run_id,
                                seq,
                                name,
                                "local",
                                CheckpointStatus.FAILED,
                                error=failure,
                                attempts=attempts,
                                started_at=started,
                                finished_at=services.clock.now_ms(),
                            )
                        )
                        raise StepFailed.from_error(name, failure, attempts) from exc
                    delay = policy.delay_ms(retry_number + 1)
                    self.log.info(
                        "step %s attempt %d failed (%s); retrying in %d ms",
                        name,
                        attempts,
                        exc,
                        delay,
                    )
                    await services.clock.sleep(delay / 1000)
                    turn.ensure_open()
                    continue
                turn.ensure_open()
                self._save_later(
                    Checkpoint(
                        run_id,
                        seq,
                        name,
                        "local",
                        CheckpointStatus.COMPLETED,
                        output=output,
                        attempts=attempts,
                        started_at=started,
                        finished_at=services.clock.now_ms(),
                    )
                )
                return output
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        result = await self._services.threads.call(fn, args)
        if inspect.isawaitable(result):
            return await result
        return result

    def side_effect(self, fn: Callable[..., T | Awaitable[T]], *args: Any) -> Awaitable[T]:
        """Run ``fn(*args)`` once and record its value (no retries, no running checkpoint).

        For cheap non-deterministic reads (a feature flag, a config value) whose
        value the rest of the run must see consistently.
        """
        if not callable(fn):
            raise TypeError(f"side_effect: {fn!r} is not callable")
        seq, recorded = self._turn.allocate("side_effect", "side_effect")

        async def compute() -> Any:
            await self._turn.flush()  # earlier results are durable before the effect
            return await self._call(fn, args)

        return self._recorded(seq, "side_effect", "side_effect", recorded, compute)

    def step(
        self,
        step: StepRef[Any] | str,
        input: Any = None,
        *,
        retries: int | None = None,
        backoff: str | None = None,
        backoff_base: Duration | None = None,
        backoff_max: Duration | None = None,
        jitter: bool | None = None,
        timeout: Duration | None = None,
        pickup_timeout: Duration | None = None,
        queue: str | None = None,
        priority: int | None = None,
        fairness_key: str | None = None,
        context: Any = None,
    ) -> Awaitable[Any]:
        """Dispatch a step by name to whichever worker serves it and return its result.

        ``step`` is what ``@engine.step`` returned, or a step name served by
        another process or language. Options override the step's registered
        policy for this call.

        Without ``timeout`` the run suspends durably while the task is out:
        nothing is held in memory, and whichever instance receives the result
        resumes the run. With ``timeout`` this process awaits the result and
        fails the attempt after ``timeout`` of silence (no heartbeat);
        ``pickup_timeout`` bounds the wait for the worker's first beat.

        A failed attempt is retried ``retries`` more times after a durable
        backoff timer, unless the worker raised :class:`FatalError`. When
        attempts run out the await raises :class:`StepFailed` with the
        worker's code and details.

        With ``queue`` (a name given to ``engine.register_queue``) the step
        first needs a slot there: a step not admitted suspends and asks again,
        ``priority`` first, round-robin across ``fairness_key`` (default: the
        run id).
        """
        definition: StepDefinition | None
        if isinstance(step, StepRef):
            name, definition = step.name, step.definition
        elif isinstance(step, str) and step:
            name, definition = step, self._services.steps.definition(step)
        else:
            raise TypeError("ctx.step takes a step reference or a non-empty step name")
        base = definition.retry if definition is not None else self._services.default_retry
        policy = RetryPolicy.build(
            retries, backoff, backoff_base, backoff_max, jitter, default=base
        )
        timeout_ms = (
            to_ms(timeout, name="step timeout")
            if timeout is not None
            else (definition.timeout_ms if definition else None)
        )
        pickup_ms = (
            to_ms(pickup_timeout, name="pickup timeout")
            if pickup_timeout is not None
            else (definition.pickup_timeout_ms if definition else None)
        )
        queue_name = queue if queue is not None else (definition.queue if definition else None)
        if queue_name is not None and queue_name not in self._services.steps.queues:
            raise ValueError(f"ctx.step: queue {queue_name!r} is not registered on this engine")
        try:
            payload = codec.to_jsonable(input)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"step {name!r}: input cannot be sent as JSON: {exc}") from exc
        call = StepCall(
            name=name,
            input=payload,
            policy=policy,
            timeout_ms=timeout_ms,
            pickup_ms=pickup_ms,
            queue=queue_name,
            priority=priority
            if priority is not None
            else ((definition and definition.priority) or None),
            fairness_key=fairness_key,
            context=context,
        )
        seq, recorded = self._turn.allocate(name, "step")
        return StepRunner(self).run(seq, call, recorded)

    # -- deterministic sources -----------------------------------------------------------

    def now(self) -> Awaitable[datetime]:
        """The current time (UTC), recorded on first execution and replayed verbatim."""
        seq, recorded = self._turn.allocate("now", "now")

        async def read() -> int:
            return self._services.clock.now_ms()

        async def as_datetime() -> datetime:
            ms = await self._recorded(seq, "now", "now", recorded, read)
            return datetime.fromtimestamp(ms / 1000, tz=UTC)

        return as_datetime()

    def uuid(self) -> Awaitable[_uuid.UUID]:
        """A random UUID4, recorded so replay returns the same one."""
        seq, recorded = self._turn.allocate("uuid", "uuid")

        async def make() -> str:
            return str(_uuid.uuid4())

        async def as_uuid() -> _uuid.UUID:
            return _uuid.UUID(await self._recorded(seq, "uuid", "uuid", recorded, make))

        return as_uuid()

    def random(self) -> Awaitable[float]:
        """A random float in [0, 1), recorded so replay returns the same one."""
        seq, recorded = self._turn.allocate("random", "random")

        async def make() -> float:
            return _random.random()

        return self._recorded(seq, "random", "random", recorded, make)

    async def _recorded(
        self,
        seq: int,
        name: str,
        kind: str,
        recorded: Checkpoint | None,
        compute: Callable[[], Awaitable[Any]],
    ) -> Any:
        if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
            return recorded.output
        if self._turn.unwinding:
            return await self._turn.park(seq, None, reconcile=False)
        with self._turn.in_flight():
            value = codec.to_jsonable(await compute())
            now = self._services.clock.now_ms()
            self._save_later(
                Checkpoint(
                    self.run_id,
                    seq,
                    name,
                    kind,
                    CheckpointStatus.COMPLETED,
                    output=value,
                    attempts=1,
                    started_at=now,
                    finished_at=now,
                )
            )
        return value

    # -- waiting -------------------------------------------------------------------------

    def sleep(self, duration: Duration) -> Awaitable[None]:
        """Wait durably: the run suspends and any instance wakes it when due.

        The wake time is fixed when the sleep first executes, so a replay does
        not restart the countdown.
        """
        ms = to_ms(duration, name="sleep duration")
        seq, recorded = self._turn.allocate("sleep", "sleep")
        return self._timer(seq, recorded, lambda now: now + ms)

    def sleep_until(self, when: datetime | int | float) -> Awaitable[None]:
        """Wait durably until ``when`` (an aware ``datetime`` or epoch seconds)."""
        if isinstance(when, datetime):
            if when.tzinfo is None:
                raise ValueError("sleep_until needs a timezone-aware datetime")
            target = int(when.timestamp() * 1000)
        elif isinstance(when, int | float) and not isinstance(when, bool):
            target = int(when * 1000)
        else:
            raise TypeError("sleep_until takes an aware datetime or epoch seconds")
        seq, recorded = self._turn.allocate("sleep", "sleep")
        return self._timer(seq, recorded, lambda _now: target)

    async def _timer(
        self, seq: int, recorded: Checkpoint | None, wake_time: Callable[[int], int]
    ) -> None:
        if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
            return
        if self._turn.unwinding:
            await self._turn.park(seq, None, reconcile=False)
        now = self._services.clock.now_ms()
        wake_at = recorded.wake_at if recorded is not None and recorded.wake_at else wake_time(now)
        checkpoint = Checkpoint(
            self.run_id,
            seq,
            "sleep",
            "sleep",
            CheckpointStatus.PENDING,
            wake_at=wake_at,
            started_at=recorded.started_at if recorded else now,
        )
        if wake_at <= now:
            checkpoint.status, checkpoint.finished_at = CheckpointStatus.COMPLETED, now
            self._save_later(checkpoint)
            return
        if recorded is None:
            with self._turn.in_flight():
                await self._save(checkpoint)
        await self._turn.park(seq, wake_at, reconcile=False)

    def wait_for_signal(self, token: str, *, timeout: Duration | None = None) -> Awaitable[Any]:
        """Wait for ``engine.signal(token, payload)`` and return the payload.

        A signal sent before the wait begins is buffered and consumed here.
        With ``timeout`` the await raises :class:`SignalTimeout` once it passes.
        One run waits on a token at a time; a second waiter replaces the first.
        """
        if not isinstance(token, str) or not token:
            raise ValueError("a signal token must be a non-empty string")
        timeout_ms = None if timeout is None else to_ms(timeout, name="signal timeout")
        name = f"signal:{token}"
        seq, recorded = self._turn.allocate(name, "signal")
        return self._wait_signal(seq, name, token, timeout_ms, recorded)

    async def _wait_signal(
        self, seq: int, name: str, token: str, timeout_ms: int | None, recorded: Checkpoint | None
    ) -> Any:
        turn, services = self._turn, self._services
        if recorded is not None:
            if recorded.status is CheckpointStatus.COMPLETED:
                return recorded.output
            if recorded.status is CheckpointStatus.FAILED:
                raise SignalTimeout(token)
            if turn.unwinding:
                return await turn.park(seq, None, reconcile=False)
            deadline = recorded.wake_at
            now = services.clock.now_ms()
            if deadline is not None and deadline <= now:
                with turn.in_flight():
                    await turn.flush()
                    won = await services.store.cancel_signal_wait(
                        self.run_id, seq, token, error_info(SignalTimeout(token)), now
                    )
                if won is not None:
                    return won.output
                raise SignalTimeout(token)
            return await turn.park(seq, deadline, reconcile=True)
        now = services.clock.now_ms()
        deadline = None if timeout_ms is None else now + timeout_ms
        checkpoint = Checkpoint(
            self.run_id,
            seq,
            name,
            "signal",
            CheckpointStatus.PENDING,
            wake_at=deadline,
            started_at=now,
        )
        with turn.in_flight():
            await turn.flush()
            result = await services.store.wait_signal(checkpoint, token, turn.owner, now)
        if result is None:
            turn.fenced = True
            turn.close("fenced")
            raise _TurnClosed("fenced")
        if result.delivered:
            return result.payload
        return await turn.park(seq, deadline, reconcile=True)

    def wait_for_event(
        self,
        name: str,
        *,
        match: Mapping[str, Any] | None = None,
        timeout: Duration | None = None,
    ) -> Awaitable[Any]:
        """Wait for ``engine.publish_event(name, payload)`` and return the payload.

        With ``match`` only a payload holding each of its top-level keys with
        an equal JSON value is taken (``match={"order_id": 42}``). Every run
        waiting on a matching event receives it; an event published while
        nobody waited is buffered and taken by the first matching wait. With
        ``timeout`` the await raises :class:`EventTimeout` once it passes.
        """
        from .events import check_match, check_name, wait_for_event

        check_name(name)
        clean = check_match(match)
        timeout_ms = None if timeout is None else to_ms(timeout, name="event timeout")
        seq, recorded = self._turn.allocate(f"event:{name}", "event")
        return wait_for_event(self, seq, name, clean, timeout_ms, recorded)

    # -- composition ---------------------------------------------------------------------

    def child(self, workflow: str, input: Any = None, *, run_id: str | None = None) -> ChildCall:
        """Start ``workflow`` as a child run and wait for its output.

        The child's id is ``run_id`` or ``<this run>.child.<seq>``, the same on
        every replay, so it is started once. It runs in this run's namespace.
        The await raises :class:`ChildFailed` if the child fails, is
        cancelled, goes dead or cannot be started.
        """
        if not isinstance(workflow, str) or not workflow:
            raise ValueError("ctx.child needs a workflow name")
        seq, recorded = self._turn.allocate(f"child:{workflow}", "child")
        if recorded is not None and isinstance(recorded.input, dict):
            child_id = str(recorded.input.get("run_id"))
        else:
            child_id = run_id or f"{self.run_id}.child.{seq}"
        return ChildCall(self, seq, child_id, workflow, input, recorded)

    def all(
        self, items: Iterable[Awaitable[Any]], *, fail_fast: bool = False
    ) -> Awaitable[list[Any]]:
        """Await many children and steps; return their values in input order.

        Children (:meth:`child`) are started together and cost one suspension,
        however many. If any item fails, :class:`GatherFailed` is raised once
        every item has finished (``fail_fast=True``: at the first failure,
        cancelling the children still running); it lists every failure.
        """
        return self._all(list(items), settled=False, fail_fast=fail_fast)

    def all_settled(self, items: Iterable[Awaitable[Any]]) -> Awaitable[list[Settled]]:
        """Like :meth:`all`, but never raises for a failed item: returns one
        :class:`Settled` per item, in input order."""
        return self._all(list(items), settled=True, fail_fast=False)

    async def _all(self, items: list[Awaitable[Any]], *, settled: bool, fail_fast: bool) -> Any:
        children = [(i, item) for i, item in enumerate(items) if isinstance(item, ChildCall)]
        others = [(i, item) for i, item in enumerate(items) if not isinstance(item, ChildCall)]
        for _, item in others:
            if not inspect.isawaitable(item):
                raise TypeError(f"ctx.all takes awaitables from ctx calls, got {item!r}")
        calls = [call for _, call in children]
        group = f"all:{calls[0].seq}" if calls else None

        async def run_children() -> list[tuple[bool, Any]]:
            return await self._run_children(calls, group, fail_fast) if calls else []

        async def run_others() -> list[Any]:
            return await asyncio.gather(*(item for _, item in others), return_exceptions=True)

        child_outcomes, other_results = await asyncio.gather(run_children(), run_others())
        outcomes: list[tuple[bool, Any]] = [(True, None)] * len(items)
        for (i, _), outcome in zip(children, child_outcomes, strict=True):
            outcomes[i] = outcome
        for (i, _), result in zip(others, other_results, strict=True):
            if isinstance(result, BaseException):
                if is_control_flow(result):
                    raise result
                outcomes[i] = (False, result)
            else:
                outcomes[i] = (True, result)
        if settled:
            return [
                Settled(True, value) if ok else Settled(False, error=value)
                for ok, value in outcomes
            ]
        failures = [(i, value) for i, (ok, value) in enumerate(outcomes) if not ok]
        if failures:
            raise GatherFailed(failures)
        return [value for _, value in outcomes]

    async def _await_child(self, call: ChildCall) -> Any:
        [(ok, value)] = await self._run_children([call], None, False)
        if not ok:
            raise value
        return value

    async def _run_children(
        self, calls: list[ChildCall], group: str | None, fail_fast: bool
    ) -> list[tuple[bool, Any]]:
        turn, services = self._turn, self._services
        outcomes: list[tuple[bool, Any] | None] = [None] * len(calls)
        fresh: list[int] = []
        waiting: list[int] = []
        for i, call in enumerate(calls):
            recorded = call.recorded
            if recorded is None:
                fresh.append(i)
            elif recorded.status is CheckpointStatus.COMPLETED:
                outcomes[i] = (True, recorded.output)
            elif recorded.status is CheckpointStatus.FAILED:
                outcomes[i] = (False, _child_failed(call.run_id, recorded.error))
            else:
                waiting.append(i)
        if fresh and turn.unwinding:
            waiting.extend(fresh)
            fresh = []
        lost = [i for i in waiting if calls[i].run_id in turn.missing_children]
        if lost and not turn.unwinding:
            # An earlier turn stored these placeholders and died before it
            # created the children: create them now.
            with turn.in_flight():
                errors = await services.spawn_children(turn.run, [calls[i] for i in lost])
            for i, error in zip(lost, errors, strict=True):
                turn.missing_children.discard(calls[i].run_id)
                if error is not None:
                    waiting.remove(i)
                    outcomes[i] = (False, _child_failed(calls[i].run_id, error))
        if fresh:
            now = services.clock.now_ms()
            # The placeholders a child settles exist before any child can finish.
            placeholders = [
                Checkpoint(
                    self.run_id,
                    calls[i].seq,
                    f"child:{calls[i].workflow}",
                    "child",
                    CheckpointStatus.PENDING,
                    input={"run_id": calls[i].run_id, "workflow": calls[i].workflow},
                    started_at=now,
                    group=group,
                )
                for i in fresh
            ]
            with turn.in_flight():
                await turn.flush()
                if not await services.store.save_checkpoints(placeholders, turn.owner):
                    turn.fenced = True
                    turn.close("fenced")
                    raise _TurnClosed("fenced")
                errors = await services.spawn_children(turn.run, [calls[i] for i in fresh])
            for i, error in zip(fresh, errors, strict=True):
                if error is None:
                    waiting.append(i)
                else:
                    outcomes[i] = (False, _child_failed(calls[i].run_id, error))
        failed = any(o is not None and not o[0] for o in outcomes)
        if waiting and fail_fast and failed:
            await services.cancel_runs([calls[i].run_id for i in waiting])
            for i in waiting:
                outcomes[i] = (
                    False,
                    RunCancelled(f"child {calls[i].run_id} was cancelled: a sibling failed"),
                )
            waiting = []
        if waiting:
            await turn.park(min(calls[i].seq for i in waiting), None, reconcile=True)
        return [o if o is not None else (False, RuntimeError("unsettled")) for o in outcomes]

    def patched(self, patch_id: str) -> Awaitable[bool]:
        """Guard an in-place change to a workflow body.

        New runs record a marker here and get ``True`` (take the new code
        path). A run that already recorded another operation at this position
        started before the change: it gets ``False`` and its positions are
        left as they were.
        """
        if not isinstance(patch_id, str) or not patch_id:
            raise ValueError("ctx.patched needs a non-empty id")
        turn = self._turn
        turn.ensure_open()
        name = f"patch:{patch_id}"
        recorded = turn.checkpoints.get(turn.next_seq)
        if recorded is not None and recorded.kind != "patch":
            return _resolved(False)
        if recorded is not None and recorded.name != name:
            raise NondeterminismError(
                f"run {self.run_id!r}: position {turn.next_seq} holds {recorded.name!r}, "
                f"but the workflow now asks for {name!r}"
            )
        seq, recorded = turn.allocate(name, "patch")
        if recorded is None:
            now = self._services.clock.now_ms()
            self._save_later(
                Checkpoint(
                    self.run_id,
                    seq,
                    name,
                    "patch",
                    CheckpointStatus.COMPLETED,
                    output=True,
                    started_at=now,
                    finished_at=now,
                )
            )
        return _resolved(True)

    # -- sagas ---------------------------------------------------------------------------

    @property
    def _has_compensations(self) -> bool:
        return bool(self._compensations)

    async def _compensate(self) -> list[ErrorInfo]:
        """Run the registered undos in reverse order; return the failures.

        Each undo is checkpointed at its reserved negative position
        (``-2 - index``), so an unwind interrupted by a crash resumes without
        undoing anything twice. Called by the engine after the body ended.
        """
        turn, services = self._turn, self._services
        failures: list[ErrorInfo] = []
        for index in reversed(range(len(self._compensations))):
            entry = self._compensations[index]
            seq = -2 - index
            recorded = turn.checkpoints.get(seq)
            if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
                continue
            started = services.clock.now_ms()
            name = f"compensate:{entry.name}"
            if not await services.store.save_checkpoint(
                Checkpoint(
                    self.run_id,
                    seq,
                    name,
                    "compensation",
                    CheckpointStatus.RUNNING,
                    started_at=started,
                    attempts=1,
                ),
                turn.owner,
            ):
                raise _TurnClosed("fenced")
            policy = RetryPolicy(retries=2, base_ms=500)
            error: ErrorInfo | None = None
            for attempt in range(policy.retries + 1):
                try:
                    await self._call(entry.fn, (entry.output,))
                    error = None
                    break
                except Exception as exc:
                    error = error_info(exc)
                    if attempt < policy.retries:
                        await services.clock.sleep(policy.delay_ms(attempt + 1) / 1000)
            status = CheckpointStatus.COMPLETED if error is None else CheckpointStatus.FAILED
            if not await services.store.save_checkpoint(
                Checkpoint(
                    self.run_id,
                    seq,
                    name,
                    "compensation",
                    status,
                    error=error,
                    started_at=started,
                    finished_at=services.clock.now_ms(),
                    attempts=1,
                ),
                turn.owner,
            ):
                raise _TurnClosed("fenced")
            if error is not None:
                self.log.error("compensation %s failed: %s", name, error["message"])
                failures.append(error)
        return failures

    # -- control -------------------------------------------------------------------------

    def continue_as_new(self, input: Any) -> None:
        """End this run and continue as a fresh run (``<id>~N``) with ``input``.

        Raises a control-flow signal; code after it does not run.
        """
        raise _ContinueAsNew(codec.to_jsonable(input))

    # -- plumbing ------------------------------------------------------------------------

    async def _save(self, checkpoint: Checkpoint) -> None:
        turn, store = self._turn, self._services.store
        turn.ensure_open()
        if store.ordered_writes:
            # Queued behind every earlier write: once this one is done they
            # are too, and the flush only collects their results.
            held = await store.save_checkpoint(checkpoint, turn.owner)
            await turn.flush()
        else:
            await turn.flush()
            held = await store.save_checkpoint(checkpoint, turn.owner)
        if not held:
            turn.fenced = True
            turn.close("fenced")
            raise _TurnClosed("fenced")

    def _save_later(self, checkpoint: Checkpoint) -> None:
        self._turn.write_later(self._services.store.save_checkpoint(checkpoint, self._turn.owner))


async def _resolved(value: bool) -> bool:
    return value


def _child_failed(run_id: str, error: ErrorInfo | None) -> ChildFailed:
    error = error or {}
    details = error.get("details")
    status = details.get("status", "failed") if isinstance(details, dict) else "failed"
    return ChildFailed(
        run_id,
        str(status),
        str(error.get("message", "failed")),
        code=error.get("code"),
        details=details,
    )


def _default_priority(definition: StepDefinition | None) -> int | None:
    return None if definition is None else definition.priority
