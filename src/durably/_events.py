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

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _codec as codec
from ._names import check_name as check_key
from ._ops.waits import check_match, check_name
from ._start import StartRun, new_run_id
from .errors import SchemaValidationError

if TYPE_CHECKING:
    from ._registry import Registry
    from .clock import Clock
    from .stores.base import WaitStore

__all__ = ["EventRouter", "check_match", "check_name", "event_trigger_run_id"]


def event_trigger_run_id(event_id: str, workflow: str) -> str:
    """The id of the run an ``on_event`` trigger starts: ``evt:<event id>:<workflow>``."""
    return f"evt:{event_id}:{workflow}"


class EventRouter:
    """The engine's event triggers and publish path.

    Internal: ``engine.publish_event`` and ``engine.on_event`` delegate here.
    """

    def __init__(
        self,
        store: WaitStore,
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
        if event_id is not None:
            check_key(event_id, "event id")
        try:
            payload = codec.to_jsonable(payload, "event payload")
        except (TypeError, ValueError) as exc:
            raise SchemaValidationError(f"event payload cannot be stored as JSON: {exc}") from exc
        workflows = self.triggers(name)
        for workflow in workflows:  # refuse a payload a trigger would reject, before anything
            definition = self._registry.get(workflow)
            if definition.takes_input:
                definition.validate_input(payload)
        await self._open()
        now = self._clock.now_ms()
        delivery = await self._store.publish_event(
            name,
            payload,
            now,
            event_id=event_id,
            buffer=buffer,
            triggered=len(workflows),
        )
        for run_id in delivery.run_ids:
            await self._wake(run_id)
        # Started after the delivery, also for a duplicate: a publish retried
        # after a crash in between still starts them (idempotent by run id).
        # Without an event id, a fresh one shaped like the engine's run ids
        # (time first): the triggered runs' ids then sort by time too.
        trigger_id = event_id or new_run_id(now)
        for workflow in workflows:
            takes_input = self._registry.get(workflow).takes_input
            await self._start(
                workflow,
                payload if takes_input else None,
                run_id=event_trigger_run_id(trigger_id, workflow),
                tags=[f"event:{name}"],
            )
        return delivery.recipients
