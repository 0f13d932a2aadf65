"""Telling the store's outages apart from the workflow's failures.

An *infrastructure error* is one the store or its transport raised because it
could not answer (a dropped connection, a server shutting down, a disk that
failed): retrying the same write later succeeds. Everything else that a store
raises (a value it refuses, a validation error of durably's own) is the
caller's, and retrying it would fail the same way forever.
"""

from __future__ import annotations

import asyncio
import logging

from .errors import DurablyError

__all__ = ["FailureLog", "is_infrastructure_error"]

# PostgreSQL SQLSTATE classes that mean "the server could not do it now":
# connection exceptions, transaction rollback (serialization, deadlock),
# insufficient resources, operator intervention (admin shutdown, cannot
# connect now), system errors, and internal errors.
_TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "40", "53", "57", "58", "XX"})


def is_infrastructure_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the store (or its transport) could not answer now.

    Duck-typed on the drivers (asyncpg, sqlite3) so no driver is imported.
    A ``ValueError`` / ``TypeError`` / :class:`DurablyError` is the caller's
    (a value that cannot be stored), never an outage.
    """
    if isinstance(exc, DurablyError | ValueError | TypeError):
        return False
    if isinstance(exc, OSError | asyncio.TimeoutError | EOFError):
        return True  # ConnectionError, TimeoutError, disk I/O: all OSError
    sqlstate = getattr(exc, "sqlstate", None)
    module = type(exc).__module__
    if isinstance(sqlstate, str) and module.startswith("asyncpg"):
        return sqlstate[:2] in _TRANSIENT_SQLSTATE_CLASSES
    if module.startswith("asyncpg"):
        # InterfaceError and its kin without a SQLSTATE: a connection that
        # closed or broke mid-protocol ("cannot switch to state 12").
        return True
    if module == "sqlite3":
        # OperationalError: locked, disk I/O, disk full, file gone.
        return type(exc).__name__ == "OperationalError"
    return False


class FailureLog:
    """One log line when something starts failing, one when it recovers.

    In between, failures are only counted: a store outage of ten seconds
    otherwise writes thousands of lines (one per phase per tick per run).
    """

    __slots__ = ("_failing", "_logger")

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._failing: dict[str, int] = {}

    def failed(self, what: str, exc: BaseException) -> None:
        """``what`` failed with ``exc``: logged the first time in a row only."""
        count = self._failing.get(what)
        if count is None:
            self._failing[what] = 1
            # The traceback of the first failure is what explains it; an
            # outage's later ones are the same story and only counted.
            self._logger.error(
                "%s failed: %s: %s (logged once until it recovers)",
                what,
                type(exc).__name__,
                _describe(exc),
                exc_info=not is_infrastructure_error(exc),
            )
        else:
            self._failing[what] = count + 1

    def succeeded(self, what: str) -> None:
        """``what`` worked: log the recovery if it was failing."""
        if self._failing:
            count = self._failing.pop(what, None)
            if count is not None:
                self._logger.warning("%s recovered after %d failure(s)", what, count)

    def failing(self, what: str) -> int:
        """How many times in a row ``what`` has failed (0: it is fine)."""
        return self._failing.get(what, 0)


def _describe(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "<unprintable>"
