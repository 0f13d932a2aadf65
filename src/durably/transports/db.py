"""The ``db://`` transport: a message table in the store's own database.

For a fleet with PostgreSQL (or processes sharing a SQLite file) and no broker.
Tasks go to topic ``tasks:<group>``, results to ``results`` and heartbeats to
``beats``, as the upstream wire's JSON (:mod:`durably.wire`), through the
store's :class:`~durably._queue.MessageQueue`:

- A server claims at most as many tasks as it has free handler slots, each
  with a lease (30 s) that it keeps extending while the handler runs. It acks
  (deletes) the task when the handler returns and hands it back, visible
  again after ``redeliver_delay_ms``, if the handler raises. A process that
  dies holding tasks has them redelivered once their lease runs out.
- The results consumer claims results and beats in batches of up to 256,
  hands them over, and acks them after; a batch whose handler raised is
  handed back and delivered again.
- On the engine's own store (the usual case: ``Engine(url, transport="db://")``)
  two stages share the store's transactions. A dispatched step's task is
  pushed in the transaction that writes its pending checkpoint
  (:meth:`checkpoint_sender`; a step without ``timeout`` also parks its run
  in it): one commit, and no crash leaves the checkpoint without its task.
  Results and beats are taken off the queue in the transaction that settles
  them (:meth:`consume_settling`: deleted there, no claim lease, no ack);
  a batch the store refuses is claimed and settled the plain way above.
- A task sent with its checkpoint for a group this transport serves, while
  its server has a free slot and nothing queued for it (its last claim
  drained its topics and no push was heard since), is **born claimed**: the
  insert that carries the checkpoint holds it for this owner (a lease, as a
  claim would), and it goes to the server in memory once committed: no
  claim statement, no notification, no poll. If this process dies, its lease
  runs out and any server claims it as usual (deliveries 2).
- Consumers wake on the queue's notifications (PostgreSQL ``LISTEN``; within
  the process on SQLite) and poll as a safety net (1 s; 50 ms on SQLite).
- Cancel notices are ``NOTIFY <channel>, 'cancel:<run_id>'`` on PostgreSQL and
  reach only this process on SQLite (workers also learn it from the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Coroutine
from functools import partial
from typing import Any, cast

from .. import _codec as codec
from .._aio import wait_event
from .._batch import BatchCall
from .._logs import engine_logger
from .._notices import StoreNotice
from .._queue import (
    Message,
    MessageQueue,
    MessageStore,
    OutboxStore,
    OutMessage,
    ResultSettlingStore,
    Unlisten,
)
from ..clock import wall_ms
from ..model import Checkpoint
from ..stores._rows import is_row_error
from ..stores.base import Resolution, TurnLease
from ..wire import Heartbeat, StepResult, StepTask, WireError
from ._db_runs import MessageRuns
from .base import (
    CancelHandler,
    HeartbeatHandler,
    ResultHandler,
    SendWithCheckpoint,
    SettleTaken,
    Taken,
    TaskHandler,
    TransportError,
)

__all__ = ["DbTransport"]

_log = engine_logger("durably.transport")

RESULTS_TOPIC = "results"
BEATS_TOPIC = "beats"
_RESULT_BATCH = 256
_SETTLED_MEMORY = 4096
"""Steps settled here whose late beats are dropped (the newest so many)."""


def task_topic(group: str) -> str:
    """The topic tasks routed to ``group`` go to."""
    return f"tasks:{group}"


def _parse(
    messages: list[Message], settled: Collection[str] = ()
) -> tuple[list[StepResult], list[Heartbeat]]:
    """The results and beats of taken messages, oldest first; a beat whose
    step's result is among them (or ``settled`` already) says nothing new, a
    malformed message is dropped."""
    results: list[StepResult] = []
    beats: list[Heartbeat] = []
    for message in sorted(messages, key=lambda m: m.id):
        try:
            body = codec.loads(message.body)
            if message.topic == BEATS_TOPIC:
                beats.append(Heartbeat.from_wire(body))
            else:
                results.append(StepResult.from_wire(body))
        except (ValueError, WireError) as exc:
            _log.error("dropping a malformed %s message: %s", message.topic, exc)
    finished = {result.step_id for result in results}
    return results, [b for b in beats if b.step_id not in finished and b.step_id not in settled]


def _result_message(result: StepResult) -> OutMessage:
    return OutMessage(RESULTS_TOPIC, codec.dumps(result.to_wire()))


def _task_messages(tasks: list[StepTask]) -> list[OutMessage]:
    return [
        OutMessage(task_topic(t.group), codec.dumps(t.to_wire()), t.priority or 0) for t in tasks
    ]


class DbTransport:
    """A :class:`~durably.transports.base.Transport` over the store's message table.

    ``lease_ms``: how long a claimed message stays invisible to others without
    being extended (a dead holder's messages come back after it).
    ``redeliver_delay_ms``: how long a task whose handler raised waits before
    it is delivered again (so a broken handler does not spin).
    ``poll_interval``: seconds between polls; by default the queue's own.
    """

    url = "db://"

    def __init__(
        self,
        store: object,
        *,
        lease_ms: int = 30_000,
        redeliver_delay_ms: int = 1_000,
        poll_interval: float | None = None,
        owner: str | None = None,
    ) -> None:
        if not isinstance(store, MessageStore) or not callable(store.messages):
            kind = type(store).__name__
            raise ValueError(f"the db:// transport needs a SQLite or PostgreSQL store, not {kind}")
        if lease_ms < 1:
            raise ValueError("lease_ms must be positive")
        self.store: MessageStore = store
        self.lease_ms = lease_ms
        self.redeliver_delay_ms = redeliver_delay_ms
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        """Who claims: unique per transport object."""
        self._poll_interval = poll_interval
        self._queue: MessageQueue | None = None
        self._unlisten: Unlisten | None = None
        self._opening = asyncio.Lock()
        # serving
        self._topics: list[str] = []
        self._served: frozenset[str] = frozenset()
        self._on_task: TaskHandler | None = None
        self._concurrency = 1
        self._serve_loop: asyncio.Task[None] | None = None
        self._serving = False
        self._generation = 0  # a serve loop runs while its generation is current
        self._task_wake = asyncio.Event()
        self._running: dict[int, asyncio.Task[None]] = {}
        self._keeper: asyncio.Task[None] | None = None
        # Born claimed tasks (see the module docstring): slots held for those
        # whose insert is in flight, slots a claim in flight asks for, and
        # whether the queue may hold tasks for this server (its last claim
        # filled every slot asked, or a push was heard since it began:
        # ``_heard_tasks`` counts those).
        self._reserved = 0
        self._claiming = 0
        self._backlog = True
        self._heard_tasks = 0
        self.born = 0
        """Tasks born claimed here (a count, for tests and benches)."""
        # results
        self._results_loop: asyncio.Task[None] | None = None
        self._results_wake = asyncio.Event()
        self._acking: set[asyncio.Task[None]] = set()
        # Results of tasks served here, settled by this transport's settling
        # consumer in the transaction that deletes their tasks (no push, no
        # take, no ack of their own): the served task's message by step id,
        # the results waiting for the next settle, the tasks it deleted.
        self._settling = False
        self._task_of: dict[str, int] = {}
        self._local: list[tuple[StepResult, int, asyncio.Future[None]]] = []
        self._settled_tasks: set[int] = set()
        self._settled_steps: OrderedDict[str, None] = OrderedDict()
        # Whether results or beats may be queued for the settling consumer
        # (as ``_backlog`` for tasks): a batch of only served results takes
        # nothing from the queue unless a push was heard since the last take
        # came back short, or a poll interval passed since it (pushes from
        # other processes on SQLite are not heard).
        self._results_backlog = True
        self._results_heard = 0
        self._results_taken_at = -float("inf")
        self._cancel_handlers: list[CancelHandler] = []
        # writes, batched while the previous batch commits
        # One write per batch, of whatever queued meanwhile: the queue chunks
        # its INSERTs itself, so the batches need no size limit.
        self._pushes: BatchCall[OutMessage, None] = BatchCall(self._push_now, max_batch=None)
        self._acks: BatchCall[int, None] = BatchCall(self._ack_now, max_batch=None)

    @property
    def poll_interval(self) -> float:
        """Seconds between polls when no notification arrives."""
        if self._poll_interval is not None:
            return self._poll_interval
        return self._queue.poll_interval if self._queue is not None else 1.0

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Start hearing the queue's notifications. The store must be open."""
        async with self._opening:
            if self._queue is not None:
                return
            queue: MessageQueue = self.store.messages()
            self._unlisten = await queue.listen(self._heard)
            # Makes the table: the store's checkpoint writes may push into it.
            await queue.depth([])
            self._queue = queue

    def run_queue(self) -> MessageRuns:
        """The fleet's run queue, on the store's message queue (see
        :mod:`durably._run_queue`). Available once :meth:`open` ran."""
        if self._queue is None:
            raise RuntimeError("open the db:// transport before using its run queue")
        return MessageRuns(self._queue)

    async def close(self) -> None:
        """Stop both consumers; cancel running handlers and hand their tasks back."""
        await self.stop_serving()
        running = list(self._running.values())
        for runner in running:
            runner.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self._stop_keeper()
        loop, self._results_loop = self._results_loop, None
        if loop is not None:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        self._settling = False
        local, self._local = self._local, []
        await self._push_local(local)
        await self._pushes.drain()
        await asyncio.gather(*list(self._acking), return_exceptions=True)
        await self._acks.drain()
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            unlisten()
        self._queue = None

    def _q(self) -> MessageQueue:
        if self._queue is None:
            raise RuntimeError("the db:// transport is not open")
        return self._queue

    def _heard(self, kind: str, argument: str) -> None:
        if kind == StoreNotice.MESSAGE:
            if argument in (RESULTS_TOPIC, BEATS_TOPIC):
                self._results_heard += 1
                self._results_backlog = True
                self._results_wake.set()
            elif argument in self._served:
                self._heard_tasks += 1
                self._backlog = True
                self._task_wake.set()
        elif kind == StoreNotice.CANCEL and argument:
            for handler in list(self._cancel_handlers):
                try:
                    handler([argument])
                except Exception:
                    _log.exception("a cancel handler failed")

    # -- sending -----------------------------------------------------------------------

    def checkpoint_sender(self, store: object) -> SendWithCheckpoint | None:
        """Tasks go out with their checkpoints when ``store`` is this
        transport's own (``CheckpointSender``)."""
        if store is not self.store or not isinstance(store, OutboxStore):
            return None
        return self._send_with_checkpoint

    def _send_with_checkpoint(
        self, checkpoint: Checkpoint, owner: str, tasks: list[StepTask]
    ) -> Awaitable[bool]:
        # Not a coroutine: the write is queued now, in call order with the
        # turn's other writes (its settle may follow before anything awaits it).
        # No isinstance here: checkpoint_sender checked the store, and a
        # runtime Protocol check per step was ~2.5% of its CPU.
        self._q()
        store = cast("OutboxStore", self.store)
        messages = _task_messages(tasks)
        born = self._born_slots(messages)
        if not born:
            return store.save_checkpoint_sending(checkpoint, owner, messages)
        until = wall_ms() + self.lease_ms
        for i in born:
            m = messages[i]  # not dataclasses.replace: measurably slower per step
            messages[i] = OutMessage(m.topic, m.body, m.priority, m.available_at, self.owner, until)
        self._reserved += len(born)
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        store.save_checkpoint_claiming(checkpoint, owner, messages).add_done_callback(
            partial(self._born, [tasks[i] for i in born], self._generation, answer)
        )
        return answer

    def _born_slots(self, messages: list[OutMessage]) -> list[int]:
        """Which of ``messages`` are born claimed: those of served topics, as
        many as there are free slots, unless tasks may be queued for this
        server (they go first, in the queue's order)."""
        if self._backlog or not self._serving or self._on_task is None:
            return []
        free = self._concurrency - len(self._running) - self._reserved - self._claiming
        born: list[int] = []
        for i, message in enumerate(messages):
            if len(born) >= free:
                break
            if message.topic in self._served:
                born.append(i)
        return born

    def _born(
        self,
        tasks: list[StepTask],
        generation: int,
        answer: asyncio.Future[bool],
        written: asyncio.Future[list[int] | None],
    ) -> None:
        """A write with born claimed tasks is over: answer it, and hand its
        tasks to the server (back to the queue if it stopped meanwhile).

        The server gets the tasks themselves, not their messages decoded
        again: a decode per born task (``codec.loads`` and
        ``StepTask.from_wire``) was ~3% of a dispatched step's calls."""
        self._reserved -= len(tasks)
        if written.cancelled():
            answer.cancel()
            return
        error = written.exception()
        if error is not None:  # nothing written
            answer.set_exception(error)
            self._slot_freed()
            return
        ids = written.result()
        answer.set_result(ids is not None)
        if not ids:  # the lease was lost: nothing written
            self._slot_freed()
            return
        handler = self._on_task
        if not self._serving or generation != self._generation or handler is None:
            self._in_background(self._hand_back(ids))
            return
        self.born += len(ids)
        for task, message_id in zip(tasks, ids, strict=True):
            self._running[message_id] = asyncio.create_task(
                self._run_task(message_id, task, handler)
            )

    async def dispatch(self, tasks: list[StepTask]) -> None:
        """Store the tasks in their groups' topics (one transaction)."""
        if not tasks:
            return
        try:
            messages = _task_messages(tasks)
            # Through the batcher: a fan's tasks (and concurrent turns' ones)
            # go out in one transaction rather than one each.
            await self._pushes.many(messages)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"could not dispatch {len(tasks)} task(s): {exc}") from exc

    async def send_result(self, result: StepResult) -> None:
        """Store the result for the results consumers; the result of a task
        served here is settled here, with its task's deletion, when this
        transport settles in its own store (:meth:`consume_settling`)."""
        message_id = self._task_of.get(result.step_id) if self._settling else None
        if message_id is None:
            await self._send(_result_message(result), "result")
            return
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._local.append((result, message_id, settled))
        self._results_wake.set()
        await settled

    async def send_heartbeat(self, beat: Heartbeat) -> None:
        """Store the beat for the results consumers."""
        await self._send(OutMessage(BEATS_TOPIC, codec.dumps(beat.to_wire())), "heartbeat")

    async def _send(self, message: OutMessage, what: str) -> None:
        self._q()
        try:
            await self._pushes(message)
        except Exception as exc:
            raise TransportError(f"could not send a {what}: {exc}") from exc

    async def _push_now(self, messages: list[OutMessage]) -> list[None]:
        await self._q().push(messages)
        return [None] * len(messages)

    async def _ack_now(self, ids: list[int]) -> list[None]:
        await self._q().ack(ids)
        return [None] * len(ids)

    async def publish_cancel(self, run_ids: list[str]) -> None:
        """Notify every listener of the store's channel (best effort)."""
        if not run_ids:
            return
        try:
            await self._q().broadcast(StoreNotice.CANCEL, run_ids)
        except Exception as exc:
            _log.warning("could not publish the cancellation of %d run(s): %s", len(run_ids), exc)

    def on_cancel(self, handler: CancelHandler) -> None:
        """Register a cancel-notice handler."""
        self._cancel_handlers.append(handler)

    # -- serving tasks -----------------------------------------------------------------

    async def serve(
        self, groups: Collection[str], on_task: TaskHandler, *, concurrency: int
    ) -> None:
        """Claim tasks of ``groups`` for ``on_task``, ``concurrency`` at once."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._q()
        self._topics = sorted({task_topic(group) for group in groups})
        self._served = frozenset(self._topics)
        self._on_task, self._concurrency = on_task, concurrency
        self._serving = True
        self._backlog = True
        if self._serve_loop is None or self._serve_loop.done():
            self._generation += 1
            self._serve_loop = asyncio.create_task(
                self._serve(self._generation), name="durably-db-tasks"
            )
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._keep_leases(), name="durably-db-leases")
        self._task_wake.set()

    async def stop_serving(self) -> None:
        """Stop claiming. A claim in flight finishes and its tasks are handed
        back; running handlers are left to finish (and are acked then)."""
        self._serving = False
        self._generation += 1
        self._on_task = None
        self._task_wake.set()
        loop, self._serve_loop = self._serve_loop, None
        if loop is not None:
            await asyncio.gather(loop, return_exceptions=True)

    async def _serve(self, generation: int) -> None:
        while self._serving and generation == self._generation:
            free = self._concurrency - len(self._running) - self._reserved
            claimed: list[Message] = []
            if free > 0 and self._topics:
                heard = self._heard_tasks
                self._claiming = free
                try:
                    claimed = await self._q().claim(
                        list(self._topics), self.owner, free, self.lease_ms, wall_ms()
                    )
                except Exception as exc:
                    _log.warning("could not claim tasks: %s", exc)
                else:
                    if len(claimed) >= free:
                        # Filled every slot: more may wait (pushed where no
                        # notice reached us), and they go before new sends.
                        self._backlog = True
                    elif heard == self._heard_tasks:
                        self._backlog = False  # drained, and no push heard since
                finally:
                    self._claiming = 0
            handler = self._on_task
            if not self._serving or generation != self._generation or handler is None:
                await self._hand_back([m.id for m in claimed])
                return
            for message in claimed:
                task = self._decode(message)
                if task is not None:
                    runner = asyncio.create_task(self._run_task(message.id, task, handler))
                    self._running[message.id] = runner
            if claimed and len(claimed) == free:
                continue  # there may be more: claim again once a slot is free
            await wait_event(self._task_wake, self.poll_interval)
            self._task_wake.clear()

    def _decode(self, message: Message) -> StepTask | None:
        """The task a claimed message carries; a malformed one is dropped (acked)."""
        try:
            return StepTask.from_wire(codec.loads(message.body))
        except (ValueError, WireError) as exc:
            _log.error("dropping a malformed task message %d: %s", message.id, exc)
            self._in_background(self._drop(message.id))
            return None

    async def _drop(self, message_id: int) -> None:
        with contextlib.suppress(Exception):  # if not, it comes back: dropped then
            await self._acks(message_id)

    async def _run_task(self, message_id: int, task: StepTask, handler: TaskHandler) -> None:
        step_id = task.step_id
        self._task_of[step_id] = message_id
        try:
            try:
                await handler(task)
            except asyncio.CancelledError:
                self._finished(message_id)
                await asyncio.shield(self._hand_back([message_id]))
                raise
            except Exception:
                _log.exception(
                    "task %s failed in its handler wrapper; delivering it again", step_id
                )
                self._finished(message_id)
                await self._hand_back([message_id], wall_ms() + self.redeliver_delay_ms)
                return
            self._finished(message_id)
            if message_id in self._settled_tasks:
                return  # deleted by the settle of its result
            try:
                await self._acks(message_id)
            except Exception as exc:  # it comes back after its lease: at least once
                _log.warning("could not ack task %s: %s", step_id, exc)
        finally:
            self._finished(message_id)
            self._settled_tasks.discard(message_id)
            if self._task_of.get(step_id) == message_id:
                del self._task_of[step_id]

    def _finished(self, message_id: int) -> None:
        if self._running.pop(message_id, None) is not None:
            self._slot_freed()

    def _slot_freed(self) -> None:
        # A claim for the freed slot only if tasks may be waiting for it: a
        # claim per finished task found nothing when tasks are born claimed
        # (the poll still claims what a lost notice or a lapsed lease leaves).
        if self._backlog:
            self._task_wake.set()

    async def _hand_back(self, ids: list[int], available_at: int | None = None) -> None:
        if not ids:
            return
        try:
            await self._q().release(ids, self.owner, available_at=available_at)
        except Exception as exc:  # they come back after their lease
            _log.warning("could not hand back %d task(s): %s", len(ids), exc)

    async def _keep_leases(self) -> None:
        """Extend the leases of the tasks whose handlers run, a third of a lease apart."""
        every = self.lease_ms / 3000
        while self._serving or self._running:
            await asyncio.sleep(every)
            ids = list(self._running)
            if not ids:
                continue
            try:
                held = set(await self._q().extend(ids, self.owner, self.lease_ms, wall_ms()))
            except Exception as exc:
                _log.warning("could not extend the leases of %d task(s): %s", len(ids), exc)
                continue
            # Not those deleted by the settle of their result (their handler
            # is finishing): nobody else can run them.
            lost = [
                i
                for i in ids
                if i not in held and i in self._running and i not in self._settled_tasks
            ]
            if lost:
                _log.warning(
                    "%d running task(s) lost their claim; another worker may run them too",
                    len(lost),
                )

    async def _stop_keeper(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)

    # -- results -----------------------------------------------------------------------

    async def consume_results(
        self, on_results: ResultHandler, on_heartbeat: HeartbeatHandler
    ) -> None:
        """Claim results and beats in batches of up to 256 and deliver them."""
        self._q()
        if self._results_loop is not None:
            raise RuntimeError("this transport already has a results consumer")
        self._results_loop = asyncio.create_task(
            self._consume(on_results, on_heartbeat), name="durably-db-results"
        )

    async def consume_settling(
        self,
        store: object,
        settle: SettleTaken,
        on_results: ResultHandler,
        on_heartbeat: HeartbeatHandler,
    ) -> bool:
        """Take results and beats off the queue in the transaction that
        settles them (``SettlingConsumer``), when ``store`` is this transport's own."""
        self._q()
        if store is not self.store or not isinstance(store, ResultSettlingStore):
            return False
        if self._results_loop is not None:
            raise RuntimeError("this transport already has a results consumer")
        self._results_loop = asyncio.create_task(
            self._consume_settling(store, settle, on_results, on_heartbeat),
            name="durably-db-results",
        )
        self._settling = True
        return True

    async def _consume_settling(
        self,
        store: ResultSettlingStore,
        settle: SettleTaken,
        on_results: ResultHandler,
        on_heartbeat: HeartbeatHandler,
    ) -> None:
        topics = [RESULTS_TOPIC, BEATS_TOPIC]
        loop = asyncio.get_running_loop()
        while True:
            self._results_wake.clear()
            taken = 0
            local: list[tuple[StepResult, int, asyncio.Future[None]]] = []

            async def take(
                resolutions_of: Callable[[list[StepResult]], list[Resolution]],
                now: int,
                lease: TurnLease | None,
            ) -> Taken:
                nonlocal taken, local
                local, self._local = self._local, []
                served = [result for result, _, _ in local]
                # Served results alone need no take (on PostgreSQL its
                # statement was one of the batch's five round trips), unless
                # something may be queued; see ``_results_backlog``.
                heard, at = self._results_heard, loop.time()
                limit = _RESULT_BATCH
                if (
                    local
                    and not self._results_backlog
                    and at - self._results_taken_at < self.poll_interval
                ):
                    limit = 0

                def decode(
                    messages: list[Message],
                ) -> tuple[tuple[list[StepResult], list[Heartbeat]], list[Resolution]]:
                    results, beats = _parse(messages, self._settled_steps)
                    results = served + results
                    return (results, beats), resolutions_of(results)

                got = await store.claim_and_resolve(
                    topics,
                    limit,
                    wall_ms(),
                    decode,
                    now,
                    lease,
                    delete=[message_id for _, message_id, _ in local],
                )
                taken = len(got.messages)
                if limit:
                    self._results_taken_at = at
                    if taken >= limit:
                        self._results_backlog = True
                    elif heard == self._results_heard:
                        self._results_backlog = False  # drained, and no push heard since
                for result, message_id, settled in local:
                    self._settled_tasks.add(message_id)
                    # A beat it sent before may still be queued: never
                    # delivered after its result (the consumer's promise).
                    self._settled_steps[result.step_id] = None
                    if len(self._settled_steps) > _SETTLED_MEMORY:
                        self._settled_steps.popitem(last=False)
                    if not settled.done():
                        settled.set_result(None)
                results, beats = got.decoded
                for beat in beats:  # committed (deleted) already: fire and forget
                    try:
                        await on_heartbeat(beat)
                    except Exception:
                        _log.exception("heartbeat of %s could not be handled", beat.step_id)
                return results, got.answers, got.leased

            try:
                await settle(take)
            except Exception as exc:
                # Results served here go the plain way (pushed; their tasks
                # acked once their handlers return).
                await self._push_local([item for item in local if not item[2].done()])
                if is_row_error(exc):
                    # A result the store refuses undid the transaction: this
                    # batch goes the plain way, which settles it entry by entry.
                    taken = await self._consume_once(topics, on_results, on_heartbeat)
                else:
                    _log.warning("could not take results: %s", exc)
            if taken < _RESULT_BATCH and not self._local:
                await wait_event(self._results_wake, self.poll_interval)

    async def _push_local(self, local: list[tuple[StepResult, int, asyncio.Future[None]]]) -> None:
        """Send results that were to be settled here as any other result."""
        if not local:
            return
        try:
            await self._pushes.many([_result_message(result) for result, _, _ in local])
        except Exception as exc:
            error = TransportError(f"could not send {len(local)} result(s): {exc}")
            for _, _, settled in local:
                if not settled.done():
                    settled.set_exception(error)
            return
        for _, _, settled in local:
            if not settled.done():
                settled.set_result(None)

    async def _consume_once(
        self, topics: list[str], on_results: ResultHandler, on_heartbeat: HeartbeatHandler
    ) -> int:
        try:
            claimed = await self._q().claim(
                topics, self.owner, _RESULT_BATCH, self.lease_ms, wall_ms()
            )
        except Exception as exc:
            _log.warning("could not claim results: %s", exc)
            return 0
        if claimed:
            await self._deliver(claimed, on_results, on_heartbeat)
        return len(claimed)

    async def _consume(self, on_results: ResultHandler, on_heartbeat: HeartbeatHandler) -> None:
        topics = [RESULTS_TOPIC, BEATS_TOPIC]
        while True:
            self._results_wake.clear()
            try:
                claimed = await self._q().claim(
                    topics, self.owner, _RESULT_BATCH, self.lease_ms, wall_ms()
                )
            except Exception as exc:
                _log.warning("could not claim results: %s", exc)
                claimed = []
            if claimed:
                await self._deliver(claimed, on_results, on_heartbeat)
            if len(claimed) < _RESULT_BATCH:
                await wait_event(self._results_wake, self.poll_interval)

    async def _deliver(
        self,
        claimed: list[Message],
        on_results: ResultHandler,
        on_heartbeat: HeartbeatHandler,
    ) -> None:
        results: list[StepResult] = []
        result_ids: list[int] = []
        beats: list[tuple[int, Heartbeat]] = []
        done: list[int] = []
        for message in sorted(claimed, key=lambda m: m.id):
            try:
                body = codec.loads(message.body)
                if message.topic == BEATS_TOPIC:
                    beats.append((message.id, Heartbeat.from_wire(body)))
                else:
                    results.append(StepResult.from_wire(body))
                    result_ids.append(message.id)
            except (ValueError, WireError) as exc:
                _log.error("dropping a malformed %s message: %s", message.topic, exc)
                done.append(message.id)
        # A beat whose step's result is in the same batch says nothing new.
        finished = {result.step_id for result in results}
        for message_id, beat in beats:
            if beat.step_id in finished:
                done.append(message_id)
                continue
            try:
                await on_heartbeat(beat)
            except Exception:
                _log.exception("heartbeat of %s could not be handled", beat.step_id)
            done.append(message_id)  # a beat is fire and forget
        if results:
            try:
                await on_results(results)
            except Exception:
                _log.exception(
                    "a batch of %d step results could not be settled; delivering it again",
                    len(results),
                )
                await self._hand_back(result_ids, wall_ms() + self.redeliver_delay_ms)
            else:
                done.extend(result_ids)
        if done:
            # Not awaited: the next claim cannot take these (they are ours
            # for a lease), so it need not wait for their delete's round trip.
            self._in_background(self._ack_results(done))

    def _in_background(self, write: Coroutine[Any, Any, None]) -> None:
        """Run a queue write nobody awaits; :meth:`close` waits for it."""
        task = asyncio.create_task(write)
        self._acking.add(task)
        task.add_done_callback(self._acking.discard)

    async def _ack_results(self, ids: list[int]) -> None:
        try:
            await self._acks.many(ids)
        except Exception as exc:  # delivered again after the lease: at least once
            _log.warning("could not ack %d result message(s): %s", len(ids), exc)
