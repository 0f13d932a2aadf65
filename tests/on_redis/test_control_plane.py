"""The control plane over Redis pub/sub (``{P}-control``): a cancel reaches
the instance running the run (its step handler sees it, its turn stops), an
instance's own notices are not heard back, malformed notices are logged once
and ignored, and a dead subscription is replaced by the watchdog.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import durably
from durably import RunStatus
from durably.testing import eventually
from durably.transports.redis import RedisTransport

from .redis_fixtures import REDIS_URL, OwnRedis, own_redis, redis_prefix, store_url

__all__ = ["own_redis", "redis_prefix", "store_url"]

pytestmark = [pytest.mark.timeout(180)]

WAIT = 60.0


async def opened(url: str, prefix: str) -> tuple[RedisTransport, list[str]]:
    transport = RedisTransport(url, prefix=prefix)
    heard: list[str] = []
    transport.on_cancel(heard.extend)
    await transport.open()
    return transport, heard


async def test_a_cancel_reaches_every_other_instance_once_and_not_its_sender(
    redis_prefix: str,
) -> None:
    a, heard_a = await opened(REDIS_URL, redis_prefix)
    b, heard_b = await opened(REDIS_URL, redis_prefix)
    try:
        await a.publish_cancel(["r1"])
        assert heard_a == ["r1"]  # told at once, in process
        await eventually(lambda: heard_b == ["r1"], what="b hears r1", timeout=WAIT)
        await b.publish_cancel(["r2"])
        # a hears r2 after its own r1 echo would have come (one channel, in order).
        await eventually(lambda: "r2" in heard_a, what="a hears r2", timeout=WAIT)
        assert heard_a == ["r1", "r2"]
        assert heard_b == ["r1", "r2"]
    finally:
        await a.close()
        await b.close()


async def test_malformed_control_notices_are_logged_once_and_ignored(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="durably.transport")
    transport, heard = await opened(REDIS_URL, redis_prefix)
    channel = transport.names.control
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for raw in ["not json", json.dumps([1]), json.dumps({"kind": 3}), '{"kind": "cancel"}']:
            await client.publish(channel, raw)
        await client.publish(channel, json.dumps({"from": "x", "kind": "event", "event": {}}))
        await client.publish(channel, json.dumps({"from": "x", "kind": "cancel", "runId": "ok"}))
        await eventually(lambda: heard == ["ok"], what="the good notice", timeout=WAIT)
        assert transport.malformed == {channel: 4}
        lines = [r for r in caplog.records if "malformed" in r.getMessage()]
        assert len(lines) == 1
    finally:
        await client.aclose()
        await transport.close()


async def test_the_watchdog_replaces_a_killed_subscription(own_redis: OwnRedis) -> None:
    transport, heard = await opened(own_redis.url, "watch")
    client = aioredis.Redis.from_url(own_redis.url)
    try:
        # The server drops every subscriber connection.
        await client.client_kill_filter(_type="pubsub")
        await eventually(
            lambda: transport.resubscriptions >= 1, what="a new subscription", timeout=WAIT
        )
        await client.publish("watch-control", json.dumps({"kind": "cancel", "runId": "a"}))
        await eventually(lambda: heard == ["a"], what="heard after the kill", timeout=WAIT)
        # The server dies and comes back (SIGKILL: nothing kept).
        await client.aclose()
        await own_redis.restart(down_for=1.0)
        client = aioredis.Redis.from_url(own_redis.url)
        await eventually(
            lambda: transport.resubscriptions >= 2, what="subscribed again", timeout=WAIT
        )
        await client.publish("watch-control", json.dumps({"kind": "cancel", "runId": "b"}))
        await eventually(lambda: heard == ["a", "b"], what="heard after the restart", timeout=WAIT)
    finally:
        await client.aclose()
        await transport.close()


async def test_a_cancel_reaches_the_handler_on_the_instance_running_the_run(
    store_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the control channel can tell the handler: the store poll that is
    # the safety net sleeps past the test.
    monkeypatch.setattr("durably.steps._server._CANCEL_POLL_S", 3600.0)
    url = f"{REDIS_URL}?prefix={redis_prefix}"
    producer = durably.Engine(store_url, transport=url, consumers="never", poll_interval=0.05)
    worker = durably.Engine(store_url, transport=url, poll_interval=0.05)
    started = asyncio.Event()
    stopped: list[str] = []

    @worker.step("loop")
    async def loop(data: Any, log: durably.StepLogger) -> str:
        started.set()
        await log.wait_cancelled()
        stopped.append(log.run_id)
        return "stopped early"

    for engine in (producer, worker):

        @engine.workflow("cancellable")
        async def cancellable(ctx: durably.WorkflowContext) -> Any:
            return await ctx.step("loop", None)

    async with producer, worker:
        await worker.start_worker()
        await producer.start("cancellable", run_id="c1")
        await asyncio.wait_for(started.wait(), WAIT)
        await producer.cancel("c1")
        await eventually(lambda: stopped == ["c1"], what="the handler stops", timeout=WAIT)
        result = await worker.wait_for_run("c1", terminal=True, timeout=WAIT)
        assert result.status is RunStatus.CANCELLED


async def test_a_schedule_paused_on_one_instance_stops_firing_on_every_instance(
    tmp_path: Path, redis_prefix: str
) -> None:
    store = f"sqlite:///{tmp_path / 'sched.db'}"
    url = f"{REDIS_URL}?prefix={redis_prefix}"
    web = durably.Engine(store, transport=url, consumers="never", poll_interval=0.05)
    worker = durably.Engine(store, transport=url, poll_interval=0.05)
    for engine in (web, worker):

        @engine.workflow("tick")
        async def tick(ctx: durably.WorkflowContext) -> None:
            return None

    passes = 0
    async with web, worker:
        looks = worker.store.list_due_schedules

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal passes
            passes += 1
            return await looks(*args, **kwargs)

        worker.store.list_due_schedules = counted  # type: ignore[method-assign]
        await worker.start_worker()
        await web.add_schedule("every-second", "tick", every="1s")

        async def fired() -> int:
            runs = await web.list_runs(workflow="tick")
            return len(runs.runs)

        async def fired_at_least(n: int) -> bool:
            return await fired() >= n

        await eventually(lambda: fired_at_least(1), what="the worker fires", timeout=WAIT)
        await web.pause_schedule("every-second")  # on the web process
        before, seen = await fired(), passes
        # Forty passes of the worker's scheduler (2 s at its 50 ms poll): two windows.
        await eventually(lambda: passes >= seen + 40, what="forty passes", timeout=WAIT)
        assert await fired() <= before + 1  # at most a window claimed as the pause landed
        paused_at = await fired()
        seen = passes
        await eventually(lambda: passes >= seen + 40, what="forty more passes", timeout=WAIT)
        assert await fired() == paused_at
        await web.resume_schedule("every-second")
        await eventually(lambda: fired_at_least(paused_at + 1), what="firing again", timeout=WAIT)
