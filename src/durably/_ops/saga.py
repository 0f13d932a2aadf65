"""Sagas: the undos registered by ``local_step(..., compensate=)`` and their unwinding.

A saga step's undo is remembered only once the step completed in this turn
(replayed or executed), so it is rebuilt on every replay and never persisted
itself. When the run fails, or is cancelled with ``compensate=True``, the
engine unwinds them in reverse; each undo is checkpointed at its own reserved
negative position, so an unwind interrupted by a crash resumes without undoing
anything twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._replay import Turn, error_info
from ..model import CheckpointKind, CheckpointStatus, ErrorInfo
from ..retry import RetryPolicy
from .env import Services, TurnEnv

__all__ = ["Saga"]

_UNDO_RETRY = RetryPolicy(retries=2, base_ms=500)
"""An undo's retries: a few quick ones, since the run is already ending."""


@dataclass(slots=True)
class _Compensation:
    seq: int
    name: str
    fn: Callable[..., Any]
    output: Any


class Saga:
    """The undos of one turn's completed saga steps, in completion order."""

    __slots__ = ("_undos",)

    def __init__(self) -> None:
        self._undos: list[_Compensation] = []

    def __bool__(self) -> bool:
        """Whether any undo is registered (the engine unwinds only then)."""
        return bool(self._undos)

    async def with_undo(
        self, seq: int, name: str, undo: Callable[..., Any], step: Awaitable[Any]
    ) -> Any:
        """Await ``step``; once it completed, register ``undo(output)`` for it."""
        output = await step
        self._undos.append(_Compensation(seq, name, undo, output))
        return output

    async def compensate(self, turn: Turn, services: Services) -> list[ErrorInfo]:
        """Run the registered undos in reverse order; return the failures.

        Each undo is checkpointed at its reserved negative position
        (``-2 - index``). Called by the engine after the body ended.
        """
        env = TurnEnv(turn, services)
        store, clock = env.store, env.clock
        failures: list[ErrorInfo] = []
        for index in reversed(range(len(self._undos))):
            entry = self._undos[index]
            seq = -2 - index
            recorded = turn.checkpoints.get(seq)
            if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
                continue
            started = clock.now_ms()
            name = f"compensate:{entry.name}"
            running = env.checkpoint(
                seq,
                name,
                CheckpointKind.COMPENSATION,
                CheckpointStatus.RUNNING,
                started_at=started,
                attempts=1,
            )
            with turn.store_calls:
                held = await store.save_checkpoint(running, turn.owner)
            if not held:
                env.fence_lost()
            error: ErrorInfo | None = None
            for attempt in range(_UNDO_RETRY.retries + 1):
                try:
                    await env.call(entry.fn, (entry.output,))
                    error = None
                    break
                except Exception as exc:
                    error = error_info(exc)
                    if attempt < _UNDO_RETRY.retries:
                        await clock.sleep(_UNDO_RETRY.delay_ms(attempt + 1) / 1000)
            status = CheckpointStatus.COMPLETED if error is None else CheckpointStatus.FAILED
            settled = env.checkpoint(
                seq,
                name,
                CheckpointKind.COMPENSATION,
                status,
                error=error,
                started_at=started,
                finished_at=clock.now_ms(),
                attempts=1,
            )
            with turn.store_calls:
                held = await store.save_checkpoint(settled, turn.owner)
            if not held:
                env.fence_lost()
            if error is not None:
                env.log.error("compensation %s failed: %s", name, error["message"])
                failures.append(error)
        return failures
