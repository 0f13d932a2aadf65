"""RunHandle: what starting a run returns, to wait for its result and act on it.

``engine.start`` and ``client.start`` return a :class:`RunHandle`. It holds
the run's id and the run as it was when started, and reaches the run through
the engine or client that started it (the three calls of :class:`RunOps`), so
a handle made in a request handler works on whichever store that client uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, cast

from ._children import RunNotFound, continued_to
from .errors import RunCancelled, RunFailed
from .model import TERMINAL_STATUSES, Run, RunResult, RunStatus

__all__ = ["RunHandle", "RunOps"]

T = TypeVar("T")


class RunOps(Protocol):
    """The calls a handle makes: what :class:`~durably.Engine` and
    :class:`~durably.Client` both offer."""

    async def wait_for_run(
        self, run_id: str, *, terminal: bool = False, timeout: float | None = None
    ) -> RunResult:
        """Wait until the run settles."""
        ...

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        ...

    async def cancel(self, run_id: str, *, compensate: bool = False) -> RunStatus:
        """Cancel the run; its status from before the call."""
        ...


class RunHandle(Generic[T]):
    """A started run: its id, and ``await handle.result()`` for its output.

    ``T`` is the workflow's result type when the run was started from the
    decorated function (``engine.start(checkout, order)``); ``Any`` when it
    was started by name. ``decode`` turns the stored JSON output into ``T``
    (``None``: the output as stored).
    """

    __slots__ = ("_decode", "_ops", "run")

    def __init__(self, run: Run, ops: RunOps, decode: Callable[[Any], T] | None = None) -> None:
        self.run = run
        """The run as it was when started (or found, for an id that existed):
        a snapshot; :meth:`get` reads it again."""
        self._ops = ops
        self._decode = decode

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.run.run_id

    async def result(self, *, timeout: float | None = None) -> T:
        """Wait until the run is terminal and return its output.

        A run that continued as new is followed to the end of its chain: the
        output is the last link's. Raises :class:`~durably.RunCancelled` when
        it was cancelled, :class:`~durably.RunFailed` when it failed or went
        dead (``error`` holds the stored failure), and :class:`TimeoutError`
        after ``timeout`` seconds (the run is left alone).
        """
        run_id = self.run_id
        async with asyncio.timeout(timeout):
            outcome = await self._ops.wait_for_run(run_id, terminal=True)
            while (link := continued_to(outcome)) is not None:
                outcome = await self._ops.wait_for_run(link, terminal=True)
        if outcome.status is RunStatus.COMPLETED:
            if self._decode is None:
                return cast(T, outcome.output)
            return self._decode(outcome.output)
        if outcome.status is RunStatus.CANCELLED:
            raise RunCancelled(
                f"run {outcome.run_id!r} was cancelled", run_id=outcome.run_id, error=outcome.error
            )
        raise RunFailed(outcome.run_id, outcome.status, outcome.error)

    async def wait(self, *, terminal: bool = False, timeout: float | None = None) -> RunResult:
        """Wait until the run settles (terminal or suspended; only terminal
        with ``terminal=True``) and return the outcome; never raises for a
        failed run (see ``wait_for_run``)."""
        return await self._ops.wait_for_run(self.run_id, terminal=terminal, timeout=timeout)

    async def get(self) -> Run:
        """The run as stored now (raises :class:`~durably.RunNotFound` if it
        was deleted)."""
        run = await self._ops.get_run(self.run_id)
        if run is None:
            raise RunNotFound(f"run {self.run_id!r} not found")
        return run

    async def status(self) -> RunStatus:
        """The run's status now."""
        return (await self.get()).status

    async def done(self) -> bool:
        """Whether the run is terminal now."""
        return await self.status() in TERMINAL_STATUSES

    async def cancel(self, *, compensate: bool = False) -> RunStatus:
        """Cancel the run (see ``Engine.cancel``); its status from before the call."""
        return await self._ops.cancel(self.run_id, compensate=compensate)

    def __repr__(self) -> str:
        return f"<RunHandle {self.run_id!r} workflow={self.run.workflow!r}>"
