"""The fleet's run queue: runs to execute travel as messages, so they spread
over every driving instance instead of running where they were created.

Used when the transport carries runs (:class:`~durably.transports.base.RunCarrier`):
the ``db`` transport's message table (:mod:`durably.transports._db_runs`) or
the ``redis`` transport's BullMQ queues (:mod:`durably.transports.redis._runs`).
Both are a :class:`~durably._queue.RunBroker`; the rules below are this
module's and hold on either.

A message says "give this run a turn" (``{"runId", "wake"}``); any driving
instance of the run's namespace takes it and executes the run. Delivery is at
least once and every delivery is checked against the store (taking the run's
lease is conditional on its status), so a duplicate or a stale message costs
one statement and executes nothing.

- Submissions made in one burst (a fan's children, a page of due timers) go
  out together: one push per loop iteration.
- An instance holds at most :data:`MAX_HELD` messages at once and removes
  each when its run's turn is over (or skipped).
- A failed push loses nothing: a start stays ``pending`` for the poll (which
  queues it once it is :data:`~durably._worker.PENDING_GRACE_MS` old), a wake
  is executed here (or stamped on the run for the timer poll). The failure is
  logged at most once a minute.
- A start on a consuming instance may skip the queue: with a slot free and
  nothing queued for it, its run is inserted already leased here and run here
  (:meth:`RunQueue.lend`, on a broker that can lend its slots: a
  :class:`LendingBroker`). A crash leaves that lease to run out, and any
  instance's recovery puts the run back on the queue.
- :meth:`RunQueue.stop_claiming` stops taking first and
  :meth:`RunQueue.hand_back` hands back every held message whose run has not
  finished here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ._logs import engine_logger
from ._queue import Delivered, QueuedRun, RunBroker
from .model import Run

__all__ = ["MAX_HELD", "LendingBroker", "RunQueue"]

_log = engine_logger("durably.runqueue")

MAX_HELD = 64
"""Queued runs one instance holds at once."""
_REPORT_EVERY_S = 60.0


@dataclass(slots=True)
class _Submission:
    run_id: str
    wake: bool
    namespace: str | None
    """``None``: not known to the submitter; looked up before the push."""
    priority: int
    state: str | None = None


@runtime_checkable
class LendingBroker(Protocol):
    """A :class:`~durably._queue.RunBroker` whose consumer can lend a slot to a
    run born leased here, which then never becomes a message."""

    def lend(self, namespace: str) -> bool:
        """Take a free slot for a run of ``namespace`` (``False``: none to lend)."""
        ...

    def give_back(self) -> None:
        """The run a slot was lent to ended its turn here."""
        ...

    @property
    def lent(self) -> int:
        """Slots lent and not given back yet."""
        ...


Lookup = Callable[[list[str]], Awaitable[dict[str, Run]]]
"""The stored runs of the given ids (runs that no longer exist are left out)."""
Execute = Callable[[str, bool], Awaitable[bool]]
"""Give the run its turn here; ``False``: not done, hand the message back."""
Fallback = Callable[[str, bool], Awaitable[None]]


def pending_state(run: Run) -> str:
    """What tells one pending spell of a run from the next (a retry or a
    recovery writes the run again): a start's job id is made of it."""
    return str(run.updated_at)


class RunQueue:
    """Pushes runs to execute and, on a driving instance, consumes them."""

    def __init__(
        self,
        broker: RunBroker,
        owner: str,
        lease_ms: int,
        execute: Execute,
        fallback: Fallback,
        lookup: Lookup,
        *,
        capacity: int = MAX_HELD,
    ) -> None:
        self._broker = broker
        # Checked once: a runtime Protocol check per start would cost more.
        self._lender = broker if isinstance(broker, LendingBroker) else None
        self._lookup = lookup
        # An instance that can run only a few turns at once must not sit on
        # messages idle peers could take.
        self._max_held = max(1, min(MAX_HELD, capacity))
        self._owner = owner
        self._lease_ms = lease_ms
        self._execute = execute
        self._fallback = fallback
        self._buffer: list[_Submission] = []
        self._flushing: asyncio.Task[None] | None = None
        self._last_report: float | None = None
        self.pushed = 0
        """Messages pushed by this instance (for tests and metrics)."""
        self.consumed = 0
        """Messages this instance took and handled."""

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

    def _unknown(self, item: _Submission) -> bool:
        return item.namespace is None or (self._broker.wants_state and not item.wake)

    async def _push(self, batch: list[_Submission]) -> None:
        unknown = [item.run_id for item in batch if self._unknown(item)]
        if unknown:
            try:
                found = await self._lookup(unknown)
            except Exception as exc:
                self._report(f"could not enqueue {len(batch)} run(s) ({exc})")
                await self._fall_back(batch)
                return
            kept = []
            for item in batch:
                if self._unknown(item):
                    run = found.get(item.run_id)
                    if run is None:
                        continue  # deleted
                    item.namespace = item.namespace or run.namespace
                    item.state = pending_state(run)
                kept.append(item)
            batch = kept
        runs = [
            QueuedRun(
                item.run_id, item.wake, item.namespace or "default", item.priority, item.state
            )
            for item in batch
        ]
        try:
            await self._broker.push(runs)
            self.pushed += len(runs)
        except Exception as exc:
            self._report(f"could not enqueue {len(runs)} run(s) ({exc})")
            await self._fall_back(batch)

    async def _fall_back(self, batch: list[_Submission]) -> None:
        for item in batch:
            try:
                await self._fallback(item.run_id, item.wake)
            except Exception:
                _log.exception("the fallback for run %s failed too", item.run_id)

    def _report(self, what: str) -> None:
        now = time.monotonic()
        if self._last_report is None or now - self._last_report >= _REPORT_EVERY_S:
            self._last_report = now
            _log.error(
                "%s; starts stay pending for the poll and wakes run here "
                "(reported at most once a minute)",
                what,
            )

    # -- born leased here ----------------------------------------------------------------

    def lend(self, namespace: str) -> bool:
        """Take a slot of this instance's consumer for a run of ``namespace``
        that a start here inserts leased to this instance: it runs here
        without a message. ``False``: this instance does not consume that
        namespace, has no free slot, or runs may be waiting in the queue.
        Every ``True`` is followed by one :meth:`give_back`."""
        return self._lender is not None and self._lender.lend(namespace)

    def give_back(self) -> None:
        """The turn of a run :meth:`lend` took a slot for is over (or it never began)."""
        if self._lender is not None:
            self._lender.give_back()

    # -- consuming -----------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Messages taken and not yet removed or handed back."""
        return self._broker.held

    @property
    def lent(self) -> int:
        """Slots lent to runs born leased here (see :meth:`lend`), not given back yet."""
        return self._lender.lent if self._lender is not None else 0

    @property
    def consuming(self) -> bool:
        """Whether this instance takes runs from the queue."""
        return self._broker.consuming

    async def start(self, pools: list[str] | None) -> None:
        """Consume the runs of these namespaces (``None``: of every namespace)."""
        if self._broker.consuming:
            return
        await self._broker.start(
            pools,
            self._deliver,
            owner=self._owner,
            lease_ms=self._lease_ms,
            capacity=self._max_held,
        )

    async def stop_claiming(self) -> None:
        """Take no more runs (the first step of a drain)."""
        await self._broker.stop_claiming()

    async def hand_back(self) -> None:
        """Release every message still held, for another instance to take
        (the last step of a drain, once running turns were handed back)."""
        await self._broker.hand_back()

    async def has_backlog(self) -> bool:
        """Whether the queue holds runs for this instance's pools (producers:
        for any pool), taken or not, or this instance is still pushing some:
        a safety poll racing our own in-flight push would queue those runs twice.
        ``False`` if the queue cannot say (it is down): the poll then runs."""
        if self._buffer or (self._flushing is not None and not self._flushing.done()):
            return True
        try:
            return await self._broker.backlog()
        except Exception as exc:
            self._report(f"could not read the run queue ({exc})")
            return False

    async def _deliver(self, body: str) -> Delivered:
        try:
            parsed = json.loads(body)
            run_id, wake = str(parsed["runId"]), bool(parsed.get("wake"))
        except (ValueError, KeyError, TypeError):
            _log.error("dropping malformed run message %r", body[:200])
            return Delivered.DONE
        try:
            finished = await self._execute(run_id, wake)
        except Exception:
            # Not executed (a store error, say): delivered again shortly.
            _log.warning("queued run %s could not be executed; handing it back", run_id)
            return Delivered.LATER
        if not finished:
            # Draining: whoever takes the message next gives the run its turn.
            return Delivered.AGAIN
        self.consumed += 1
        return Delivered.DONE
