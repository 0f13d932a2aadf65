"""Client: start and steer runs from an application, with no registrations.

A web request handler, a cron script or an admin tool starts runs by workflow
*name* and never executes anything: no worker loop, no step consumers, no
leases. Underneath it is an :class:`~durably.Engine` that never drives
(``drive=False, consumers="never"``), so a start from a client reaches the
engines that execute runs exactly as a producer engine's does (the run queue
of the ``db://`` transport, store notices on PostgreSQL, the poll otherwise),
and a cancel reaches the turn running it the same way.

:class:`SyncClient` is the same surface for synchronous code, on an event
loop of its own (:mod:`durably._client_loop`).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Coroutine, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Generic, TypeVar

from . import _codec as codec
from ._children import RunNotFound
from ._client_loop import LoopThread
from ._names import check_name
from ._registry import UNPINNED, check_version, validate_input
from ._start import check_signal
from .clock import Clock
from .durations import Duration
from .engine import Engine
from .errors import SchemaValidationError, WorkflowNotRegistered
from .handle import RunHandle
from .model import BulkCancel, Checkpoint, Run, RunResult, RunStatus, UpdateResult
from .schedules import Schedule
from .stores import RunPage, StateStore
from .transports import Transport

__all__ = ["Client", "SyncClient", "SyncRunHandle"]

T = TypeVar("T")
R = TypeVar("R")


class Client:
    """Start, signal, cancel and inspect runs by workflow name; never executes them.

    Args:
        store: the store URL (or object) the executing engines use; defaults
            like :class:`~durably.Engine`'s (``DURABLY_DATABASE_URL``).
        transport: the executing engines' transport URL: with ``db://``
            starts and wakes go through its run queue.
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
        # An entity's run is created by its first call: by name, unpinned,
        # like any start from a client.
        self._engine._entities.use_start(self._start_entity)

    @property
    def store(self) -> StateStore:
        """The store runs live in."""
        return self._engine.store

    @property
    def namespace(self) -> str:
        """The pool new runs go to."""
        return self._engine.namespace

    @property
    def clock(self) -> Clock:
        """The time source of the runs this client writes."""
        return self._engine.clock

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
        attributes: dict[str, Any] | None = None,
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
            attributes=attributes,
        )
        return RunHandle(run, self)

    async def _start_entity(self, workflow: str, input: Any, *, run_id: str) -> Run:
        return await self._engine._create_run(
            workflow, UNPINNED, input, run_id=run_id, start_at=None, tags=None, priority=0
        )

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

    async def update(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Send an update to the run's ``ctx.on_update`` handler and wait for
        its answer (see ``Engine.update``)."""
        return await self._engine.update(
            run_id, name, payload, update_id=update_id, timeout=timeout
        )

    async def call_entity(
        self,
        name: str,
        key: str,
        op: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Apply ``op`` to an entity and return its reply (see ``Engine.call_entity``);
        an engine registering the entity executes it."""
        return await self._engine.call_entity(
            name, key, op, payload, update_id=update_id, timeout=timeout
        )

    async def signal_entity(
        self, name: str, key: str, op: str, payload: Any = None, *, update_id: str | None = None
    ) -> str:
        """Send ``op`` to an entity without waiting (see ``Engine.signal_entity``)."""
        return await self._engine.signal_entity(name, key, op, payload, update_id=update_id)

    async def get_entity_state(self, name: str, key: str) -> Any:
        """The entity's state after its last operation (see
        ``Engine.get_entity_state``; ``None`` before any, since a client
        does not know the initial state)."""
        return await self._engine.get_entity_state(name, key)

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

    async def cancel_where(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        tag: str | None = None,
        attributes: list[tuple[str, str, Any]] | dict[str, Any] | None = None,
        limit: int = 500,
        compensate: bool = False,
    ) -> BulkCancel:
        """Cancel the live runs matching the filter, at most ``limit`` per call
        (see ``Engine.cancel_where``)."""
        return await self._engine.cancel_where(
            status=status,
            workflow=workflow,
            tag=tag,
            attributes=attributes,
            limit=limit,
            compensate=compensate,
        )

    async def retry(self, run_id: str) -> Run:
        """Run a failed or dead run again from where it failed (see ``Engine.retry``)."""
        return await self._engine.retry(run_id)

    async def resume(self, run_id: str) -> bool:
        """Release the run from its ``ctx.breakpoint`` and wake it now (see
        ``Engine.resume``); ``False`` for an ended run."""
        return await self._engine.resume(run_id)

    async def redispatch_pending(self, run_id: str) -> int:
        """Send the run's pending dispatched steps again (see ``Engine.redispatch_pending``)."""
        return await self._engine.redispatch_pending(run_id)

    async def delete_run(self, run_id: str) -> bool:
        """Delete an ended run with its history (see ``Engine.delete_run``)."""
        return await self._engine.delete_run(run_id)

    async def complete_task(self, token: str, result: Any = None) -> bool:
        """Complete the ``ctx.task`` given ``token`` (see ``Engine.complete_task``)."""
        return await self._engine.complete_task(token, result)

    async def fail_task(
        self, token: str, message: str, *, code: str | None = None, details: Any = None
    ) -> bool:
        """Fail the ``ctx.task`` given ``token`` (see ``Engine.fail_task``)."""
        return await self._engine.fail_task(token, message, code=code, details=details)

    async def deliver_webhook(self, token: str, body: Any = None) -> bool:
        """Hand ``body`` to the ``ctx.webhook()`` of ``token`` (see ``Engine.deliver_webhook``);
        what :func:`durably.webhooks.app` calls, so a ``Client`` can serve webhooks."""
        return await self._engine.deliver_webhook(token, body)

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
        status: RunStatus | str | list[RunStatus | str] | None = None,
        workflow: str | None = None,
        tag: str | None = None,
        parent_id: str | None = None,
        attributes: list[tuple[str, str, Any]] | dict[str, Any] | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Runs newest first, filtered (see ``Engine.list_runs``)."""
        return await self._engine.list_runs(
            status=status,
            workflow=workflow,
            tag=tag,
            parent_id=parent_id,
            attributes=attributes,
            limit=limit,
            cursor=cursor,
        )

    async def get_attributes(self, run_id: str) -> dict[str, Any]:
        """The run's search attributes (see ``Engine.get_attributes``)."""
        return await self._engine.get_attributes(run_id)

    async def history(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints in seq order."""
        return await self._engine.history(run_id)

    async def get_value(self, run_id: str, key: str, default: Any = None) -> Any:
        """The value the run published under ``key`` (see ``Engine.get_value``)."""
        return await self._engine.get_value(run_id, key, default)

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


class SyncRunHandle(Generic[T]):
    """:class:`~durably.RunHandle` for synchronous code (what
    :meth:`SyncClient.start` returns): the same calls, blocking."""

    __slots__ = ("_handle", "_loop")

    def __init__(self, handle: RunHandle[T], loop: LoopThread) -> None:
        self._handle = handle
        self._loop = loop

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self._handle.run_id

    @property
    def run(self) -> Run:
        """The run as it was when started (a snapshot; :meth:`get` reads it again)."""
        return self._handle.run

    def result(self, *, timeout: float | None = None) -> T:
        """Block until the run is terminal; its output (see :meth:`RunHandle.result`)."""
        return self._loop.call(self._handle.result(timeout=timeout), "result")

    def wait(self, *, terminal: bool = False, timeout: float | None = None) -> RunResult:
        """Block until the run settles (see :meth:`RunHandle.wait`)."""
        return self._loop.call(self._handle.wait(terminal=terminal, timeout=timeout), "wait")

    def get(self) -> Run:
        """The run as stored now."""
        return self._loop.call(self._handle.get(), "get")

    def status(self) -> RunStatus:
        """The run's status now."""
        return self._loop.call(self._handle.status(), "status")

    def cancel(self, *, compensate: bool = False) -> RunStatus:
        """Cancel the run; its status from before the call."""
        return self._loop.call(self._handle.cancel(compensate=compensate), "cancel")

    def __repr__(self) -> str:
        return f"<SyncRunHandle {self.run_id!r} workflow={self.run.workflow!r}>"


class SyncClient:
    """:class:`Client` for synchronous code: Django and Flask views, scripts, shells.

    The same calls, blocking, and safe from any number of threads at once:
    the client lives on an event loop of its own in a daemon thread, so its
    store connections (PostgreSQL's pool included) outlive every request.
    Create one per process (at import or app start), share it, and close it
    at exit — or use it as a context manager::

        with durably.SyncClient(store=URL) as client:
            client.start("checkout", order, run_id="checkout:42")

    Calling it from a running event loop raises :class:`~durably.WrongEventLoop`
    (it would block that loop): there, use :class:`Client`. Arguments as
    :class:`Client`.
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
        def make() -> Client:
            return Client(
                store,
                transport=transport,
                namespace=namespace,
                schemas=schemas,
                strict=strict,
                clock=clock,
            )

        self._make = make
        self._async_client = make()
        self._loop = LoopThread("durably-sync-client")
        self._pid = os.getpid()
        self._fork_lock = threading.Lock()

    @property
    def _client(self) -> Client:
        if self._pid != os.getpid():
            self._after_fork()
        return self._async_client

    def _after_fork(self) -> None:
        # A process forked after this client was made (gunicorn --preload, a
        # multiprocessing pool) has no loop thread: a call would wait forever
        # for it, and the parent's connections are not this process's. Start
        # afresh here; the parent's client is left to the parent.
        with self._fork_lock:
            if self._pid == os.getpid():
                return
            closed = self._loop.closed
            self._async_client = self._make()
            self._loop = LoopThread("durably-sync-client")
            self._pid = os.getpid()
            if closed:
                self._loop.stop()

    @property
    def client(self) -> Client:
        """The async client underneath (use it only on this client's loop)."""
        return self._client

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._loop.closed

    def _call(self, coro: Coroutine[Any, Any, R], what: str) -> R:
        return self._loop.call(coro, what)

    def open(self) -> None:
        """Connect the store now (otherwise the first call does)."""
        self._call(self._client.open(), "open")

    def close(self) -> None:
        """Close the store and stop the loop thread. Idempotent."""
        client = self._client
        if self._loop.closed:
            return
        try:
            self._call(client.close(), "close")
        finally:
            self._loop.stop()

    def __enter__(self) -> SyncClient:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        start_at: datetime | Duration | None = None,
        tags: list[str] | None = None,
        priority: int = 0,
        version: str | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> SyncRunHandle[Any]:
        """Create a run of ``workflow`` and return its handle (see :meth:`Client.start`)."""
        handle = self._call(
            self._client.start(
                workflow,
                input,
                run_id=run_id,
                start_at=start_at,
                tags=tags,
                priority=priority,
                version=version,
                attributes=attributes,
            ),
            "start",
        )
        return SyncRunHandle(handle, self._loop)

    def signal_with_start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str,
        token: str,
        payload: Any = None,
        tags: list[str] | None = None,
        priority: int = 0,
    ) -> SyncRunHandle[Any]:
        """Start ``run_id`` unless it exists, then signal it (see
        :meth:`Client.signal_with_start`)."""
        handle = self._call(
            self._client.signal_with_start(
                workflow,
                input,
                run_id=run_id,
                token=token,
                payload=payload,
                tags=tags,
                priority=priority,
            ),
            "signal_with_start",
        )
        return SyncRunHandle(handle, self._loop)

    def retry_with_input(
        self, run_id: str, input: Any, *, new_run_id: str | None = None
    ) -> SyncRunHandle[Any]:
        """A fresh run with corrected ``input`` (see :meth:`Client.retry_with_input`)."""
        handle = self._call(
            self._client.retry_with_input(run_id, input, new_run_id=new_run_id),
            "retry_with_input",
        )
        return SyncRunHandle(handle, self._loop)

    def get_handle(self, run_id: str) -> SyncRunHandle[Any]:
        """A handle on an existing run (raises :class:`~durably.RunNotFound`)."""
        return SyncRunHandle(self._call(self._client.get_handle(run_id), "get_handle"), self._loop)

    def signal(self, token: str, payload: Any = None) -> str | None:
        """Deliver ``payload`` to the run waiting on ``token`` (see :meth:`Client.signal`)."""
        return self._call(self._client.signal(token, payload), "signal")

    def update(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Send an update and wait for its answer (see :meth:`Client.update`)."""
        return self._call(
            self._client.update(run_id, name, payload, update_id=update_id, timeout=timeout),
            "update",
        )

    def call_entity(
        self,
        name: str,
        key: str,
        op: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Apply ``op`` to an entity and return its reply (see :meth:`Client.call_entity`)."""
        return self._call(
            self._client.call_entity(name, key, op, payload, update_id=update_id, timeout=timeout),
            "call_entity",
        )

    def signal_entity(
        self, name: str, key: str, op: str, payload: Any = None, *, update_id: str | None = None
    ) -> str:
        """Send ``op`` to an entity without waiting (see :meth:`Client.signal_entity`)."""
        return self._call(
            self._client.signal_entity(name, key, op, payload, update_id=update_id),
            "signal_entity",
        )

    def get_entity_state(self, name: str, key: str) -> Any:
        """The entity's state (see :meth:`Client.get_entity_state`)."""
        return self._call(self._client.get_entity_state(name, key), "get_entity_state")

    def publish_event(
        self, name: str, payload: Any = None, *, id: str | None = None, buffer: bool = True
    ) -> int:
        """Publish event ``name`` (see :meth:`Client.publish_event`)."""
        return self._call(
            self._client.publish_event(name, payload, id=id, buffer=buffer), "publish_event"
        )

    def cancel(self, run_id: str, *, compensate: bool = False) -> RunStatus:
        """Cancel a run (see :meth:`Client.cancel`)."""
        return self._call(self._client.cancel(run_id, compensate=compensate), "cancel")

    def retry(self, run_id: str) -> Run:
        """Run a failed or dead run again from where it failed."""
        return self._call(self._client.retry(run_id), "retry")

    def wait_for_run(
        self, run_id: str, *, terminal: bool = False, timeout: float | None = None
    ) -> RunResult:
        """Block until the run settles (see :meth:`Client.wait_for_run`)."""
        return self._call(
            self._client.wait_for_run(run_id, terminal=terminal, timeout=timeout), "wait_for_run"
        )

    def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        return self._call(self._client.get_run(run_id), "get_run")

    def list_runs(
        self,
        *,
        status: RunStatus | str | list[RunStatus | str] | None = None,
        workflow: str | None = None,
        tag: str | None = None,
        parent_id: str | None = None,
        attributes: list[tuple[str, str, Any]] | dict[str, Any] | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Runs newest first, filtered (see :meth:`Client.list_runs`)."""
        return self._call(
            self._client.list_runs(
                status=status,
                workflow=workflow,
                tag=tag,
                parent_id=parent_id,
                attributes=attributes,
                limit=limit,
                cursor=cursor,
            ),
            "list_runs",
        )

    def get_attributes(self, run_id: str) -> dict[str, Any]:
        """The run's search attributes (see :meth:`Client.get_attributes`)."""
        return self._call(self._client.get_attributes(run_id), "get_attributes")

    def history(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints in seq order."""
        return self._call(self._client.history(run_id), "history")

    def list_schedules(self) -> list[Schedule]:
        """This namespace's schedules with their state, by name."""
        return self._call(self._client.list_schedules(), "list_schedules")

    def get_schedule(self, name: str) -> Schedule | None:
        """A schedule with its state, or ``None``."""
        return self._call(self._client.get_schedule(name), "get_schedule")

    def pause_schedule(self, name: str) -> Schedule:
        """Stop firing ``name`` until resumed."""
        return self._call(self._client.pause_schedule(name), "pause_schedule")

    def resume_schedule(self, name: str) -> Schedule:
        """Fire ``name`` again from its next window."""
        return self._call(self._client.resume_schedule(name), "resume_schedule")

    def trigger_schedule(self, name: str) -> str:
        """Queue a run of schedule ``name`` now; its run id."""
        return self._call(self._client.trigger_schedule(name), "trigger_schedule")

    def remove_schedule(self, name: str) -> bool:
        """Delete a schedule; ``False`` if there was none."""
        return self._call(self._client.remove_schedule(name), "remove_schedule")
