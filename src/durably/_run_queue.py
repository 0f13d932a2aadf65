"""The fleet's run queue: runs to execute travel as messages, so they spread
over every driving instance instead of running where they were created.

Used when the transport carries runs (the ``db`` transport's message table).
A message says "give this run a turn" (``{"runId", "wake"}``) on topic
``runs:<namespace>``; any driving instance of that namespace claims it and
executes the run. Delivery is at least once and every delivery is checked
against the store (taking the run's lease is conditional on its status), so a
duplicate or a stale message costs one statement and executes nothing.

- Submissions made in one burst (a fan's children, a page of due timers) go
  out together: one push per loop iteration, multi-row inserts.
- An instance holds at most :data:`MAX_HELD` claimed messages at once and
  acks each when its run's turn is over (or skipped); held messages' leases
  are extended while their turns run, so a long turn is not redelivered.
- A failed push loses nothing: a start stays ``pending`` for the poll, a wake
  is executed here (or stamped on the run for the timer poll). The failure is
  logged at most once a minute.
- :meth:`RunQueue.stop` stops claiming first and hands back every held
  message whose run has not finished here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ._aio import wait_event
from ._logs import engine_logger
from ._notices import StoreNotice
from ._queue import Message, MessageQueue, OutMessage
from .clock import wall_ms

__all__ = ["MAX_HELD", "RunQueue", "run_topic"]

_log = engine_logger("durably.runqueue")

MAX_HELD = 64
"""Queued runs one instance holds at once."""
_REPORT_EVERY_S = 60.0
_PREFIX = "runs:"
_RETRY_DELAY_MS = 1000


def run_topic(namespace: str) -> str:
    """The topic runs of ``namespace`` are queued on."""
    return f"runs:{namespace}"


@dataclass(slots=True)
class _Submission:
    run_id: str
    wake: bool
    namespace: str | None
    """``None``: not known to the submitter; looked up before the push."""
    priority: int


Namespaces = Callable[[list[str]], Awaitable[dict[str, str]]]
"""The namespaces of the given runs (runs that no longer exist are left out)."""
Execute = Callable[[str, bool], Awaitable[bool]]
"""Give the run its turn here; ``False``: not done, hand the message back."""
Fallback = Callable[[str, bool], Awaitable[None]]


class RunQueue:
    """Pushes runs to execute and, on a driving instance, consumes them."""

    def __init__(
        self,
        queue: MessageQueue,
        owner: str,
        lease_ms: int,
        execute: Execute,
        fallback: Fallback,
        namespaces: Namespaces,
        *,
        capacity: int = MAX_HELD,
    ) -> None:
        self._queue = queue
        self._namespaces = namespaces
        # An instance that can run only a few turns at once must not sit on
        # messages idle peers could take.
        self._max_held = max(1, min(MAX_HELD, capacity))
        self._owner = owner
        self._lease_ms = lease_ms
        self._execute = execute
        self._fallback = fallback
        self._buffer: list[_Submission] = []
        self._flushing: asyncio.Task[None] | None = None
        self._topics: list[str] = []
        self._pools: list[str] | None = None
        self._topics_seen_at = 0.0
        self._held: dict[int, asyncio.Task[None]] = {}
        self._consumer: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._nudge = asyncio.Event()
        self._unlisten: Callable[[], None] | None = None
        self._last_report: float | None = None
        self._acks: list[int] = []
        self._acking: asyncio.Task[None] | None = None
        self.pushed = 0
        """Messages pushed by this instance (for tests and metrics)."""
        self.consumed = 0
        """Messages this instance claimed and handled."""

    # -- producing -----------------------------------------------------------------------

    def submit(self, run_id: str, *, wake: bool, namespace: str | None, priority: int = 0) -> None:
        """Queue ``run_id`` for a turn; pushed with the rest of this loop
        iteration's. Its ``namespace`` picks the pool that runs it (``None``:
        looked up, one query for the whole burst)."""
        self._buffer.append(_Submission(run_id, wake, namespace, priority))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush_soon())

    async def flush(self) -> None:
        """Push everything submitted so far (used before closing)."""
        while self._buffer:
            await self._push(self._take())
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)

    def _take(self) -> list[_Submission]:
        batch, self._buffer = self._buffer, []
        return batch

    async def _flush_soon(self) -> None:
        await asyncio.sleep(0)  # gather the rest of this burst
        while self._buffer:
            await self._push(self._take())

    async def _push(self, batch: list[_Submission]) -> None:
        unknown = [item.run_id for item in batch if item.namespace is None]
        if unknown:
            try:
                found = await self._namespaces(unknown)
            except Exception as exc:
                self._report(exc, len(batch))
                await self._fall_back(batch)
                return
            for item in batch:
                if item.namespace is None:
                    item.namespace = found.get(item.run_id)
            batch = [item for item in batch if item.namespace is not None]  # deleted runs
        messages = [
            OutMessage(
                run_topic(item.namespace or "default"),
                json.dumps({"runId": item.run_id, "wake": item.wake}, separators=(",", ":")),
                item.priority,
            )
            for item in batch
        ]
        try:
            await self._queue.push(messages)
            self.pushed += len(messages)
        except Exception as exc:
            self._report(exc, len(messages))
            await self._fall_back(batch)

    async def _fall_back(self, batch: list[_Submission]) -> None:
        for item in batch:
            try:
                await self._fallback(item.run_id, item.wake)
            except Exception:
                _log.exception("the fallback for run %s failed too", item.run_id)

    def _report(self, exc: Exception, count: int) -> None:
        now = time.monotonic()
        if self._last_report is None or now - self._last_report >= _REPORT_EVERY_S:
            self._last_report = now
            _log.error(
                "could not enqueue %d run(s) (%s); starts stay pending for the poll and "
                "wakes run here (reported at most once a minute)",
                count,
                exc,
            )

    # -- consuming -----------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Messages claimed and not yet acked or handed back."""
        return len(self._held)

    @property
    def consuming(self) -> bool:
        """Whether this instance takes runs from the queue."""
        return self._consumer is not None

    async def start(self, pools: list[str] | None) -> None:
        """Consume the runs of these namespaces (``None``: of every namespace)."""
        if self._consumer is not None:
            return
        self._pools = pools
        self._topics = [run_topic(pool) for pool in pools] if pools is not None else []
        self._unlisten = await self._queue.listen(self._heard)
        self._consumer = asyncio.create_task(self._consume(), name="durably-run-queue")
        self._keeper = asyncio.create_task(self._keep_leases(), name="durably-run-queue-leases")

    async def stop_claiming(self) -> None:
        """Take no more runs (the first step of a drain)."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None

    async def hand_back(self) -> None:
        """Release every message still held, for another instance to take
        (the last step of a drain, once running turns were handed back)."""
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

    async def has_backlog(self) -> bool:
        """Whether the queue holds runs for this instance's pools (producers:
        for any pool), claimed or not, or this instance is still pushing some:
        a safety poll racing our own in-flight push would queue those runs twice."""
        if self._buffer or (self._flushing is not None and not self._flushing.done()):
            return True
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
            room = self._max_held - len(self._held)
            claimed: list[Message] = []
            if room > 0 and self._topics:
                claimed = await self._claim(room)
            for message in claimed:
                self._held[message.id] = asyncio.create_task(self._handle(message))
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
        try:
            body = json.loads(message.body)
            run_id, wake = str(body["runId"]), bool(body.get("wake"))
        except (ValueError, KeyError, TypeError):
            _log.error("dropping malformed run message %r", message.body[:200])
            await self._done(message.id)
            return
        try:
            finished = await self._execute(run_id, wake)
        except Exception:
            # Not executed (a store error, say): delivered again shortly.
            _log.warning("queued run %s could not be executed; handing it back", run_id)
            self._held.pop(message.id, None)
            with contextlib.suppress(Exception):
                await self._queue.release(
                    [message.id], self._owner, available_at=wall_ms() + _RETRY_DELAY_MS
                )
            return
        if not finished:
            # Draining: whoever takes the message next gives the run its turn.
            self._held.pop(message.id, None)
            with contextlib.suppress(Exception):
                await self._queue.release([message.id], self._owner)
            return
        self.consumed += 1
        await self._done(message.id)

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
        self._nudge.set()  # slots are free: claim more

    async def _keep_leases(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 2000)
            ids = list(self._held)
            if ids:
                try:
                    await self._queue.extend(ids, self._owner, self._lease_ms, wall_ms())
                except Exception:
                    _log.warning("could not extend the leases of queued runs", exc_info=True)
