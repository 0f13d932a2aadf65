"""The ``redis://`` transport itself: :class:`RedisTransport` (see the
package docstring for the wire it speaks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from typing import Any, NamedTuple, NoReturn

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from ..._logs import engine_logger
from ..._notices import StoreNotice
from ..._urls import redact_url
from ...wire import Heartbeat, StepResult, StepTask, WireError
from ..base import (
    CancelHandler,
    HeartbeatHandler,
    ResultHandler,
    TaskHandler,
    TransportError,
    TurnHandler,
)
from . import _turns
from ._batched import (
    AddedJob,
    Collector,
    Lane,
    added_job,
    batch_client,
    check_added,
    packed_job_opts,
    run_scripts,
)
from ._bullmq import (
    Reserved,
    _BatchWorker,
    _Consumer,
    _delayed,
    _Job,
    _new_queue,
    _Processor,
    _Queue,
)
from ._looped import CALL_MAX, add_call, add_each_call, add_each_script, add_script
from ._names import RedisNames, bullmq_priority, split_url
from ._runs import RedisRuns

_log = engine_logger("durably.transport")
_EVENTS = "durably.events"
"""The control notice kind of lifecycle events (ours; upstream instances ignore it)."""

_RESULT_BATCH = 256
_BEAT_TTL_MS = 30_000
_SETTLED_MEMORY = 10_000
"""Step ids of recently delivered results, so a late beat for one is dropped."""
_DRAIN_DELAY_S = 1
"""How long an idle BullMQ worker blocks waiting for a job (bullmq's default is 5 s).
A worker closing while it blocks may swallow the queue's wake-up marker, and the
others then sleep until their wait ends: this bounds that stall."""
_TASK_JOB_OPTS: dict[str, Any] = {"removeOnComplete": True, "removeOnFail": {"age": 86_400}}
_OTHER_JOB_OPTS: dict[str, Any] = {"removeOnComplete": True, "removeOnFail": True}
_SILENT_S = 10.0
"""How long a subscription may stay silent before the watchdog pings it."""
_OPEN_RETRY_FIRST_S = 0.25
_OPEN_RETRY_MAX_S = 5.0
_REPORT_EVERY_S = 60.0


def _task_opts(priority: int | None) -> tuple[dict[str, Any], bytes]:
    """A task job's options for ``priority`` and their packed form (shared by
    every task of that priority: never changed)."""
    known = _TASK_OPTS.get(priority)
    if known is None:
        if len(_TASK_OPTS) >= 256:
            _TASK_OPTS.clear()
        opts = {**_TASK_JOB_OPTS, "priority": bullmq_priority(priority)}
        known = _TASK_OPTS[priority] = (opts, packed_job_opts(opts))
    return known


_TASK_OPTS: dict[int | None, tuple[dict[str, Any], bytes]] = {}


class _Done(NamedTuple):
    """A job a worker finished, to complete in the transport's next write."""

    worker: _BatchWorker
    done: tuple[Any, Any, str]


_Item = list[tuple[str, dict[str, Any]]] | _Done
"""What the transport's writes carry: a caller's batch of jobs to add, or a
worker's finished job."""


def _may_wait(item: _Item) -> bool:
    # A job finished by a worker whose queue was found dry: completing it is
    # on nobody's path (its result was settled before), and its write's take
    # would find nothing. (A worker with jobs waiting takes them with the
    # finish, at once.)
    return isinstance(item, _Done) and item.worker.drained


_FINISH_LINGER_S = 0.002
"""How long finished jobs alone (of workers whose queues were found dry) wait
for a write to go with (an add, other workers' finishes): a write of
finishes alone is a round trip of its own."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class RedisTransport:
    """A :class:`~durably.transports.base.Transport` over BullMQ and Redis pub/sub.

    ``url``: ``redis://`` or ``rediss://``, with an optional user and password,
    port and database number. ``prefix``/``namespace``: the upstream's naming
    (package docstring). ``redeliver_delay_ms``: how long a task whose handler
    wrapper raised (or a results batch whose consumer raised) waits before it
    is delivered again. ``lock_ms``: BullMQ's job lock (a dead holder's jobs
    come back after it, via the stalled-job check). ``retry_open``: :meth:`open`
    waits for an unreachable Redis (one log line, then retries) instead of
    raising :class:`TransportError`; an engine's transport does.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "durable",
        namespace: str | None = None,
        redeliver_delay_ms: int = 1_000,
        lock_ms: int = 30_000,
        retry_open: bool = False,
    ) -> None:
        scheme = url.partition("://")[0].lower()
        if scheme not in ("redis", "rediss"):
            raise ValueError(f"not a Redis URL: {redact_url(url)}")
        if not prefix or ":" in prefix or (namespace and ":" in namespace):
            raise ValueError("the Redis prefix and namespace must be non-empty and without ':'")
        self._connect_url = url
        self.url = redact_url(url)
        """The URL without credentials."""
        self.names = RedisNames(prefix, namespace)
        self.redeliver_delay_ms = redeliver_delay_ms
        self.lock_ms = lock_ms
        self.retry_open = retry_open
        self.instance_id = f"durably-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        """Who publishes (the ``from`` of control notices)."""
        self._client: aioredis.Redis | None = None
        # the batch writers' connections (no per-operation socket timeout: see batch_client)
        self._batch_client: aioredis.Redis | None = None
        self._opening = asyncio.Lock()
        self._closing = False
        self._queues: dict[str, _Queue] = {}
        # serving
        self._workers: list[_Consumer] = []
        self._generation = 0
        self._slots = asyncio.Semaphore(1)
        self._on_task: TaskHandler | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing_workers: set[asyncio.Task[None]] = set()
        self._bridging: set[asyncio.Future[None]] = set()
        # results
        self._results_worker: _Consumer | None = None
        self._turn_consumers: list[_Consumer] = []
        self._on_results: ResultHandler | None = None
        self._on_heartbeat: HeartbeatHandler | None = None
        # results taken, one group per fetch, each told at once whether its batch was settled
        self._batch: list[tuple[list[StepResult], asyncio.Future[bool]]] = []
        self._flush: asyncio.Task[None] | None = None
        self._settled: OrderedDict[str, None] = OrderedDict()
        # pub/sub
        self._cancel_handlers: list[CancelHandler] = []
        self._event_listeners: list[Callable[[str, str], None]] = []
        self._readers: list[asyncio.Task[None]] = []
        self._pubsubs: dict[str, PubSub] = {}
        self._listeners: dict[str, list[Callable[[Any], Awaitable[None]]]] = {}
        self.resubscriptions = 0
        """Subscriptions replaced by the watchdog (for tests and metrics)."""
        self.malformed: dict[str, int] = {}
        """Malformed messages dropped, per channel."""
        # Weakly: an engine takes a new run queue at each start and drops
        # the old one; a list kept them all for the process's lifetime.
        self._run_queues: weakref.WeakSet[RedisRuns] = weakref.WeakSet()
        # tasks and results added, batched while the previous batch is written
        self._adding: Collector[_Item, None] = Collector(
            self._write, patient=_may_wait, linger_s=_FINISH_LINGER_S
        )
        self._adding_lane = Lane()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisTransport:
        """Build from a URL; ``?prefix=`` and ``?namespace=`` set the naming."""
        clean, ours = split_url(url)
        if "prefix" in ours:
            options.setdefault("prefix", ours["prefix"])
        if "namespace" in ours:
            options.setdefault("namespace", ours["namespace"] or None)
        return cls(clean, **options)

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Connect and start hearing control notices. Idempotent. Redis down:
        :class:`TransportError`, or with ``retry_open`` one log line and a
        retry every few seconds until it answers (a reminder each minute)."""
        async with self._opening:
            if self._client is not None:
                return
            delay, since, reported = _OPEN_RETRY_FIRST_S, time.monotonic(), 0.0
            while True:
                pool = aioredis.BlockingConnectionPool.from_url(
                    self._connect_url, decode_responses=True, max_connections=32, timeout=30
                )
                client = aioredis.Redis.from_pool(pool)  # aclose() closes the pool too
                try:
                    await client.ping()
                    break
                except Exception as exc:
                    await client.aclose()
                    error = f"cannot reach Redis at {self.url}: {type(exc).__name__}"
                    if not self.retry_open:
                        raise TransportError(error) from None
                    now = time.monotonic()
                    if not reported or now - reported >= _REPORT_EVERY_S:
                        waited = "" if not reported else f" (for {now - since:.0f} s)"
                        _log.error("%s%s; retrying until it answers", error, waited)
                        reported = now
                await asyncio.sleep(delay)
                delay = min(delay * 2, _OPEN_RETRY_MAX_S)
            if reported:
                _log.warning("Redis at %s answers; going on", self.url)
            self._client = client
            self._batch_client = batch_client(self._connect_url)
            self._closing = False
            await self._subscribe(self.names.control, self._heard_control)

    async def close(self) -> None:
        """Stop every consumer; hand back tasks whose handlers were still running."""
        self._closing = True
        await self.stop_serving()
        handlers = list(self._handlers)
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._closing_workers:
            await asyncio.gather(*self._closing_workers, return_exceptions=True)
        if self._bridging:
            await asyncio.gather(*self._bridging, return_exceptions=True)
        worker, self._results_worker = self._results_worker, None
        if worker is not None:
            await worker.close()
        turn_consumers, self._turn_consumers = self._turn_consumers, []
        for consumer in turn_consumers:
            await consumer.close()
        if self._flush is not None:
            await asyncio.gather(self._flush, return_exceptions=True)
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._readers.clear()
        for pubsub in self._pubsubs.values():
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # untyped in older redis-py
        self._pubsubs.clear()
        self._listeners.clear()
        await self._adding.drain()
        await self._adding_lane.close()
        client, self._client = self._client, None
        batches, self._batch_client = self._batch_client, None
        self._queues.clear()
        if client is not None:
            await client.aclose()
        if batches is not None:
            await batches.aclose()

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            raise RuntimeError("the redis:// transport is not open")
        return self._client

    def _batches(self) -> aioredis.Redis:
        """The client batch writers send through (see :func:`._batched.batch_client`)."""
        if self._batch_client is None:
            raise RuntimeError("the redis:// transport is not open")
        return self._batch_client

    def _queue(self, name: str) -> _Queue:
        queue = self._queues.get(name)
        if queue is None:
            # Queues share the transport's pool (a queue only adds jobs);
            # workers get connections of their own (they block).
            queue = self._queues[name] = _new_queue(name, self._redis())
        return queue

    def run_queue(self) -> RedisRuns:
        """The fleet's run queue, on BullMQ (see :mod:`durably._run_queue`).
        Available once :meth:`open` ran."""
        runs = RedisRuns(
            self.names,
            self._connect_url,
            self._redis(),
            self._queue,
            self._give_back,
            self._adding.add,
            self._batches(),
            self._finish,
        )
        self._run_queues.add(runs)
        return runs

    # -- pub/sub -----------------------------------------------------------------------

    async def _subscribe(self, channel: str, on_message: Callable[[Any], Awaitable[None]]) -> None:
        """Hear ``channel`` from now on (the subscription is live on the server
        when this returns), through a reader that keeps it alive. One
        subscription and one reader per channel, telling every handler: two
        readers of one subscription would fight over its socket, each message
        reaching only one of them."""
        handlers = self._listeners.get(channel)
        if handlers is not None:
            handlers.append(on_message)
            return
        pubsub = await self._open_subscription(channel)
        self._pubsubs[channel] = pubsub
        self._listeners[channel] = [on_message]
        self._readers.append(
            asyncio.create_task(self._read(channel, self._tell(channel)), name=f"durably-{channel}")
        )

    def _tell(self, channel: str) -> Callable[[Any], Awaitable[None]]:
        handlers = self._listeners[channel]

        async def tell(body: Any) -> None:
            for handler in list(handlers):
                try:
                    await handler(body)
                except Exception:
                    _log.exception("a message on %s could not be handled", channel)

        return tell

    async def _open_subscription(self, channel: str) -> PubSub:
        pubsub = self._redis().pubsub()
        try:
            await pubsub.subscribe(channel)
            # Wait for the confirmation: a message published after this returns
            # is heard (the subscription is live on the server).
            while True:
                message = await pubsub.get_message(timeout=5.0)
                if message is None:
                    raise TransportError(f"no subscription confirmation for {channel} from Redis")
                if message.get("type") == "subscribe":
                    return pubsub
        except BaseException:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # untyped in older redis-py
            raise

    async def _read(self, channel: str, on_message: Callable[[Any], Awaitable[None]]) -> None:
        """Deliver the channel's messages; the watchdog: a subscription silent
        for :data:`_SILENT_S` is pinged, and one that does not answer (a dead
        or half-open connection, a restarted server) is replaced by a new one."""
        heard_at, pinged = time.monotonic(), False
        # The flag as well as the cancellation ends it: redis-py can swallow
        # a cancellation that lands inside a read, and close() must not hang.
        while not self._closing:
            pubsub = self._pubsubs[channel]
            try:
                message = await pubsub.get_message(timeout=1.0)
                if message is not None:
                    heard_at, pinged = time.monotonic(), False
                elif time.monotonic() - heard_at >= _SILENT_S:
                    if pinged:
                        raise ConnectionError(f"no answer to a ping for {_SILENT_S:.0f} s")
                    await pubsub.ping()
                    heard_at, pinged = time.monotonic(), True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._resubscribe(channel, exc)
                heard_at, pinged = time.monotonic(), False
                continue
            if message is None or message.get("type") != "message":
                continue
            try:
                body = json.loads(message["data"])
            except (TypeError, ValueError):
                self._malformed(channel, "not JSON")
                continue
            try:
                await on_message(body)
            except Exception:
                _log.exception("a message on %s could not be handled", channel)

    async def _resubscribe(self, channel: str, error: Exception) -> None:
        """Replace a dead subscription, retrying until Redis answers."""
        _log.warning("lost the Redis subscription to %s (%s); reconnecting", channel, error)
        old = self._pubsubs[channel]
        with contextlib.suppress(Exception):
            await old.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # untyped in older redis-py
        delay = _OPEN_RETRY_FIRST_S
        while not self._closing:
            try:
                self._pubsubs[channel] = await self._open_subscription(channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _OPEN_RETRY_MAX_S)
                continue
            self.resubscriptions += 1
            _log.warning("subscribed to %s again", channel)
            return

    def _malformed(self, channel: str, why: str) -> None:
        """Log the first malformed message of a channel; count the rest."""
        self.malformed[channel] = self.malformed.get(channel, 0) + 1
        if self.malformed[channel] == 1:
            _log.error(
                "dropping a malformed message on %s (%s); further ones are dropped silently",
                channel,
                why,
            )

    async def _heard_control(self, body: Any) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("kind"), str):
            self._malformed(self.names.control, "not a control notice")
            return
        if body.get("from") == self.instance_id:
            return  # our own: its handlers were told when it was sent
        if body["kind"] == _EVENTS:
            self._tell_events(body.get("notices"))
            return
        if body["kind"] != "cancel":
            return  # other notices are not a transport's business
        run_id = body.get("runId")
        if not isinstance(run_id, str) or not run_id:
            self._malformed(self.names.control, "a cancel without a runId")
            return
        self._tell_cancel([run_id])

    def _tell_cancel(self, run_ids: list[str]) -> None:
        for handler in list(self._cancel_handlers):
            try:
                handler(run_ids)
            except Exception:
                _log.exception("a cancel handler failed")

    async def publish_cancel(self, run_ids: list[str]) -> None:
        """Tell this process's handlers, and publish one cancel notice per run
        on the control channel for every other instance (best effort)."""
        if not run_ids:
            return
        self._tell_cancel(list(run_ids))
        try:
            async with self._redis().pipeline(transaction=False) as pipe:
                for run_id in run_ids:
                    notice = {"from": self.instance_id, "kind": "cancel", "runId": run_id}
                    pipe.publish(self.names.control, json.dumps(notice))
                await pipe.execute()
        except Exception as exc:
            _log.warning("could not publish the cancellation of %d run(s): %s", len(run_ids), exc)

    async def broadcast_events(self, kind: str, notices: list[str]) -> None:
        """Publish lifecycle events (compact JSON each) to every instance on the
        control channel, so a subscriber anywhere hears runs executing here."""
        if not notices:
            return
        body = {"from": self.instance_id, "kind": _EVENTS, "notices": notices}
        await self._redis().publish(self.names.control, json.dumps(body))

    async def listen_events(self, listener: Callable[[str, str], None]) -> Callable[[], None]:
        """Hear other instances' lifecycle events: ``listener(kind, notice)``
        with the store notice kind of events; returns its removal."""
        await self.open()
        self._event_listeners.append(listener)

        def remove() -> None:
            if listener in self._event_listeners:
                self._event_listeners.remove(listener)

        return remove

    def _tell_events(self, notices: Any) -> None:
        if not isinstance(notices, list):
            self._malformed(self.names.control, "events without a notices list")
            return
        for notice in notices:
            if not isinstance(notice, str):
                continue
            for listener in list(self._event_listeners):
                try:
                    listener(StoreNotice.EVENT, notice)
                except Exception:
                    _log.exception("a lifecycle event listener failed")

    def on_cancel(self, handler: CancelHandler) -> None:
        """Register a cancel-notice handler."""
        self._cancel_handlers.append(handler)

    # -- sending -----------------------------------------------------------------------

    async def dispatch(self, tasks: list[StepTask]) -> None:
        """Add the tasks to their groups' queues (one pipeline per queue)."""
        if not tasks:
            return
        by_queue: dict[str, list[dict[str, Any]]] = {}
        for task in tasks:
            opts, packed = _task_opts(task.priority)
            job = {"name": "task", "data": task.to_wire(), "opts": opts, "packedOpts": packed}
            by_queue.setdefault(self.names.tasks(task.group), []).append(job)
        try:
            self._redis()
            await self._adding.add([(name, job) for name, jobs in by_queue.items() for job in jobs])
        except Exception as exc:
            raise TransportError(
                f"could not dispatch {len(tasks)} task(s): {type(exc).__name__}: {exc}"
            ) from exc

    async def send_result(self, result: StepResult) -> None:
        """Settle the result here if this instance consumes results, else (or
        if that settle failed) add it to the results queue.

        A result settled here is one this instance would have been free to
        take off the queue itself (results go to whichever instance takes them
        first): it skips the queue's add, take and finish. The task it answers
        is completed only after this returns, so a crash before the settle
        leaves the task job held and BullMQ's stalled check delivers it again,
        as after a crash before the result job was added."""
        self._redis()
        here = self._on_results is not None and not self._closing
        if here and await self._settle_here([result]):
            return
        job = {"name": "result", "data": result.to_wire(), "opts": dict(_OTHER_JOB_OPTS)}
        try:
            await self._adding.add([(self.names.results, job)])
        except Exception as exc:
            raise TransportError(f"could not send a result: {type(exc).__name__}: {exc}") from exc

    async def _finish(self, worker: _BatchWorker, done: tuple[Any, Any, str]) -> None:
        """Complete a worker's job (a :data:`._bullmq.Finisher`) in the next
        write, with the adds and other workers' finishes that go with it."""
        await self._adding.add(_Done(worker, done))

    async def _write(self, items: list[_Item]) -> list[BaseException | None]:
        """One transaction for every item queued meanwhile: the jobs of each
        caller's batch of adds (tasks, results, runs; one looped add script
        call per queue and job shape), the jobs workers finished (one looped
        finish call per worker), then the takes of this instance's workers
        with room; each item fails alone if a job of it is refused."""
        groups: dict[tuple[str, tuple[str, ...], bytes], list[tuple[int, AddedJob]]] = {}
        # jobs of ids of their own (runs' starts): their packed arguments differ
        own_ids: dict[tuple[str, tuple[str, ...], int], list[tuple[int, AddedJob]]] = {}
        added_to: dict[str, int] = {}
        finished: dict[_BatchWorker, list[tuple[int, tuple[Any, Any, str]]]] = {}
        for owner, item in enumerate(items):
            if isinstance(item, _Done):
                finished.setdefault(item.worker, []).append((owner, item.done))
                continue
            for name, job in item:
                scripts = self._queue(name).backend.scripts
                added = added_job(
                    scripts, job["name"], job["data"], job["opts"], None, job.get("packedOpts")
                )
                if job["opts"].get("jobId"):
                    mark = (added.script.sha, added.keys, added.timestamp)
                    own_ids.setdefault(mark, []).append((owner, added))
                else:
                    key = (added.script.sha, added.keys, added.packed)
                    groups.setdefault(key, []).append((owner, added))
                added_to[name] = added_to.get(name, 0) + 1
        calls, members = [], []
        for group in groups.values():
            for start in range(0, len(group), CALL_MAX):
                part = group[start : start + CALL_MAX]
                first = part[0][1]
                jobs = [(added.data, added.opts) for _, added in part]
                script = add_script(first.script)
                calls.append(add_call(script, first.keys, first.packed, first.timestamp, jobs))
                members.append([owner for owner, _ in part])
        for group in own_ids.values():
            for start in range(0, len(group), CALL_MAX):
                part = group[start : start + CALL_MAX]
                first = part[0][1]
                own = [(added.packed, added.data, added.opts) for _, added in part]
                script = add_each_script(first.script)
                calls.append(add_each_call(script, first.keys, first.timestamp, own))
                members.append([owner for owner, _ in part])
        finishes = []
        for worker, held in finished.items():
            made = worker.finish_calls([done for _, done in held])
            finishes.append((worker, held, len(calls), len(made)))
            calls += made
        # Jobs for a queue this instance consumes (a group it serves, a pool
        # whose runs it takes), with room: its worker takes them (or whatever
        # it would take next) in the same transaction, each locked by a token
        # of its own, instead of waking on the queue's marker and fetching
        # them in a round trip of its own. Other consumers see what a fetch
        # of that worker's right after the add would leave them. A worker
        # whose jobs are finished here takes the next ones for their slots.
        takes: list[tuple[Reserved, _BatchWorker | None]] = []
        for worker in finished:
            reserved = worker.finish_take()
            if reserved is not None:
                takes.append((reserved, worker))
        for name, count in added_to.items():
            consumer = self._consumer_of(name)
            if consumer is None or any(consumer.worker is w for _, w in takes):
                continue  # (a finish's take takes what was added too)
            reserved = consumer.reserve(count)
            if reserved is not None:
                takes.append((reserved, None))
        first_take = len(calls)
        calls += [reserved.call for reserved, _ in takes]
        try:
            replies = await run_scripts(
                self._batches(), calls, transaction=True, lane=self._adding_lane
            )
        except BaseException:
            for reserved, _ in takes:
                reserved.cancel()
            raise
        for (reserved, finisher), reply in zip(takes, replies[first_take:], strict=True):
            if finisher is not None:
                finisher.started(reserved, reply)
                continue
            try:
                reserved.taken(reply)
            except Exception:
                # Added all the same: what the take locked comes back through
                # BullMQ's stalled check once its lock runs out.
                _log.exception("could not start the jobs taken with their add")
        outcomes: list[BaseException | None] = [None] * len(items)
        for owners, reply in zip(members, replies[: len(members)], strict=True):
            each = reply if isinstance(reply, list) else [reply] * len(owners)
            for owner, one in zip(owners, each, strict=True):
                try:
                    check_added(one)
                except Exception as exc:
                    outcomes[owner] = outcomes[owner] or exc
        for worker, held, at, count in finishes:
            told = worker.finish_outcomes([done for _, done in held], replies[at : at + count])
            for (owner, _), outcome in zip(held, told, strict=True):
                outcomes[owner] = outcome
        return outcomes

    def _consumer_of(self, queue: str) -> _Consumer | None:
        """This instance's consumer of ``queue`` (step tasks or runs), if any."""
        for consumer in self._workers:
            if consumer.queue == queue:
                return consumer
        for runs in self._run_queues:
            found = runs.consumer(queue)
            if found is not None:
                return found
        return None

    async def send_heartbeat(self, beat: Heartbeat) -> None:
        """Publish the beat, and keep it as the step's latest for late listeners."""
        body = json.dumps(beat.to_wire())
        try:
            async with self._redis().pipeline(transaction=False) as pipe:
                pipe.publish(self.names.heartbeat, body)
                pipe.set(self.names.step_beat(beat.step_id), body, px=_BEAT_TTL_MS)
                await pipe.execute()
        except Exception as exc:
            raise TransportError(f"could not send a heartbeat: {type(exc).__name__}") from exc

    # -- serving tasks -----------------------------------------------------------------

    async def serve(
        self, groups: Collection[str], on_task: TaskHandler, *, concurrency: int
    ) -> None:
        """Serve ``groups`` (one BullMQ worker each), ``concurrency`` handlers at once."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._redis()
        self._retire_workers()
        self._on_task = on_task
        # One slot pool across every group: a worker may hold a job waiting
        # for a slot; it hands it back if serving stops first.
        self._slots = asyncio.Semaphore(concurrency)
        generation = self._generation
        options = {
            "concurrency": concurrency,
            "lockDuration": self.lock_ms,
            "stalledInterval": self.lock_ms,
            "drainDelay": _DRAIN_DELAY_S,
        }
        for group in sorted(set(groups)):
            name = self.names.tasks(group)
            process = self._processor(generation, name)
            consumer = _Consumer(
                name,
                process,
                self._connect_url,
                options,
                self._give_back,
                batches=self._batches(),
                finisher=self._finish,
            )
            consumer.worker.on("failed", self._bridge_failure)
            self._workers.append(consumer)

    async def stop_serving(self) -> None:
        """Stop taking tasks; jobs taken but not started are handed back at once.
        Running handlers are left to finish (their workers close after them)."""
        self._retire_workers()
        self._on_task = None
        # Let the retired workers' processors see the new generation and
        # hand back what they hold.
        await asyncio.sleep(0)

    def _retire_workers(self) -> None:
        self._generation += 1
        workers, self._workers = self._workers, []
        for worker in workers:
            closing = asyncio.create_task(worker.close())
            self._closing_workers.add(closing)
            closing.add_done_callback(self._closing_workers.discard)

    def _processor(self, generation: int, queue: str) -> _Processor:
        async def process(job: _Job, token: str) -> None:
            if generation != self._generation:
                await self._hand_back(queue, job, token, 0)
            try:
                task = StepTask.from_wire(job.data)
            except (WireError, ValueError, TypeError) as exc:
                _log.error("dropping a malformed task (job %s): %s", job.id, exc)
                return  # completed: removed, never delivered again
            slots = self._slots
            await slots.acquire()
            try:
                handler = self._on_task
                if generation != self._generation or handler is None:
                    await self._hand_back(queue, job, token, 0)
                # The handler runs in this job's own task (no task of its
                # own): close() cancels it through _handlers.
                current = asyncio.current_task()
                assert current is not None
                self._handlers.add(current)
                try:
                    await handler(task)
                except asyncio.CancelledError:
                    # close(): this process stops; the task goes to another one.
                    await self._hand_back(queue, job, token, 0)
                except TransportError as exc:
                    # Redis went away under the result: one line, not a traceback each.
                    _log.warning("task %s: %s; delivering it again", task.step_id, exc)
                    await self._hand_back(queue, job, token, self.redeliver_delay_ms)
                except Exception:
                    _log.exception(
                        "task %s failed in its handler wrapper; delivering it again",
                        task.step_id,
                    )
                    await self._hand_back(queue, job, token, self.redeliver_delay_ms)
                finally:
                    self._handlers.discard(current)
            finally:
                slots.release()

        return process

    async def _hand_back(self, queue: str, job: _Job, token: str, delay_ms: int) -> NoReturn:
        """Put a held job back (visible again after ``delay_ms``) and stop processing it."""
        await self._give_back(queue, job, token, delay_ms)
        raise _delayed()

    async def _give_back(self, queue: str, job: _Job, token: str, delay_ms: int = 0) -> None:
        """Move a job we hold back to the queue, visible again after ``delay_ms``."""
        # Through the transport's own connection, not the job's worker: a
        # worker that is closing may hold a job after its connection closed,
        # and that job must go back now, not after its lock expires.
        try:
            now = _now_ms()
            moving = self._queue(queue).backend.moveToDelayed(
                job.id, now, delay_ms, token, {"skipAttempt": True}
            )
            await asyncio.shield(moving)
        except Exception as exc:  # it comes back after its lock expires
            _log.warning("could not hand job %s of %s back: %s", job.id, queue, exc)

    def _bridge_failure(self, job: Any = None, error: Any = None, *_: Any) -> None:
        """Answer a task job that reached BullMQ's terminal ``failed`` state.

        The handler wrapper never lets a step's failure escape, so a failed
        job is an infrastructure failure: the job stalled more often than
        allowed (its holders died; bullmq 3 fails it at the next pickup) or
        something outside the handler threw. Nothing else would ever answer
        it, so, as the upstream workers do, send a retryable failure: the
        engine's retry policy decides what happens next.
        """
        data = getattr(job, "data", None)
        if not isinstance(data, dict) or isinstance(data.get("history"), list):
            return  # not a step task (a workflow turn is re-driven by its engine)
        run_id, seq, step_id = data.get("runId"), data.get("seq"), data.get("stepId")
        if not isinstance(run_id, str) or not isinstance(step_id, str):
            return
        if isinstance(seq, bool) or not isinstance(seq, int | float):
            return
        reason = getattr(job, "failedReason", None) or str(error or "") or "unknown"
        _log.warning("task %s failed in BullMQ (%s); answering it as failed", step_id, reason)
        result = StepResult(
            run_id,
            int(seq),
            ok=False,
            error={"message": f"remote step worker failed: {reason}", "retryable": True},
        )
        sending = asyncio.ensure_future(self._send_bridged(result))
        self._bridging.add(sending)
        sending.add_done_callback(self._bridging.discard)

    async def _send_bridged(self, result: StepResult) -> None:
        try:
            await self.send_result(result)
        except Exception as exc:
            _log.warning("could not answer the failed task %s: %s", result.step_id, exc)

    # -- results -----------------------------------------------------------------------

    async def consume_results(
        self, on_results: ResultHandler, on_heartbeat: HeartbeatHandler
    ) -> None:
        """Hear beats; take results (competing with other instances) in batches of up to 256."""
        self._redis()
        if self._on_results is not None:
            raise RuntimeError("this transport already has a results consumer")
        self._on_results, self._on_heartbeat = on_results, on_heartbeat
        await self._subscribe(self.names.heartbeat, self._heard_beat)
        await self._replay_latest_beats()
        name = self.names.results
        self._results_worker = _Consumer(
            name,
            self._take_one_result,
            self._connect_url,
            {
                "concurrency": _RESULT_BATCH,
                "lockDuration": self.lock_ms,
                "stalledInterval": self.lock_ms,
                "drainDelay": _DRAIN_DELAY_S,
            },
            self._give_back,
            batch=self._take_results,
            batches=self._batches(),
        )

    async def _replay_latest_beats(self) -> None:
        """Hear the latest beat of every step still beating (sent before we listened)."""
        client = self._redis()
        try:
            pattern = self.names.step_beat("*")
            keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
            for start in range(0, len(keys), 500):
                for body in await client.mget(keys[start : start + 500]):
                    if body is not None:
                        await self._heard_beat(json.loads(body))
        except Exception as exc:
            _log.warning("could not read the latest step beats: %s", exc)

    async def _heard_beat(self, body: Any) -> None:
        handler = self._on_heartbeat
        if handler is None or not isinstance(body, dict) or "stepId" not in body:
            return  # a run-scoped beat (remote turns) is not a step's
        try:
            beat = Heartbeat.from_wire(body)
        except WireError as exc:
            _log.error("dropping a malformed heartbeat: %s", exc)
            return
        step_id = beat.step_id
        taken = (r.step_id == step_id for results, _ in self._batch for r in results)
        if step_id in self._settled or any(taken):
            return  # its result is here already: the beat says nothing new
        await handler(beat)

    async def _take_one_result(self, job: _Job, token: str) -> None:
        # Results are taken a fetch at a time (_take_results); a job that
        # reaches this path anyway is one of a batch of one.
        if not (await self._take_results([job]))[0]:
            raise _delayed()

    async def _take_results(self, jobs: list[Any]) -> list[bool]:
        """Settle a fetch's results in one batch (with any others taken
        meanwhile); for each job, whether to complete it (False: handed back)."""
        queue = self.names.results
        if self._closing:
            # Fetched while closing: another instance settles them now.
            for job in jobs:
                await self._give_back(queue, job, job.token, 0)
            return [False] * len(jobs)
        results, parsed = [], []
        for job in jobs:
            try:
                results.append(StepResult.from_wire(job.data))
                parsed.append(job)
            except (WireError, ValueError, TypeError) as exc:
                # completed: removed, never delivered again
                _log.error("dropping a malformed result (job %s): %s", job.id, exc)
        if not results:
            return [True] * len(jobs)
        if await self._settle_here(results):
            return [True] * len(jobs)
        for job in parsed:
            await self._give_back(queue, job, job.token, self.redeliver_delay_ms)
        again = {id(job) for job in parsed}
        return [id(job) not in again for job in jobs]

    async def _settle_here(self, results: list[StepResult]) -> bool:
        """Settle ``results`` with the others taken meanwhile; whether they were."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._batch.append((results, done))
        if self._flush is None or self._flush.done():
            self._flush = asyncio.create_task(self._flush_soon())
        return await done

    async def _flush_soon(self) -> None:
        while self._batch:
            # What arrived while the previous batch was settled is here
            # already, and one turn of the loop lets the fetches under way
            # join: a burst is settled in a few store writes without holding
            # a lone result back.
            await asyncio.sleep(0)
            groups: list[tuple[list[StepResult], asyncio.Future[bool]]] = []
            size = 0
            while self._batch and (not groups or size + len(self._batch[0][0]) <= _RESULT_BATCH):
                group = self._batch.pop(0)
                groups.append(group)
                size += len(group[0])
            batch = [result for results, _ in groups for result in results]
            ok = True
            handler = self._on_results
            try:
                if handler is not None:
                    await handler(batch)
            except Exception:
                _log.exception(
                    "a batch of %d step results could not be settled; delivering it again",
                    len(batch),
                )
                ok = False
            if ok:
                for result in batch:
                    self._settled[result.step_id] = None
            for _, done in groups:
                if not done.done():
                    done.set_result(ok)
            while len(self._settled) > _SETTLED_MEMORY:
                self._settled.popitem(last=False)

    # -- remote workflow turns (TurnCarrier; see _turns) ----------------------------------

    async def send_turn(self, token: str, task: dict[str, Any], priority: int | None) -> None:
        """Queue a turn on ``{P}-tasks-{token}`` (job name ``workflow``)."""
        self._redis()
        await _turns.send_turn(self, token, task, priority)

    async def consume_turns(
        self, on_decision: TurnHandler, on_step_event: TurnHandler, on_run_beat: TurnHandler
    ) -> None:
        """Take decisions and step events (competing); hear run-scoped beats."""
        self._redis()
        if self._turn_consumers:
            raise RuntimeError("this transport already has a turns consumer")
        await self._subscribe(self.names.heartbeat, on_run_beat)
        self._turn_consumers = _turns.consumers(self, on_decision, on_step_event)

    async def live_workers(self) -> list[dict[str, Any]]:
        """The workers whose liveness keys exist now."""
        return await _turns.live_workers(self)

    async def queue_depths(self, tokens: Collection[str]) -> dict[str, int]:
        """Tasks waiting in each routing token's queue."""
        return await _turns.queue_depths(self, tokens)
