"""Failure routing and housekeeping hooks: dead letters, error routes,
retention with archival, stalled-run detection.

A *handler* is either the name of a workflow (started durably, with an id
derived from the run, so a handler fires once per run however often the
hook is invoked) or an async callable taking the :class:`Run` (called in this
process; an exception is logged, never propagated).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ._logs import engine_logger
from ._start import StartRun
from .model import Checkpoint, Run, RunStatus

__all__ = ["EvictHook", "Handler", "Hooks", "StalledHook", "StartRun"]

Handler = str | Callable[[Run], Awaitable[Any]]
"""A workflow name, or ``async def handler(run)``."""
EvictHook = Callable[[Run, list[Checkpoint]], Awaitable[Any]]
"""``async def archive(run, history)``; raising keeps the run."""
StalledHook = Callable[[Run], Awaitable[Any]]
"""``async def alert(run)``, called once per stalled episode."""

_log = engine_logger("durably._hooks")


class Hooks:
    """What the engine calls when runs fail, die, age out or stall."""

    def __init__(self) -> None:
        self.dead: list[Handler] = []
        self.errors: dict[str, list[Handler]] = {}
        self.evict: list[EvictHook] = []
        self.stalled: list[StalledHook] = []
        # run id -> the episode last reported (see Worker.sweep_stalled)
        self.stalled_seen: dict[str, tuple[int, int]] = {}

    def add_dead(self, handler: Handler) -> None:
        """Call ``handler`` for every run that goes ``dead``."""
        self.dead.append(_check_handler(handler))

    def add_error(self, code: str, handler: Handler) -> None:
        """Route failed runs whose error ``code`` matches (``"*"``: any) to ``handler``."""
        if not isinstance(code, str) or not code:
            raise ValueError("on_error needs an error code, or '*' for every failure")
        self.errors.setdefault(code, []).append(_check_handler(handler))

    def add_evict(self, hook: EvictHook) -> None:
        """Offer runs to ``hook`` before retention deletes them."""
        if not callable(hook):
            raise TypeError("on_evict takes an async callable (run, history)")
        self.evict.append(hook)

    def add_stalled(self, hook: StalledHook) -> None:
        """Tell ``hook`` of runs that stalled."""
        if not callable(hook):
            raise TypeError("on_stalled takes an async callable (run)")
        self.stalled.append(hook)

    def error_handlers(self, code: str | None) -> list[Handler]:
        """Handlers for a failure with ``code``, then the catch-all ``"*"`` ones."""
        return [*self.errors.get(code or "error", []), *self.errors.get("*", [])]

    async def after_failure(self, run: Run, start: StartRun) -> None:
        """Route a run that just became failed or dead to its handlers.

        A workflow-name handler is started through ``start`` with an id
        derived from the run (``dlq:<run_id>``, ``onerror:<code>:<run_id>``),
        so it fires once per run however often this is called; a callable
        handler is awaited here, its exception logged.
        """
        if run.status is RunStatus.DEAD:
            handlers = self.dead
            handler_id = f"dlq:{run.run_id}"
        elif run.status is RunStatus.FAILED:
            code = (run.error or {}).get("code")
            handlers = self.error_handlers(code)
            handler_id = f"onerror:{code}:{run.run_id}"
        else:
            return
        for handler in handlers:
            if isinstance(handler, str):
                try:
                    await start(handler, handler_input(run), run_id=handler_id)
                except Exception:
                    _log.exception("could not start handler %s for run %s", handler, run.run_id)
            else:
                await call_safely(handler, run)


def handler_input(run: Run) -> dict[str, Any]:
    """What a handler workflow receives about the run it handles."""
    return {
        "run_id": run.run_id,
        "workflow": run.workflow,
        "status": run.status.value,
        "error": run.error,
        "input": run.input,
    }


async def call_safely(hook: Callable[..., Awaitable[Any]], *args: Any) -> bool:
    """Await ``hook(*args)``; log and return ``False`` if it raises."""
    try:
        await hook(*args)
    except Exception:
        _log.exception("hook %r failed", hook)
        return False
    return True


def _check_handler(handler: Handler) -> Handler:
    if isinstance(handler, str) and handler:
        return handler
    if callable(handler):
        return handler
    raise TypeError("a handler is a workflow name or an async callable taking the run")
