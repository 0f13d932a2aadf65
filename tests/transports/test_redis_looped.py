"""BullMQ's add and finish scripts looped server-side (``_looped``), on the
real Redis: each job gets exactly the KEYS and ARGV bullmq would send for it,
and the batch paths hold with a batch of one, a batch of many (more than one
script call), racing callers and a connection dropped mid-batch."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import weakref
from typing import Any

import pytest
import redis.asyncio as aioredis
from bullmq import Job, Queue, Worker
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from durably._queue import Delivered
from durably.transports.redis import RedisTransport
from durably.transports.redis import _batched as batched
from durably.transports.redis._batched import (
    Call,
    Collector,
    Lane,
    Script,
    added_job,
    batch_client,
    compact_json,
    move_to_active_args,
    parse_taken,
    run_scripts,
    take_script,
)
from durably.transports.redis._looped import (
    CALL_MAX,
    add_call,
    add_each_call,
    add_each_script,
    add_script,
    finish_call,
    finish_script,
    finished_opts,
)
from durably.wire import Heartbeat, StepResult
from on_redis.redis_fixtures import OwnRedis, own_redis

from .conftest import REDIS_TEST_URL, wait_until

__all__ = ["own_redis"]

_OPTS = {"removeOnComplete": True, "removeOnFail": True}


def _add(queue: Any, datas: list[Any], opts: dict[str, Any] | None = None) -> list[Call]:
    """The looped add calls for ``datas`` (one job each), CALL_MAX per call."""
    jobs = [added_job(queue.scripts, "task", data, opts or _OPTS) for data in datas]
    first = jobs[0]
    script = add_script(first.script)
    return [
        add_call(
            script,
            first.keys,
            first.packed,
            first.timestamp,
            [(j.data, j.opts) for j in jobs[start : start + CALL_MAX]],
        )
        for start in range(0, len(jobs), CALL_MAX)
    ]


async def _take(queue: Any, client: aioredis.Redis, n: int, token: str) -> list[tuple[str, str]]:
    """Take up to ``n`` jobs as the transport's workers do: (job id, its lock token)."""
    script = take_script(Script.of(queue.scripts.commands["moveToActive"]))
    keys, args = move_to_active_args(queue.keys, token, 30_000, n)
    (reply,) = await run_scripts(client, [Call(script, keys, args)])
    taken, _ = parse_taken(reply)
    return [(job_id, f"{token}:{i}") for i, (_, job_id) in enumerate(taken, start=1)]


def _finish(queue: Any, held: list[tuple[str, str]], value: Any = "ok") -> list[Call]:
    """The looped finish calls completing ``held`` (job id, token), CALL_MAX per call."""
    script = finish_script(Script.of(queue.scripts.commands["moveToFinished"]))
    now = round(time.time() * 1000)
    jobs = [
        (job_id, compact_json(value), finished_opts(token, True, {}, {}, 1, 0))
        for job_id, token in held
    ]
    return [
        finish_call(script, queue.keys, jobs[start : start + CALL_MAX], now)
        for start in range(0, len(jobs), CALL_MAX)
    ]


def _flat(replies: list[Any]) -> list[Any]:
    return [one for reply in replies for one in reply]


# -- what each job's call is -------------------------------------------------------------


# Tokens of each msgpack string size (fixstr, str8: a worker's uuid-based
# ones) and each keep-jobs shape: the opts are packed once per shape and the
# token spliced in, and must still be bullmq's bytes.
@pytest.mark.parametrize("token", ["tok:1", f"{'a' * 36}:12:3", "t" * 300])
@pytest.mark.parametrize("remove", [True, False, 7, {"age": 60, "count": 5}])
async def test_a_finished_jobs_keys_and_args_are_bullmqs_own(
    prefix: str, client: aioredis.Redis, token: str, remove: Any
) -> None:
    # What the loop hands BullMQ's moveToFinished for job i is what bullmq's
    # own worker would send for it (timestamp aside: one per call here).
    queue = Queue(f"{prefix}-q", {"connection": client})
    worker = Worker(f"{prefix}-q", None, {"connection": client, "autorun": False})
    try:
        job = Job(worker, "task", {"n": 1}, {**_OPTS, "attempts": 3})
        job.id, job.attemptsMade = "17", 1
        keys, args = worker.scripts.moveToCompletedArgs(job, {"r": [1]}, remove, token, False)
        packed = finished_opts(token, remove, worker.opts, job.opts, job.attempts, 1)
        call = finish_call(
            finish_script(Script.of(worker.scripts.commands["moveToFinished"])),
            worker.keys,
            [("17", compact_json({"r": [1]}), packed)],
            args[1],
        )
        # rebuild job 1's KEYS and ARGV the way the Lua tail does
        ks, av = list(call.keys), list(call.args)
        assert [*ks[:11], ks[13], ks[11], ks[12]] == keys
        assert [av[5], av[0], av[1], av[6], av[2], av[3], av[4], av[7]] == args
    finally:
        await worker.close(force=True)
        await queue.close()


@pytest.mark.parametrize("opts", [_OPTS, {**_OPTS, "priority": 1_048_571}])
async def test_looped_adds_store_the_jobs_bullmq_would_store(
    prefix: str, client: aioredis.Redis, opts: dict[str, Any]
) -> None:
    ours = Queue(f"{prefix}-ours", {"connection": client})
    theirs = Queue(f"{prefix}-theirs", {"connection": client})
    datas = [{"runId": f"r{i}", "seq": i, "input": {"é": [i, 2.5, None]}} for i in range(3)]
    replies = await run_scripts(client, _add(ours, datas, opts), transaction=True)
    assert _flat(replies) == ["1", "2", "3"]
    await theirs.addBulk([{"name": "task", "data": d, "opts": opts} for d in datas])
    volatile = {"timestamp"}
    for job_id in ("1", "2", "3"):
        a = await client.hgetall(f"{ours.keys['']}{job_id}")
        b = await client.hgetall(f"{theirs.keys['']}{job_id}")
        assert {k: v for k, v in a.items() if k not in volatile} == {
            k: v for k, v in b.items() if k not in volatile
        }
    for name in ("wait", "prioritized", "marker"):
        kind = await client.type(ours.keys[name])
        assert kind == await client.type(theirs.keys[name])
    if opts.get("priority"):
        assert await client.zrange(ours.keys["prioritized"], 0, -1) == ["1", "2", "3"]
    else:
        assert await client.lrange(ours.keys["wait"], 0, -1) == ["3", "2", "1"]
    events = [e[1]["event"] for e in await client.xrange(ours.keys["events"])]
    assert events == [e[1]["event"] for e in await client.xrange(theirs.keys["events"])]


@pytest.mark.parametrize("count", [1, 2 * CALL_MAX + 7])
async def test_looped_adds_of_own_ids_store_the_jobs_bullmq_would_store(
    prefix: str, client: aioredis.Redis, count: int
) -> None:
    # Jobs of ids of their own (runs' starts) differ in their packed
    # arguments: one call adds many, each with its own, and an id added
    # twice keeps its first job (as bullmq's add does).
    ours = Queue(f"{prefix}-ours", {"connection": client})
    theirs = Queue(f"{prefix}-theirs", {"connection": client})
    opts = {"removeOnComplete": True, "removeOnFail": True, "priority": 3}
    ids = [f"start-{i}" for i in range(count)] + ["start-0"]
    datas = [{"runId": f"r{i}", "wake": False} for i in range(count)] + [{"again": True}]
    jobs = [
        added_job(ours.scripts, "run", data, {**opts, "jobId": job_id}, timestamp=1_000)
        for data, job_id in zip(datas, ids, strict=True)
    ]
    script = add_each_script(jobs[0].script)
    calls = [
        add_each_call(script, jobs[0].keys, 1_000, [(j.packed, j.data, j.opts) for j in part])
        for part in (jobs[start : start + CALL_MAX] for start in range(0, len(jobs), CALL_MAX))
    ]
    assert _flat(await run_scripts(client, calls, transaction=True)) == ids
    await theirs.addBulk(
        [
            {"name": "run", "data": d, "opts": {**opts, "jobId": job_id}}
            for d, job_id in zip(datas, ids, strict=True)
        ]
    )
    for job_id in ids[:count]:
        a = await client.hgetall(f"{ours.keys['']}{job_id}")
        b = await client.hgetall(f"{theirs.keys['']}{job_id}")
        assert a["data"] != '{"again":true}'
        assert json.loads(a.pop("opts")) == json.loads(b.pop("opts"))
        assert a.pop("timestamp") == "1000"
        b.pop("timestamp")
        assert a == b
    assert await client.zrange(ours.keys["prioritized"], 0, -1) == await client.zrange(
        theirs.keys["prioritized"], 0, -1
    )
    events = [e[1]["event"] for e in await client.xrange(ours.keys["events"])]
    assert events == [e[1]["event"] for e in await client.xrange(theirs.keys["events"])]


# -- a batch of one, a batch of many ---------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2 * CALL_MAX + 7])
async def test_a_looped_batch_adds_and_finishes_every_job_once(
    prefix: str, client: aioredis.Redis, count: int
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    calls = _add(queue, [{"n": i} for i in range(count)])
    assert len(calls) == -(-count // CALL_MAX)
    ids = _flat(await run_scripts(client, calls, transaction=True))
    assert ids == [str(i) for i in range(1, count + 1)]
    held = await _take(queue, client, count, "w")
    assert sorted(job_id for job_id, _ in held) == sorted(ids)
    replies = await run_scripts(client, _finish(queue, held))
    assert _flat(replies) == [0] * count
    assert await client.llen(queue.keys["active"]) == 0
    assert [k async for k in client.scan_iter(match=f"{queue.keys['']}[0-9]*")] == []
    completed = [
        e[1]["jobId"]
        for e in await client.xrange(queue.keys["events"])
        if e[1]["event"] == "completed"
    ]
    assert sorted(completed) == sorted(ids)


async def test_one_refused_job_does_not_stop_the_others_in_its_call(
    prefix: str, client: aioredis.Redis
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    await run_scripts(client, _add(queue, [{"n": i} for i in range(4)]), transaction=True)
    held = await _take(queue, client, 4, "w")
    (a, ta), (b, _), (c, tc), (d, td) = held
    # b: someone else's lock (BullMQ's "lock mismatch", -6); c: a key of the
    # wrong type makes BullMQ's script raise for it (an error reply of its own).
    await client.set(f"{queue.keys['']}{b}:lock", "another")
    await client.delete(f"{queue.keys['']}{c}")
    await client.set(f"{queue.keys['']}{c}", "not a hash")
    calls = _finish(queue, [(a, ta), (b, "w:2"), (c, tc), (d, td)])
    replies = _flat(await run_scripts(client, calls))
    assert replies[0] == 0 and replies[3] == 0
    assert replies[1] == -6
    assert isinstance(replies[2], ResponseError)
    assert "WRONGTYPE" in str(replies[2])
    assert sorted(await client.lrange(queue.keys["active"], 0, -1)) == sorted([b, c])


# -- racing callers ------------------------------------------------------------------------


async def test_racing_finishers_complete_each_job_exactly_once(prefix: str) -> None:
    clients = [aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True) for _ in range(3)]
    try:
        queue = Queue(f"{prefix}-q", {"connection": clients[0]})
        count = CALL_MAX + 50
        await run_scripts(clients[0], _add(queue, list(range(count))), transaction=True)
        held = await _take(queue, clients[0], count, "w")
        # three callers finish the same jobs at once (a retried batch racing
        # the first): each job completes once, the others see it gone (-1)
        got = await asyncio.gather(*(run_scripts(c, _finish(queue, held)) for c in clients))
        per_job = list(zip(*(_flat(r) for r in got), strict=True))
        assert all(sorted(replies) == [-1, -1, 0] for replies in per_job)
        completed = [
            e[1]["jobId"]
            for e in await clients[0].xrange(queue.keys["events"])
            if e[1]["event"] == "completed"
        ]
        assert sorted(completed) == sorted(job_id for job_id, _ in held)
    finally:
        for c in clients:
            await c.aclose()


async def test_racing_adders_get_distinct_jobs(prefix: str) -> None:
    clients = [aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True) for _ in range(3)]
    try:
        queue = Queue(f"{prefix}-q", {"connection": clients[0]})
        batches = [[{"c": c, "n": i} for i in range(CALL_MAX + 20)] for c in range(3)]
        got = await asyncio.gather(
            *(
                run_scripts(client, _add(queue, batch), transaction=True)
                for client, batch in zip(clients, batches, strict=True)
            )
        )
        ids = [job_id for replies in got for job_id in _flat(replies)]
        assert len(set(ids)) == len(ids) == 3 * (CALL_MAX + 20)
        assert await clients[0].llen(queue.keys["wait"]) == len(ids)
    finally:
        for c in clients:
            await c.aclose()


# -- a connection dropped mid-batch -----------------------------------------------------------


class _Cut(Connection):
    """A connection that sends only the first ``keep`` bytes of a longer
    write, then drops: Redis runs the commands it received whole."""

    keep: int | None = None

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        keep = type(self).keep
        data = b"".join(command) if isinstance(command, list | tuple) else command
        if keep is None or len(data) <= keep:  # the handshake, or not the batch
            await super().send_packed_command(command, check_health)
            return
        assert self._writer is not None
        self._writer.write(data[:keep])
        await self._writer.drain()
        await self.disconnect()
        raise RedisConnectionError("dropped mid-batch (test)")


def _cutting_client(calls: list[Call], whole: int, transaction: bool) -> aioredis.Redis:
    """A client whose next pipeline reaches Redis up to the middle of call ``whole``."""
    conn = Connection()
    pieces = [conn.pack_command("MULTI")[0]] if transaction else []
    for call in calls[:whole]:
        pieces += conn.pack_command(
            "EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args
        )
    cut = sum(len(p) for p in pieces) + 100  # into the next call
    _Cut.keep = cut
    pool = aioredis.ConnectionPool.from_url(
        REDIS_TEST_URL, decode_responses=True, connection_class=_Cut
    )
    return aioredis.Redis.from_pool(pool)


async def test_a_finish_batch_cut_mid_way_finishes_whole_calls_only_and_a_retry_ends_it(
    prefix: str, client: aioredis.Redis
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    count = 2 * CALL_MAX
    await run_scripts(client, _add(queue, list(range(count))), transaction=True)
    held = await _take(queue, client, count, "w")
    calls = _finish(queue, held)
    # make sure the scripts are loaded: a NOSCRIPT retry would hide the cut
    await client.script_load(calls[0].script.text)
    cutting = _cutting_client(calls, 1, transaction=False)
    try:
        with pytest.raises(RedisConnectionError):
            await run_scripts(cutting, calls)
    finally:
        _Cut.keep = None
        await cutting.aclose()
    # the first call ran whole, the second not at all: its jobs are still
    # held (locked, active) and come back through BullMQ's stalled check if
    # their holder is gone; nothing is half-finished
    first, second = {j for j, _ in held[:CALL_MAX]}, {j for j, _ in held[CALL_MAX:]}
    assert set(await client.lrange(queue.keys["active"], 0, -1)) == second
    for job_id in second:
        assert await client.exists(f"{queue.keys['']}{job_id}:lock")
    for job_id in first:
        assert not await client.exists(f"{queue.keys['']}{job_id}")
    # the holder retries the whole batch: the rest completes, the finished
    # ones are told they are gone (-1), none completes twice
    replies = _flat(await run_scripts(client, _finish(queue, held)))
    assert replies == [-1] * CALL_MAX + [0] * CALL_MAX
    assert await client.llen(queue.keys["active"]) == 0
    completed = [
        e[1]["jobId"]
        for e in await client.xrange(queue.keys["events"])
        if e[1]["event"] == "completed"
    ]
    assert sorted(completed) == sorted(j for j, _ in held)


async def test_an_add_transaction_cut_mid_way_adds_nothing(
    prefix: str, client: aioredis.Redis
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    calls = _add(queue, [{"n": i} for i in range(2 * CALL_MAX)])
    await client.script_load(calls[0].script.text)
    cutting = _cutting_client(calls, 1, transaction=True)
    try:
        with pytest.raises(RedisConnectionError):
            await run_scripts(cutting, calls, transaction=True)
    finally:
        _Cut.keep = None
        await cutting.aclose()
    # MULTI without EXEC: Redis discards it, so the caller's retry is the
    # only copy of its jobs
    assert await client.llen(queue.keys["wait"]) == 0
    assert await client.get(queue.keys["id"]) is None
    ids = _flat(await run_scripts(client, calls, transaction=True))
    assert len(ids) == 2 * CALL_MAX
    assert await client.llen(queue.keys["wait"]) == 2 * CALL_MAX
    stored = await client.hget(f"{queue.keys['']}{ids[-1]}", "data")
    assert json.loads(stored or "null") == {"n": 2 * CALL_MAX - 1}


# -- a kept connection (Lane) -----------------------------------------------------------------


async def test_a_lane_survives_its_connection_killed_between_batches(
    prefix: str, client: aioredis.Redis
) -> None:
    # The lane keeps its connection across batches (no pool health check
    # before each): one the server dropped meanwhile is found dead by the
    # next batch, which reconnects and runs once, whole.
    queue = Queue(f"{prefix}-q", {"connection": client})
    mine = aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    lane = Lane()
    try:
        await run_scripts(mine, _add(queue, [0]), transaction=True, lane=lane)
        conn = await lane.take(mine)
        assert conn is not None
        await conn.send_command("CLIENT", "ID")
        conn_id = await conn.read_response()
        await lane.put_back(mine, conn)
        assert await client.client_kill_filter(_id=conn_id) == 1
        await run_scripts(mine, _add(queue, [1, 2]), transaction=True, lane=lane)
        assert await client.llen(queue.keys["wait"]) == 3
        assert await lane.take(mine) is conn  # still the kept one, reconnected
        await lane.put_back(mine, conn)
    finally:
        await lane.close()
        await mine.aclose()


async def test_batches_racing_on_one_lane_each_run_once(
    prefix: str, client: aioredis.Redis
) -> None:
    # A call made while the kept connection is out (a direct finish beside
    # the collector's) takes a pooled one; one made after close() too.
    queue = Queue(f"{prefix}-q", {"connection": client})
    lane = Lane()
    try:
        replies = await asyncio.gather(
            *(run_scripts(client, _add(queue, [n]), transaction=True, lane=lane) for n in range(5))
        )
        assert len({reply[0][0] for reply in replies}) == 5
        await lane.close()
        await run_scripts(client, _add(queue, [5]), transaction=True, lane=lane)
        assert await lane.take(client) is None  # closed for this client
        assert await client.llen(queue.keys["wait"]) == 6
    finally:
        await lane.close()


# -- the batch writers' client (one deadline per batch) -----------------------------------


@pytest.mark.parametrize("count", [1, 3 * CALL_MAX])
async def test_a_batch_client_adds_takes_and_finishes_a_batch_whole(
    prefix: str, client: aioredis.Redis, count: int
) -> None:
    # A batch of one and one of several looped calls, in a transaction and
    # out of one, on a lane's kept connection and on a pooled one: the same
    # replies as through a client with a socket timeout.
    queue = Queue(f"{prefix}-q", {"connection": client})
    batches = batch_client(REDIS_TEST_URL)
    assert batches.connection_pool.connection_kwargs.get("socket_timeout") is None
    lane = Lane()
    try:
        ids = _flat(await run_scripts(batches, _add(queue, list(range(count))), transaction=True))
        assert len(set(ids)) == count
        script = take_script(Script.of(queue.scripts.commands["moveToActive"]))
        keys, args = move_to_active_args(queue.keys, "w", 30_000, count)
        (reply,) = await run_scripts(batches, [Call(script, keys, args)], lane=lane)
        taken, _ = parse_taken(reply)
        held = [(job_id, f"w:{i}") for i, (_, job_id) in enumerate(taken, start=1)]
        assert sorted(job_id for job_id, _ in held) == sorted(ids)
        finished = _flat(await run_scripts(batches, _finish(queue, held), lane=lane))
        assert finished == [0] * count
        assert await client.llen(queue.keys["active"]) == 0
    finally:
        await lane.close()
        await batches.aclose()


async def test_a_batch_clients_lane_survives_its_connection_killed_between_batches(
    prefix: str, client: aioredis.Redis
) -> None:
    queue = Queue(f"{prefix}-q", {"connection": client})
    batches = batch_client(REDIS_TEST_URL)
    lane = Lane()
    try:
        await run_scripts(batches, _add(queue, [0]), transaction=True, lane=lane)
        conn = await lane.take(batches)
        assert conn is not None
        await conn.send_command("CLIENT", "ID")
        conn_id = await conn.read_response()
        await lane.put_back(batches, conn)
        assert await client.client_kill_filter(_id=conn_id) == 1
        await run_scripts(batches, _add(queue, [1, 2]), transaction=True, lane=lane)
        assert await client.llen(queue.keys["wait"]) == 3
    finally:
        await lane.close()
        await batches.aclose()


async def test_a_batch_the_server_does_not_answer_fails_and_the_next_one_runs(
    own_redis: OwnRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The deadline bounds the whole batch (no socket timeout does): a server
    # paused far longer than it fails the batch as a socket timeout would,
    # and drops the connection (its reply may still come), so the lane's
    # next batch runs on a fresh one and reads its own replies.
    monkeypatch.setattr(batched, "BATCH_TIMEOUT_S", 0.2)
    admin = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    batches = batch_client(own_redis.url)
    queue = Queue("paused-q", {"connection": admin})
    lane = Lane()
    try:
        await run_scripts(batches, _add(queue, [0]), transaction=True, lane=lane)
        await admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        with pytest.raises(RedisTimeoutError):
            await run_scripts(batches, _add(queue, [1]), transaction=True, lane=lane)
        await admin.execute_command("CLIENT", "UNPAUSE")
        ids = _flat(await run_scripts(batches, _add(queue, [2]), transaction=True, lane=lane))
        assert len(ids) == 1
        # the paused batch ran once the server went on (its reply was dropped), or not at all
        assert await admin.llen(queue.keys["wait"]) in (2, 3)
    finally:
        await lane.close()
        await batches.aclose()
        await admin.aclose()


# -- the collector's patient items ----------------------------------------------------------


async def test_patient_items_wait_for_others_and_an_impatient_one_ends_the_wait() -> None:
    # Items that may wait (a job to finish) go out with the next other item
    # (an add) in one write; one that may not wait ends the wait at once,
    # whatever the linger (here far longer than the test).
    writes: list[list[str]] = []

    async def write(items: list[str]) -> list[str | BaseException]:
        writes.append(list(items))
        return [f"{item}!" for item in items]

    collector = Collector(write, patient=lambda item: item.startswith("p"), linger_s=3600)
    first = asyncio.ensure_future(collector.add("p1"))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(collector.add("p2"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert writes == []  # lingering
    assert await collector.add("a1") == "a1!"
    assert await first == "p1!" and await second == "p2!"
    assert writes == [["p1", "p2", "a1"]]


async def test_patient_items_alone_go_out_after_the_linger() -> None:
    writes: list[list[str]] = []

    async def write(items: list[str]) -> list[str | BaseException]:
        writes.append(list(items))
        return [f"{item}!" for item in items]

    collector = Collector(write, patient=lambda item: True, linger_s=0.01)
    assert await asyncio.gather(collector.add("p1"), collector.add("p2")) == ["p1!", "p2!"]
    assert await collector.add("p3") == "p3!"
    assert writes == [["p1", "p2"], ["p3"]]


# -- the run queues' discovery ------------------------------------------------------------


async def test_finding_the_run_queues_scans_a_big_keyspace_in_few_round_trips(
    prefix: str, client: aioredis.Redis
) -> None:
    # An engine driving every pool looks for new run queues each second: with
    # SCAN's default page of 10 keys that was one round trip per 10 keys of
    # the whole database, each second (a third of a dispatched step's round
    # trips in the bench). Failed first with 300+ SCANs.
    for start in range(0, 3_000, 500):
        await client.mset({f"{prefix}-filler:{i}": "x" for i in range(start, start + 500)})
    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    await transport.open()
    try:
        runs = transport.run_queue()
        await Queue(f"{prefix}-runs", {"connection": client}).add("run", {"runId": "r"})
        real = transport._redis().scan
        scans = 0

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal scans
            scans += 1
            return await real(*args, **kwargs)

        transport._redis().scan = counted  # type: ignore[method-assign]
        assert await runs._queue_names() == [f"{prefix}-runs"]
        dbsize = await client.dbsize()
        assert scans <= dbsize // 1000 + 5, (scans, dbsize)  # other keys may come and go
    finally:
        await transport.close()


# -- results taken and settled a fetch at a time ------------------------------------------


async def _results_left(client: aioredis.Redis, prefix: str) -> list[str]:
    results = f"bull:{prefix}-results"
    for _ in range(300):
        if await client.llen(f"{results}:active") == 0:
            break
        await asyncio.sleep(0.01)
    return [k async for k in client.scan_iter(match=f"{results}:[0-9]*", count=1000)]


def _result(i: int) -> StepResult:
    return StepResult(f"r{i}", 1, ok=True, output=i)


@pytest.mark.parametrize("count", [1, 2 * CALL_MAX + 7])
async def test_results_are_settled_in_batches_each_once(
    prefix: str, client: aioredis.Redis, count: int
) -> None:
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    sender = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    batches: list[list[StepResult]] = []
    try:
        await engine.open()
        await sender.open()
        await _consume(engine, batches)
        await asyncio.gather(*(sender.send_result(_result(i)) for i in range(count)))
        await wait_until(lambda: sum(map(len, batches)) >= count, timeout=20, what="results")
        await asyncio.sleep(0.2)  # a duplicate would show up by now
        got = sorted(r.step_id for b in batches for r in b)
        assert got == sorted(f"r{i}:1" for i in range(count))
        if count > 1:
            assert len(batches) < count  # settled many at a time
        assert await _results_left(client, prefix) == []
    finally:
        await sender.close()
        await engine.close()


async def test_two_result_consumers_racing_settle_each_result_once(
    prefix: str, client: aioredis.Redis
) -> None:
    engines = [RedisTransport(REDIS_TEST_URL, prefix=prefix) for _ in range(2)]
    sender = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    got: list[list[StepResult]] = [[], []]
    count = 3 * CALL_MAX
    try:
        await sender.open()
        for engine, mine in zip(engines, got, strict=True):
            await engine.open()
            await _consume(engine, [], into=mine)
        for start in range(0, count, 50):  # in waves, so both consumers take some
            await asyncio.gather(
                *(sender.send_result(_result(i)) for i in range(start, start + 50))
            )
            await asyncio.sleep(0.01)
        await wait_until(lambda: len(got[0]) + len(got[1]) >= count, timeout=20, what="all")
        await asyncio.sleep(0.2)
        ids = [r.step_id for r in got[0] + got[1]]
        assert sorted(ids) == sorted(f"r{i}:1" for i in range(count))  # each once
        assert await _results_left(client, prefix) == []
    finally:
        for transport in (sender, *engines):
            await transport.close()


async def test_a_batch_that_could_not_be_settled_is_delivered_again(
    prefix: str, client: aioredis.Redis
) -> None:
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix, redeliver_delay_ms=50)
    sender = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    seen: list[str] = []
    failed = False

    async def on_results(batch: list[StepResult]) -> None:
        nonlocal failed
        if not failed:
            failed = True
            raise RuntimeError("the store is away (test)")
        seen.extend(r.step_id for r in batch)

    try:
        await engine.open()
        await sender.open()
        await engine.consume_results(on_results, _no_beat)
        await asyncio.gather(*(sender.send_result(_result(i)) for i in range(30)))
        await wait_until(lambda: len(set(seen)) >= 30, timeout=20, what="30 results")
        assert sorted(set(seen)) == sorted(f"r{i}:1" for i in range(30))
        assert await _results_left(client, prefix) == []
    finally:
        await sender.close()
        await engine.close()


@pytest.mark.parametrize("ran", [False, True], ids=["before-it-ran", "after-it-ran"])
async def test_a_connection_dropped_while_finishing_a_batch_loses_no_result(
    prefix: str, client: aioredis.Redis, ran: bool
) -> None:
    # The finishing call of a settled batch fails as a dropped connection
    # does, before Redis ran it or after (its reply lost). The results were
    # settled already; their jobs are failed as bullmq's worker fails a job
    # whose completion raised (or, if that fails too, come back through the
    # stalled check and are settled again, which the engine tolerates):
    # none is lost and none is left behind.
    engine = RedisTransport(REDIS_TEST_URL, prefix=prefix, lock_ms=400)
    sender = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    batches: list[list[StepResult]] = []
    count = 40
    try:
        await engine.open()
        await sender.open()
        await _consume(engine, batches)
        assert engine._results_worker is not None
        worker: Any = engine._results_worker.worker
        real, dropped = worker._finish_many, 0

        async def drop_once(done: list[Any]) -> list[Any]:
            nonlocal dropped
            if dropped:
                return list(await real(done))
            dropped = len(done)
            if ran:
                await real(done)
            raise RedisConnectionError("connection dropped mid-batch (test)")

        worker._finish_many = drop_once
        await asyncio.gather(*(sender.send_result(_result(i)) for i in range(count)))
        await wait_until(lambda: dropped > 0, timeout=20, what="a dropped finish")
        await wait_until(lambda: sum(map(len, batches)) >= count, timeout=20, what="results")
        ids = {r.step_id for b in batches for r in b}
        assert ids == {f"r{i}:1" for i in range(count)}
        assert await _results_left(client, prefix) == []
        await asyncio.sleep(1.0)  # past the lock: nothing comes back
        assert sum(map(len, batches)) == count
    finally:
        await sender.close()
        await engine.close()


async def _no_beat(beat: Heartbeat) -> None:
    return None


async def _consume(
    transport: RedisTransport,
    batches: list[list[StepResult]],
    into: list[StepResult] | None = None,
) -> None:
    async def on_results(batch: list[StepResult]) -> None:
        batches.append(list(batch))
        if into is not None:
            into.extend(batch)

    await transport.consume_results(on_results, _no_beat)


async def test_a_stopped_run_queue_is_not_kept_by_the_transport(prefix: str) -> None:
    # An engine takes a new run queue from its transport at each start: a
    # transport that kept every one it handed out grew (with their
    # consumers' state) for as long as a process restarted engines on it.
    # Failed first: the transport held each run queue in a list forever.
    async def deliver(_body: str) -> Delivered:
        return Delivered.DONE

    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    await transport.open()
    try:
        kept = []
        for _ in range(3):
            runs = transport.run_queue()
            await runs.start(["default"], deliver, owner="o", lease_ms=30_000, capacity=4)
            await runs.stop_claiming()
            await runs.hand_back()
            kept.append(weakref.ref(runs))
            del runs
        gc.collect()
        assert [ref() for ref in kept] == [None, None, None]
    finally:
        await transport.close()


@pytest.mark.parametrize("count", [1, 2 * CALL_MAX + 7])
async def test_runs_pushed_by_two_instances_go_in_looped_calls_each_queued_once(
    prefix: str, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    # Runs' starts have job ids of their own: they go out many per script
    # call (failed first: one call per start), and two instances pushing the
    # same starts queue each once.
    from durably._queue import QueuedRun
    from durably.transports.redis import _transport

    sent: list[int] = []
    real = _transport.run_scripts

    async def counted(client: Any, calls: Any, **options: Any) -> list[Any]:
        sent.append(len(calls))
        return await real(client, calls, **options)

    monkeypatch.setattr(_transport, "run_scripts", counted)
    a = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    b = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    await a.open()
    await b.open()
    try:
        runs = [QueuedRun(f"run-{i}", False, "default", 0, "s1") for i in range(count)]
        await asyncio.gather(a.run_queue().push(runs), b.run_queue().push(runs))
        assert max(sent) <= 2 * -(-count // CALL_MAX)
        seen: list[str] = []
        everything = asyncio.Event()

        async def deliver(body: str) -> Delivered:
            seen.append(json.loads(body)["runId"])
            if len(seen) >= count:
                everything.set()
            return Delivered.DONE

        queue = a.run_queue()
        await queue.start(["default"], deliver, owner="o", lease_ms=30_000, capacity=64)
        await asyncio.wait_for(everything.wait(), 10)
        await asyncio.sleep(0.2)  # a duplicate would come now
        await queue.stop_claiming()
        await queue.hand_back()
        assert sorted(seen) == sorted(run.run_id for run in runs)
    finally:
        await a.close()
        await b.close()


async def test_runs_pushed_after_the_add_connection_was_killed_are_all_queued(
    prefix: str, client: aioredis.Redis
) -> None:
    # The looped add of runs' starts goes through the transport's kept add
    # connection: killed between two pushes, the second push is retried on a
    # new one, each start queued once.
    from durably._queue import QueuedRun

    transport = RedisTransport(REDIS_TEST_URL, prefix=prefix)
    await transport.open()
    try:
        queue = transport.run_queue()
        await queue.push([QueuedRun(f"a-{i}", False, "default", 0, "s") for i in range(3)])
        lane, batches = transport._adding_lane, transport._batches()
        conn = await lane.take(batches)
        assert conn is not None
        await conn.send_command("CLIENT", "ID")
        conn_id = await conn.read_response()
        await lane.put_back(batches, conn)
        assert await client.client_kill_filter(_id=conn_id) == 1
        await queue.push([QueuedRun(f"b-{i}", False, "default", 0, "s") for i in range(5)])
        runs = Queue(transport.names.runs(None), {"connection": client})
        assert await client.zcard(runs.keys["prioritized"]) == 8
        datas = [
            json.loads(await client.hget(f"{runs.keys['']}{job_id}", "data") or "null")["runId"]
            for job_id in await client.zrange(runs.keys["prioritized"], 0, -1)
        ]
        assert sorted(datas) == sorted([f"a-{i}" for i in range(3)] + [f"b-{i}" for i in range(5)])
    finally:
        await transport.close()
