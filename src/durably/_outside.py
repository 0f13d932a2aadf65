"""The engine's side of ``ctx.set_value``, ``ctx.task``, ``ctx.webhook`` and
``ctx.breakpoint``: reading a published value, and delivering to a token.

Every delivery checks its token against the recorded position first (secret
compared in constant time, run and position as recorded, the wait not yet
answered). Only then is it sent as an ordinary signal. So a forged, stale or
duplicate token changes nothing and buffers nothing — a signal to an unknown
token would otherwise sit in the buffer until ``buffer_ttl``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ._children import RunNotFound
from ._ops.boundaries import (
    BREAKPOINT_PREFIX,
    TASK,
    TASK_FAILED,
    TASK_RESULT,
    WEBHOOK,
    breakpoint_token,
    parse_token,
)
from .model import TERMINAL_STATUSES, Checkpoint, CheckpointKind, CheckpointStatus, Run

__all__ = ["OutsideCalls"]

_ANSWERED = (CheckpointStatus.COMPLETED, CheckpointStatus.FAILED)


class _Store(Protocol):
    async def get_run(self, run_id: str) -> Run | None: ...

    async def get_checkpoint(self, run_id: str, seq: int) -> Checkpoint | None: ...

    async def load_checkpoints(self, run_id: str) -> dict[int, Checkpoint]: ...


class OutsideCalls:
    """Values, task completions, webhook bodies and breakpoint releases from outside a run."""

    def __init__(
        self,
        store: _Store,
        signal: Callable[[str, Any], Awaitable[str | None]],
        wake: Callable[[str], Awaitable[None]],
    ) -> None:
        self._store = store
        self._signal = signal
        self._wake = wake

    async def get_value(self, run_id: str, key: str, default: Any = None) -> Any:
        """The last value the run set under ``key``, or ``default``."""
        if await self._store.get_run(run_id) is None:
            raise RunNotFound(run_id)
        name = f"value:{key}"
        found = default
        for _seq, checkpoint in sorted((await self._store.load_checkpoints(run_id)).items()):
            if checkpoint.kind == CheckpointKind.VALUE and checkpoint.name == name:
                found = checkpoint.output
        return found

    async def complete_task(self, token: str, payload: dict[str, Any]) -> bool:
        """Answer the task ``token`` names; ``False`` if it was already answered."""
        parsed = parse_token(token, TASK)
        if parsed is None:
            raise ValueError("not a task token (it comes from ctx.task's dispatch function)")
        recorded = await self._store.get_checkpoint(parsed.run_id, parsed.seq)
        stored = (
            recorded.input.get("token") if recorded and isinstance(recorded.input, dict) else None
        )
        if recorded is None or recorded.kind != CheckpointKind.TASK or not _same(stored, token):
            raise ValueError("unknown task token: no task of any run was given it")
        wait = await self._store.get_checkpoint(parsed.run_id, parsed.seq + 1)
        if wait is not None and wait.status in _ANSWERED:
            return False
        run = await self._store.get_run(parsed.run_id)
        if run is None or run.status in TERMINAL_STATUSES:
            return False
        await self._signal(token, payload)
        return True

    async def deliver_webhook(self, token: str, body: Any) -> bool:
        """Hand ``body`` to the webhook ``token`` names; ``False`` if no such webhook."""
        parsed = parse_token(token, WEBHOOK)
        if parsed is None:
            return False
        recorded = await self._store.get_checkpoint(parsed.run_id, parsed.seq)
        if (
            recorded is None
            or recorded.kind != CheckpointKind.WEBHOOK
            or not _same(recorded.output, token)
        ):
            return False
        run = await self._store.get_run(parsed.run_id)
        if run is None or run.status in TERMINAL_STATUSES:
            return False
        await self._signal(token, body)
        return True

    async def resume(self, run_id: str) -> bool:
        """Release the run's breakpoints and wake it; ``False`` for an ended run."""
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        if run.status in TERMINAL_STATUSES:
            return False
        for seq, checkpoint in sorted((await self._store.load_checkpoints(run_id)).items()):
            if (
                checkpoint.kind == CheckpointKind.SIGNAL
                and checkpoint.status == CheckpointStatus.PENDING
                and checkpoint.name.startswith(BREAKPOINT_PREFIX)
            ):
                await self._signal(breakpoint_token(seq, run_id), None)
        await self._wake(run_id)
        return True


def _same(recorded: Any, token: str) -> bool:
    # Constant time: the secret must not leak through how long a refusal takes.
    return isinstance(recorded, str) and hmac.compare_digest(
        recorded.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass")
    )


def task_result(result: Any) -> dict[str, Any]:
    """The payload ``complete_task`` sends."""
    return {TASK_RESULT: result}


def task_failure(message: str, code: str | None, details: Any) -> dict[str, Any]:
    """The payload ``fail_task`` sends."""
    return {TASK_FAILED: {"message": message, "code": code, "details": details}}
