"""``ctx.transaction``: a step whose database writes commit with its checkpoint.

A local step's effect and its checkpoint are two commits, so a crash between
them runs the effect again: fine for an idempotent call, wrong for an
``INSERT`` into the app's own table. Here the app's function runs inside the
store's transaction that writes the checkpoint, under the run's lease: both
land, or neither does, and a retry starts from a clean slate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .. import _codec as codec
from .._intercept import StepInfo
from ..errors import FatalError, StepFailed
from ..model import Checkpoint, CheckpointKind, CheckpointStatus
from ..retry import RetryPolicy
from ..stores.base import TransactionStore
from .attempts import AttemptEvents
from .env import TurnEnv
from .local_step import after_failed_attempt

__all__ = ["transaction"]


async def transaction(
    env: TurnEnv,
    store: TransactionStore,
    seq: int,
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    policy: RetryPolicy,
    recorded: Checkpoint | None,
) -> Any:
    """Run ``fn(connection, *args)`` in the checkpoint's transaction, with retries."""
    if recorded is not None:
        if recorded.status is CheckpointStatus.COMPLETED:
            return recorded.output
        if recorded.status is CheckpointStatus.FAILED:
            raise StepFailed.from_error(name, recorded.error, recorded.attempts)
    turn, clock = env.turn, env.clock
    if turn.unwinding:
        return await turn.park(seq, None, reconcile=False)
    started = clock.now_ms()
    attempts = 0
    intercept = env.services.intercept
    told = AttemptEvents(env, name, seq) if env.services.events.active else None
    committed: list[tuple[bool, Any]] = []

    async def commit(checkpoint_for: Callable[[Any], Checkpoint]) -> Any:
        with turn.store_calls:
            committed.append(
                await store.transact(
                    env.run_id, turn.owner, lambda conn: fn(conn, *args), checkpoint_for
                )
            )
        return committed[-1][1]

    with turn.in_flight():
        for retry_number in range(policy.retries + 1):
            attempts += 1

            def checkpoint_for(value: Any, tried: int = attempts) -> Checkpoint:
                return env.checkpoint(
                    seq,
                    name,
                    CheckpointKind.TRANSACTION,
                    CheckpointStatus.COMPLETED,
                    output=codec.to_jsonable(value, "transaction result"),
                    attempts=tried,
                    started_at=started,
                    finished_at=clock.now_ms(),
                )

            # Earlier results first: this commit must not overtake them.
            await turn.flush()
            if told is not None:
                told.started(attempts)
            try:
                if intercept.steps:
                    # What the body gets is what was committed with the
                    # checkpoint (and what replay returns): an interceptor's
                    # substitute value cannot be, so it is not used.
                    info = StepInfo(
                        env.run_id, name, seq, attempts, "transaction", turn.run.workflow
                    )
                    await intercept.run_step(info, functools.partial(commit, checkpoint_for))
                else:
                    await commit(checkpoint_for)
                held, output = committed[-1]
            except Exception as exc:
                turn.ensure_open()
                final = isinstance(exc, FatalError | codec.EncodeError)
                if told is not None:
                    told.failed(attempts, exc, final or retry_number == policy.retries)
                # The attempt's writes were rolled back with its checkpoint.
                await after_failed_attempt(
                    env,
                    seq,
                    name,
                    CheckpointKind.TRANSACTION,
                    exc,
                    final or retry_number == policy.retries,
                    attempts,
                    started,
                    policy,
                    retry_number,
                )
                continue
            if not held:
                env.fence_lost()
            turn.wrote(seq)
            if told is not None:
                told.completed(attempts)
            return output
    raise AssertionError("unreachable")  # pragma: no cover
