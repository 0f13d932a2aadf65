"""The BullMQ wire's own floor per dispatched step: no engine, no store, no transport object.

What one ``redis://`` dispatched step costs on the wire at least, with the transport's own
helpers (``_batched``, ``_looped``, ``_bullmq``) and BullMQ's Lua: each round is the one
transaction the transport's steady state sends (``RedisTransport._write``), carrying

- the looped add of ``--batch`` new task jobs (``StepTask.to_wire``, ``added_job``: the data
  JSON, the packed arguments), and of ``batch / K`` run jobs of their own ids (a workflow's
  start on the run queue: one per K steps),
- the looped ``moveToFinished`` of the jobs the previous round took (``finish_calls``),
- the takes (``moveToActive`` looped) of the task and run queues' workers,

then parses the taken jobs as the transport does (``parse_taken``, the worker's ``_job``: the
data's JSON, a bullmq ``Job`` from a template; ``StepTask.from_wire`` for a task). Nothing
else: no collector, no task per job, no handler, no result (a result is settled in the process
that sends it, no wire). Prints per step (one task job, 1/K run job): client CPU, Redis server
CPU (``INFO cpu`` of the server process, and its scripts' ``INFO commandstats`` time), round
trips and script calls; then ``ctx.local_step``, ``local://`` and ``redis://`` measured in the
same run (``dispatch_durably.py throughput``, fresh processes, interleaved with the floor
rounds) and the bounds the floor implies for redis:// ÷ local_step.

    python redis_floor.py                        # batch 20, 5,000 steps x 3, then the engine
    python redis_floor.py --batch 1,20,50,100 --no-engine
    python redis_floor.py --db postgres --repeat 3

By default a private ``redis-server`` (no persistence, as the shared one) is started on a free
port, so the server CPU is this bench's alone; ``--shared`` uses ``BENCH_REDIS_URL`` instead
(its server figures then include every other client's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection

from durably.transports.redis._batched import (
    Call,
    Lane,
    added_job,
    batch_client,
    check_added,
    move_to_active_args,
    packed_job_opts,
    parse_taken,
    run_scripts,
)
from durably.transports.redis._bullmq import _BatchWorker, _new_queue
from durably.transports.redis._looped import (
    CALL_MAX,
    add_call,
    add_each_call,
    add_each_script,
    add_script,
)
from durably.transports.redis._names import bullmq_priority
from durably.wire import Heartbeat, StepResult, StepTask

HERE = Path(__file__).resolve().parent
# as the transport's (RedisTransport._task_opts, RedisRuns.push): prioritized jobs, neutral
_TASK_OPTS: dict[str, Any] = {
    "removeOnComplete": True,
    "removeOnFail": {"age": 86_400},
    "priority": bullmq_priority(None),
}
_RUN_OPTS: dict[str, Any] = {
    "removeOnComplete": True,
    "removeOnFail": True,
    "priority": bullmq_priority(None),
}
_LOCK_MS = 30_000

_writes = [0]


def _count_writes() -> None:
    """Count every write on a redis-py connection (a round trip each, here)."""
    original = AbstractConnection.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        _writes[0] += 1
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


def _server_figures(url: str) -> dict[str, float]:
    """The server process's CPU seconds and its script calls and time."""
    client = redis.Redis.from_url(url)
    try:
        cpu = client.info("cpu")
        stats = client.info("commandstats")
    finally:
        client.close()
    evalsha = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return {
        "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "script_calls": float(evalsha["calls"]),
        "script_usec": float(evalsha["usec"]),
    }


class _Side:
    """One queue: its bullmq queue (for its scripts and keys) and a worker that never runs
    its own loop (its job building and finishing calls are the transport's)."""

    def __init__(self, name: str, url: str, client: aioredis.Redis, batches: aioredis.Redis):
        self.queue = _new_queue(name, client)
        self.scripts = self.queue.backend.scripts

        async def never(*_: Any) -> None:
            raise AssertionError("the floor bench runs no worker loop")

        self.worker = _BatchWorker(
            name,
            never,
            {"connection": url, "concurrency": 10_000, "lockDuration": _LOCK_MS, "autorun": False},
            never,
            batches=batches,
        )
        self.held: list[Any] = []
        self.rounds = 0

    def take(self, room: int) -> tuple[Call, str]:
        """The take call for ``room`` jobs, and its token."""
        self.rounds += 1
        token = f"{self.worker.id}:{self.rounds}"
        keys, args = move_to_active_args(self.worker.keys, token, _LOCK_MS, room)
        return Call(self.worker._take, keys, args), token

    async def close(self) -> None:
        await self.worker.close()


class _Clock:
    """CPU seconds per phase of a round (``time.process_time``)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._at = time.process_time()

    def lap(self, phase: str) -> None:
        now = time.process_time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._at
        self._at = now


async def _floor(url: str, steps: int, batch: int, k: int) -> dict[str, float]:
    """``steps`` task jobs (and ``steps / k`` run jobs) through add, take and finish,
    ``batch`` task jobs per round trip; figures per task job (a step)."""
    prefix = f"floor-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    batches = batch_client(url)
    lane = Lane()
    tasks = _Side(f"{prefix}-tasks-noop", url, client, batches)
    runs = _Side(f"{prefix}-runs", url, client, batches)
    task_packed = packed_job_opts(_TASK_OPTS)
    try:
        # warm: scripts loaded, templates built
        await _rounds(tasks, runs, batches, lane, 3 * batch, batch, k, task_packed, _Clock())
        before = _server_figures(url)
        _writes[0] = 0
        clock = _Clock()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await _rounds(tasks, runs, batches, lane, steps, batch, k, task_packed, clock)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        writes = _writes[0]
        after = _server_figures(url)
    finally:
        await lane.close()
        await tasks.close()
        await runs.close()
        keys = [key async for key in client.scan_iter(match=f"*{prefix}*", count=1000)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
        await client.aclose()
        await batches.aclose()
    per = 1e6 / steps
    out = {
        "client_cpu_us": cpu * per,
        "server_cpu_us": (after["cpu_s"] - before["cpu_s"]) * per,
        "script_us": (after["script_usec"] - before["script_usec"]) / steps,
        "script_calls": (after["script_calls"] - before["script_calls"]) / steps,
        "round_trips": writes / steps,
        "steps_per_s": steps / wall,
    }
    for phase, seconds in clock.phases.items():
        out[f"client {phase}"] = seconds * per
    return out


async def _rounds(
    tasks: _Side,
    runs: _Side,
    batches: aioredis.Redis,
    lane: Lane,
    steps: int,
    batch: int,
    k: int,
    task_packed: bytes,
    clock: _Clock,
) -> None:
    """The rounds: each adds ``batch`` tasks (and a run start per ``k`` steps), finishes
    what the previous round took, and takes what it added, in one transaction."""
    done = 0
    run_debt = 0.0
    seq = 0
    while done < steps or tasks.held or runs.held:
        n = min(batch, steps - done)
        done += n
        run_debt += n / k
        n_runs = int(run_debt)
        run_debt -= n_runs
        now_ms = int(time.time() * 1000)
        clock.lap("other")
        # adds: one looped call per 100 jobs of a shape, as RedisTransport._write groups them
        calls: list[Call] = []
        added: list[Any] = []
        if n:
            for _ in range(n):
                seq += 1
                task = StepTask(
                    f"r{seq // k:019d}", seq % k + 1, "noop", "noop", seq, sent_at=now_ms
                )
                added.append(
                    added_job(tasks.scripts, "task", task.to_wire(), _TASK_OPTS, None, task_packed)
                )
            for start in range(0, n, CALL_MAX):
                part = added[start : start + CALL_MAX]
                first = part[0]
                jobs = [(a.data, a.opts) for a in part]
                calls.append(
                    add_call(
                        add_script(first.script), first.keys, first.packed, first.timestamp, jobs
                    )
                )
        own: list[Any] = []
        for _ in range(n_runs):
            run_id = uuid.uuid4().hex
            opts = {**_RUN_OPTS, "jobId": f"start-{run_id}"}
            own.append(added_job(runs.scripts, "run", {"runId": run_id, "wake": False}, opts))
        if own:
            first = own[0]
            each = [(a.packed, a.data, a.opts) for a in own]
            calls.append(
                add_each_call(add_each_script(first.script), first.keys, first.timestamp, each)
            )
        n_adds = len(calls)
        clock.lap("pack adds")
        # finishes of what the previous round took
        finishes = []
        for side in (tasks, runs):
            if side.held:
                done_jobs = [(job, None, job.token) for job in side.held]
                made = side.worker.finish_calls(done_jobs)
                finishes.append((side, done_jobs, len(calls), len(made)))
                calls += made
        clock.lap("pack finishes")
        takes = []
        for side, room in ((tasks, n), (runs, n_runs)):
            if room:
                call, token = side.take(room)
                takes.append((side, token, len(calls)))
                calls.append(call)
        clock.lap("pack takes")
        replies = await run_scripts(batches, calls, transaction=True, lane=lane)
        clock.lap("exchange")
        for reply in replies[:n_adds]:
            for one in reply if isinstance(reply, list) else [reply]:
                check_added(one)
        for side, done_jobs, at, count in finishes:
            for outcome in side.worker.finish_outcomes(done_jobs, replies[at : at + count]):
                if outcome is not None:
                    raise outcome
            side.held = []
        clock.lap("read adds, finishes")
        for side, token, at in takes:
            taken, _ = parse_taken(replies[at])
            side.held = side.worker._jobs(taken, token)
        clock.lap("parse taken, build jobs")
        for job in tasks.held:
            StepTask.from_wire(job.data)
        clock.lap("task from wire")
        if len(tasks.held) != n:
            raise RuntimeError(f"took {len(tasks.held)} tasks of {n}")


async def _server_split(url: str, steps: int, batch: int) -> dict[str, float]:
    """Redis's script time per task job for each of BullMQ's scripts on the step path:
    ``batch`` task jobs added, then taken, then finished, each its own call and round
    trip (``INFO commandstats`` read between them); microseconds per job."""
    prefix = f"floor-split-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    batches = batch_client(url)
    tasks = _Side(f"{prefix}-tasks-noop", url, client, batches)
    packed = packed_job_opts(_TASK_OPTS)
    spent = {"add (addPrioritizedJob)": 0.0, "take (moveToActive)": 0.0}
    spent["finish (moveToFinished)"] = 0.0

    async def timed(phase: str, calls: list[Call]) -> list[Any]:
        before = (await asyncio.to_thread(_server_figures, url))["script_usec"]
        replies = await run_scripts(batches, calls)
        after = (await asyncio.to_thread(_server_figures, url))["script_usec"]
        spent[phase] += after - before
        return replies

    try:
        for seq in range(0, steps, batch):
            now_ms = int(time.time() * 1000)
            added = [
                added_job(
                    tasks.scripts,
                    "task",
                    StepTask(
                        f"r{i // 5:019d}", i % 5 + 1, "noop", "noop", i, sent_at=now_ms
                    ).to_wire(),
                    _TASK_OPTS,
                    None,
                    packed,
                )
                for i in range(seq, seq + batch)
            ]
            first = added[0]
            jobs = [(a.data, a.opts) for a in added]
            call = add_call(
                add_script(first.script), first.keys, first.packed, first.timestamp, jobs
            )
            await timed("add (addPrioritizedJob)", [call])
            take, token = tasks.take(batch)
            (reply,) = await timed("take (moveToActive)", [take])
            held = tasks.worker._jobs(parse_taken(reply)[0], token)
            done = [(job, None, job.token) for job in held]
            await timed("finish (moveToFinished)", tasks.worker.finish_calls(done))
    finally:
        await tasks.close()
        keys = [key async for key in client.scan_iter(match=f"*{prefix}*", count=1000)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
        await client.aclose()
        await batches.aclose()
    return {phase: usec / steps for phase, usec in spent.items()}


async def _transport_share(url: str, transport: str, runs: int, k: int) -> dict[str, float]:
    """The transport's own share as ``redis_path.py`` measures it: ``runs`` make-believe runs
    each sending ``k`` tasks one after the other through ``transport`` (``local`` or
    ``redis``), served and settled in this process (no engine, no store). CPU per step."""
    from durably.transports.local import LocalTransport
    from durably.transports.redis import RedisTransport

    prefix = f"floor-share-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    chosen: Any = LocalTransport() if transport == "local" else RedisTransport(url, prefix=prefix)
    waiting: dict[str, asyncio.Future[StepResult]] = {}

    async def on_task(task: StepTask) -> None:
        await chosen.send_result(StepResult(task.run_id, task.seq, ok=True, output=task.input))

    async def on_results(results: list[StepResult]) -> None:
        for result in results:
            future = waiting.pop(result.step_id, None)
            if future is not None and not future.done():
                future.set_result(result)

    async def on_beat(_: Heartbeat) -> None:
        return None

    async def run(run_id: str, steps: int) -> None:
        loop = asyncio.get_running_loop()
        for seq in range(1, steps + 1):
            task = StepTask(run_id, seq, "noop", "noop", input=seq, sent_at=int(time.time() * 1e3))
            future: asyncio.Future[StepResult] = loop.create_future()
            waiting[task.step_id] = future
            await chosen.dispatch([task])
            await future

    await chosen.open()
    try:
        await chosen.consume_results(on_results, on_beat)
        await chosen.serve(["noop"], on_task, concurrency=64)
        await asyncio.gather(*(run(f"warm{i}", 2) for i in range(20)))
        cpu0 = time.process_time()
        await asyncio.gather(*(run(f"r{i}", k) for i in range(runs)))
        cpu = time.process_time() - cpu0
    finally:
        await chosen.close()
        if transport == "redis":
            client = aioredis.Redis.from_url(url)
            keys = [key async for key in client.scan_iter(match=f"*{prefix}*", count=1000)]
            for start in range(0, len(keys), 500):
                await client.delete(*keys[start : start + 500])
            await client.aclose()
    return {"cpu_us": cpu * 1e6 / (runs * k)}


def _engine_side(transport: str, db: str, n: int, k: int, url: str) -> dict[str, Any]:
    """One ``dispatch_durably.py throughput`` run in a fresh process: its JSON line."""
    argv = [sys.executable, str(HERE / "dispatch_durably.py"), "--db", db, "--name"]
    argv += [f"bench_floor_{transport}", "--transport", transport]
    argv += ["throughput", "--n", str(n), "--k", str(k), "--warmup", "10"]
    env = {**os.environ, "BENCH_REDIS_URL": url}
    before = _server_figures(url)
    done = subprocess.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    after = _server_figures(url)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{transport}: no result\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    if "cpu_us_per_step" not in result:
        raise RuntimeError(f"{transport}: {result}")
    # the whole process's (its warm-up workflows too): the server's CPU per step timed
    steps = n * k
    result["server_cpu_us_per_step"] = (after["cpu_s"] - before["cpu_s"]) * 1e6 / steps
    result["script_calls_per_step"] = (after["script_calls"] - before["script_calls"]) / steps
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spawn_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    """A private redis-server without persistence (as the shared one runs)."""
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="redis-floor-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", workdir, "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url, workdir
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the private redis-server did not answer")


def _median(values: list[float]) -> str:
    digits = 3 if statistics.median(values) < 1 else 1
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:9.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=5000, help="task jobs per floor round")
    p.add_argument("--batch", default="20", help="comma list: task jobs per round trip")
    p.add_argument("--k", type=int, default=5, help="steps per workflow (a run job per K)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--db", default="sqlite", choices=["sqlite", "postgres"])
    p.add_argument("--n", type=int, default=1000, help="workflows of the engine runs")
    p.add_argument("--transports", default="inline,local,redis", help="engine runs")
    p.add_argument("--no-engine", action="store_true", help="the floor only")
    p.add_argument("--shared", action="store_true", help="use BENCH_REDIS_URL, no own server")
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    transports = [] if args.no_engine else [t for t in args.transports.split(",") if t]
    _count_writes()
    proc, workdir = None, ""
    if args.shared or shutil.which("redis-server") is None:
        url = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    else:
        proc, url, workdir = _spawn_redis()
    floors: dict[int, list[dict[str, float]]] = {b: [] for b in batches}
    shares: dict[str, list[float]] = {"local": [], "redis": []}
    split: list[dict[str, float]] = []
    engine: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
    try:
        for rep in range(args.repeat):
            for b in batches:
                floors[b].append(asyncio.run(_floor(url, args.steps, b, args.k)))
            split.append(asyncio.run(_server_split(url, args.steps, max(batches))))
            for t in shares:
                got = asyncio.run(_transport_share(url, t, args.steps // args.k, args.k))
                shares[t].append(got["cpu_us"])
            for t in transports:
                engine[t].append(_engine_side(t, args.db, args.n, args.k, url))
            sys.stderr.write(f"[{rep + 1}/{args.repeat}] done\n")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
    where = "a private redis-server" if proc is not None else url
    print(f"\nBullMQ wire floor per step (1 task job + 1/{args.k} run job), on {where};")
    print(f"median (min-max) of {args.repeat} rounds of {args.steps} steps each")
    for b in batches:
        rows = floors[b]
        print(f"\n batch {b} task jobs per round trip")
        for key in rows[0]:
            print(f"  {key:32s} {_median([r[key] for r in rows])}")
    print(f"\nRedis script time per task job, each script alone (batch {max(batches)}):")
    for key in split[0]:
        print(f"  {key:32s} {_median([r[key] for r in split])}")
    print(f"\nTransports alone (redis_path.py's make-believe runs, {args.steps // args.k} x K):")
    for t, values in shares.items():
        print(f"  {t + '://':10s} CPU us/step {_median(values)}")
    if not transports:
        return
    print(f"\nThe engine, dispatch_durably.py throughput --db {args.db} --n {args.n} --k {args.k}:")
    cpu: dict[str, float] = {}
    rate: dict[str, float] = {}
    for t in transports:
        cpu[t] = statistics.median(r["cpu_us_per_step"] for r in engine[t])
        rate[t] = statistics.median(r["steps_per_s"] for r in engine[t])
        label = "local_step" if t == "inline" else f"{t}://"
        print(
            f"  {label:12s} CPU us/step {_median([r['cpu_us_per_step'] for r in engine[t]])}"
            f"   steps/s {_median([r['steps_per_s'] for r in engine[t]])}"
        )
        if t == "redis":
            print(
                "  redis://     Redis server CPU us/step (warm-up included) "
                f"{_median([r['server_cpu_us_per_step'] for r in engine[t]])}, EVALSHA calls/step "
                f"{_median([r['script_calls_per_step'] for r in engine[t]])}"
            )
    if "inline" not in cpu or "local" not in cpu:
        return
    base, local = cpu["inline"], cpu["local"]
    local_share = statistics.median(shares["local"])
    print("\nImplied lower bounds on redis:// / local_step in CPU per step:")
    for b in batches:
        client = statistics.median(r["client_cpu_us"] for r in floors[b])
        server = statistics.median(r["server_cpu_us"] for r in floors[b])
        print(f"  batch {b}:")
        print(
            f"    (local:// + wire client) / local_step = ({local:.0f} + {client:.0f}) / "
            f"{base:.0f} = {(local + client) / base:.2f}x"
        )
        print(
            f"    the same, local://'s own transport share counted as free = "
            f"({local:.0f} - {local_share:.0f} + {client:.0f}) / {base:.0f} = "
            f"{(local - local_share + client) / base:.2f}x"
        )
        print(
            f"    + Redis's CPU (same 2 cores) = ({local:.0f} + {client:.0f} + {server:.0f}) / "
            f"{base:.0f} = {(local + client + server) / base:.2f}x"
        )
    if "redis" in cpu:
        print(
            f"  measured: redis:// / local_step CPU {cpu['redis'] / base:.2f}x, "
            f"steps/s {rate['inline'] / rate['redis']:.2f}x; "
            f"local:// / local_step CPU {local / base:.2f}x, "
            f"steps/s {rate['inline'] / rate['local']:.2f}x"
        )


if __name__ == "__main__":
    main()
