"""Events: named, broadcast messages between the outside world and runs.

``engine.publish_event(name, payload)`` delivers ``payload`` to every run
waiting in ``ctx.wait_for_event(name, match=…)`` whose ``match`` the payload
satisfies (top-level keys compared by JSON equality, key order never
mattering; see :mod:`durably.stores._match`), and starts one run of every
workflow registered with ``on_event=name``. It returns how many runs received
it. A publish that reaches nobody keeps one copy for the first matching
waiter (``buffer=False`` drops it instead). ``id=`` makes a publish
idempotent: a second publish with the same id delivers nothing, and the runs
it starts are named ``evt:<id>:<workflow>``.

Delivery has the same no-lost-wake guarantee as signals: a waiter registers
and checks the buffer in one atomic store call, a publisher takes the waiters
and buffers in one atomic store call, both under the event name's lock.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from . import codec
from .errors import EventTimeout, SchemaValidationError, _TurnClosed
from .model import Checkpoint, CheckpointStatus
from .replay import error_info
from .stores._match import canonical

if TYPE_CHECKING:
    from .clock import Clock
    from .context import WorkflowContext
    from .registry import Registry
    from .stores import StateStore

__all__ = ["EventRouter", "check_match", "check_name", "event_trigger_run_id", "wait_for_event"]


def event_trigger_run_id(event_id: str, workflow: str) -> str:
    """The id of the run an ``on_event`` trigger starts: ``evt:<event id>:<workflow>``."""
    return f"evt:{event_id}:{workflow}"


def check_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a usable event name."""
    if not isinstance(name, str) or not name:
        raise ValueError("an event name must be a non-empty string")


def check_match(match: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate a ``wait_for_event`` match and return it as JSON data (``None`` if empty)."""
    if match is None:
        return None
    if not isinstance(match, Mapping) or not all(isinstance(k, str) for k in match):
        raise TypeError("match must be a mapping of top-level keys (str) to values")
    try:
        value = codec.to_jsonable(dict(match))
        canonical(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"match cannot be stored as JSON: {exc}") from exc
    return value if value else None


class StartRun(Protocol):
    """Starts a run idempotently by id (``Engine.start``)."""

    def __call__(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        tags: list[str] | None = None,
    ) -> Awaitable[Any]: ...


class EventRouter:
    """The engine's event triggers and publish path.

    Internal: ``engine.publish_event`` and ``engine.on_event`` delegate here.
    """

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        registry: Registry,
        *,
        open: Callable[[], Awaitable[None]],
        wake: Callable[[str], Awaitable[None]],
        start: StartRun,
    ) -> None:
        """``open()`` connects the engine before a publish writes; ``wake(run_id)``
        gives a run that received the event its turn; ``start`` starts a
        trigger's run (idempotent by id). Triggers name workflows of ``registry``."""
        self._store = store
        self._clock = clock
        self._registry = registry
        self._open = open
        self._wake = wake
        self._start = start
        self._triggers: dict[str, list[str]] = {}

    def add_trigger(self, events: str | Sequence[str], workflow: str) -> None:
        """Start a run of ``workflow`` (input: the payload) for every publish of ``events``."""
        names = [events] if isinstance(events, str) else list(events)
        if not names:
            raise ValueError("on_event needs at least one event name")
        for name in names:
            check_name(name)
            workflows = self._triggers.setdefault(name, [])
            if workflow not in workflows:
                workflows.append(workflow)

    def triggers(self, name: str) -> list[str]:
        """The workflows started by a publish of ``name``."""
        return list(self._triggers.get(name, ()))

    async def publish(self, name: str, payload: Any, *, event_id: str | None, buffer: bool) -> int:
        """Deliver, buffer and trigger (see the module docstring); return the recipients."""
        check_name(name)
        if event_id is not None and (not isinstance(event_id, str) or not event_id):
            raise ValueError("an event id must be a non-empty string")
        try:
            payload = codec.to_jsonable(payload)
        except (TypeError, ValueError) as exc:
            raise SchemaValidationError(f"event payload cannot be stored as JSON: {exc}") from exc
        workflows = self.triggers(name)
        for workflow in workflows:  # refuse a payload a trigger would reject, before anything
            definition = self._registry.get(workflow)
            if definition.takes_input:
                definition.validate_input(payload)
        await self._open()
        delivery = await self._store.publish_event(
            name,
            payload,
            self._clock.now_ms(),
            event_id=event_id,
            buffer=buffer,
            triggered=len(workflows),
        )
        for run_id in delivery.run_ids:
            await self._wake(run_id)
        # Started after the delivery, also for a duplicate: a publish retried
        # after a crash in between still starts them (idempotent by run id).
        trigger_id = event_id or uuid.uuid4().hex
        for workflow in workflows:
            takes_input = self._registry.get(workflow).takes_input
            await self._start(
                workflow,
                payload if takes_input else None,
                run_id=event_trigger_run_id(trigger_id, workflow),
                tags=[f"event:{name}"],
            )
        return delivery.recipients


async def wait_for_event(
    ctx: WorkflowContext,
    seq: int,
    name: str,
    match: dict[str, Any] | None,
    timeout_ms: int | None,
    recorded: Checkpoint | None,
) -> Any:
    """The body of ``ctx.wait_for_event`` once its position is taken."""
    turn, services = ctx._turn, ctx._services
    if recorded is not None:
        if recorded.status is CheckpointStatus.COMPLETED:
            return recorded.output
        if recorded.status is CheckpointStatus.FAILED:
            raise EventTimeout(name)
        if turn.unwinding:
            return await turn.park(seq, None, reconcile=False)
        deadline = recorded.wake_at
        now = services.clock.now_ms()
        if deadline is not None and deadline <= now:
            with turn.in_flight():
                await turn.flush()
                won = await services.store.cancel_event_wait(
                    ctx.run_id, seq, name, error_info(EventTimeout(name)), now
                )
            if won is not None:
                return won.output
            raise EventTimeout(name)
        return await turn.park(seq, deadline, reconcile=True)
    if turn.unwinding:
        # A compensating cancel replays history only: nothing new is waited on.
        return await turn.park(seq, None, reconcile=False)
    now = services.clock.now_ms()
    deadline = None if timeout_ms is None else now + timeout_ms
    checkpoint = Checkpoint(
        ctx.run_id,
        seq,
        f"event:{name}",
        "event",
        CheckpointStatus.PENDING,
        input={"match": match} if match else None,
        wake_at=deadline,
        started_at=now,
    )
    with turn.in_flight():
        await turn.flush()
        result = await services.store.wait_event(checkpoint, name, match, turn.owner, now)
    if result is None:
        turn.fenced = True
        turn.close("fenced")
        raise _TurnClosed("fenced")
    if result.delivered:
        return result.payload
    return await turn.park(seq, deadline, reconcile=True)
