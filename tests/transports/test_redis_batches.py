"""The ``redis://`` transport's batched BullMQ paths on the real Redis: many
jobs taken per script call, finished and added per pipeline, and bullmq's
guarantees kept (each job to one holder, live locks renewed, a dead holder's
jobs brought back)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis
from bullmq import Job, Queue
from redis.exceptions import NoScriptError

from durably.transports.redis import RedisTransport
from durably.transports.redis import _transport as transport_module
from durably.transports.redis._batched import (
    Call,
    Script,
    add_job_call,
    move_to_active_args,
    parse_taken,
    run_scripts,
    take_script,
)
from durably.transports.redis._bullmq import _BatchWorker
from durably.transports.redis._transport import _Done
from durably.wire import Heartbeat, StepResult, StepTask

from .conftest import REDIS_TEST_URL, wait_until


class Taker:
    """Takes jobs of one queue the way the transport's workers do."""

    def __init__(self, queue: Any, client: aioredis.Redis) -> None:
        self.keys: dict[str, str] = queue.keys
        self.script = take_script(Script.of(queue.scripts.commands["moveToActive"]))
        self.client = client

    async def take(
        self, n: int, token: str = "t", lock_ms: int = 30_000
    ) -> tuple[list[tuple[dict[str, str], str]], int]:
        keys, args = move_to_active_args(self.keys, token, lock_ms, n)
        (reply,) = await run_scripts(self.client, [Call(self.script, keys, args)])
        return parse_taken(reply)


@pytest.mark.parametrize(
    "opts",
    [
        {"removeOnComplete": True, "removeOnFail": {"age": 86_400}, "priority": 1_048_571},
        {"removeOnComplete": True, "removeOnFail": True},
        {"removeOnComplete": True, "removeOnFail": True, "priority": 7, "lifo": False},
        # a run queue's start: its own job id
        {"removeOnComplete": True, "removeOnFail": True, "priority": 5, "jobId": "start-ab12"},
        {"removeOnComplete": True, "removeOnFail": True, "jobId": "start-cd34"},
    ],
)
async def test_an_added_job_is_what_bullmq_would_add_byte_for_byte(
    prefix: str, client: aioredis.Redis, opts: dict[str, Any]
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    data = {"runId": "r1", "seq": 2, "input": {"é": [1, 2.5, None]}}
    ours = add_job_call(queue.scripts, "task", data, opts, timestamp=1_700_000_000_123)
    job = Job(queue, "task", data, {**opts, "timestamp": 1_700_000_000_123})
    theirs = queue.scripts.addJobArgs(job)
    theirs.append(job.timestamp)
    # the timestamp option bullmq needs here is not part of what it packs
    theirs[2] = queue.scripts.addJobArgs(Job(queue, "task", data, opts))[2]
    name = "addPrioritizedJob" if opts.get("priority") else "addStandardJob"
    assert ours.script.sha == queue.scripts.commands[name].sha
    assert list(ours.args) == theirs
    [job_id] = await run_scripts(client, [ours])
    stored = await client.hgetall(f"{queue.keys['']}{job_id}")
    assert json.loads(stored["data"]) == data
    assert stored["name"] == "task"


async def test_a_take_of_one_locks_it_and_consumes_the_marker_once_dry(
    prefix: str, client: aioredis.Redis
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    await queue.add("task", {"n": 1}, {"removeOnComplete": True})
    taker = Taker(queue, client)
    marker = queue.keys["marker"]
    assert await client.zscore(marker, "0") is not None
    jobs, delay_until = await taker.take(5, token="w:1")
    assert [json.loads(raw["data"]) for raw, _ in jobs] == [{"n": 1}]
    [(_, job_id)] = jobs
    assert await client.get(f"{queue.keys['']}{job_id}:lock") == "w:1:1"
    assert await client.lrange(queue.keys["active"], 0, -1) == [job_id]
    # ran dry with nothing waiting: the next wait blocks instead of waking at once
    assert await client.zscore(marker, "0") is None
    assert delay_until == 0
    assert await taker.take(5) == ([], 0)


async def test_a_take_of_many_stops_at_its_count_or_when_dry(
    prefix: str, client: aioredis.Redis
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    await queue.addBulk(
        [{"name": "task", "data": {"n": i}, "opts": {"priority": 1_048_576}} for i in range(10)]
    )
    taker = Taker(queue, client)
    first, _ = await taker.take(4, token="a")
    assert [json.loads(raw["data"])["n"] for raw, _ in first] == [0, 1, 2, 3]
    locks = [await client.get(f"{queue.keys['']}{job_id}:lock") for _, job_id in first]
    assert locks == ["a:1", "a:2", "a:3", "a:4"]  # a token per job
    assert await client.zscore(queue.keys["marker"], "0") is not None  # not dry: jobs wait
    rest, _ = await taker.take(100, token="b")
    assert [json.loads(raw["data"])["n"] for raw, _ in rest] == [4, 5, 6, 7, 8, 9]
    assert await client.zscore(queue.keys["marker"], "0") is None
    assert await client.llen(queue.keys["active"]) == 10


async def test_a_dry_take_keeps_a_delayed_jobs_marker_and_says_when_it_is_due(
    prefix: str, client: aioredis.Redis
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    await queue.add("task", {"n": 1}, {"delay": 60_000})
    taker = Taker(queue, client)
    jobs, delay_until = await taker.take(3)
    assert jobs == []
    assert delay_until > 0
    assert await client.zscore(queue.keys["marker"], "1") is not None


async def test_racing_takes_share_the_jobs_without_overlap(prefix: str) -> None:
    clients = [aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True) for _ in range(3)]
    try:
        queue = Queue(f"{prefix}-q", {"connection": clients[0]})
        await queue.addBulk([{"name": "task", "data": {"n": i}} for i in range(120)])
        takers = [Taker(queue, c) for c in clients]
        taken: list[str] = []

        async def drain(taker: Taker, token: str) -> None:
            while True:
                jobs, _ = await taker.take(7, token=token)
                if not jobs:
                    return
                taken.extend(job_id for _, job_id in jobs)

        await asyncio.gather(*(drain(t, f"w{i}") for i, t in enumerate(takers)))
        assert len(taken) == 120
        assert len(set(taken)) == 120
    finally:
        for c in clients:
            await c.aclose()


async def test_a_script_redis_does_not_hold_is_loaded_and_run_once(
    client: aioredis.Redis,
) -> None:
    # A script never loaded (as after a restart or SCRIPT FLUSH): NOSCRIPT,
    # then loaded and run, each call exactly once.
    key = f"durably-test-{uuid.uuid4().hex[:12]}"
    text = f"-- {key}\nreturn redis.call('INCR', KEYS[1])"
    script = Script(text, hashlib.sha1(text.encode()).hexdigest())
    try:
        calls = [Call(script, [key], []) for _ in range(3)]
        assert await run_scripts(client, calls) == [1, 2, 3]
        assert await client.get(key) == "3"
        # a script whose text does not match its SHA: loaded once, retried
        # once, and its NOSCRIPT returned rather than looping
        wrong = Script("return 1", "0" * 40)
        [reply] = await run_scripts(client, [Call(wrong, [], [])], transaction=True)
        assert isinstance(reply, NoScriptError)
    finally:
        await client.delete(key)


async def _results_consumer(transport: RedisTransport, got: list[StepResult]) -> None:
    async def on_results(batch: list[StepResult]) -> None:
        got.extend(batch)

    async def on_beat(beat: Heartbeat) -> None:
        return None

    await transport.consume_results(on_results, on_beat)


@pytest.mark.parametrize("count", [1, 150])
async def test_two_servers_racing_handle_each_task_once_and_leave_no_job(
    prefix: str, client: aioredis.Redis, count: int
) -> None:
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    servers = [RedisTransport(REDIS_TEST_URL, prefix=prefix) for _ in range(2)]
    handled: Counter[str] = Counter()
    got: list[StepResult] = []
    try:
        await engine.open()
        await _results_consumer(engine, got)
        for server in servers:
            await server.open()

            async def handle(task: StepTask, server: RedisTransport = server) -> None:
                handled[task.step_id] += 1
                await asyncio.sleep(0)  # others run meanwhile: batches overlap
                await server.send_result(
                    StepResult(task.run_id, task.seq, ok=True, output=task.input)
                )

            await server.serve(["g"], handle, concurrency=40)
        # many dispatch calls at once: they share the add pipelines
        await asyncio.gather(
            *(engine.dispatch([StepTask(f"r{i}", 1, "g", "g", i)]) for i in range(count))
        )
        await wait_until(lambda: len(got) >= count, timeout=20, what=f"{count} results")
        await asyncio.sleep(0.2)  # a duplicate would show up by now
        assert sorted(r.step_id for r in got) == sorted(f"r{i}:1" for i in range(count))
        assert sorted(r.output for r in got) == list(range(count))
        assert set(handled.values()) == {1}
        assert len(handled) == count
        tasks, results = f"bull:{prefix}-tasks-g", f"bull:{prefix}-results"

        async def finished() -> bool:
            return (
                await client.llen(f"{tasks}:active") == 0
                and await client.llen(f"{results}:active") == 0
            )

        for _ in range(200):
            if await finished():
                break
            await asyncio.sleep(0.01)
        # every job completed and removed (removeOnComplete): no hash left
        left = [k async for k in client.scan_iter(match=f"{tasks}:[0-9]*")]
        left += [k async for k in client.scan_iter(match=f"{results}:[0-9]*")]
        assert left == []
    finally:
        for transport in (*servers, engine):
            await transport.close()


async def test_a_dead_holders_tasks_come_back_and_a_live_holder_keeps_its_own(
    prefix: str, client: aioredis.Redis
) -> None:
    # Short locks: the stalled-job check runs every lock_ms.
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix, lock_ms=400)
    server = RedisTransport(REDIS_TEST_URL, prefix=prefix, lock_ms=400)
    handled: Counter[str] = Counter()
    got: list[StepResult] = []
    try:
        await engine.open()
        await _results_consumer(engine, got)
        await engine.dispatch([StepTask(f"dead{i}", 1, "g", "g") for i in range(5)])
        # A holder that takes them and dies (never finishes, never renews).
        queue = Queue(f"{prefix}-tasks-g", {"connection": client})
        dead, _ = await Taker(queue, client).take(10, token="dead", lock_ms=400)
        assert len(dead) == 5
        await server.open()

        async def handle(task: StepTask) -> None:
            handled[task.step_id] += 1
            if task.run_id.startswith("slow"):
                await asyncio.sleep(1.5)  # several lock lengths: renewed, never stalled
            await server.send_result(StepResult(task.run_id, task.seq, ok=True, output=None))

        await server.serve(["g"], handle, concurrency=10)
        await engine.dispatch([StepTask(f"slow{i}", 1, "g", "g") for i in range(3)])
        await wait_until(lambda: len(got) >= 8, timeout=20, what="8 results")
        await asyncio.sleep(0.5)
        assert sorted(r.step_id for r in got) == sorted(
            [f"dead{i}:1" for i in range(5)] + [f"slow{i}:1" for i in range(3)]
        )
        assert set(handled.values()) == {1}
    finally:
        await server.close()
        await engine.close()


async def test_a_task_stalled_too_often_is_answered_as_failed_not_run(
    prefix: str, client: aioredis.Redis
) -> None:
    # Two holders died with it: BullMQ's stalled check marks it failed (at the
    # next pickup, bullmq 3), and the server answers it instead of running it.
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    server = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    got: list[StepResult] = []
    try:
        await engine.open()
        await _results_consumer(engine, got)
        await engine.dispatch([StepTask("r1", 1, "g", "g")])
        queue = Queue(f"{prefix}-tasks-g", {"connection": client})
        taker = Taker(queue, client)

        async def stall_check() -> list[str]:
            await client.delete(queue.keys["stalled-check"])  # not rate-limited here
            return list(await queue.scripts.moveStalledJobsToWait(1, 30_000))

        for holder in ("dead1", "dead2"):
            [(_, job_id)], _ = await taker.take(1, token=holder, lock_ms=50)
            assert await stall_check() == []  # marks it as possibly stalled
            lock = f"{queue.keys['']}{job_id}:lock"
            for _ in range(500):
                if not await client.exists(lock):
                    break
                await asyncio.sleep(0.01)
            assert await stall_check() == [job_id]  # its lock ran out: back to wait
        assert await client.hget(f"{queue.keys['']}{job_id}", "defa")
        await server.open()

        async def never(task: StepTask) -> None:
            raise AssertionError("a task stalled too often must not run")

        await server.serve(["g"], never, concurrency=4)
        await wait_until(lambda: len(got) == 1, timeout=10, what="the bridged failure")
        [result] = got
        assert (result.step_id, result.ok, result.retryable) == ("r1:1", False, True)
        assert "stalled more than allowable limit" in str(result.error)
    finally:
        await server.close()
        await engine.close()


async def _noop(*_: Any) -> None:
    return None


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"stc": "2", "atm": "1", "ats": "3"},
        {"defa": "job stalled more than allowable limit", "progress": "42"},
        {"returnvalue": '"x"', "finishedOn": "1700000000999"},  # bullmq's own path
        {"parentKey": "bull:p:1", "parent": '{"id":"1","queueKey":"bull:p"}'},
    ],
)
async def test_a_taken_job_is_the_job_bullmq_would_build(
    prefix: str, client: aioredis.Redis, extra: dict[str, str]
) -> None:
    # The worker builds a taken job from a template per name and options
    # instead of bullmq's Job.fromJSON: every field must be what fromJSON
    # gives, for a job of ours and for one a bullmq producer added with
    # options we never use, each job with a data, opts and stacktrace of its own.
    queue = Queue(f"{prefix}-q", {"connection": client})
    ours = {"removeOnComplete": True, "removeOnFail": {"age": 86_400}, "priority": 9}
    await run_scripts(client, [add_job_call(queue.scripts, "task", {"n": 1}, ours)])
    theirs = {"attempts": 3, "backoff": {"type": "fixed", "delay": 10}, "lifo": True}
    await queue.add("other", {"n": [2, None]}, theirs)
    # jobs of ids of their own (runs' starts) share a template without their
    # id; one whose id the options encode otherwise ("/" as "\/") has its own
    for own in ("start-a", "start-b", "start/c"):
        job = add_job_call(queue.scripts, "run", {"n": own}, {**ours, "jobId": own})
        await run_scripts(client, [job])
    taken, _ = await Taker(queue, client).take(10)
    assert len(taken) == 5
    worker = _BatchWorker(
        f"{prefix}-q", _noop, {"connection": REDIS_TEST_URL, "autorun": False}, _noop
    )
    try:
        for raw, job_id in taken + taken:  # the second time from the template
            raw = {**raw, **extra}
            built, expected = worker._job(raw, job_id), Job.fromJSON(worker, raw, job_id)
            assert type(built) is Job
            assert vars(built) == vars(expected)
            again = worker._job(raw, job_id)
            assert again.opts is not built.opts and again.stacktrace is not built.stacktrace
            assert again.data is not built.data
        # the two runs' starts share one template (their ids not in it), the
        # third has one of its own; a hash bullmq builds itself takes none
        runs = [opts for name, opts in worker._templates if name == "run"]
        assert len(runs) == (0 if "returnvalue" in extra or "parent" in extra else 2)
        assert not any('"start-' in opts for opts in runs)
    finally:
        await worker.close()


# -- tasks taken in the transaction adding them ----------------------------------------------


async def _serving(transport: RedisTransport) -> list[Any]:
    """The BullMQ workers of a serving transport, once each waits for jobs
    on the dry queue: a worker whose first fetch is still out has no room to
    lend an add's take (the tests counting those took none, now and then)."""
    consumers = list(transport._workers)
    await wait_until(
        lambda: all(c.worker.running and c.worker.waiting is not None for c in consumers),
        what="workers waiting for jobs",
    )
    return [c.worker for c in consumers]


async def test_tasks_for_a_group_served_here_are_taken_as_they_are_added(
    prefix: str, client: aioredis.Redis
) -> None:
    # The worker takes them in the add's own transaction: each locked by a
    # token of its own, the queue's marker consumed (no worker wakes for
    # them), and the worker's own fetches take none.
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    release = asyncio.Event()
    started: list[str] = []

    async def handle(task: StepTask) -> None:
        started.append(task.step_id)
        await release.wait()

    try:
        await transport.open()
        await transport.serve(["g"], handle, concurrency=8)
        [worker] = await _serving(transport)
        fetched: list[int] = []
        own_fetch = worker._next_jobs

        async def counted(batch: int, room: int) -> list[Any]:
            jobs: list[Any] = await own_fetch(batch, room)
            fetched.append(len(jobs))
            return jobs

        worker._next_jobs = counted
        await transport.dispatch([StepTask(f"r{i}", 1, "g", "g") for i in range(5)])
        assert worker.handed == 5
        await wait_until(lambda: len(started) == 5, what="five handlers")
        queue = Queue(f"{prefix}-tasks-g", {"connection": client})
        active = await client.lrange(queue.keys["active"], 0, -1)
        locks = [await client.get(f"{queue.keys['']}{job_id}:lock") for job_id in active]
        assert len(active) == 5 and all(lock.startswith(f"{worker.id}:") for lock in locks)
        assert len(set(locks)) == 5
        assert await client.zscore(queue.keys["marker"], "0") is None
        assert sum(fetched) == 0
    finally:
        release.set()
        await transport.close()


@pytest.mark.parametrize("count", [4, 60])
async def test_a_busy_worker_takes_its_next_jobs_with_its_finishes(
    prefix: str, client: aioredis.Redis, count: int
) -> None:
    # More tasks than room: the add takes what fits, and each write
    # finishing jobs takes the next ones for the slots they freed (bullmq's
    # fetch-next), so the worker's fetch loop, blocked on the dry queue's
    # marker, takes (almost) none itself. Each task is handled once, every
    # job is gone at the end, and the worker holds no slot.
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    handled: Counter[str] = Counter()
    got: list[StepResult] = []

    async def handle(task: StepTask) -> None:
        handled[task.step_id] += 1
        await transport.send_result(StepResult(task.run_id, task.seq, ok=True, output=None))

    try:
        await transport.open()
        await _results_consumer(transport, got)
        await transport.serve(["g"], handle, concurrency=3)
        [worker] = await _serving(transport)
        fetched: list[int] = []
        own_fetch = worker._next_jobs

        async def counted(batch: int, room: int) -> list[Any]:
            jobs: list[Any] = await own_fetch(batch, room)
            fetched.append(len(jobs))
            return jobs

        worker._next_jobs = counted
        await transport.dispatch([StepTask(f"r{i}", 1, "g", "g") for i in range(count)])
        await wait_until(lambda: len(got) == count, what="every result")
        assert sorted(handled) == sorted(f"r{i}:1" for i in range(count))
        assert set(handled.values()) == {1}
        # three with the add; of the rest, at most one take's worth by the loop
        # (it wakes on the queue's marker while the first handlers run)
        assert worker.handed + sum(fetched) == count
        assert sum(fetched) <= 3
        queue = Queue(f"{prefix}-tasks-g", {"connection": client})
        await wait_until(lambda: worker._busy == 0 and not worker.jobs, what="every job finished")
        for state in ("wait", "active"):
            assert await client.llen(queue.keys[state]) == 0
        assert await client.zcard(queue.keys["prioritized"]) == 0
    finally:
        await transport.close()


async def test_one_step_at_a_time_each_finish_goes_out_with_the_next_add(
    prefix: str, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step's job is completed in the transport's write that adds the next
    # step (finishes alone wait for one, up to the linger): one write per
    # step where there were two (its add, its finish). Each step runs once
    # and every job is gone at the end (the last finish goes out alone).
    monkeypatch.setattr(transport_module, "_FINISH_LINGER_S", 0.5)
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    writes: list[list[Any]] = []
    real = transport._write

    async def counted(items: list[Any]) -> list[Any]:
        writes.append(list(items))
        return await real(items)

    transport._adding._write = counted
    handled: Counter[str] = Counter()
    waiting: dict[str, asyncio.Future[StepResult]] = {}

    async def handle(task: StepTask) -> None:
        handled[task.step_id] += 1
        await transport.send_result(StepResult(task.run_id, task.seq, ok=True, output=task.seq))

    async def on_results(batch: list[StepResult]) -> None:
        for result in batch:
            waiting.pop(result.step_id).set_result(result)

    async def on_beat(beat: Heartbeat) -> None:
        return None

    steps = 20
    try:
        await transport.open()
        await transport.consume_results(on_results, on_beat)
        await transport.serve(["g"], handle, concurrency=4)
        [worker] = await _serving(transport)
        for seq in range(1, steps + 1):
            future = asyncio.get_running_loop().create_future()
            waiting[f"r:{seq}"] = future
            await transport.dispatch([StepTask("r", seq, "g", "g", input=seq)])
            assert (await future).output == seq
        await wait_until(lambda: not worker.jobs, what="the last job finished")
        assert handled == Counter({f"r:{seq}": 1 for seq in range(1, steps + 1)})
        done = [item for write in writes for item in write if isinstance(item, _Done)]
        assert len(done) == steps
        # a write per add, and the last finish alone (a finish that missed
        # its add, on a machine slower than the linger, would be one more)
        assert steps + 1 <= len(writes) <= steps + 3
        queue = Queue(f"{prefix}-tasks-g", {"connection": client})
        for state in ("wait", "active"):
            assert await client.llen(queue.keys[state]) == 0
    finally:
        await transport.close()


async def test_a_second_consumer_of_the_queue_gets_what_the_taker_has_no_room_for(
    prefix: str, client: aioredis.Redis
) -> None:
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix)  # serves g too, room for 2
    other = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    release = asyncio.Event()
    handled: dict[str, Counter[str]] = {"engine": Counter(), "other": Counter()}
    got: list[StepResult] = []

    def handler(name: str, transport: RedisTransport) -> Any:
        async def handle(task: StepTask) -> None:
            handled[name][task.step_id] += 1
            await release.wait()
            await transport.send_result(StepResult(task.run_id, task.seq, ok=True, output=None))

        return handle

    try:
        for transport in (engine, other):
            await transport.open()
        await _results_consumer(engine, got)
        await engine.serve(["g"], handler("engine", engine), concurrency=2)
        await other.serve(["g"], handler("other", other), concurrency=20)
        [worker] = await _serving(engine)
        await _serving(other)
        await engine.dispatch([StepTask(f"r{i}", 1, "g", "g") for i in range(10)])
        assert worker.handed == 2
        count = lambda: sum(map(len, handled.values()))  # noqa: E731
        await wait_until(lambda: count() == 10, what="ten handlers")
        assert len(handled["engine"]) == 2 and len(handled["other"]) == 8
        release.set()
        await wait_until(lambda: len(got) == 10, what="ten results")
        assert sorted(r.step_id for r in got) == sorted(f"r{i}:1" for i in range(10))
        assert all(set(c.values()) <= {1} for c in handled.values())
    finally:
        release.set()
        await other.close()
        await engine.close()


async def test_tasks_taken_as_added_by_an_instance_that_dies_come_back_as_stalled(
    prefix: str, client: aioredis.Redis
) -> None:
    # The instance dies right after the transaction that added and took its
    # tasks: they are active, locked by its tokens, never renewed. BullMQ's
    # stalled check (here another instance's) moves them back to wait, with a
    # "stalled" event each, and they run once elsewhere.
    dying = RedisTransport(REDIS_TEST_URL, prefix=prefix, lock_ms=400)
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix, lock_ms=400)
    server = RedisTransport(REDIS_TEST_URL, prefix=prefix, lock_ms=400)
    handled: Counter[str] = Counter()
    got: list[StepResult] = []

    async def never(task: StepTask) -> None:
        raise AssertionError("the dead instance runs nothing")

    async def handle(task: StepTask) -> None:
        handled[task.step_id] += 1
        await server.send_result(StepResult(task.run_id, task.seq, ok=True, output=None))

    try:
        await dying.open()
        await dying.serve(["g"], never, concurrency=8)
        [worker] = await _serving(dying)
        dropped: list[int] = []
        worker.taken = lambda reply, token, room: dropped.append(len(reply))
        await dying.dispatch([StepTask(f"r{i}", 1, "g", "g") for i in range(3)])
        assert dropped == [3]
        queue = Queue(f"{prefix}-tasks-g", {"connection": client})
        held = await client.lrange(queue.keys["active"], 0, -1)
        assert len(held) == 3
        await dying.close()  # holds them still: nothing hands them back
        assert sorted(await client.lrange(queue.keys["active"], 0, -1)) == sorted(held)
        for transport in (engine, server):
            await transport.open()
        await _results_consumer(engine, got)
        await server.serve(["g"], handle, concurrency=8)
        await wait_until(lambda: len(got) == 3, timeout=20, what="three results")
        assert sorted(handled) == [f"r{i}:1" for i in range(3)]
        assert set(handled.values()) == {1}
        stalled = [
            e[1]["jobId"]
            for e in await client.xrange(queue.keys["events"])
            if e[1]["event"] == "stalled"
        ]
        assert sorted(stalled) == sorted(held)
    finally:
        for transport in (server, engine, dying):
            await transport.close()


async def test_jobs_taken_with_their_add_that_cannot_be_started_come_back_after_their_lock(
    prefix: str, client: aioredis.Redis
) -> None:
    # The take ran but its reply could not be read into jobs: the dispatch
    # still succeeds (the task is added), the worker gets its room back, and
    # the job, locked by nobody alive, comes back through the stalled check.
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix, lock_ms=400)
    got: list[StepTask] = []

    async def handle(task: StepTask) -> None:
        got.append(task)

    try:
        await transport.open()
        await transport.serve(["g"], handle, concurrency=4)
        [worker] = await _serving(transport)
        build = worker._job
        broken = [True]

        def once(raw: dict[str, str], job_id: str) -> Any:
            if broken:
                broken.clear()
                raise RuntimeError("unreadable (test)")
            return build(raw, job_id)

        worker._job = once
        await transport.dispatch([StepTask("r1", 1, "g", "g")])
        assert not broken and worker.handed == 0
        assert worker._busy == 0
        await wait_until(lambda: len(got) == 1, timeout=10, what="the task, after its lock")
        assert got[0].step_id == "r1:1"
    finally:
        await transport.close()
