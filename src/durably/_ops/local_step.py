"""Work done in this process and recorded: ``local_step``, ``side_effect``, ``now``,
``uuid``, ``random``.

A local step is a retry loop around user code with an optional ``running``
checkpoint per attempt; a recorded value is computed once and replayed
verbatim. Both write their result with the next flush rather than awaiting
it, so a sequential workflow pays one store round trip per step, not two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .. import _codec as codec
from .._intercept import StepInfo
from .._logs import RUN_CONTEXT, with_step
from .._replay import error_info
from .._typed import PLAIN, Misfit, Typed
from ..errors import FatalError, StepFailed
from ..model import Checkpoint, CheckpointKind, CheckpointStatus
from ..retry import RetryPolicy
from .attempts import AttemptEvents
from .env import TurnEnv

__all__ = ["after_failed_attempt", "local_step", "recorded_value"]


async def local_step(
    env: TurnEnv,
    seq: int,
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    policy: RetryPolicy,
    track: bool,
    recorded: Checkpoint | None,
    typed: Typed = PLAIN,
) -> Any:
    """Run ``fn(*args)`` with ``policy``'s retries and checkpoint its result at ``seq``.

    The body receives the stored result decoded as ``typed`` (its declared
    type), live and on replay alike. A result that does not fit fails the
    step without retries, as one no store can keep does.
    """
    if recorded is not None:
        if recorded.status is CheckpointStatus.COMPLETED:
            return typed.decode(recorded.output)
        if recorded.status is CheckpointStatus.FAILED:
            raise StepFailed.from_error(name, recorded.error, recorded.attempts)
    turn, clock = env.turn, env.clock
    if turn.unwinding:
        return await turn.park(seq, None, reconcile=False)
    attempts = recorded.attempts if recorded is not None else 0
    started = clock.now_ms()
    intercept = env.services.intercept
    told = AttemptEvents(env, name, seq) if env.services.events.active else None
    with turn.in_flight():
        for retry_number in range(policy.retries + 1):
            attempts += 1
            soon: _RunningSoon | None = None
            if track:
                running = env.checkpoint(
                    seq,
                    name,
                    CheckpointKind.LOCAL,
                    CheckpointStatus.RUNNING,
                    attempts=attempts,
                    started_at=started,
                )
                if turn.needs_fence():
                    # Awaited: it also makes every earlier result durable
                    # and proves the lease before the side effect happens.
                    await env.save(running)
                else:
                    # A quick step's result supersedes it in the same
                    # commit (one write per step, not two); one that ends
                    # without yielding to the loop never queues it at all.
                    soon = _RunningSoon(env, running)
            else:
                await turn.flush()
            if told is not None:
                told.started(attempts)
            try:
                env.services.faults.starting(name)
                step_context = with_step(name)
                try:
                    if intercept.steps:
                        info = StepInfo(env.run_id, name, seq, attempts, "local", turn.run.workflow)
                        result = await intercept.run_step(info, lambda: env.call(fn, args))
                    else:
                        result = await env.call(fn, args)
                finally:
                    RUN_CONTEXT.reset(step_context)
                output, value = typed.store(result, "step result")
            except Exception as exc:
                if soon is not None:
                    soon.now()  # recorded before the attempt's failure is
                turn.ensure_open()
                fatal = isinstance(exc, FatalError | codec.EncodeError | Misfit)
                final = fatal or retry_number == policy.retries
                if told is not None:
                    told.failed(attempts, exc, final)
                await after_failed_attempt(
                    env,
                    seq,
                    name,
                    CheckpointKind.LOCAL,
                    exc,
                    final,
                    attempts,
                    started,
                    policy,
                    retry_number,
                )
                continue
            if soon is not None:
                soon.drop()  # the result below supersedes it
            turn.ensure_open()
            if told is not None:
                told.completed(attempts)
            env.save_later(
                env.checkpoint(
                    seq,
                    name,
                    CheckpointKind.LOCAL,
                    CheckpointStatus.COMPLETED,
                    output=output,
                    attempts=attempts,
                    started_at=started,
                    finished_at=clock.now_ms(),
                )
            )
            if env.services.faults.crash_due(name):
                # A simulated crash: the result is durable, then this process
                # writes nothing more, as if it had died (the run stays leased).
                await turn.flush()
                env.fence_lost()
            return value
    raise AssertionError("unreachable")  # pragma: no cover


class _RunningSoon:
    """An attempt's ``running`` record, queued at the next turn of the event
    loop: an attempt that ends without yielding to the loop (a quick async
    step) drops it, as its result would supersede it in the same commit anyway;
    one that yields (I/O, a step thread) has it queued while it runs."""

    __slots__ = ("_checkpoint", "_env", "_handle")

    def __init__(self, env: TurnEnv, checkpoint: Checkpoint) -> None:
        self._env = env
        self._checkpoint = checkpoint
        self._handle: asyncio.Handle | None = asyncio.get_running_loop().call_soon(self.now)

    def now(self) -> None:
        """Queue the record now, unless queued already or the turn is closed."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        handle.cancel()
        if not self._env.turn.closed:
            self._env.save_later(self._checkpoint)

    def drop(self) -> None:
        """The attempt ended: a record not queued yet never will be."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def after_failed_attempt(
    env: TurnEnv,
    seq: int,
    name: str,
    kind: CheckpointKind,
    exc: Exception,
    final: bool,
    attempts: int,
    started: int,
    policy: RetryPolicy,
    retry_number: int,
) -> None:
    """After attempt ``attempts`` of a step raised ``exc``: when ``final``, record
    the step failed and raise :class:`StepFailed`; else wait out the backoff of
    retry ``retry_number + 1`` (counted within this turn)."""
    if final:
        failure = error_info(exc)
        await env.save(
            env.checkpoint(
                seq,
                name,
                kind,
                CheckpointStatus.FAILED,
                error=failure,
                attempts=attempts,
                started_at=started,
                finished_at=env.clock.now_ms(),
            )
        )
        raise StepFailed.from_error(name, failure, attempts) from exc
    delay = policy.delay_ms(retry_number + 1)
    env.log.info("step %s attempt %d failed (%s); retrying in %d ms", name, attempts, exc, delay)
    await env.clock.sleep(delay / 1000)
    env.turn.ensure_open()


async def recorded_value(
    env: TurnEnv,
    seq: int,
    name: str,
    kind: CheckpointKind,
    recorded: Checkpoint | None,
    compute: Callable[[], Awaitable[Any]],
    typed: Typed = PLAIN,
) -> Any:
    """Return the value recorded at ``seq``, or compute, record and return it
    (decoded as ``typed``, the declared type, either way)."""
    if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
        return typed.decode(recorded.output)
    turn = env.turn
    if turn.unwinding:
        return await turn.park(seq, None, reconcile=False)
    with turn.in_flight():
        data, value = typed.store(await compute(), f"the value of {name}")
        now = env.clock.now_ms()
        env.save_later(
            env.checkpoint(
                seq,
                name,
                kind,
                CheckpointStatus.COMPLETED,
                output=data,
                attempts=1,
                started_at=now,
                finished_at=now,
            )
        )
    return value
