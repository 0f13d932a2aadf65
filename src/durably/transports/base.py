"""The ``Transport`` protocol: how dispatched-step tasks reach workers and how
their results and heartbeats come back.

A transport only carries messages; the engine decides what they mean and the
store keeps what must survive. Every delivery may happen more than once (a
worker that dies holding a task has it redelivered where the medium allows),
so the engine settles only a *pending* checkpoint and drops the rest.
Implementations: :mod:`.memory` (inline, for tests), :mod:`.local` (in-process
queues, the default) and :mod:`.db` (a message table in the store's database,
for fleets without a broker), all proven by the conformance suite shipped as
:mod:`durably.testing.conformance.transports`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol, runtime_checkable

from .._queue import RunBroker
from ..errors import DurablyError
from ..model import Checkpoint, Run
from ..stores.base import Resolution, TurnLease
from ..wire import Heartbeat, StepResult, StepTask

__all__ = [
    "CancelHandler",
    "CheckpointSender",
    "EventCarrier",
    "HeartbeatHandler",
    "ResultHandler",
    "RunCarrier",
    "SendWithCheckpoint",
    "SettleTaken",
    "SettlingConsumer",
    "TakeResults",
    "Taken",
    "TaskHandler",
    "Transport",
    "TransportError",
    "TurnCarrier",
    "TurnHandler",
]

TaskHandler = Callable[[StepTask], Awaitable[None]]
"""Worker side: run one task and send its result. The transport counts the task
delivered once this returns; if it raises, or the process dies first, the task
is delivered again where the medium allows."""

ResultHandler = Callable[[list[StepResult]], Awaitable[None]]
"""Engine side: settle a batch of results (several may belong to one run)."""

HeartbeatHandler = Callable[[Heartbeat], Awaitable[None]]
"""Engine side: a worker is alive and working on a step."""

CancelHandler = Callable[[list[str]], None]
"""Worker side: these runs were cancelled; handlers working for them should stop."""


SendWithCheckpoint = Callable[[Checkpoint, str, list[StepTask]], Awaitable[bool]]
"""``(checkpoint, lease owner, tasks)``: write the checkpoint under the owner's
lease and send the tasks in the same transaction; ``False`` (nothing written,
nothing sent) if the lease is lost. Raising means neither happened."""


class TransportError(DurablyError):
    """A transport could not send a message (nothing was sent)."""


@runtime_checkable
class Transport(Protocol):
    """Carries tasks to workers and results, heartbeats and cancel notices back.

    **Inline transports.** A transport may run each task's handler inside
    :meth:`dispatch` and hold nothing (``memory://``, made for deterministic
    tests: when ``dispatch`` returns, the handler has run and its result is
    with the consumer). Having no queue, it answers three cases differently,
    and the conformance suite checks these answers instead:

    - *A task for a group nobody serves* (including after
      :meth:`stop_serving`) gets a failure result at once, not retryable:
      ``{"message": "no handler for <name>", "retryable": False}``
      (``StepResult.no_handler``), so a test missing a handler fails fast
      instead of waiting forever. A queueing transport keeps the task until a
      server of its group takes it.
    - *A handler that raises* is logged and its task is not delivered again:
      an inline retry could loop forever inside ``dispatch``, and the engine's
      redispatch of stale steps owns such a task. A queueing transport
      delivers it again.
    - *Nothing is held*, so there is nothing to hand back, to order by
      priority (tasks run in dispatch order, one at a time) or to deliver
      again when a results consumer raises (the error reaches the sender of
      the result).

    These are kept rather than brought in line because each queueing answer
    needs a queue, and the memory transport exists to have none.
    """

    url: str
    """The URL the transport was chosen by (``memory://``, ``local://``, ``db://``)."""

    async def open(self) -> None:
        """Connect. Idempotent."""

    async def close(self) -> None:
        """Stop every consumer and disconnect. Idempotent."""

    async def dispatch(self, tasks: list[StepTask]) -> None:
        """Send tasks to whichever worker serves each task's ``group``.

        Raises :class:`TransportError` if they could not be sent. Returning
        means the transport holds them: they are not lost if this process dies.
        """

    async def serve(
        self, groups: Collection[str], on_task: TaskHandler, *, concurrency: int
    ) -> None:
        """Start delivering tasks routed to ``groups`` to ``on_task``, at most
        ``concurrency`` at once. Calling it again replaces the served set."""

    async def stop_serving(self) -> None:
        """Stop taking tasks; hand back those taken but not started. Tasks
        whose handlers are running are left to finish."""

    async def consume_results(
        self, on_results: ResultHandler, on_heartbeat: HeartbeatHandler
    ) -> None:
        """Start delivering results and heartbeats sent by workers. At most
        one consumer per transport object. A heartbeat that arrives together
        with its own step's result may be dropped; it is never delivered
        after that result."""

    async def send_result(self, result: StepResult) -> None:
        """Send a task's result back to the engines."""

    async def send_heartbeat(self, beat: Heartbeat) -> None:
        """Tell the engines a step is alive (fire and forget: a lost beat costs
        at most one silence window)."""

    async def publish_cancel(self, run_ids: list[str]) -> None:
        """Tell every worker these runs were cancelled (best effort: workers
        also learn it from the store)."""

    def on_cancel(self, handler: CancelHandler) -> None:
        """Register the worker's cancel-notice handler."""


@runtime_checkable
class RunCarrier(Protocol):
    """A transport that also carries the fleet's run queue (``db``, ``redis``):
    runs to execute travel through it and spread over every driving instance."""

    def run_queue(self) -> RunBroker:
        """A new carrier of the run queue (the transport must be open)."""


@runtime_checkable
class CheckpointSender(Protocol):
    """A transport whose messages can live in the store's own database
    (``db``): a dispatched step's task is then sent in the transaction that
    writes its pending checkpoint, one commit where there were two, and no
    crash can leave the checkpoint saved and the task unsent."""

    def checkpoint_sender(self, store: object) -> SendWithCheckpoint | None:
        """How to write a checkpoint and send tasks in one transaction of
        ``store``; ``None`` if the transport's messages are not in that store."""


Taken = tuple[list[StepResult], list[int | None], dict[str, tuple[Run, dict[int, Checkpoint]]]]
"""Results taken off a transport and settled: the results, the store's answer
for each (``resolve_checkpoints``), and the runs leased with their histories."""

TakeResults = Callable[
    [Callable[[list[StepResult]], list[Resolution]], int, TurnLease | None], Awaitable[Taken]
]
"""``take(resolutions_of, now, lease)``: in one transaction of the store, take
a batch of results off the transport and settle ``resolutions_of(results)``
at ``now`` (leasing woken runs with ``lease``, as ``resolve_and_lease``)."""

SettleTaken = Callable[[TakeResults], Awaitable[None]]
"""Engine side: settle a batch through ``take``, then wake or resume its runs."""


@runtime_checkable
class SettlingConsumer(Protocol):
    """A transport whose results can live in the store's own database
    (``db``): they are then taken off the queue in the transaction that
    settles them, one commit where a claim, a settle and an ack were three,
    and no result is ever acked unsettled or settled but still queued."""

    async def consume_settling(
        self,
        store: object,
        settle: SettleTaken,
        on_results: ResultHandler,
        on_heartbeat: HeartbeatHandler,
    ) -> bool:
        """Start the results consumer settling in ``store`` through
        ``settle``; ``False`` (nothing started) if the transport's messages are
        not in that store. ``on_results`` is the plain path, for a batch the
        store refused as a whole (settled there entry by entry)."""


TurnHandler = Callable[[Any], Awaitable[None]]
"""Engine side: one message from a worker executing remote turns, as parsed
JSON (the handler checks its shape). Raising delivers it again later."""


@runtime_checkable
class EventCarrier(Protocol):
    """A transport that fans lifecycle events out to every instance (``redis``
    pub/sub), so ``engine.subscribe()`` hears runs executing anywhere even on
    a store whose notices do not cross processes (SQLite)."""

    async def broadcast_events(self, kind: str, notices: list[str]) -> None:
        """Publish events (compact JSON each) to every other instance."""

    async def listen_events(self, listener: Callable[[str, str], None]) -> Callable[[], None]:
        """Call ``listener(kind, notice)`` for other instances' events; returns
        the removal."""


@runtime_checkable
class TurnCarrier(Protocol):
    """A transport that also carries remote workflow turns (``redis``): turns
    out to the worker serving a workflow, decisions, run-scoped heartbeats and
    step events back, and the workers' liveness keys and descriptors."""

    async def send_turn(self, token: str, task: dict[str, Any], priority: int | None) -> None:
        """Queue a turn (WorkflowTask JSON) for the worker serving ``token``;
        :class:`TransportError` if it could not be sent."""

    async def consume_turns(
        self, on_decision: TurnHandler, on_step_event: TurnHandler, on_run_beat: TurnHandler
    ) -> None:
        """Start delivering decisions (each to one instance), step events (each
        to one instance) and run-scoped beats (to every instance)."""

    async def live_workers(self) -> list[dict[str, Any]]:
        """The workers whose liveness keys exist now: one entry per key, with
        ``token``, ``instanceId``, ``beat`` (its value) and ``descriptor``
        (parsed JSON or ``None``)."""

    async def queue_depths(self, tokens: Collection[str]) -> dict[str, int]:
        """How many tasks wait in the queue of each routing token (and of any
        other task queue the transport finds)."""
