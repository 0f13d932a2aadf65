"""Remote workflow turns on Redis: what :class:`RedisTransport` does as a
:class:`~durably.transports.base.TurnCarrier`.

- Turns go to the BullMQ queue ``{P}-tasks-{token}`` (job name ``workflow``,
  removed on completion or failure: a lost turn is re-driven by its engine,
  never bridged), where ``token`` is the workflow's routing token.
- Decisions and step events come back on ``{P}-decisions`` and
  ``{P}-step-events``, competing consumers: each is taken by one instance.
- Run-scoped beats share ``{P}-heartbeat`` with step beats; every instance
  hears them (a second subscription, so the step-beat path is untouched).
- Workers announce themselves with ``{P}-worker-heartbeat:{token}:{iid}``
  (liveness: the key exists) and ``{P}-worker-descriptor:{token}:{iid}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from typing import Any, NoReturn, Protocol

import redis.asyncio as aioredis

from ..base import TransportError, TurnHandler
from ._bullmq import _Consumer, _Job, _Queue
from ._names import RedisNames, bullmq_priority


class RedisTransport(Protocol):
    """What of :class:`~._transport.RedisTransport` the turn channel uses."""

    names: RedisNames
    lock_ms: int
    redeliver_delay_ms: int
    _connect_url: str

    def _redis(self) -> aioredis.Redis: ...

    def _batches(self) -> aioredis.Redis: ...

    def _queue(self, name: str) -> _Queue: ...

    async def _give_back(self, queue: str, job: _Job, token: str, delay_ms: int = 0) -> None: ...

    async def _hand_back(self, queue: str, job: _Job, token: str, delay_ms: int) -> NoReturn: ...


_log = logging.getLogger("durably.transport")

_TURN_JOB_OPTS: dict[str, Any] = {"removeOnComplete": True, "removeOnFail": True}
_CONSUMER_CONCURRENCY = 32
_DRAIN_DELAY_S = 1
_WAITING_TYPES = ("wait", "paused", "prioritized", "delayed")


def decisions_queue(transport: RedisTransport) -> str:
    """``{P}-decisions``."""
    return f"{transport.names.base}-decisions"


def step_events_queue(transport: RedisTransport) -> str:
    """``{P}-step-events``."""
    return f"{transport.names.base}-step-events"


async def send_turn(
    transport: RedisTransport, token: str, task: dict[str, Any], priority: int | None
) -> None:
    """Queue one turn for the worker serving ``token``."""
    opts = dict(_TURN_JOB_OPTS)
    if priority is not None:
        opts["priority"] = bullmq_priority(priority)
    job = {"name": "workflow", "data": task, "opts": opts}
    try:
        await transport._queue(transport.names.tasks(token)).addBulk([job])
    except Exception as exc:
        raise TransportError(f"could not send a turn: {type(exc).__name__}: {exc}") from exc


def consumers(
    transport: RedisTransport,
    on_decision: TurnHandler,
    on_step_event: TurnHandler,
) -> list[_Consumer]:
    """The BullMQ consumers of decisions and step events."""
    options = {
        "concurrency": _CONSUMER_CONCURRENCY,
        "lockDuration": transport.lock_ms,
        "stalledInterval": transport.lock_ms,
        "drainDelay": _DRAIN_DELAY_S,
    }
    made = []
    for queue, handler in (
        (decisions_queue(transport), on_decision),
        (step_events_queue(transport), on_step_event),
    ):
        made.append(
            _Consumer(
                queue,
                _processor(transport, queue, handler),
                transport._connect_url,
                options,
                transport._give_back,
                batches=transport._batches(),
            )
        )
    return made


def _processor(transport: RedisTransport, queue: str, handler: TurnHandler) -> Any:
    async def process(job: _Job, token: str) -> None:
        try:
            await handler(job.data)
        except Exception:
            # The handler logs and drops what is malformed; what raises here
            # is the store or the broker failing: deliver it again later.
            _log.exception("a message on %s could not be handled; delivering it again", queue)
            await transport._hand_back(queue, job, token, transport.redeliver_delay_ms)

    return process


async def live_workers(transport: RedisTransport) -> list[dict[str, Any]]:
    """Every live worker key, with its beat and descriptor (see TurnCarrier)."""
    client = transport._redis()
    base = transport.names.base
    beat_prefix = f"{base}-worker-heartbeat:"
    keys = [key async for key in client.scan_iter(match=f"{beat_prefix}*", count=500)]
    if not keys:
        return []
    found: list[dict[str, Any]] = []
    for start in range(0, len(keys), 500):
        page = keys[start : start + 500]
        names = [key[len(beat_prefix) :].partition(":") for key in page]
        descriptor_keys = [f"{base}-worker-descriptor:{token}:{iid}" for token, _, iid in names]
        beats = await client.mget(page)
        descriptors = await client.mget(descriptor_keys)
        for (token, _, iid), beat, descriptor in zip(names, beats, descriptors, strict=True):
            if beat is None:
                continue  # expired between the scan and the read
            found.append(
                {
                    "token": token,
                    "instanceId": iid,
                    "beat": _json(beat),
                    "descriptor": _json(descriptor),
                }
            )
    return found


async def queue_depths(transport: RedisTransport, tokens: Collection[str]) -> dict[str, int]:
    """Tasks waiting in each token's queue, and in every other task queue of
    this prefix that exists (found by its BullMQ job counter)."""
    head = f"bull:{transport.names.tasks('')}"
    found = {
        key[len(head) : -len(":id")]
        async for key in transport._redis().scan_iter(match=f"{head}*:id", count=500)
    }
    depths: dict[str, int] = {}
    for token in sorted(set(tokens) | found):
        queue: Any = transport._queue(transport.names.tasks(token))
        depths[token] = int(await queue.getJobCountByTypes(*_WAITING_TYPES))
    return depths


def _json(text: str | bytes | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        try:
            return float(text)  # a legacy worker's bare timestamp
        except ValueError:
            return None
