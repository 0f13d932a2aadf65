"""The run queue on the ``db`` transport's message table (:class:`MessageRuns`).

A message on topic ``runs:<namespace>`` says "give this run a turn"
(``{"runId", "wake"}``); any driving instance of that namespace claims it
with a lease, extends the lease while the turn runs, and acks it after. The
shared rules (what a delivery means, checking it against the store, what a
failed push costs) live in :mod:`durably._run_queue`.

A consumer also lends its slots to runs born leased here (:meth:`MessageRuns.lend`):
a start on this instance, while the queue holds nothing for it and a slot is free,
inserts its run already leased to this instance and runs it here, with no message
at all (no push, claim, delivery check or ack). Those runs count against the
slots as held messages do, so an instance still runs at most ``capacity`` of
the queue's runs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from .._aio import wait_event
from .._notices import StoreNotice
from .._queue import Deliver, Delivered, Message, MessageQueue, OutMessage, QueuedRun, Unlisten
from ..clock import wall_ms

__all__ = ["MessageRuns", "run_topic"]

_log = logging.getLogger("durably.runqueue")

_PREFIX = "runs:"
_RETRY_DELAY_MS = 1000


def run_topic(namespace: str) -> str:
    """The topic runs of ``namespace`` are queued on."""
    return f"{_PREFIX}{namespace}"


class MessageRuns:
    """A :class:`~durably._queue.RunBroker` over a store's :class:`MessageQueue`."""

    wants_state = False

    def __init__(self, queue: MessageQueue) -> None:
        self._queue = queue
        self._deliver: Deliver | None = None
        self._owner = ""
        self._lease_ms = 30_000
        self._max_held = 1
        self._topics: list[str] = []
        self._pools: list[str] | None = None
        self._topics_seen_at = 0.0
        self._held: dict[int, asyncio.Task[None]] = {}
        self._consumer: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._nudge = asyncio.Event()
        self._unlisten: Unlisten | None = None
        self._acks: list[int] = []
        self._acking: asyncio.Task[None] | None = None
        # Whether runs may wait in the queue for us (the last claim filled
        # its slots, or no slot was free): then no slot is lent to a start,
        # whose run would go before them. Until the first claim says, assume so.
        self._saturated = True
        self._lent = 0

    @property
    def held(self) -> int:
        """Messages claimed and not yet acked or handed back."""
        return len(self._held)

    @property
    def consuming(self) -> bool:
        """Whether this instance claims runs."""
        return self._consumer is not None

    @property
    def lent(self) -> int:
        """Slots lent to runs born leased here and not given back yet."""
        return self._lent

    def lend(self, namespace: str) -> bool:
        """Take a slot for a run of ``namespace`` a start here inserts leased
        to this instance; ``False`` if this instance does not claim that
        namespace's runs, has no free slot, or runs may be queued for it
        (they go first). :meth:`give_back` when that run's turn is over."""
        if self._consumer is None or self._saturated:
            return False
        if self._pools is not None and namespace not in self._pools:
            return False
        if len(self._held) + self._lent >= self._max_held:
            return False
        self._lent += 1
        return True

    def give_back(self) -> None:
        """A slot :meth:`lend` took is free again."""
        self._lent -= 1
        if self._saturated:
            self._nudge.set()  # runs may wait: claim for the freed slot

    async def push(self, runs: list[QueuedRun]) -> None:
        """Insert one message per run (one transaction)."""
        await self._queue.push(
            [
                OutMessage(
                    run_topic(run.namespace),
                    json.dumps({"runId": run.run_id, "wake": run.wake}, separators=(",", ":")),
                    run.priority,
                )
                for run in runs
            ]
        )

    async def start(
        self, pools: list[str] | None, deliver: Deliver, *, owner: str, lease_ms: int, capacity: int
    ) -> None:
        """Claim the runs of these namespaces (``None``: of every namespace)."""
        if self._consumer is not None:
            return
        self._deliver = deliver
        self._owner, self._lease_ms, self._max_held = owner, lease_ms, capacity
        self._pools = pools
        self._topics = [run_topic(pool) for pool in pools] if pools is not None else []
        self._unlisten = await self._queue.listen(self._heard)
        self._consumer = asyncio.create_task(self._consume(), name="durably-run-queue")
        self._keeper = asyncio.create_task(self._keep_leases(), name="durably-run-queue-leases")

    async def stop_claiming(self) -> None:
        """Claim no more."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None

    async def hand_back(self) -> None:
        """Release every message still held, for another instance to take."""
        if self._held:
            await asyncio.wait(set(self._held.values()), timeout=1.0)
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        left = list(self._held)
        for task in self._held.values():
            task.cancel()
        self._held.clear()
        if self._acking is not None:
            await asyncio.gather(self._acking, return_exceptions=True)
        if left:
            with contextlib.suppress(Exception):
                await self._queue.release(left, self._owner)

    def _heard(self, kind: str, argument: str) -> None:
        if kind != StoreNotice.MESSAGE:
            return
        if argument in self._topics:
            self._nudge.set()
        elif self._pools is None and argument.startswith(_PREFIX):
            self._topics.append(argument)  # a namespace this all-pools engine had not seen
            self._nudge.set()

    async def backlog(self) -> bool:
        """Whether the run topics of our pools (producers: any) hold messages."""
        topics = self._topics if self._pools is not None and self._topics else None
        found = await self._queue.depth(topics)
        return any(topic.startswith(_PREFIX) and n > 0 for topic, n in found.items())

    async def _discover(self) -> None:
        """An engine driving every namespace claims from every run topic."""
        if self._pools is not None or time.monotonic() - self._topics_seen_at < 1.0:
            return
        self._topics_seen_at = time.monotonic()
        try:
            found = await self._queue.depth()
        except Exception:
            _log.warning("listing run topics failed", exc_info=True)
            return
        known = set(self._topics)
        self._topics.extend(t for t in found if t.startswith(_PREFIX) and t not in known)

    async def _consume(self) -> None:
        while True:
            await self._discover()
            # Cleared before the claim, so a notification arriving while the
            # claim is in flight (for a message it cannot see yet) is kept.
            self._nudge.clear()
            room = self._max_held - len(self._held) - self._lent
            claimed: list[Message] = []
            if room > 0 and self._topics:
                claimed = await self._claim(room)
            for message in claimed:
                self._held[message.id] = asyncio.create_task(self._handle(message))
            self._saturated = room <= 0 or len(claimed) == room
            if claimed and len(claimed) == room:
                await asyncio.sleep(0)
                continue
            await wait_event(self._nudge, self._queue.poll_interval)

    async def _claim(self, limit: int) -> list[Message]:
        claiming = asyncio.ensure_future(
            self._queue.claim(list(self._topics), self._owner, limit, self._lease_ms, wall_ms())
        )
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            # Stopped (a drain) mid-claim: what the statement took would stay
            # invisible to everyone until its lease ran out; hand it back now.
            with contextlib.suppress(Exception):
                taken = await asyncio.wait_for(claiming, 5.0)
                await self._queue.release([m.id for m in taken], self._owner)
            raise
        except Exception:
            _log.warning("claiming queued runs failed", exc_info=True)
            return []

    async def _handle(self, message: Message) -> None:
        assert self._deliver is not None
        outcome = await self._deliver(message.body)
        if outcome is Delivered.DONE:
            await self._done(message.id)
            return
        self._held.pop(message.id, None)
        later = wall_ms() + _RETRY_DELAY_MS if outcome is Delivered.LATER else None
        with contextlib.suppress(Exception):
            await self._queue.release([message.id], self._owner, available_at=later)

    async def _done(self, message_id: int) -> None:
        self._held.pop(message_id, None)
        self._acks.append(message_id)
        if self._acking is None or self._acking.done():
            self._acking = asyncio.get_running_loop().create_task(self._ack_soon())

    async def _ack_soon(self) -> None:
        await asyncio.sleep(0)  # one statement for every turn that ended together
        while self._acks:
            ids, self._acks = self._acks, []
            try:
                await self._queue.ack(ids)
            except Exception:
                # Redelivered after the lease; the store check makes that harmless.
                _log.warning("could not ack %d run message(s)", len(ids), exc_info=True)
        # Slots are free, but claiming is worth a round trip only if runs may
        # be waiting: the last claim filled every slot, or no slot was free.
        # After a claim that came back short, a new message's notice (or the
        # poll, where notices do not cross processes) is what claims it.
        if self._saturated:
            self._nudge.set()

    async def _keep_leases(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 2000)
            ids = list(self._held)
            if ids:
                try:
                    await self._queue.extend(ids, self._owner, self._lease_ms, wall_ms())
                except Exception:
                    _log.warning("could not extend the leases of queued runs", exc_info=True)
