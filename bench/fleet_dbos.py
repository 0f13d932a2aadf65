"""DBOS's side of the fleet scaling: W DBOS processes sharing one PostgreSQL.

Run by ``fleet.py --sides dbos`` in three roles, each its own process:

- ``schema``: ``DBOS.launch()`` once on the fresh database, so its system tables exist before
  the fleet starts (the processes do not all migrate at once);
- ``producer --m M --k K``: a ``DBOSClient`` enqueues M runs of ``fleet_wf(K)`` on the queue
  ``fleet`` (1,000 at a time), as durably's producer stores M runs with ``consumers="never"``;
- ``worker``: imports, says ready, and on "go" launches DBOS (its own ``executor_id``) with the
  queue registered; it runs what it dequeues until "stop", then prints its step count and CPU.

DBOS has no "any process takes the next run" other than a queue, so the fleet's shared work is a
queue. Two settings differ from DBOS's defaults, both for a fair race: ``worker_concurrency=256``
(durably's ``max_concurrent_runs`` default; without a limit the first process to poll claims
every enqueued run and the others idle), and ``polling_interval_sec=0.05`` (the queue poll; at
the default 1 s a process starts at most 256 runs a second). ``BENCH_DBOS_FLEET_POLL`` and
``BENCH_DBOS_FLEET_CONCURRENCY`` change them.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from typing import Any

from dbos import DBOS, DBOSConfig

STEPS = [0]
QUEUE = "fleet"
APP = "durably-bench"
APP_VERSION = "bench-fleet"


@DBOS.step()
async def fleet_step(i: int) -> int:
    STEPS[0] += 1
    return i


@DBOS.workflow(name="fleet_wf")
async def fleet_wf(k: int) -> int:
    for i in range(k):
        await fleet_step(i)
    return k


def config(url: str, executor_id: str | None = None) -> DBOSConfig:
    """The same DBOS configuration in every role (one app, one version)."""
    cfg: DBOSConfig = {
        "name": APP,
        "system_database_url": url,
        "log_level": "WARNING",
        "run_migrations": True,
        "application_version": APP_VERSION,
    }
    if executor_id:
        cfg["executor_id"] = executor_id
    return cfg


def register() -> None:
    """Declare the fleet's queue (database-backed in DBOS 3.x: after the launch)."""
    DBOS.register_queue(
        QUEUE,
        worker_concurrency=int(os.environ.get("BENCH_DBOS_FLEET_CONCURRENCY", "256")),
        polling_interval_sec=float(os.environ.get("BENCH_DBOS_FLEET_POLL", "0.05")),
    )


def schema(url: str) -> None:
    """Create DBOS's system tables and the queue on the fresh database."""
    DBOS(config=config(url))
    DBOS.launch()
    register()
    DBOS.destroy(workflow_completion_timeout_sec=0)


async def producer(url: str, m: int, k: int) -> None:
    from dbos import DBOSClient, EnqueueOptions

    client = DBOSClient(system_database_url=url)
    options: EnqueueOptions = {
        "queue_name": QUEUE,
        "workflow_name": "fleet_wf",
        "app_version": APP_VERSION,
        "application_name": APP,
    }
    t0 = time.perf_counter()
    try:
        for lo in range(0, m, 1000):
            hi = min(m, lo + 1000)
            await asyncio.gather(*(client.enqueue_async(options, k) for _ in range(lo, hi)))
    finally:
        client.destroy()
    print(json.dumps({"started": m, "seconds": round(time.perf_counter() - t0, 3)}), flush=True)


def worker(url: str) -> None:
    """Ready, then on "go" launch DBOS and serve the queue until "stop"."""
    print("ready", flush=True)
    sys.stdin.readline()  # "go"
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    DBOS(config=config(url, executor_id=f"fleet-{os.getpid()}"))
    DBOS.launch()
    register()
    sys.stdin.readline()  # "stop"
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    DBOS.destroy(workflow_completion_timeout_sec=0)
    out: dict[str, Any] = {
        "steps": STEPS[0],
        "cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 3),
        "peak_rss_mb": round(r1.ru_maxrss / 1024.0, 1),
        "statements": {},
    }
    print(json.dumps(out), flush=True)


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=["schema", "producer", "worker"])
    p.add_argument("--url", required=True)
    p.add_argument("--m", type=int, default=0)
    p.add_argument("--k", type=int, default=5)
    args = p.parse_args()
    if args.role == "schema":
        schema(args.url)
    elif args.role == "producer":
        asyncio.run(producer(args.url, args.m, args.k))
    else:
        worker(args.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
