"""The lifecycle events of a step's attempts, told the same way for every step
kind that executes in the turn (local steps, transactions)."""

from __future__ import annotations

from typing import Any

from .._lifecycle_events import EventKind
from .._replay import error_info
from .env import TurnEnv

__all__ = ["AttemptEvents"]


class AttemptEvents:
    """Emits ``step.started`` / ``step.failed`` / ``step.completed`` for one step.

    Built only when someone listens (``events.active``), so a step nobody
    watches pays nothing beyond that check.
    """

    __slots__ = ("_env", "_name", "_seq", "_started_at")

    def __init__(self, env: TurnEnv, name: str, seq: int) -> None:
        self._env = env
        self._name = name
        self._seq = seq
        self._started_at = 0

    def started(self, attempt: int) -> None:
        """An attempt begins now."""
        self._started_at = self._env.clock.now_ms()
        self._tell(EventKind.STEP_STARTED, self._started_at, attempt)

    def failed(self, attempt: int, exc: BaseException, final: bool) -> None:
        """The attempt begun last raised ``exc``; ``final``: no retry follows."""
        at = self._env.clock.now_ms()
        self._tell(
            EventKind.STEP_FAILED,
            at,
            attempt,
            duration_ms=at - self._started_at,
            error=error_info(exc),
            final=final,
        )

    def completed(self, attempt: int) -> None:
        """The attempt begun last succeeded."""
        at = self._env.clock.now_ms()
        self._tell(EventKind.STEP_COMPLETED, at, attempt, duration_ms=at - self._started_at)

    def _tell(self, kind: EventKind, at: int, attempt: int, **fields: Any) -> None:
        env = self._env
        env.services.events.event(
            kind,
            env.run_id,
            at,
            workflow=env.turn.run.workflow,
            step=self._name,
            seq=self._seq,
            attempt=attempt,
            **fields,
        )
