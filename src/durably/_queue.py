"""The ``MessageQueue`` protocol: a durable message queue in a store's own database.

The SQL stores implement it (``SqliteStore.messages()``,
``PostgresStore.messages()``); the ``db`` transport carries step tasks,
results and heartbeats through it, and the fleet's run queue
(:mod:`durably._run_queue`) carries runs. It lives apart from both sides so
that neither imports the other's private modules. Semantics, the same on
SQLite and PostgreSQL:

- **Topics.** A message belongs to one topic (``tasks:<group>``, ``results``…);
  a consumer claims from the topics it names.
- **Order.** Highest ``priority`` first, then oldest (insertion ``id``).
- **At-least-once, by lease.** :meth:`MessageQueue.claim` marks messages as
  held by ``owner`` until ``now + lease_ms`` and counts the delivery. The
  holder :meth:`~MessageQueue.ack` s (deletes) them when done,
  :meth:`~MessageQueue.release` s them to hand them back at once, or
  :meth:`~MessageQueue.extend` s the lease while it still works. A holder that
  dies does none of these: its messages become visible again once the lease
  has passed, and another consumer gets them (``deliveries`` grows).
- **Delay.** A message with ``available_at`` in the future is invisible until then.
- **Born claimed.** A message pushed with ``claimed_by`` set (with its
  checkpoint, :meth:`OutboxStore.save_checkpoint_claiming`) is held by that
  owner from its insert on, as if claimed then (its first delivery): the
  ``db`` transport hands a task its own server has a free slot for straight
  to it. Nobody is notified of it; if its holder dies, it comes back after
  the lease like any claimed message.
- **Wake-ups.** Every push notifies listeners of its topics (PostgreSQL
  ``NOTIFY``; SQLite only within this process), so consumers need not wait
  for their next poll; they still poll every :attr:`MessageQueue.poll_interval`
  seconds, since a notification may be lost.

The table ``durably_messages`` is created on first use, not by the stores'
migrations: a deployment that never uses the queue never has it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .model import Checkpoint, Run
    from .stores.base import Resolution, TurnLease

__all__ = [
    "PUSH_CHUNK",
    "Deliver",
    "Delivered",
    "Listener",
    "Message",
    "MessageQueue",
    "MessageStore",
    "OutMessage",
    "OutboxStore",
    "QueuedRun",
    "ResultSettlingStore",
    "RunBroker",
    "SettledMessages",
    "Unlisten",
]

PUSH_CHUNK = 1000
"""Messages per multi-row INSERT (a store's :meth:`MessageQueue.push` chunks by it)."""

Listener = Callable[[str, str], None]
"""``listener(kind, argument)``: ``("message", topic)`` after a push, or a
broadcast's ``(kind, argument)`` (the ``db`` transport's ``("cancel", run_id)``);
the kinds are :class:`~durably._notices.StoreNotice` values."""

Unlisten = Callable[[], None]
"""Removes the listener it was returned for."""


@dataclass(frozen=True, slots=True)
class OutMessage:
    """A message to push."""

    topic: str
    body: str
    """JSON text (the queue does not look inside)."""
    priority: int = 0
    available_at: int | None = None
    """Epoch ms before which no consumer sees it; ``None``: at once."""
    claimed_by: str | None = None
    """Born claimed by this owner (see the module docstring); ``None``: free."""
    claimed_until: int | None = None
    """The born claim's lease end (epoch ms), with ``claimed_by``."""


@dataclass(frozen=True, slots=True)
class Message:
    """A claimed message."""

    id: int
    topic: str
    body: str
    priority: int
    deliveries: int
    """How many times it has been claimed, this claim included."""


@runtime_checkable
class MessageQueue(Protocol):
    """Topics of messages in a database, claimed with a lease."""

    poll_interval: float
    """Seconds between a consumer's polls when no notification arrives."""

    async def push(self, messages: list[OutMessage]) -> None:
        """Store the messages (one multi-row INSERT per :data:`PUSH_CHUNK`, one
        transaction) and notify the listeners of their topics."""

    async def claim(
        self, topics: list[str], owner: str, limit: int, lease_ms: int, now: int
    ) -> list[Message]:
        """Claim up to ``limit`` visible messages of ``topics`` for ``owner``
        until ``now + lease_ms``, highest priority then oldest first."""

    async def ack(self, ids: list[int]) -> None:
        """Delete the messages: done with."""

    async def release(self, ids: list[int], owner: str, *, available_at: int | None = None) -> None:
        """Hand back the messages ``owner`` still holds, visible again at once
        (or from ``available_at``)."""

    async def extend(self, ids: list[int], owner: str, lease_ms: int, now: int) -> list[int]:
        """Hold the messages ``owner`` still holds until ``now + lease_ms``;
        return the ids that were (the others were lost to another consumer or acked)."""

    async def depth(self, topics: list[str] | None = None) -> dict[str, int]:
        """How many messages each topic holds (claimed or not)."""

    async def broadcast(self, kind: str, arguments: list[str]) -> None:
        """Tell every listener ``(kind, argument)`` for each argument (best
        effort: PostgreSQL ``NOTIFY`` reaches every process, SQLite only this one)."""

    async def listen(self, listener: Listener) -> Unlisten:
        """Call ``listener`` for pushes and broadcasts; returns its removal."""


@runtime_checkable
class MessageStore(Protocol):
    """A store that keeps a :class:`MessageQueue` in its own database (SQLite,
    PostgreSQL): what the ``db`` transport needs of a store."""

    def messages(self) -> MessageQueue:
        """The store's message queue, made on first use."""
        ...


@runtime_checkable
class OutboxStore(Protocol):
    """A :class:`MessageStore` that can push messages in the transaction that
    writes a checkpoint (SQLite, PostgreSQL): the ``db`` transport sends a
    dispatched step's task with its pending checkpoint, one commit instead of
    two, and no crash can fall between them."""

    def save_checkpoint_sending(
        self, checkpoint: Checkpoint, owner: str, messages: list[OutMessage]
    ) -> Awaitable[bool]:
        """:meth:`~durably.stores.base.CheckpointStore.save_checkpoint`, in call
        order with it, and in the same transaction, if and only if the
        checkpoint was written (the lease held), push ``messages`` and notify
        their topics' listeners once committed."""
        ...

    def save_checkpoint_claiming(
        self, checkpoint: Checkpoint, owner: str, messages: list[OutMessage]
    ) -> asyncio.Future[list[int] | None]:
        """:meth:`save_checkpoint_sending`, answering the ids of the messages
        pushed born claimed (those with ``claimed_by``), in the order given;
        ``None`` if the lease was lost (nothing written). Born claimed
        messages notify nobody."""
        ...


@dataclass(frozen=True, slots=True)
class SettledMessages:
    """What :meth:`ResultSettlingStore.claim_and_resolve` took and did."""

    messages: list[Message]
    """The messages deleted (every one claimed, whatever ``decode`` made of it)."""
    decoded: Any
    """What ``decode`` returned for them."""
    answers: list[int | None]
    """:meth:`~durably.stores.base.CheckpointStore.resolve_checkpoints`'s answers."""
    leased: dict[str, tuple[Run, dict[int, Checkpoint]]]
    """The runs leased (with ``lease``), with their histories."""


@runtime_checkable
class ResultSettlingStore(Protocol):
    """A :class:`MessageStore` that settles step results in the transaction
    that takes their messages off the queue (SQLite, PostgreSQL): no claim of
    its own, no ack after, nothing acked but unsettled or settled but queued."""

    async def claim_and_resolve(
        self,
        topics: list[str],
        limit: int,
        visible_at: int,
        decode: Callable[[list[Message]], tuple[Any, list[Resolution]]],
        now: int,
        lease: TurnLease | None,
        delete: Sequence[int] = (),
    ) -> SettledMessages:
        """In one transaction: delete the messages ``delete`` names (the tasks
        of results settled here), and up to ``limit`` messages of ``topics``
        visible and unclaimed at ``visible_at`` (wall-clock ms; highest
        priority then oldest first; rows another consumer's transaction holds
        are skipped), settle (at ``now``) the resolutions
        ``decode(messages)`` makes of them (its first value is handed back as
        :attr:`SettledMessages.decoded`) and, with ``lease``, lease the runs
        they wake as :meth:`~durably.stores.base.CheckpointStore.resolve_and_lease`
        does. If anything raises, nothing was taken. ``decode`` must not block
        (on SQLite it runs on the store's thread). ``limit`` 0 takes nothing
        (``decode`` gets no message): the deletes and the settle only."""
        ...


# -- the run queue's carriers ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueuedRun:
    """A run to give a turn, as the run queue hands it to its broker."""

    run_id: str
    wake: bool
    """A wake of a run that already ran (else: a start, a retry, a recovery)."""
    namespace: str
    """The pool whose instances execute it."""
    priority: int = 0
    state: str | None = None
    """The pending state a start is for (a broker that dedupes starts by it
    asked for it with :attr:`RunBroker.wants_state`); ``None`` for a wake."""


class Delivered(Enum):
    """What became of a run message handed to the run queue."""

    DONE = "done"
    """Handled (or malformed and dropped): remove it."""
    AGAIN = "again"
    """Not taken here (draining): hand it back at once."""
    LATER = "later"
    """Not executed (a store error): deliver it again after a short delay."""


Deliver = Callable[[str], Awaitable[Delivered]]
"""``deliver(body)``: give the run in a message's JSON body its turn."""


@runtime_checkable
class RunBroker(Protocol):
    """What carries the fleet's run queue (see :mod:`durably._run_queue`): the
    ``db`` transport's message table or the ``redis`` transport's BullMQ queues.

    At-least-once: a message is removed only once ``deliver`` said
    :attr:`Delivered.DONE`, and a holder that dies has its messages delivered
    again elsewhere. At most ``capacity`` messages are held at once.
    """

    wants_state: bool
    """Whether :meth:`push` wants each start's :attr:`QueuedRun.state`."""

    @property
    def held(self) -> int:
        """Messages taken and not yet removed or handed back."""
        ...

    @property
    def consuming(self) -> bool:
        """Whether :meth:`start` ran and :meth:`stop_claiming` did not."""
        ...

    async def push(self, runs: list[QueuedRun]) -> None:
        """Queue the runs (all or, raising, possibly not all)."""

    async def start(
        self, pools: list[str] | None, deliver: Deliver, *, owner: str, lease_ms: int, capacity: int
    ) -> None:
        """Hand the runs of these pools (``None``: of every pool) to ``deliver``."""

    async def stop_claiming(self) -> None:
        """Take no more (a drain's first step); what is held stays held."""

    async def hand_back(self) -> None:
        """Give back every message still held (a drain's last step)."""

    async def backlog(self) -> bool:
        """Whether runs of the pools consumed here (not consuming: of any pool)
        are queued or held."""
