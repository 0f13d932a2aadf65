"""Helpers shared by every side of the benchmark (durably, DBOS, the floor, scale).

Each side is a separate script run in its own process by ``compare.py``. A side prints exactly one
JSON object on its last line of stdout; everything else (logs, warnings) goes to stderr. A side
that cannot run (a missing feature, a store that does not exist yet) prints
``{"error": "...", "skipped": true}`` and exits 0, so the table shows the reason in its cell.

Databases are reset before every measurement: SQLite files are deleted, PostgreSQL databases are
dropped and re-created, so no run sees another's rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PG_ADMIN_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass(frozen=True)
class Target:
    """Where a side keeps its state: a SQLite file (relative to the work dir) or a PG database."""

    db: str  # "sqlite" | "postgres"
    url: str  # the URL the side passes to its engine
    sqlite_path: Path | None  # absolute path of the SQLite file, if db == "sqlite"
    pg_admin_url: str | None  # maintenance DB used to drop/create, if db == "postgres"
    pg_dbname: str | None


def pg_base_url() -> str:
    """Base URL of the PostgreSQL server, without a database name (env BENCH_PG_URL)."""
    return os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432").rstrip("/")


def run_id_shape() -> str:
    """The run ids a bench's engine makes and ``grow.py seed`` copies: ``time`` (the engine's
    own, time first) or ``random`` (``BENCH_RUN_IDS=random``: 128 random bits, the shape before
    2026-12-05), so one source tree measures both."""
    shape = os.environ.get("BENCH_RUN_IDS", "time")
    if shape not in ("time", "random"):
        raise SystemExit(f"BENCH_RUN_IDS must be time or random, not {shape!r}")
    return shape


def use_run_id_shape() -> None:
    """Make this process's engines start runs with ids of :func:`run_id_shape`."""
    if run_id_shape() == "random":
        import random

        import durably._start as start

        def random_run_id(now_ms: int | None = None) -> str:
            return f"{random.getrandbits(128):032x}"

        start.new_run_id = random_run_id


def make_target(db: str, name: str, workdir: Path) -> Target:
    """A fresh target named ``name`` (file ``name.db`` or database ``name``).

    SQLite URLs are written relative (``sqlite:///name.db``) and the side runs with ``workdir`` as
    its current directory, so the URL means the same file whether the engine reads the part after
    ``sqlite:///`` as a relative path (durably) or as SQLAlchemy does (DBOS).
    """
    if db == "sqlite":
        return Target(db, f"sqlite:///{name}.db", workdir / f"{name}.db", None, None)
    if db == "postgres":
        # BENCH_DB_SUFFIX: benches of several checkouts share one server; each drops and
        # re-creates its databases by name, so give yours their own names
        name += os.environ.get("BENCH_DB_SUFFIX", "")
        base = pg_base_url()
        return Target(db, f"{base}/{name}", None, f"{base}/postgres", name)
    raise SystemExit(f"unknown db {db!r} (use sqlite or postgres)")


def remove_sqlite(path: Path) -> None:
    """Delete a SQLite database file with its WAL, shared-memory and journal files."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(str(path) + suffix).unlink(missing_ok=True)


async def reset_target(t: Target) -> None:
    """Delete the SQLite file(s) or drop and re-create the PostgreSQL database."""
    if t.db == "sqlite":
        assert t.sqlite_path is not None
        remove_sqlite(t.sqlite_path)
        return
    import asyncpg  # only the bench venv needs it

    assert t.pg_admin_url is not None and t.pg_dbname is not None
    conn = await asyncpg.connect(t.pg_admin_url)
    try:
        ident = '"' + t.pg_dbname.replace('"', '""') + '"'
        await conn.execute(f"DROP DATABASE IF EXISTS {ident} WITH (FORCE)")
        await conn.execute(f"CREATE DATABASE {ident}")
    finally:
        await conn.close()


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def rss_mb() -> float:
    """Resident set size of this process now, in MiB (``nan`` where /proc has none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024.0, 1)
    return float("nan")


class RssSampler:
    """``(wall clock, RSS MiB)`` every ``every`` seconds between :meth:`start` and
    :meth:`stop`, on a thread of its own: the event loop being sampled (or DBOS's
    own threads) may be too busy to take samples on time."""

    def __init__(self, every: float = 0.25) -> None:
        self.every = every
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), rss_mb()))
            self._stop.wait(self.every)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wake_result(
    n: int,
    lags: Sequence[float],
    sampler: RssSampler,
    *,
    poll: float,
    spread: float,
    first_due_ms: int,
    rss_before: float,
    t_open: float,
    t_done: float,
) -> dict[str, Any]:
    """What ``big.py``'s and ``big_dbos.py``'s wake processes report alike: RSS idle
    (samples before the first due time), while firing and at the end, and each
    run's lag (seconds from its due time to its step) as percentiles and as the
    share within one ``poll``."""
    first_due = first_due_ms / 1000.0
    idle = [m for t, m in sampler.samples if t < first_due]
    firing = [m for t, m in sampler.samples if t >= first_due]
    return {
        "n": n,
        "poll_interval_s": poll,
        "rss_before_engine_mb": rss_before,
        "rss_idle_suspended_mb": max(idle) if idle else None,
        "idle_seconds": round(first_due - t_open, 1),
        "rss_firing_peak_mb": max(firing) if firing else None,
        "rss_end_mb": sampler.samples[-1][1] if sampler.samples else None,
        "peak_rss_mb": peak_rss_mb(),
        "spread_s": spread,
        "done_after_last_due_s": round(t_done - (first_due + spread), 2),
        "lag_p50_s": round(percentile(lags, 50), 3),
        "lag_p90_s": round(percentile(lags, 90), 3),
        "lag_p99_s": round(percentile(lags, 99), 3),
        "lag_max_s": round(max(lags), 3),
        "lag_min_s": round(min(lags), 3),
        "within_one_poll": round(sum(1 for x in lags if x <= poll) / len(lags), 4),
        "measured": len(lags),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; values need not be sorted."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def latency_summary(samples_s: Sequence[float]) -> dict[str, float]:
    ms = [x * 1000.0 for x in samples_s]
    return {
        "count": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
    }


def emit(result: dict[str, Any]) -> None:
    """Print the one JSON result line on stdout."""
    result.setdefault("peak_rss_mb", peak_rss_mb())
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def side_parser(description: str) -> argparse.ArgumentParser:
    """The command line every engine side accepts."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--db", choices=["sqlite", "postgres"], required=True)
    p.add_argument("--name", default=None, help="database / file name (default: bench_<side>)")
    p.add_argument("--workdir", default=".work", help="SQLite files go here (the run's cwd)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="measure on the database as it is (not reset first): grow.py's 1,000,000 runs",
    )
    sub = p.add_subparsers(dest="scenario", required=True)
    tp = sub.add_parser("throughput", help="N workflows of K trivial local steps started at once")
    tp.add_argument("--n", type=int, default=500)
    tp.add_argument("--k", type=int, default=5)
    tp.add_argument("--warmup", type=int, default=20, help="workflows run (and not timed) first")
    tp.add_argument("--timeout", type=float, default=600.0)
    lt = sub.add_parser("latency", help="one one-step workflow at a time, start -> result")
    lt.add_argument("--count", type=int, default=200)
    lt.add_argument("--warmup", type=int, default=10)
    lt.add_argument("--timeout", type=float, default=60.0, help="per workflow")
    return p


def prepare_workdir(path: str) -> Path:
    wd = Path(path).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    os.chdir(wd)
    return wd


async def timed_batch(
    n: int,
    start: Callable[[int], Awaitable[Any]],
    wait: Callable[[Any], Awaitable[Any]],
    timeout: float,
) -> tuple[float, float, list[Any]]:
    """Start n workflows at once, then await all of them.

    Returns (seconds until every start returned, seconds until every result arrived, results).
    """
    t0 = time.perf_counter()
    handles = await asyncio.wait_for(asyncio.gather(*(start(i) for i in range(n))), timeout)
    t_started = time.perf_counter() - t0
    results = await asyncio.wait_for(asyncio.gather(*(wait(h) for h in handles)), timeout)
    return t_started, time.perf_counter() - t0, list(results)


def throughput_result(n: int, k: int, t_started: float, elapsed: float) -> dict[str, Any]:
    return {
        "n": n,
        "k": k,
        "seconds": round(elapsed, 4),
        "start_seconds": round(t_started, 4),
        "workflows_per_s": round(n / elapsed, 2),
        "steps_per_s": round(n * k / elapsed, 2),
    }


def error_result(
    base: dict[str, Any], exc: BaseException, *, skipped: bool = False
) -> dict[str, Any]:
    traceback.print_exc(file=sys.stderr)
    msg = f"{type(exc).__name__}: {exc}".strip()
    if len(msg) > 300:
        msg = msg[:297] + "..."
    out = dict(base)
    out["error"] = msg
    if skipped:
        out["skipped"] = True
    return out
