"""The DBOS Transact side of the comparison (DBOS 3.x, async API).

Workflows and steps are ``async def`` decorated with ``@DBOS.workflow()`` / ``@DBOS.step()``;
runs are started with ``DBOS.start_workflow_async`` (N at once, gathered) and awaited with
``handle.get_result()``, as durably's side does with ``engine.start`` / ``engine.wait_for_run``.

    python dbos_side.py --db sqlite throughput --n 500 --k 5
    python dbos_side.py --db postgres latency --count 200

``--sqlite-journal wal`` switches the SQLite file to WAL before DBOS opens it (DBOS leaves
SQLite in its default rollback-journal mode); it is an extra, not the as-shipped default.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
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
    side_parser,
    throughput_result,
    timed_batch,
)
from dbos import DBOS, DBOSConfig


@DBOS.step()
async def trivial(i: int) -> int:
    return i


@DBOS.workflow()
async def bench_wf(k: int) -> int:
    for i in range(k):
        await trivial(i)
    return k


@DBOS.workflow()
async def one_step_wf(x: int) -> int:
    return await trivial(x)


def launch(t: Target, sqlite_journal: str | None) -> None:
    if t.db == "sqlite" and sqlite_journal:
        assert t.sqlite_path is not None
        with sqlite3.connect(t.sqlite_path) as c:  # journal_mode=WAL is stored in the file
            c.execute(f"PRAGMA journal_mode={sqlite_journal}")
    config: DBOSConfig = {
        "name": "durably-bench",
        "system_database_url": t.url,
        "log_level": "WARNING",
        "run_migrations": True,
    }
    DBOS(config=config)
    DBOS.launch()


def sqlite_journal_mode(t: Target) -> str | None:
    if t.db != "sqlite" or t.sqlite_path is None:
        return None
    with sqlite3.connect(t.sqlite_path) as c:
        row = c.execute("PRAGMA journal_mode").fetchone()
    return str(row[0]) if row else None


async def throughput(n: int, k: int, warmup: int, timeout: float) -> dict[str, Any]:
    async def start(_: int) -> Any:
        return await DBOS.start_workflow_async(bench_wf, k)

    async def wait(h: Any) -> Any:
        return await h.get_result()

    if warmup:
        await timed_batch(warmup, start, wait, timeout)
    t_started, elapsed, results = await timed_batch(n, start, wait, timeout)
    bad = [r for r in results if r != k]
    if bad:
        raise RuntimeError(f"{len(bad)} workflows returned a wrong result, e.g. {bad[0]!r}")
    return throughput_result(n, k, t_started, elapsed)


async def latency(count: int, warmup: int, timeout: float) -> dict[str, Any]:
    samples: list[float] = []
    for i in range(warmup + count):
        t0 = time.perf_counter()
        h = await DBOS.start_workflow_async(one_step_wf, i)
        r = await asyncio.wait_for(h.get_result(), timeout)
        dt = time.perf_counter() - t0
        if r != i:
            raise RuntimeError(f"workflow returned {r!r}, expected {i}")
        if i >= warmup:
            samples.append(dt)
    return latency_summary(samples)


def main() -> None:
    p = side_parser(__doc__ or "")
    p.add_argument("--sqlite-journal", default=None, help="e.g. wal: set before DBOS opens it")
    args = p.parse_args()
    wd = prepare_workdir(args.workdir)
    t = make_target(args.db, args.name or "bench_dbos", wd)
    base: dict[str, Any] = {
        "side": "dbos",
        "version": version("dbos"),
        "db": args.db,
        "scenario": args.scenario,
    }
    logging.getLogger("dbos").setLevel(logging.WARNING)
    try:
        if not args.keep:  # --keep: dbos_grow.py's seeded database, measured as it is
            asyncio.run(reset_target(t))
        launch(t, args.sqlite_journal)
    except Exception as exc:  # the table shows the reason instead of crashing
        emit(error_result(base, exc))
        return
    try:
        if args.scenario == "throughput":
            res = asyncio.run(throughput(args.n, args.k, args.warmup, args.timeout))
        else:
            res = asyncio.run(latency(args.count, args.warmup, args.timeout))
        out = {**base, **res}
        jm = sqlite_journal_mode(t)
        if jm:
            out["sqlite_journal_mode"] = jm
        emit(out)
    except Exception as exc:
        emit(error_result(base, exc))
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=0)


if __name__ == "__main__":
    main()
