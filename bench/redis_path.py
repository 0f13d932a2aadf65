"""The ``redis://`` transport's own share of a dispatched step, without an engine or a store.

``--runs`` make-believe runs each send ``--k`` step tasks one after the other through
:class:`~durably.transports.redis.RedisTransport` (``dispatch``), this process serves them (a
handler that answers at once with ``send_result``, ``--concurrency`` at a time, as an engine's
step server does) and consumes the results (settled here, as an engine's dispatcher would);
each result lets its run send its next task. Prints this process's CPU per step, the
client's writes (round trips) per step, and Redis's script time per step (its
``INFO commandstats``, every client's: read it as an upper bound on a shared server).

    python redis_path.py --runs 1000 --k 5 --repeat 5
    python redis_path.py --runs 1 --k 200            # one step at a time (the latency path)
    PYTHONPATH=/tmp/before/src python redis_path.py   # another tree (before/after)
    python redis_path.py --cprofile out.prof

The figures are the transport's alone: an engine adds its turns, checkpoints and store
writes on top (``dispatch_compare.py`` measures those together).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import time
import uuid
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection

from durably.transports.redis import RedisTransport
from durably.wire import Heartbeat, StepResult, StepTask

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

_writes = [0]


def _count_writes() -> None:
    original = AbstractConnection.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        _writes[0] += 1
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


def _script_usec() -> tuple[int, int]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    calls = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_exec"))
    usec = sum(v["usec"] for k, v in stats.items() if k == "cmdstat_evalsha")
    return calls, usec


async def _forget(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"*{prefix}*", count=1000)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()


async def _round(args: argparse.Namespace, profile: cProfile.Profile | None) -> dict[str, float]:
    prefix = f"bench-path-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    transport = RedisTransport(REDIS_URL, prefix=prefix)
    waiting: dict[str, asyncio.Future[StepResult]] = {}

    async def on_task(task: StepTask) -> None:
        await transport.send_result(StepResult(task.run_id, task.seq, ok=True, output=task.input))

    async def on_results(results: list[StepResult]) -> None:
        for result in results:
            future = waiting.pop(result.step_id, None)
            if future is not None and not future.done():
                future.set_result(result)

    async def on_beat(_: Heartbeat) -> None:
        return None

    async def run(run_id: str, k: int) -> None:
        loop = asyncio.get_running_loop()
        for seq in range(1, k + 1):
            task = StepTask(run_id, seq, "noop", "noop", input=seq, sent_at=int(time.time() * 1e3))
            future: asyncio.Future[StepResult] = loop.create_future()
            waiting[task.step_id] = future
            await transport.dispatch([task])
            result = await future
            assert result.ok and result.output == seq

    await transport.open()
    try:
        await transport.consume_results(on_results, on_beat)
        await transport.serve(["noop"], on_task, concurrency=args.concurrency)
        await asyncio.gather(*(run(f"warm{i}", 2) for i in range(20)))
        calls0, usec0 = _script_usec()
        _writes[0] = 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        await asyncio.gather(*(run(f"r{i}", args.k) for i in range(args.runs)))
        if profile is not None:
            profile.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        writes = _writes[0]
        calls1, usec1 = _script_usec()
    finally:
        await transport.close()
        await _forget(prefix)
    steps = args.runs * args.k
    return {
        "cpu_us_per_step": cpu * 1e6 / steps,
        "steps_per_s": steps / wall,
        "round_trips_per_step": writes / steps,
        "redis_script_us_per_step": (usec1 - usec0) / steps,
        "redis_calls_per_step": (calls1 - calls0) / steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--k", type=int, default=5)
    p.add_argument(
        "--concurrency", type=int, default=64, help="handlers at once (step_concurrency)"
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cprofile", default=None)
    args = p.parse_args()
    _count_writes()
    profile = cProfile.Profile(time.process_time) if args.cprofile else None
    rows = [asyncio.run(_round(args, profile)) for _ in range(args.repeat)]
    for key in rows[0]:
        values = sorted(row[key] for row in rows)
        print(
            f"{key:26s} median {values[len(values) // 2]:10.2f}"
            f"  min {values[0]:10.2f}  max {values[-1]:10.2f}"
        )
    if profile is not None:
        profile.dump_stats(args.cprofile)


if __name__ == "__main__":
    main()
