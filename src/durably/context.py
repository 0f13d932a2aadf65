"""``WorkflowContext``: the operations a workflow body uses for everything
that is not pure computation.

Each public method is a plain (non-async) function that takes the operation's
position at call time and returns an awaitable; see :mod:`durably.replay` for
why. An operation whose checkpoint is completed returns the recorded value
without executing anything.
"""

from __future__ import annotations

import inspect
import logging
import random as _random
import uuid as _uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from . import codec
from ._threads import StepThreads
from .clock import Clock
from .durations import Duration, to_ms
from .errors import FatalError, SignalTimeout, StepFailed, _ContinueAsNew, _TurnClosed
from .model import Checkpoint, CheckpointStatus, ErrorInfo
from .replay import Turn, error_info
from .retry import RetryPolicy
from .stores.base import StateStore

__all__ = ["WorkflowContext"]

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


class WorkflowContext:
    """The handle a workflow body receives as its first argument.

    All I/O, time and randomness in a body must go through it; everything it
    returns is recorded, so a replay after a crash sees the same values.
    """

    def __init__(self, turn: Turn, services: _Services) -> None:
        self._turn = turn
        self._services = services
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

        With ``track_start`` (the engine default) a ``running`` checkpoint is
        written before the first attempt, so history shows a step that was
        interrupted by a crash; it is re-run on replay.
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
        track = self._services.track_start if track_start is None else track_start
        seq, recorded = self._turn.allocate(name, "local")
        return self._local_step(seq, name, fn, args, policy, track, recorded)

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
                raise _step_failed(name, recorded.error, recorded.attempts)
        turn, services = self._turn, self._services
        run_id = turn.run.run_id
        attempts = recorded.attempts if recorded is not None else 0
        started = services.clock.now_ms()
        with turn.in_flight():
            for retry_number in range(policy.retries + 1):
                attempts += 1
                if track:
                    # Awaited: it also makes every earlier result durable
                    # before this step's side effect happens.
                    await self._save(
                        Checkpoint(
                            run_id,
                            seq,
                            name,
                            "local",
                            CheckpointStatus.RUNNING,
                            attempts=attempts,
                            started_at=started,
                        )
                    )
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
                        raise _step_failed(name, failure, attempts) from exc
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


def _step_failed(name: str, error: ErrorInfo | None, attempts: int) -> StepFailed:
    error = error or {}
    return StepFailed(
        name,
        str(error.get("message", "failed")),
        code=error.get("code"),
        details=error.get("details"),
        attempts=attempts,
    )
