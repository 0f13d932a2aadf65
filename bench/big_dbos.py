"""DBOS's side of the big shapes (``big.py``): a fan of N child workflows, N sleeping workflows.

    python big_dbos.py fan --n 10000
    python big_dbos.py park --n 10000 --lead 90 --spread 60
    python big_dbos.py wake --n 10000 --first-due-ms ... --spread 60 --poll 1

**fan**: one parent workflow starts N child workflows (``DBOS.start_workflow_async``, gathered)
and awaits every handle; each child returns its input, as ``scale.py fanout``'s leaf does.
Seconds from the parent's start to its result, children/s, peak RSS of the process.

**suspended**: ``park`` launches DBOS on a fresh database and starts N workflows that
``await DBOS.sleep_async(due - now)`` (a durable sleep: DBOS records its end time, and a
recovered workflow sleeps only what is left) then run one step; once every one has recorded its
sleep, the process stops DBOS and exits, leaving N ``PENDING`` workflows. ``wake`` is a fresh
process with the same executor id and application version: ``DBOS.launch()`` recovers them
(DBOS's way of taking over a dead process's workflows), and its RSS is sampled every 0.25 s
while they sleep (before the first due time), while they fire, and at the end. Each run's lag is
the wall clock of its step minus its due time. ``within_one_poll`` is the share within
``--poll`` seconds, durably's poll interval: DBOS's sleep is an in-memory timer, not a poll, so
the same yardstick serves both.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from importlib.metadata import version
from typing import Any

from common import (
    RssSampler,
    emit,
    error_result,
    make_target,
    prepare_workdir,
    reset_target,
    rss_mb,
    wake_result,
)
from dbos import DBOS, DBOSConfig

LAGS: list[float] = []


@DBOS.workflow(name="leaf")
async def leaf(i: int) -> int:
    return i


@DBOS.workflow(name="fan")
async def fan(count: int) -> int:
    handles = await asyncio.gather(*(DBOS.start_workflow_async(leaf, i) for i in range(count)))
    outs = await asyncio.gather(*(h.get_result() for h in handles))
    if list(outs) != list(range(count)):
        raise RuntimeError("children's outputs are not in input order")
    return len(outs)


@DBOS.step()
async def woke(due_ms: int) -> int:
    now = time.time()
    LAGS.append(now - due_ms / 1000.0)
    return int(now * 1000)


@DBOS.workflow(name="nap")
async def nap(due_ms: int) -> int:
    # never 0: DBOS.sleep_async(0) returns without recording a step, so a workflow recovered
    # after its due time would number its next step differently from its first execution
    # (DBOSUnexpectedStepError); the recorded end time is what a recovered sleep waits for
    await DBOS.sleep_async(max(0.001, due_ms / 1000.0 - time.time()))
    return await woke(due_ms)


def launch(url: str) -> None:
    """DBOS on ``url`` with a fixed executor id and application version."""
    config: DBOSConfig = {
        "name": "durably-bench",
        "system_database_url": url,
        "log_level": "WARNING",
        "run_migrations": True,
        # fixed, so the wake process recovers what the park process left (recovery matches it)
        "application_version": "bench-big",
        "executor_id": "bench-big",
    }
    DBOS(config=config)
    DBOS.launch()


async def count(url: str, sql: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()


SLEPT = (
    "SELECT count(DISTINCT o.workflow_uuid) FROM dbos.operation_outputs o "
    "JOIN dbos.workflow_status s ON s.workflow_uuid = o.workflow_uuid "
    "WHERE s.name = 'nap' AND o.function_name ILIKE '%sleep%'"
)
DONE = "SELECT count(*) FROM dbos.workflow_status WHERE name = 'nap' AND status = 'SUCCESS'"
FAILED = (
    "SELECT count(*) FROM dbos.workflow_status WHERE name = 'nap' "
    "AND status NOT IN ('SUCCESS', 'PENDING', 'ENQUEUED')"
)


def run_fan(url: str, n: int, timeout: float) -> dict[str, Any]:
    """One parent of N children: seconds until its result."""
    launch(url)

    async def go() -> int:
        h = await DBOS.start_workflow_async(fan, n)
        r: int = await asyncio.wait_for(h.get_result(), timeout)
        return r

    t0 = time.perf_counter()
    out = asyncio.run(go())
    elapsed = time.perf_counter() - t0
    if out != n:
        raise RuntimeError(f"parent returned {out!r}, expected {n}")
    return {"n": n, "seconds": round(elapsed, 3), "per_s": round(n / elapsed, 1)}


def park(url: str, n: int, lead: float, spread: float) -> dict[str, Any]:
    """Start N sleeping workflows; return once every one has recorded its sleep."""
    t0 = time.time()
    base_ms = int((t0 + lead) * 1000)
    launch(url)

    async def go() -> None:
        for lo in range(0, n, 1000):
            hi = min(n, lo + 1000)
            await asyncio.gather(
                *(
                    DBOS.start_workflow_async(nap, base_ms + int(spread * 1000 * i / n))
                    for i in range(lo, hi)
                )
            )
        while await count(url, SLEPT) < n:
            if time.time() > t0 + lead:
                raise RuntimeError(f"not all {n} workflows asleep {lead} s after the park began")
            await asyncio.sleep(0.5)

    asyncio.run(go())
    return {"parked": n, "park_seconds": round(time.time() - t0, 1), "first_due_ms": base_ms}


def wake(
    url: str, n: int, first_due_ms: int, spread: float, poll: float, timeout: float
) -> dict[str, Any]:
    """Recover the parked workflows in this fresh process; RSS and lag until all are done."""
    rss_before = rss_mb()
    sampler = RssSampler()
    sampler.start()
    t_open = time.time()
    launch(url)  # recovers the parked workflows

    async def until_done() -> None:
        deadline = time.time() + timeout
        while await count(url, DONE) < n:
            failed = await count(url, FAILED)
            if failed:  # a failed workflow never succeeds: say so now, not at the timeout
                raise RuntimeError(f"{failed} of {n} workflows failed (see dbos.workflow_status)")
            if time.time() > deadline:
                raise RuntimeError(f"timeout: {await count(url, DONE)}/{n} done")
            await asyncio.sleep(0.5)

    asyncio.run(until_done())
    t_done = time.time()
    sampler.stop()
    return wake_result(
        n,
        list(LAGS),
        sampler,
        poll=poll,
        spread=spread,
        first_due_ms=first_due_ms,
        rss_before=rss_before,
        t_open=t_open,
        t_done=t_done,
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["fan", "park", "wake"])
    p.add_argument("--name", default="bench_dbos_big")
    p.add_argument("--workdir", default=".work")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--lead", type=float, default=60.0)
    p.add_argument("--spread", type=float, default=60.0)
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--first-due-ms", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    t = make_target("postgres", args.name, prepare_workdir(args.workdir))
    base = {
        "side": "dbos",
        "version": version("dbos"),
        "db": "postgres",
        "scenario": f"big-{args.what}",
        "n": args.n,
    }
    try:
        if args.what in ("fan", "park"):
            asyncio.run(reset_target(t))
        if args.what == "fan":
            res = run_fan(t.url, args.n, args.timeout)
        elif args.what == "park":
            res = park(t.url, args.n, args.lead, args.spread)
        else:
            res = wake(t.url, args.n, args.first_due_ms, args.spread, args.poll, args.timeout)
        emit({**base, **res})
    except Exception as exc:
        emit(error_result(base, exc))
    # the parked workflows are still asleep in this process: leave without waiting for them
    # (DBOS.destroy would), as a crashed process would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
