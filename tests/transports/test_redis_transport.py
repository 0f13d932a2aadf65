"""The ``redis://`` transport's own rules: URLs, names, priorities and the jobs it
writes (the upstream wire as BullMQ stores it). The shared contract is in
``test_transport_contract.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from durably._urls import redact_url
from durably.stores import SqliteStore
from durably.transports import open_transport
from durably.transports.redis import RedisNames, RedisTransport, bullmq_priority
from durably.wire import Heartbeat, StepResult, StepTask

from .conftest import REDIS_TEST_URL, wait_until


def test_names_fold_the_namespace_into_the_prefix_as_upstream() -> None:
    assert RedisNames().tasks("payments-charge") == "durable-tasks-payments-charge"
    assert RedisNames().results == "durable-results"
    assert RedisNames(namespace="default").heartbeat == "durable-heartbeat"
    dev = RedisNames("durable", "dev")
    assert dev.tasks("py-echo@acme") == "durable-dev-tasks-py-echo@acme"
    assert dev.results == "durable-dev-results"
    assert dev.control == "durable-dev-control"


def test_priorities_are_inverted_and_clamped() -> None:
    assert bullmq_priority(5) == 1_048_571  # the upstream's live example
    assert bullmq_priority(None) == bullmq_priority(0) == 1_048_576
    assert bullmq_priority(-2) == 1_048_578
    assert bullmq_priority(10**9) == 1
    assert bullmq_priority(-(10**9)) == 2_097_151


def test_urls_are_parsed_and_credentials_never_shown() -> None:
    transport = RedisTransport.from_url(
        "redis://user:s3cret@127.0.0.1:6380/3?prefix=acme&namespace=dev"
    )
    assert transport.url == "redis://user:***@127.0.0.1:6380/3"
    assert transport.names == RedisNames("acme", "dev")
    assert "prefix" not in transport._connect_url  # ours, not for redis-py
    assert redact_url("rediss://:pw@host:6379/0") == "rediss://:***@host:6379/0"
    with pytest.raises(ValueError, match="database must be a number") as caught:
        RedisTransport.from_url("redis://u:s3cret@host/zero")
    assert "s3cret" not in str(caught.value)
    store = SqliteStore("sqlite:///:memory:")
    chosen = open_transport("rediss://u:pw@example.invalid:6390/1", store)
    assert isinstance(chosen, RedisTransport)
    assert chosen.url == "rediss://u:***@example.invalid:6390/1"


async def test_redis_down_is_one_clear_error_without_credentials() -> None:
    transport = RedisTransport("redis://user:s3cret@127.0.0.1:1/0")
    with pytest.raises(Exception, match=r"cannot reach Redis at redis://user:\*\*\*@127") as e:
        await transport.open()
    assert "s3cret" not in str(e.value)


async def test_jobs_are_the_upstream_wire_as_bullmq_stores_it(prefix: str) -> None:
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    await transport.open()
    client = aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    try:
        task = StepTask("run-abc", 3, "payments:charge", "payments-charge", {"n": 1}, priority=5)
        await transport.dispatch([task])
        await transport.send_result(StepResult("run-abc", 3, ok=True, output=None))
        queue = f"bull:{prefix}-tasks-payments-charge"
        ids = await client.zrange(f"{queue}:prioritized", 0, -1)
        assert len(ids) == 1
        job = await client.hgetall(f"{queue}:{ids[0]}")
        assert job["name"] == "task"
        assert json.loads(job["data"]) == task.to_wire()
        assert json.loads(job["data"])["stepId"] == "run-abc:3"
        assert json.loads(job["opts"])["removeOnFail"] == {"age": 86_400}
        assert int(job["priority"]) == 1_048_571
        results = f"bull:{prefix}-results"
        [result_id] = await client.lrange(f"{results}:wait", 0, -1)
        stored = await client.hgetall(f"{results}:{result_id}")
        assert stored["name"] == "result"
        assert json.loads(stored["data"]) == {
            "runId": "run-abc",
            "seq": 3,
            "stepId": "run-abc:3",
            "status": "completed",
            "output": None,
        }
    finally:
        await client.aclose()
        await transport.close()


async def test_beats_reach_every_instance_and_run_scoped_beats_are_ignored(prefix: str) -> None:
    instances = [RedisTransport(REDIS_TEST_URL, prefix=prefix) for _ in range(3)]
    heard: list[list[Heartbeat]] = [[] for _ in instances]
    try:
        for transport, beats in zip(instances, heard, strict=True):
            await transport.open()

            async def on_results(batch: list[StepResult]) -> None:
                return None

            async def on_beat(beat: Heartbeat, beats: list[Heartbeat] = beats) -> None:
                beats.append(beat)

            await transport.consume_results(on_results, on_beat)
        client = aioredis.Redis.from_url(REDIS_TEST_URL)
        try:
            # what durable-worker publishes while a turn runs: no stepId
            run_beat = {"runId": "wrun-1", "seq": 0, "group": "py-workflows"}
            await client.publish(f"{prefix}-heartbeat", json.dumps(run_beat))
        finally:
            await client.aclose()
        await instances[0].send_heartbeat(Heartbeat("r1", 2, "g", at=1_700_000_000_000))
        await wait_until(lambda: all(len(beats) == 1 for beats in heard), what="every instance")
        assert all(beats[0].step_id == "r1:2" for beats in heard)
    finally:
        for transport in instances:
            await transport.close()


async def test_each_result_is_settled_by_exactly_one_instance(prefix: str) -> None:
    instances = [RedisTransport(REDIS_TEST_URL, prefix=prefix) for _ in range(3)]
    taken: list[str] = []
    try:
        for transport in instances:
            await transport.open()

            async def on_results(batch: list[StepResult]) -> None:
                taken.extend(result.step_id for result in batch)

            async def on_beat(beat: Heartbeat) -> None:
                return None

            await transport.consume_results(on_results, on_beat)
        for i in range(90):
            await instances[i % 3].send_result(StepResult(f"r{i}", 1, ok=True, output=i))
        await wait_until(lambda: len(taken) >= 90, what="90 results")
        await asyncio.sleep(0.3)  # a duplicate would show up by now
        assert sorted(taken) == sorted(f"r{i}:1" for i in range(90))
    finally:
        for transport in instances:
            await transport.close()


async def test_a_task_job_failing_in_bullmq_is_answered_as_a_retryable_failure(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Something outside the handler throws (here: parsing): BullMQ fails the
    # job, and the serving transport answers it instead of leaving it unanswered.
    def broken(data: object) -> StepTask:
        raise RuntimeError("parser exploded")

    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    await transport.open()
    got: list[StepResult] = []

    async def on_results(batch: list[StepResult]) -> None:
        got.extend(batch)

    async def on_beat(beat: Heartbeat) -> None:
        return None

    async def never(task: StepTask) -> None:
        raise AssertionError("the handler must not run")

    try:
        monkeypatch.setattr(StepTask, "from_wire", broken)
        await transport.consume_results(on_results, on_beat)
        await transport.serve(["g"], never, concurrency=1)
        await transport.dispatch([StepTask("r1", 4, "g", "g")])
        await wait_until(lambda: len(got) == 1, what="the bridged failure")
        [result] = got
        assert (result.step_id, result.ok, result.retryable) == ("r1:4", False, True)
        assert result.error == {
            "message": "remote step worker failed: parser exploded",
            "retryable": True,
        }
    finally:
        await transport.close()


def test_a_password_in_the_query_is_not_shown_either() -> None:
    shown = redact_url("redis://h:6379/0?password=s3cret&prefix=p")
    assert shown == "redis://h:6379/0?password=***&prefix=p"


async def test_a_result_this_instance_consumes_is_settled_here_before_its_task_completes(
    prefix: str,
) -> None:
    # The server's result goes straight to this instance's results consumer:
    # no job on the results queue; the task job is still held (active,
    # locked) while the settle runs, and completed after it.
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    await transport.open()
    client = aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    tasks = f"bull:{prefix}-tasks-g"
    held_while_settling: list[int] = []
    got: list[StepResult] = []

    async def on_results(batch: list[StepResult]) -> None:
        held_while_settling.append(await client.llen(f"{tasks}:active"))
        got.extend(batch)

    async def on_beat(beat: Heartbeat) -> None:
        return None

    async def serve(task: StepTask) -> None:
        await transport.send_result(StepResult(task.run_id, task.seq, ok=True, output=task.seq))

    try:
        await transport.consume_results(on_results, on_beat)
        await transport.serve(["g"], serve, concurrency=4)
        await transport.dispatch([StepTask("r1", i, "g", "g") for i in range(1, 4)])
        await wait_until(lambda: len(got) == 3, what="three results")
        assert sorted(r.output for r in got) == [1, 2, 3]
        assert all(n >= 1 for n in held_while_settling)
        for _ in range(200):
            if await client.llen(f"{tasks}:active") == 0:
                break
            await asyncio.sleep(0.01)
        assert await client.llen(f"{tasks}:active") == 0
        assert await client.get(f"bull:{prefix}-results:id") is None  # never queued
    finally:
        await client.aclose()
        await transport.close()


async def test_a_result_that_could_not_be_settled_here_goes_on_the_queue(prefix: str) -> None:
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix, redeliver_delay_ms=50)
    await transport.open()
    calls: list[list[str]] = []

    async def on_results(batch: list[StepResult]) -> None:
        calls.append([r.step_id for r in batch])
        if len(calls) == 1:
            raise RuntimeError("store down (test)")

    async def on_beat(beat: Heartbeat) -> None:
        return None

    try:
        await transport.consume_results(on_results, on_beat)
        await transport.send_result(StepResult("r1", 1, ok=True, output=None))
        # refused here, so queued: taken off the queue and settled again
        await wait_until(lambda: len(calls) == 2, what="the queued result settled")
        assert calls == [["r1:1"], ["r1:1"]]
    finally:
        await transport.close()


async def test_results_and_turns_consumers_share_one_heartbeat_subscription(
    prefix: str,
) -> None:
    # Both hear the heartbeat channel: one subscription, one reader, each
    # handler told (two readers of one subscription fight over its socket,
    # and each fight replaced the subscription, losing beats meanwhile).
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    step_beats: list[Heartbeat] = []
    run_beats: list[Any] = []

    async def on_results(batch: list[StepResult]) -> None:
        return None

    async def on_beat(beat: Heartbeat) -> None:
        step_beats.append(beat)

    async def on_run_beat(body: Any) -> None:
        if "stepId" not in body:
            run_beats.append(body)

    async def ignore(body: Any) -> None:
        return None

    try:
        await transport.open()
        await transport.consume_results(on_results, on_beat)
        await transport.consume_turns(ignore, ignore, on_run_beat)
        await asyncio.sleep(1.5)  # both readers waited (get_message's 1 s) at least once
        client = aioredis.Redis.from_url(REDIS_TEST_URL)
        try:
            run_beat = {"runId": "wrun-1", "seq": 0, "group": "py-workflows"}
            await client.publish(f"{prefix}-heartbeat", json.dumps(run_beat))
        finally:
            await client.aclose()
        await transport.send_heartbeat(Heartbeat("r1", 2, "g", at=1_700_000_000_000))
        await wait_until(lambda: step_beats and run_beats, what="both beats")
        assert [b.step_id for b in step_beats] == ["r1:2"]
        assert [b["runId"] for b in run_beats] == ["wrun-1"]
        assert transport.resubscriptions == 0
    finally:
        await transport.close()
