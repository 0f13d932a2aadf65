"""Client: start and steer runs from an application, with no registrations.

A web request handler, a cron script or an admin tool starts runs by workflow
*name* and never executes anything: no worker loop, no step consumers, no
leases. Underneath it is an :class:`~durably.Engine` that never drives
(``drive=False, consumers="never"``), so a start from a client reaches the
engines that execute runs exactly as a producer engine's does (the run queue
on ``db://`` and ``redis://``, store notices on PostgreSQL, the poll
otherwise), and a cancel reaches the turn running it the same way.

:class:`SyncClient` (in :mod:`durably._sync_client`) is the same surface for
synchronous code.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from types import TracebackType
from typing import Any

from . import _codec as codec
from ._children import RunNotFound
from ._names import check_name
from ._registry import UNPINNED, check_version, validate_input
from ._start import check_signal
from .clock import Clock
from .durations import Duration
from .engine import Engine
from .errors import SchemaValidationError, WorkflowNotRegistered
from .handle import RunHandle
from .model import Checkpoint, Run, RunResult, RunStatus
from .schedules import Schedule
from .stores import RunPage, StateStore
from .transports import Transport

__all__ = ["Client"]


class Client:
    """Start, signal, cancel and inspect runs by workflow name; never executes them.

    Args:
        store: the store URL (or object) the executing engines use; defaults
            like :class:`~durably.Engine`'s (``DURABLY_DATABASE_URL``).
        transport: the executing engines' transport URL (``db://``,
            ``redis://…``): starts and wakes go through its run queue.
        namespace: the pool new runs go to (default ``"default"``).
        schemas: ``{workflow name: input type}`` (a pydantic model, a
            dataclass, any validator): input is validated before the run is
            created, as ``@engine.workflow(input=...)`` would.
        strict: reject a workflow name missing from ``schemas`` before
            anything is created. Without it an unknown name creates the run:
            another process may serve it.
        clock: the time source (a :class:`durably.testing.VirtualClock` in tests).

    A run started without ``version`` is pinned by the first engine that
    executes it, to that engine's current version of the workflow. Use it
    as ``async with durably.Client(url) as client:``, or call
    :meth:`close` when done.
    """

    def __init__(
        self,
        store: str | StateStore | None = None,
        *,
        transport: str | Transport | None = None,
        namespace: str | None = None,
        schemas: Mapping[str, Any] | None = None,
        strict: bool = False,
        clock: Clock | None = None,
    ) -> None:
        if strict and not schemas:
            raise ValueError("strict=True rejects every name missing from schemas=; pass schemas")
        for name in schemas or {}:
            check_name(name, "workflow name")
        self._schemas = dict(schemas or {})
        self._strict = strict
        self._engine = Engine(
            store,
            transport=transport,
            namespace=namespace,
            clock=clock,
            drive=False,
            consumers="never",
        )

    @property
    def store(self) -> StateStore:
        """The store runs live in."""
        return self._engine.store

    @property
    def namespace(self) -> str:
        """The pool new runs go to."""
        return self._engine.namespace

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect the store (done lazily by every call)."""
        await self._engine.open()

    async def close(self) -> None:
        """Push what is still queued and close the store."""
        await self._engine.close()

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- starting -------------------------------------------------------------------------

    async def start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        start_at: datetime | Duration | None = None,
        tags: list[str] | None = None,
        priority: int = 0,
        version: str | None = None,
    ) -> RunHandle[Any]:
        """Create a run of ``workflow`` and return its handle at once.

        Idempotent by ``run_id``, like ``Engine.start``. ``version`` pins the
        run to that version; without it the first engine that executes the
        run pins it. Raises :class:`SchemaValidationError` (or, with
        ``strict``, :class:`WorkflowNotRegistered`) before anything is stored.
        """
        stored_input = self._check_input(workflow, input)
        if version is not None:
            check_version(version)
        run = await self._engine._create_run(
            workflow,
            UNPINNED if version is None else str(version),
            stored_input,
            run_id=run_id,
            start_at=start_at,
            tags=tags,
            priority=priority,
        )
        return RunHandle(run, self)

    def _check_input(self, workflow: str, input: Any) -> Any:
        if not isinstance(workflow, str) or not workflow:
            raise ValueError("workflow must be a non-empty workflow name")
        check_name(workflow, "workflow name")
        if workflow in self._schemas:
            return validate_input(workflow, self._schemas[workflow], input)
        if self._strict:
            known = ", ".join(sorted(self._schemas))
            raise WorkflowNotRegistered(
                f"workflow {workflow!r} is not in this client's schemas (known: {known})"
            )
        try:
            return codec.to_jsonable(input, "input")
        except (TypeError, ValueError) as exc:
            raise SchemaValidationError(
                f"input of workflow {workflow!r} cannot be stored as JSON: {exc}"
            ) from exc

    async def signal_with_start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str,
        token: str,
        payload: Any = None,
        tags: list[str] | None = None,
        priority: int = 0,
    ) -> RunHandle[Any]:
        """Start ``run_id`` unless it exists, then send it signal ``token``
        (see ``Engine.signal_with_start``); return its handle."""
        check_signal(token, payload)
        handle = await self.start(workflow, input, run_id=run_id, tags=tags, priority=priority)
        await self.signal(token, payload)
        return handle

    async def retry_with_input(
        self, run_id: str, input: Any, *, new_run_id: str | None = None
    ) -> RunHandle[Any]:
        """Start a fresh run of the same workflow with corrected ``input``
        (see ``Engine.retry_with_input``); the original stays as it is."""
        run = await self._require(run_id)
        return await self.start(
            run.workflow,
            input,
            run_id=new_run_id or f"{run_id}~retry~{uuid.uuid4().hex[:8]}",
            tags=run.tags,
            priority=run.priority,
        )

    # -- steering -------------------------------------------------------------------------

    async def signal(self, token: str, payload: Any = None) -> str | None:
        """Deliver ``payload`` to the run waiting on ``token`` (see ``Engine.signal``)."""
        return await self._engine.signal(token, payload)

    async def publish_event(
        self, name: str, payload: Any = None, *, id: str | None = None, buffer: bool = True
    ) -> int:
        """Publish event ``name`` to the runs waiting for it (see
        ``Engine.publish_event``). ``on_event`` triggers are an engine's
        registrations: a client's publish starts no run."""
        return await self._engine.publish_event(name, payload, id=id, buffer=buffer)

    async def cancel(self, run_id: str, *, compensate: bool = False) -> RunStatus:
        """Cancel a run and its live children (see ``Engine.cancel``); the turn
        executing it elsewhere is stopped at its next ``ctx`` call or write."""
        return await self._engine.cancel(run_id, compensate=compensate)

    async def retry(self, run_id: str) -> Run:
        """Run a failed or dead run again from where it failed (see ``Engine.retry``)."""
        return await self._engine.retry(run_id)

    # -- reading --------------------------------------------------------------------------

    async def get_handle(self, run_id: str) -> RunHandle[Any]:
        """A handle on an existing run (raises :class:`~durably.RunNotFound`)."""
        return RunHandle(await self._require(run_id), self)

    async def wait_for_run(
        self, run_id: str, *, terminal: bool = False, timeout: float | None = None
    ) -> RunResult:
        """Wait until the run settles (see ``Engine.wait_for_run``)."""
        return await self._engine.wait_for_run(run_id, terminal=terminal, timeout=timeout)

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        return await self._engine.get_run(run_id)

    async def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        tag: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Runs newest first, filtered; pass ``page.next_cursor`` for the next page."""
        return await self._engine.list_runs(
            status=status, workflow=workflow, tag=tag, limit=limit, cursor=cursor
        )

    async def history(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints in seq order."""
        return await self._engine.history(run_id)

    # -- schedules ------------------------------------------------------------------------

    async def list_schedules(self) -> list[Schedule]:
        """This namespace's schedules with their state, by name."""
        return await self._engine.list_schedules()

    async def get_schedule(self, name: str) -> Schedule | None:
        """A schedule with its state, or ``None``."""
        return await self._engine.get_schedule(name)

    async def pause_schedule(self, name: str) -> Schedule:
        """Stop firing ``name`` until resumed (see ``Engine.pause_schedule``)."""
        return await self._engine.pause_schedule(name)

    async def resume_schedule(self, name: str) -> Schedule:
        """Fire ``name`` again from its next window (see ``Engine.resume_schedule``)."""
        return await self._engine.resume_schedule(name)

    async def trigger_schedule(self, name: str) -> str:
        """Queue a run of schedule ``name`` now, for the next firing pass of an
        engine that has its workflow (see ``Engine.trigger_schedule``); its run id."""
        return await self._engine.trigger_schedule(name)

    async def remove_schedule(self, name: str) -> bool:
        """Delete a schedule; ``False`` if there was none."""
        return await self._engine.remove_schedule(name)

    async def _require(self, run_id: str) -> Run:
        run = await self.get_run(run_id)
        if run is None:
            raise RunNotFound(f"run {run_id!r} not found")
        return run
