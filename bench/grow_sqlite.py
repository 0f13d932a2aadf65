"""Cost as work grows on SQLite: an empty file against one holding 1,000,000 finished runs,
for each shape of run id the engine can make (``BENCH_RUN_IDS``: ``time`` or ``random``).

    python grow_sqlite.py --runs 1000000 --repeat 3     # seed both shapes, then interleave

On SQLite ``durably_checkpoints`` is a ``WITHOUT ROWID`` table clustered on ``(run_id, seq)``
and ``durably_runs`` has an index on ``id``: where a new run's id sorts is where its rows go.

``seed`` lets the engine run one K=5 workflow as a template and copies its row and checkpoints
``--runs`` times in SQL (ids of the shape asked, times spread over ~23 days, every 20th failed),
like ``grow.py seed`` does on PostgreSQL. ``measure`` runs one-step runs one at a time and K=5
runs started together, and reports per run: the process's CPU time (the store's thread
included), and the bytes and ``read`` calls the process made (``/proc/self/io``: what SQLite's
own page cache missed). The driver runs each measurement in its own process, rounds interleaved
(random empty, random full, time empty, time full); the empty files are fresh each time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import run_id_shape
from grow import SPREAD_MS, build_engine

HERE = Path(__file__).resolve().parent


def proc_io() -> dict[str, int]:
    """This process's read/write counters (Linux)."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value)
    return out


async def seed(path: Path, runs: int, k: int) -> dict[str, Any]:
    remove(path)
    engine = build_engine(f"sqlite:///{path}")
    async with engine:
        run = await engine.start("bench", k)
        res = await engine.wait_for_run(run.run_id, terminal=True, timeout=60)
        if str(res.status) != "completed":
            raise RuntimeError(f"template run ended {res.status}")
    template = run.run_id
    shape = run_id_shape()
    now = int(time.time() * 1000)

    def seeded_id(i: int) -> str:
        digest = hashlib.md5(str(i).encode()).hexdigest()
        if shape == "random":
            return digest
        return f"{now - (runs - i) * SPREAD_MS:012x}{digest[:20]}"

    t0 = time.perf_counter()
    conn = sqlite3.connect(path)
    try:
        conn.create_function("seeded_id", 1, seeded_id, deterministic=True)
        conn.execute("PRAGMA cache_size = -1000000")  # 1 GB while loading
        run_cols = [r[1] for r in conn.execute("PRAGMA table_info(durably_runs)")]
        cp_cols = [r[1] for r in conn.execute("PRAGMA table_info(durably_checkpoints)")]
        created = f"{now} - ({runs} - g.i) * {SPREAD_MS}"
        over = {
            "id": "seeded_id(g.i)",
            "created_at": created,
            "updated_at": f"{created} + 40",
            "status": "CASE WHEN g.i % 20 = 0 THEN 'failed' ELSE t.status END",
            "output": "CASE WHEN g.i % 20 = 0 THEN NULL ELSE t.output END",
            "locked_by": "NULL",
            "locked_until": "NULL",
        }
        cp_over = {
            "run_id": "seeded_id(g.i)",
            "started_at": f"{created} + c.seq * 5",
            "finished_at": f"{created} + c.seq * 5 + 1",
        }
        series = "WITH RECURSIVE g(i) AS (SELECT ? UNION ALL SELECT i + 1 FROM g WHERE i < ?) "
        run_sql = (
            f"{series}INSERT INTO durably_runs ({', '.join(run_cols)}) SELECT "
            + ", ".join(over.get(c, f"t.{c}") for c in run_cols)
            + " FROM durably_runs t, g WHERE t.id = ?"
        )
        cp_sql = (
            f"{series}INSERT INTO durably_checkpoints ({', '.join(cp_cols)}) SELECT "
            + ", ".join(cp_over.get(c, f"c.{c}") for c in cp_cols)
            + " FROM durably_checkpoints c, g WHERE c.run_id = ?"
        )
        chunk = 100_000
        for lo in range(1, runs + 1, chunk):
            hi = min(runs, lo + chunk - 1)
            with conn:
                conn.execute(run_sql, (lo, hi, template))
                conn.execute(cp_sql, (lo, hi, template))
        conn.execute("ANALYZE")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return {
        "runs": runs,
        "shape": shape,
        "seconds": round(time.perf_counter() - t0, 1),
        "mib": mib(path),
    }


async def measure(path: Path, count: int, n: int, k: int) -> dict[str, Any]:
    engine = build_engine(f"sqlite:///{path}")
    out: dict[str, Any] = {}
    async with engine:
        for i in range(10):  # warm-up: the schema, the statements, the first pages
            run = await engine.start("one_step", i)
            await engine.wait_for_run(run.run_id, terminal=True, timeout=60)

        io0, c0 = proc_io(), time.process_time()
        for i in range(count):
            run = await engine.start("one_step", i)
            res = await engine.wait_for_run(run.run_id, terminal=True, timeout=60)
            if res.output != i:
                raise RuntimeError(f"run {run.run_id} ended {res.status}")
        io1, c1 = proc_io(), time.process_time()
        out["latency"] = per_run(io0, io1, c1 - c0, count)

        runs = [await engine.start("bench", k) for _ in range(n)]
        for run in runs:
            res = await engine.wait_for_run(run.run_id, terminal=True, timeout=300)
            if res.output != k:
                raise RuntimeError(f"run {run.run_id} ended {res.status}")
        io2, c2 = proc_io(), time.process_time()
        out["throughput"] = per_run(io1, io2, c2 - c1, n)
    return out


def mib(path: Path) -> int:
    """A file's size in MiB."""
    return round(path.stat().st_size / 2**20)


def remove(path: Path) -> None:
    """Delete a SQLite file and its WAL and shared-memory files."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def per_run(
    before: dict[str, int], after: dict[str, int], cpu_s: float, n: int
) -> dict[str, float]:
    return {
        "cpu_ms": round(1000 * cpu_s / n, 4),
        "read_kib": round((after["rchar"] - before["rchar"]) / 1024 / n, 2),
        "reads": round((after["syscr"] - before["syscr"]) / n, 2),
        "written_kib": round((after["wchar"] - before["wchar"]) / 1024 / n, 2),
    }


def child(args: list[str], shape: str) -> dict[str, Any]:
    env = {**os.environ, "BENCH_RUN_IDS": shape}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def drive(a: argparse.Namespace) -> None:
    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shapes = ["random", "time"]
    full = {s: work / f"grow_sqlite_{s}.db" for s in shapes}
    if not a.reuse:
        for s in shapes:
            print("seed", s, child(["seed", str(full[s]), "--runs", str(a.runs)], s), flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(a.repeat):
        for s in shapes:
            empty = work / f"grow_sqlite_{s}_empty.db"
            for name, path in (("empty", empty), ("full", full[s])):
                if name == "empty":
                    remove(empty)
                m = ["measure", str(path), "--count", str(a.count), "--n", str(a.n)]
                got = child(m, s)
                results.setdefault(f"{s} {name}", []).append(got)
                print(rnd, s, name, json.dumps(got), flush=True)
    report(results)


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    print()
    print("| per run | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    for path in ("latency", "throughput"):
        for key in ("cpu_ms", "read_kib", "reads", "written_kib"):
            cells = []
            for runs in results.values():
                vals = [r[path][key] for r in runs]
                cells.append(f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
            print(f"| {path} {key} | " + " | ".join(cells) + " |")
    for s in ("random", "time"):
        for path in ("latency", "throughput"):
            e, f = results[f"{s} empty"], results[f"{s} full"]
            ratios = [b[path]["cpu_ms"] / a[path]["cpu_ms"] for a, b in zip(e, f, strict=True)]
            print(
                f"{s} {path} CPU full/empty paired: {100 * statistics.median(ratios):.1f}% "
                f"({100 * min(ratios):.0f}-{100 * max(ratios):.0f}%)"
            )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="what")
    sp = sub.add_parser("seed")
    sp.add_argument("path")
    sp.add_argument("--runs", type=int, default=1_000_000)
    sp.add_argument("--k", type=int, default=5)
    mp = sub.add_parser("measure")
    mp.add_argument("path")
    mp.add_argument("--count", type=int, default=300)
    mp.add_argument("--n", type=int, default=300)
    mp.add_argument("--k", type=int, default=5)
    p.add_argument("--runs", type=int, default=1_000_000)
    p.add_argument("--count", type=int, default=300, help="one-step runs, one at a time")
    p.add_argument("--n", type=int, default=300, help="K=5 runs started together")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--reuse", action="store_true", help="keep the seeded files")
    p.add_argument("--workdir", default=str(HERE / ".work"))
    a = p.parse_args()
    if a.what == "seed":
        print(json.dumps(asyncio.run(seed(Path(a.path), a.runs, a.k))))
    elif a.what == "measure":
        print(json.dumps(asyncio.run(measure(Path(a.path), a.count, a.n, a.k))))
    else:
        drive(a)


if __name__ == "__main__":
    main()
