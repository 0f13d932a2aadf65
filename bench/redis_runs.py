"""The ``redis://`` run queue alone: runs' starts pushed, taken and finished through BullMQ.

Pushes ``--runs`` starts (a start's job has an id of its own, made of its run id and pending
state) ``--burst`` per push, as an engine's run queue pushes a loop iteration's submissions, and
takes them back in the same process (a deliver that answers at once, 64 held at a time, as an
engine's run queue does). Prints this process's CPU per run, Redis's ``EVALSHA`` calls per run and
their time (its ``INFO commandstats``, every client's: read it as an upper bound on a shared
server), and the wall time per run.

    python redis_runs.py --runs 4000 --burst 50
    python redis_runs.py --runs 1000 --burst 1      # one start per push
    PYTHONPATH=/tmp/before/src python redis_runs.py  # another tree (before/after)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import redis

from durably._queue import Delivered, QueuedRun
from durably.transports.redis import RedisTransport

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def _scripts(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


async def _round(runs: int, burst: int) -> dict[str, float]:
    prefix = f"benchruns{uuid.uuid4().hex[:8]}"
    transport = RedisTransport(REDIS_URL, prefix=prefix)
    await transport.open()
    queue = transport.run_queue()
    taken = [0]
    everything = asyncio.Event()

    async def deliver(_body: str) -> Delivered:
        taken[0] += 1
        if taken[0] >= runs:
            everything.set()
        return Delivered.DONE

    await queue.start(None, deliver, owner="bench", lease_ms=30_000, capacity=64)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        await asyncio.sleep(0.3)  # the consumer waits on its queue
        calls0, usec0 = _scripts(client)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(0, runs, burst):
            await queue.push(
                [QueuedRun(uuid.uuid4().hex, False, "default", 0, "1") for _ in range(burst)]
            )
        await asyncio.wait_for(everything.wait(), 120)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        calls1, usec1 = _scripts(client)
        await queue.stop_claiming()
        await queue.hand_back()
        for key in client.scan_iter(match=f"bull:{prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()
        await transport.close()
    return {
        "cpu_us_per_run": 1e6 * (cpu1 - cpu0) / runs,
        "evalsha_calls_per_run": (calls1 - calls0) / runs,
        "evalsha_us_per_run": (usec1 - usec0) / runs,
        "wall_us_per_run": 1e6 * (wall1 - wall0) / runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4000)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    rounds = [asyncio.run(_round(args.runs, args.burst)) for _ in range(args.repeat)]
    for name in rounds[0]:
        values = sorted(r[name] for r in rounds)
        print(
            f"{name:24} median {values[len(values) // 2]:10.2f}"
            f"  min {values[0]:10.2f}  max {values[-1]:10.2f}"
        )


if __name__ == "__main__":
    main()
