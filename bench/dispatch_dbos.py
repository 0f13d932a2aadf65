"""The DBOS Transact side of the dispatched-steps benchmark (DBOS 3.x, async API).

DBOS has no "task sent to whichever worker serves this name" primitive; its closest equivalent
is a **queue**: a workflow enqueues a child workflow on a ``Queue`` (``enqueue_async``), any DBOS
process listening to that queue dequeues and runs it, and the parent awaits the child's handle.
The child here is a workflow whose body is one trivial ``@DBOS.step`` (an enqueued function must
be a workflow), so one dispatched step costs DBOS an enqueue, a dequeue, a child workflow with
one step, and the parent's ``get_result``. The same process enqueues and dequeues, as durably's
side both dispatches and serves.

    python dispatch_dbos.py --db sqlite throughput --n 200 --k 5
    python dispatch_dbos.py --db postgres latency --count 200
    python dispatch_dbos.py --db postgres fan --count 20 --width 100

DBOS's queue worker and the parent's ``get_result`` both *poll*, every second by default
(``polling_interval_sec=1.0``). ``--poll`` sets both (default 0.05 s, the safety-net poll of
durably's ``db://`` transport on SQLite); ``--poll 1`` measures DBOS as shipped.
``--sqlite-journal wal`` switches the SQLite file to WAL before DBOS opens it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from importlib.metadata import version
from typing import Any

from common import (
    Target,
    emit,
    error_result,
    latency_summary,
    make_target,
    prepare_workdir,
    reset_target,
    throughput_result,
    timed_batch,
)
from dbos import DBOS, DBOSConfig
from dispatch_durably import Profiler, dispatch_parser

POLL = 0.05  # set from --poll before anything runs
QUEUE: Any = None


@DBOS.step()
async def noop(x: int) -> int:
    return x


@DBOS.workflow()
async def task_wf(x: int) -> int:
    """What a dispatched step becomes: a queued child workflow with one step."""
    return await noop(x)


async def dispatch(x: int) -> int:
    """``ctx.step(noop, x)``'s equivalent inside a DBOS workflow."""
    h = await QUEUE.enqueue_async(task_wf, x)
    r: int = await h.get_result(polling_interval_sec=POLL)
    return r


@DBOS.workflow()
async def steps_wf(k: int) -> int:
    for i in range(k):
        await dispatch(i)
    return k


@DBOS.workflow()
async def one_step_wf(x: int) -> int:
    return await dispatch(x)


@DBOS.workflow()
async def fan_wf(width: int) -> int:
    handles = [await QUEUE.enqueue_async(task_wf, i) for i in range(width)]
    outs = [await h.get_result(polling_interval_sec=POLL) for h in handles]
    return sum(outs)


def launch(t: Target, sqlite_journal: str | None) -> None:
    global QUEUE
    if t.db == "sqlite" and sqlite_journal:
        import sqlite3

        assert t.sqlite_path is not None
        with sqlite3.connect(t.sqlite_path) as c:
            c.execute(f"PRAGMA journal_mode={sqlite_journal}")
    config: DBOSConfig = {
        "name": "durably-bench",
        "system_database_url": t.url,
        "log_level": "WARNING",
        "run_migrations": True,
    }
    DBOS(config=config)
    DBOS.launch()
    QUEUE = DBOS.register_queue("steps", polling_interval_sec=POLL)


async def one_at_a_time(
    wf: Any, inputs: list[int], expect: Any, warmup: int, timeout: float, prof: Profiler
) -> tuple[list[float], float]:
    samples: list[float] = []
    total = 0.0
    for i, x in enumerate(inputs):
        if i == warmup:
            prof.start()
        t0 = time.perf_counter()
        h = await DBOS.start_workflow_async(wf, x)
        r = await asyncio.wait_for(h.get_result(), timeout)
        dt = time.perf_counter() - t0
        if r != expect(x):
            raise RuntimeError(f"workflow returned {r!r}, expected {expect(x)!r}")
        if i >= warmup:
            samples.append(dt)
            total += dt
    prof.stop()
    return samples, total


async def run_scenario(args: Any, prof: Profiler) -> dict[str, Any]:
    if args.scenario == "throughput":
        k = args.k

        async def start(_: int) -> Any:
            return await DBOS.start_workflow_async(steps_wf, k)

        async def wait(h: Any) -> Any:
            return await h.get_result()

        if args.warmup:
            await timed_batch(args.warmup, start, wait, args.timeout)
        prof.start()
        t_started, elapsed, results = await timed_batch(args.n, start, wait, args.timeout)
        prof.stop()
        bad = [r for r in results if r != k]
        if bad:
            raise RuntimeError(f"{len(bad)} workflows returned a wrong result, e.g. {bad[0]!r}")
        return throughput_result(args.n, k, t_started, elapsed)
    if args.scenario == "latency":
        xs = list(range(args.warmup + args.count))
        samples, _ = await one_at_a_time(
            one_step_wf, xs, lambda x: x, args.warmup, args.timeout, prof
        )
        return latency_summary(samples)
    w = args.width
    xs = [w] * (args.warmup + args.count)
    samples, total = await one_at_a_time(
        fan_wf, xs, lambda _: w * (w - 1) // 2, args.warmup, args.timeout, prof
    )
    return {
        **latency_summary(samples),
        "width": w,
        "steps_per_s": round(w * len(samples) / total, 2),
    }


def main() -> None:
    global POLL
    p = dispatch_parser(__doc__ or "", "bench_dbos")
    p.add_argument("--poll", type=float, default=0.05, help="queue and get_result poll, seconds")
    p.add_argument("--sqlite-journal", default=None, help="e.g. wal: set before DBOS opens it")
    args = p.parse_args()
    POLL = args.poll
    if args.profile:  # relative to where it was asked, not the work dir
        args.profile = os.path.abspath(args.profile)
    wd = prepare_workdir(args.workdir)
    t = make_target(args.db, args.name, wd)
    base: dict[str, Any] = {
        "side": "dbos",
        "version": version("dbos"),
        "db": args.db,
        "transport": "queue",
        "poll_s": POLL,
        "scenario": args.scenario,
    }
    logging.getLogger("dbos").setLevel(logging.WARNING)
    try:
        asyncio.run(reset_target(t))
        launch(t, args.sqlite_journal)
    except Exception as exc:
        emit(error_result(base, exc))
        return
    try:
        res = asyncio.run(run_scenario(args, Profiler(args.profile)))
        emit({**base, **res})
    except Exception as exc:
        emit(error_result(base, exc))
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=0)


if __name__ == "__main__":
    main()
