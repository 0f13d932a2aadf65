"""Which run, workflow and step a log record belongs to.

The engine sets :data:`RUN_CONTEXT` while it drives a run's turn, runs a step
or serves a dispatched one; asyncio tasks and the step threads inherit it. The
filter every engine logger carries copies it onto each record as ``run_id``,
``workflow`` and ``step`` (``None`` outside a run), so an application's
handlers and formatters can use them (``%(run_id)s``) on every engine line.
"""

from __future__ import annotations

import contextvars
import logging
from typing import NamedTuple

__all__ = ["RUN_CONTEXT", "LogContext", "RunContextFilter", "engine_logger", "with_step"]


class LogContext(NamedTuple):
    """The run (and step) the code running now works for."""

    run_id: str | None = None
    workflow: str | None = None
    step: str | None = None


RUN_CONTEXT: contextvars.ContextVar[LogContext] = contextvars.ContextVar(
    "durably_run",
    default=LogContext(),  # noqa: B039 - a NamedTuple: immutable
)


def with_step(step: str) -> contextvars.Token[LogContext]:
    """Mark the current task (and what it starts) as running ``step``; reset with the token."""
    return RUN_CONTEXT.set(RUN_CONTEXT.get()._replace(step=step))


class RunContextFilter(logging.Filter):
    """Adds ``run_id``, ``workflow`` and ``step`` to every record it sees
    (a value the caller passed in ``extra=`` is kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = RUN_CONTEXT.get()
        for field, value in zip(LogContext._fields, context, strict=True):
            if not hasattr(record, field):
                setattr(record, field, value)
        return True


_FILTER = RunContextFilter()


def engine_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the run-context filter on it (once)."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log
