"""The waits of :class:`~durably.stores.memory.MemoryStore`: signals and
events (``WaitStore``), their buffers and their expiry, as a mixin over the
store's dictionaries."""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from typing import TYPE_CHECKING, Any

from ..model import TERMINAL_STATUSES, Checkpoint, CheckpointKind, CheckpointStatus, ErrorInfo, Run
from ._match import match_index, project
from .base import EventDelivery, SignalWait


class MemoryWaits:
    """Signal and event waits over the dictionaries :class:`MemoryStore` keeps
    (declared here, created by its ``__init__``)."""

    _runs: dict[str, Run]
    _checkpoints: dict[str, dict[int, Checkpoint]]
    _waiters: dict[str, dict[tuple[str, int], None]]
    _buffered: dict[str, deque[tuple[int, Any]]]
    _event_waiters: dict[str, dict[tuple[str, int], tuple[str, str]]]
    _buffered_events: dict[str, deque[tuple[int, Any]]]
    _published: dict[str, int]

    if TYPE_CHECKING:

        def _holds(self, run_id: str, owner: str) -> bool: ...

        def _put(self, checkpoint: Checkpoint) -> None: ...

    # -- signals -------------------------------------------------------------------------

    async def wait_signal(
        self, checkpoint: Checkpoint, token: str, owner: str, now: int
    ) -> SignalWait | None:
        """Consume a buffered signal or register the waiter."""
        if not self._holds(checkpoint.run_id, owner):
            return None
        buffered = self._buffered.get(token)
        if buffered:
            _, payload = buffered.popleft()
            if not buffered:
                del self._buffered[token]
            self._put(_completed(checkpoint, payload, now))
            return SignalWait(True, payload)
        # A wait registered again keeps its place in line.
        self._waiters.setdefault(token, {}).setdefault((checkpoint.run_id, checkpoint.seq))
        self._put(checkpoint)
        return SignalWait(False)

    async def send_signal(self, token: str, payload: Any, now: int) -> str | None:
        """Deliver to the oldest waiter, or buffer."""
        waits = self._waiters.get(token)
        if not waits:
            self._buffered[token].append((now, copy.deepcopy(payload)))
            return None
        run_id, seq = next(iter(waits))
        self._forget_wait(token, run_id, seq)
        current = self._checkpoints[run_id].get(seq)
        base = current or Checkpoint(
            run_id, seq, f"signal:{token}", CheckpointKind.SIGNAL, CheckpointStatus.PENDING
        )
        self._put(_completed(base, copy.deepcopy(payload), now))
        return run_id

    async def cancel_signal_wait(
        self, run_id: str, seq: int, token: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """Time a wait out unless a signal won the race."""
        current = self._checkpoints.get(run_id, {}).get(seq)
        if current is not None and current.status is CheckpointStatus.COMPLETED:
            return copy.deepcopy(current)
        self._forget_wait(token, run_id, seq)
        if current is not None:
            current.status = CheckpointStatus.FAILED
            current.error = copy.deepcopy(error)
            current.finished_at = now
        return None

    def _forget_wait(self, token: str, run_id: str, seq: int) -> None:
        waits = self._waiters.get(token)
        if waits is not None:
            waits.pop((run_id, seq), None)
            if not waits:
                del self._waiters[token]

    async def list_buffered_signals(self, token: str) -> list[Any]:
        """Buffered payloads for ``token``."""
        return copy.deepcopy([payload for _, payload in self._buffered.get(token, ())])

    # -- events --------------------------------------------------------------------------

    async def wait_event(
        self,
        checkpoint: Checkpoint,
        name: str,
        match: dict[str, Any] | None,
        owner: str,
        now: int,
    ) -> SignalWait | None:
        """Consume the oldest matching buffered event or register the waiter."""
        if not self._holds(checkpoint.run_id, owner):
            return None
        keys, text = match_index(match)
        buffered = self._buffered_events.get(name)
        if buffered:
            for index, (_, payload) in enumerate(buffered):
                if project(payload, keys) == text:
                    del buffered[index]
                    if not buffered:
                        del self._buffered_events[name]
                    self._put(_completed(checkpoint, payload, now))
                    return SignalWait(True, copy.deepcopy(payload))
        self._event_waiters.setdefault(name, {})[(checkpoint.run_id, checkpoint.seq)] = (
            keys,
            text,
        )
        self._put(checkpoint)
        return SignalWait(False)

    async def publish_event(
        self,
        name: str,
        payload: Any,
        now: int,
        *,
        event_id: str | None = None,
        buffer: bool = True,
        triggered: int = 0,
    ) -> EventDelivery:
        """Deliver to every matching waiter, or buffer one copy."""
        if event_id is not None and event_id in self._published:
            return EventDelivery([], self._published[event_id], duplicate=True)
        waiters = self._event_waiters.get(name, {})
        projections: dict[str, str | None] = {}
        delivered: list[str] = []
        for (run_id, seq), (keys, text) in list(waiters.items()):
            if keys not in projections:
                projections[keys] = project(payload, keys)
            if projections[keys] != text:
                continue
            del waiters[(run_id, seq)]
            run = self._runs.get(run_id)
            current = self._checkpoints.get(run_id, {}).get(seq)
            if (
                run is None
                or run.status in TERMINAL_STATUSES
                or current is None
                or current.status is not CheckpointStatus.PENDING
            ):
                continue
            self._put(_completed(current, copy.deepcopy(payload), now))
            if run_id not in delivered:
                delivered.append(run_id)
        if not waiters:
            self._event_waiters.pop(name, None)
        buffered = not delivered and not triggered and buffer
        if buffered:
            self._buffered_events.setdefault(name, deque()).append((now, copy.deepcopy(payload)))
        recipients = len(delivered) + triggered
        if event_id is not None:
            self._published[event_id] = recipients
        return EventDelivery(delivered, recipients, buffered=buffered)

    async def cancel_event_wait(
        self, run_id: str, seq: int, name: str, error: ErrorInfo, now: int
    ) -> Checkpoint | None:
        """Time an event wait out unless an event won the race."""
        current = self._checkpoints.get(run_id, {}).get(seq)
        if current is not None and current.status is CheckpointStatus.COMPLETED:
            return copy.deepcopy(current)
        waiters = self._event_waiters.get(name)
        if waiters is not None:
            waiters.pop((run_id, seq), None)
            if not waiters:
                del self._event_waiters[name]
        if current is not None:
            current.status = CheckpointStatus.FAILED
            current.error = copy.deepcopy(error)
            current.finished_at = now
        return None

    async def list_buffered_events(self, name: str) -> list[Any]:
        """Buffered payloads on event ``name``."""
        return copy.deepcopy([payload for _, payload in self._buffered_events.get(name, ())])

    async def expire_buffered(self, before: int, limit: int) -> int:
        """Delete up to ``limit`` buffered signals and events created before ``before``."""
        expired = 0
        for buffers in (self._buffered, self._buffered_events):
            for key in list(buffers):
                queue = buffers[key]
                while queue and queue[0][0] < before and expired < limit:
                    queue.popleft()
                    expired += 1
                if not queue:
                    del buffers[key]
        return expired


def _completed(checkpoint: Checkpoint, payload: Any, now: int) -> Checkpoint:
    return dataclasses.replace(
        checkpoint, status=CheckpointStatus.COMPLETED, output=payload, finished_at=now
    )
