"""Durable waits: timers, and waits for a signal or an event with an optional timeout.

A signal wait and an event wait are one routine over a :class:`_Mailbox`
(which store calls register and cancel the waiter, and which error a
timeout raises): the wait registers atomically with the store (taking a
buffered message if one is there), parks with its deadline as the wake
time, and on a later turn past the deadline cancels atomically — a message
that won the race is still returned.

While a compensating cancel unwinds, a wait reached for the first time
parks without registering: registering would take a buffered message meant
for a live run, and record a pending wait on a run that is ending.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from .. import _codec as codec
from .._lifecycle_events import EventKind
from .._names import check_name as check_key
from .._replay import error_info
from ..errors import EventTimeout, SignalTimeout
from ..model import Checkpoint, CheckpointKind, CheckpointStatus, ErrorInfo
from ..stores._match import canonical
from ..stores.base import SignalWait
from .env import TurnEnv

__all__ = [
    "EventBatch",
    "check_batch",
    "check_match",
    "check_name",
    "timer",
    "wait_for_event",
    "wait_for_events",
    "wait_for_signal",
]

MAX_BATCH_ITEMS = 1000
"""The most events one ``wait_for_events`` collects (each is a checkpoint)."""


def check_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a usable event name."""
    if not isinstance(name, str) or not name:
        raise ValueError("an event name must be a non-empty string")
    check_key(name, "event name")


def check_match(match: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate a ``wait_for_event`` match and return it as JSON data (``None`` if empty)."""
    if match is None:
        return None
    if not isinstance(match, Mapping) or not all(isinstance(k, str) for k in match):
        raise TypeError("match must be a mapping of top-level keys (str) to values")
    try:
        value = codec.to_jsonable(dict(match), "event match")
        canonical(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"match cannot be stored as JSON: {exc}") from exc
    return value if value else None


async def timer(
    env: TurnEnv, seq: int, recorded: Checkpoint | None, wake_time: Callable[[int], int]
) -> None:
    """Suspend until ``wake_time(now)``, fixed when the timer first executes."""
    if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
        return
    turn = env.turn
    if turn.unwinding:
        await turn.park(seq, None, reconcile=False)
    now = env.clock.now_ms()
    wake_at = recorded.wake_at if recorded is not None and recorded.wake_at else wake_time(now)
    checkpoint = env.checkpoint(
        seq,
        "sleep",
        CheckpointKind.SLEEP,
        CheckpointStatus.PENDING,
        wake_at=wake_at,
        started_at=recorded.started_at if recorded else now,
    )
    if wake_at <= now:
        checkpoint.status, checkpoint.finished_at = CheckpointStatus.COMPLETED, now
        env.save_later(checkpoint)
        return
    if recorded is None:
        with turn.in_flight():
            await env.save(checkpoint)
    await turn.park(seq, wake_at, reconcile=False)


class _Mailbox(Protocol):
    """Where a wait's message comes from: the store calls and error of one wait kind."""

    def timed_out(self) -> SignalTimeout:
        """The error a wait past its deadline raises."""
        ...

    def register(
        self, env: TurnEnv, checkpoint: Checkpoint, now: int
    ) -> Awaitable[SignalWait | None]:
        """Take a buffered message or register the waiter (``None``: fenced)."""
        ...

    def cancel(
        self, env: TurnEnv, seq: int, error: ErrorInfo, now: int
    ) -> Awaitable[Checkpoint | None]:
        """Remove the timed-out waiter, or return the checkpoint a message completed."""
        ...


class _Signal:
    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def timed_out(self) -> SignalTimeout:
        return SignalTimeout(self.token)

    def register(
        self, env: TurnEnv, checkpoint: Checkpoint, now: int
    ) -> Awaitable[SignalWait | None]:
        env.turn.may_have_waiters = True
        return env.store.wait_signal(checkpoint, self.token, env.turn.owner, now)

    def cancel(
        self, env: TurnEnv, seq: int, error: ErrorInfo, now: int
    ) -> Awaitable[Checkpoint | None]:
        return env.store.cancel_signal_wait(env.run_id, seq, self.token, error, now)


class _Event:
    __slots__ = ("match", "name")

    def __init__(self, name: str, match: dict[str, Any] | None) -> None:
        self.name = name
        self.match = match

    def timed_out(self) -> SignalTimeout:
        return EventTimeout(self.name)

    def register(
        self, env: TurnEnv, checkpoint: Checkpoint, now: int
    ) -> Awaitable[SignalWait | None]:
        env.turn.may_have_waiters = True
        return env.store.wait_event(checkpoint, self.name, self.match, env.turn.owner, now)

    def cancel(
        self, env: TurnEnv, seq: int, error: ErrorInfo, now: int
    ) -> Awaitable[Checkpoint | None]:
        return env.store.cancel_event_wait(env.run_id, seq, self.name, error, now)


def wait_for_signal(
    env: TurnEnv,
    seq: int,
    name: str,
    token: str,
    timeout_ms: int | None,
    recorded: Checkpoint | None,
) -> Awaitable[Any]:
    """The body of ``ctx.wait_for_signal`` once its position is taken (an awaitable)."""
    mailbox = _Signal(token)
    return env.turn.resumable_at(
        seq,
        recorded,
        lambda cp: _wait(env, seq, name, CheckpointKind.SIGNAL, None, timeout_ms, cp, mailbox),
    )


def wait_for_event(
    env: TurnEnv,
    seq: int,
    name: str,
    event: str,
    match: dict[str, Any] | None,
    timeout_ms: int | None,
    recorded: Checkpoint | None,
) -> Awaitable[Any]:
    """The body of ``ctx.wait_for_event`` once its position is taken (an awaitable)."""
    stored_input = {"match": match} if match else None
    mailbox = _Event(event, match)
    kind = CheckpointKind.EVENT
    return env.turn.resumable_at(
        seq,
        recorded,
        lambda cp: _wait(env, seq, name, kind, stored_input, timeout_ms, cp, mailbox),
    )


def check_batch(max_items: object, window_ms: int) -> int:
    """``max_items`` of a ``wait_for_events`` as a count (1 to 1000), or a clear error."""
    if isinstance(max_items, bool) or not isinstance(max_items, int):
        raise TypeError(f"wait_for_events: max_items must be an int, got {max_items!r}")
    if not 1 <= max_items <= MAX_BATCH_ITEMS:
        raise ValueError(
            f"wait_for_events: max_items must be between 1 and {MAX_BATCH_ITEMS}, got {max_items}"
        )
    if window_ms < 0:
        raise ValueError("wait_for_events: window must not be negative")
    return max_items


class EventBatch:
    """The positions of one ``ctx.wait_for_events`` call, all taken at the call
    (so a concurrent ``ctx`` call never lands between them, however the
    events arrive): the first event's wait, the moment the window opened,
    then one wait per further event."""

    __slots__ = ("first", "label", "rest", "window")

    def __init__(
        self,
        label: str,
        first: tuple[int, Checkpoint | None],
        window: tuple[int, Checkpoint | None],
        rest: list[tuple[int, Checkpoint | None]],
    ) -> None:
        self.label = label
        self.first = first
        self.window = window
        self.rest = rest


async def wait_for_events(
    env: TurnEnv,
    batch: EventBatch,
    event: str,
    match: dict[str, Any] | None,
    window_ms: int,
    timeout_ms: int | None,
) -> list[Any]:
    """The body of ``ctx.wait_for_events``: wait for a first event (raising
    :class:`EventTimeout` after ``timeout_ms``), then collect more until the
    batch is full or ``window_ms`` passed since the first was taken."""
    stored_input = {"match": match} if match else None
    mailbox = _Event(event, match)
    label, kind = batch.label, CheckpointKind.EVENT
    seq, recorded = batch.first
    first = env.turn.resumable_at(
        seq,
        recorded,
        lambda cp: _wait(env, seq, label, kind, stored_input, timeout_ms, cp, mailbox),
    )
    items = [await first]
    if not batch.rest:
        return items
    opened = await _window_opened(env, *batch.window, f"{label}:window")
    closes = opened + window_ms
    for seq, recorded in batch.rest:

        def wait(cp: Checkpoint | None, seq: int = seq) -> Awaitable[Any]:
            return _wait(env, seq, label, kind, stored_input, None, cp, mailbox, deadline_at=closes)

        try:
            item = await env.turn.resumable_at(seq, recorded, wait)
        except EventTimeout:
            break  # the window closed (recorded, so a replay stops here too)
        items.append(item)
    return items


async def _window_opened(env: TurnEnv, seq: int, recorded: Checkpoint | None, name: str) -> int:
    """When the batch's first event was taken (epoch ms), recorded at ``seq``."""
    if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
        return int(recorded.output)
    turn = env.turn
    if turn.unwinding:
        return int(await turn.park(seq, None, reconcile=False))
    now = env.clock.now_ms()
    env.save_later(
        env.checkpoint(
            seq,
            name,
            CheckpointKind.NOW,
            CheckpointStatus.COMPLETED,
            output=now,
            attempts=1,
            started_at=now,
            finished_at=now,
        )
    )
    return now


async def _wait(
    env: TurnEnv,
    seq: int,
    name: str,
    kind: CheckpointKind,
    stored_input: Any,
    timeout_ms: int | None,
    recorded: Checkpoint | None,
    mailbox: _Mailbox,
    *,
    deadline_at: int | None = None,
) -> Any:
    turn = env.turn
    if recorded is not None:
        if recorded.status is CheckpointStatus.COMPLETED:
            return recorded.output
        if recorded.status is CheckpointStatus.FAILED:
            raise mailbox.timed_out()
    if turn.unwinding:
        # A compensating cancel replays history only: nothing new is waited on.
        return await turn.park(seq, None, reconcile=False)
    now = env.clock.now_ms()
    if recorded is not None:
        deadline = recorded.wake_at
        if deadline is not None and deadline <= now:
            with turn.in_flight(), turn.store_calls:
                await turn.flush()
                won = await mailbox.cancel(env, seq, error_info(mailbox.timed_out()), now)
            turn.wrote(seq)
            if won is not None:
                return won.output
            raise mailbox.timed_out()
        return await turn.park(seq, deadline, reconcile=True)
    deadline = deadline_at if timeout_ms is None else now + timeout_ms
    checkpoint = env.checkpoint(
        seq,
        name,
        kind,
        CheckpointStatus.PENDING,
        input=stored_input,
        wake_at=deadline,
        started_at=now,
    )
    with turn.in_flight(), turn.store_calls:
        await turn.flush()
        result = await mailbox.register(env, checkpoint, now)
    if result is None:
        env.fence_lost()
    turn.wrote(seq, None if result.delivered else checkpoint)
    if result.delivered:
        events = env.services.events
        if events.active and isinstance(mailbox, _Signal):
            # A buffered signal, taken by the wait that needed it.
            events.event(
                EventKind.SIGNAL_DELIVERED,
                env.run_id,
                now,
                workflow=turn.run.workflow,
                seq=seq,
                token=mailbox.token,
            )
        return result.payload
    if deadline is not None and deadline <= now:
        # Due already (a batch window that closed): no turn waits for nothing.
        with turn.in_flight(), turn.store_calls:
            won = await mailbox.cancel(env, seq, error_info(mailbox.timed_out()), now)
        turn.wrote(seq)
        if won is not None:
            return won.output
        raise mailbox.timed_out()
    return await turn.park(seq, deadline, reconcile=True)
