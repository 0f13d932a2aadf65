"""Dispatched steps: durably's ``ctx.step`` through each transport against DBOS queues.

    python dispatch_compare.py                  # both databases, 1 repeat (~5 min on 2 cores)
    python dispatch_compare.py --repeat 3       # min-max over 3 interleaved runs
    python dispatch_compare.py --quick          # smoke run, ~1-2 min
    bash run.sh dispatch --repeat 3             # the same through run.sh (its venv)

For each database (SQLite, PostgreSQL) and each scenario, every durably transport
(``memory://``, ``local://``, ``db://`` and ``redis://`` at ``BENCH_REDIS_URL``, on that
database's store) and DBOS (a child workflow enqueued on a ``Queue`` and awaited, see
dispatch_dbos.py) run one after the other, each in a fresh process on a freshly reset
database. Scenarios (see dispatch_durably.py):

- throughput: N=200 workflows of K=5 sequential dispatched steps, started at once;
- latency: one workflow with one dispatched step at a time, 200 samples;
- fan: one workflow at a time doing ``ctx.all`` of 100 dispatched steps, 20 samples.

``inline`` (on by default) runs the same workflows with ``ctx.local_step``: the "local_step"
column, the baseline each transport's "/ local_step" ratio compares with. ``--baseline REV`` also
measures every transport with durably's ``src/`` as of REV (exported under .work/), for before/after
in one run; ``--scenarios throughput`` keeps to one scenario.

The table's ratios are durably / DBOS for rates and DBOS / durably for times (above 1x means
durably is faster). Cells are medians of ``--repeat`` runs with min-max in brackets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from compare import (
    LOGS,
    NOTES,
    WORK,
    Cell,
    durably_revision,
    fmt_cell,
    pg_reachable,
    run_side,
    table,
)
from starts_compare import export_src

TRANSPORTS = ("inline", "memory", "local", "db", "redis")
"""``inline`` is no transport: the same workflows with ``ctx.local_step`` (the baseline)."""


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smaller counts, ~1-2 minutes")
    p.add_argument("--db", default="sqlite,postgres", help="comma list: sqlite,postgres")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="durably transports")
    p.add_argument("--no-dbos", action="store_true", help="durably only")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--latency-count", type=int, default=None)
    p.add_argument("--fan-count", type=int, default=None)
    p.add_argument("--fan-width", type=int, default=100)
    p.add_argument("--dbos-poll", type=float, default=0.05, help="DBOS queue/get_result poll (s)")
    p.add_argument("--repeat", type=int, default=int(os.environ.get("BENCH_REPEAT", "1")))
    p.add_argument("--timeout", type=float, default=600.0, help="per subprocess, seconds")
    p.add_argument("--json", default=None)
    p.add_argument("--scenarios", default="throughput,latency,fan", help="comma list")
    p.add_argument(
        "--baseline", default=None, help="git revision: every transport measured there too"
    )
    args = p.parse_args()

    dbs = [d.strip() for d in args.db.split(",") if d.strip()]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    n = 50 if args.quick else args.n
    lat = args.latency_count or (30 if args.quick else 200)
    fan = args.fan_count or (5 if args.quick else 20)
    if "postgres" in dbs and not pg_reachable():
        sys.stderr.write("bench: PostgreSQL is not reachable; measuring SQLite only\n")
        dbs = [d for d in dbs if d != "postgres"] or ["sqlite"]
    baseline_src = str(export_src(args.baseline)) if args.baseline else None
    based = [f"{t}@{args.baseline}" for t in transports] if args.baseline else []
    sides = [*transports, *based, *([] if args.no_dbos else ["dbos"])]
    wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}

    scen_argv = {
        "throughput": ["throughput", "--n", str(n), "--k", str(args.k), "--warmup", "10"],
        "latency": ["latency", "--count", str(lat), "--warmup", "10"],
        "fan": ["fan", "--count", str(fan), "--width", str(args.fan_width), "--warmup", "2"],
    }
    cells: dict[tuple[str, str, str], Cell] = {}

    def cell(side: str, db: str, scen: str) -> Cell:
        return cells.setdefault((side, db, scen), Cell(f"dispatch {side} {db} {scen}"))

    WORK.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    revision = durably_revision()
    t_all = time.perf_counter()
    sys.stderr.write(f"bench dispatch: dbs={dbs} sides={sides} repeat={args.repeat}\n")
    for rep in range(args.repeat):
        for db in dbs:
            sys.stderr.write(f"[{rep + 1}/{args.repeat}] {db}\n")
            for scen, sargv in scen_argv.items():
                if scen not in wanted:
                    continue
                for side in sides:
                    if side == "dbos":
                        argv = ["dispatch_dbos.py", "--db", db, "--poll", str(args.dbos_poll)]
                    elif "@" in side:
                        transport = side.split("@")[0]
                        argv = ["dispatch_durably.py", "--db", db, "--transport", transport]
                        argv += ["--src", str(baseline_src)]
                    else:
                        argv = ["dispatch_durably.py", "--db", db, "--transport", side]
                    argv += [*sargv, "--timeout", str(args.timeout)]
                    c = cell(side, db, scen)
                    c.runs.append(run_side(c.label, argv, args.timeout))
    total = time.perf_counter() - t_all

    def med(c: Cell, key: str) -> float | None:
        return c.median(key)

    def better(d: float | None, b: float | None, rate: bool) -> str:
        if d is None or b is None or d == 0 or b == 0:
            return "n/a"
        r = d / b if rate else b / d
        return f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"

    metrics = [
        ("throughput", "workflows_per_s", f"workflows/s N={n} K={args.k}", True, 1),
        ("throughput", "steps_per_s", f"steps/s N={n} K={args.k}", True, 1),
        ("throughput", "cpu_us_per_step", f"CPU us/step N={n} K={args.k}", False, 1),
        ("latency", "p50_ms", "latency p50 ms, 1 step", False, 2),
        ("latency", "p99_ms", "latency p99 ms, 1 step", False, 2),
        ("fan", "p50_ms", f"fan of {args.fan_width}: p50 ms", False, 1),
        ("fan", "p99_ms", f"fan of {args.fan_width}: p99 ms", False, 1),
        ("fan", "steps_per_s", f"fan of {args.fan_width}: steps/s", True, 1),
    ]

    def name(side: str) -> str:
        transport, _, rev = side.partition("@")
        label = "local_step" if transport == "inline" else f"{transport}://"
        return f"{label}@{rev}" if rev else label

    durably_sides = [*transports, *based]
    header = ["metric", "db", *(f"durably {name(t)}" for t in durably_sides)]
    dispatched = [t for t in transports if t != "inline"]
    if "inline" in transports:
        header += [f"local_step / {name(t)}" for t in dispatched]
        header += [f"local_step / {name(t)}@{args.baseline}" for t in dispatched if based]
    if not args.no_dbos:
        header += [f"DBOS queue (poll {args.dbos_poll:g}s)"]
        header += [f"{name(t)} vs DBOS" for t in transports]
    rows: list[list[str]] = []
    for db in dbs:
        for scen, key, label, rate, digits in metrics:
            if scen not in wanted:
                continue
            row = [label, db]
            row += [fmt_cell(cell(t, db, scen), key, digits=digits) for t in durably_sides]
            if "inline" in transports:
                # local_step against each transport: how far dispatching is from a local step
                for t in dispatched + (
                    [f"{t}@{args.baseline}" for t in dispatched] if based else []
                ):
                    base_side = "inline" if "@" not in t else f"inline@{args.baseline}"
                    row.append(
                        better(
                            med(cell(base_side, db, scen), key), med(cell(t, db, scen), key), rate
                        )
                    )
            if not args.no_dbos:
                b = cell("dbos", db, scen)
                row.append(fmt_cell(b, key, digits=digits))
                row += [better(med(cell(t, db, scen), key), med(b, key), rate) for t in transports]
            rows.append(row)

    print(f"\nDispatched steps (durably at {revision}, {started}, repeat={args.repeat})")
    print(table(header, rows))
    loads = [x for c in cells.values() for r in c.runs for x in r.get("load1", [])]
    if loads:
        print(
            f"1-minute load average around the runs: {min(loads):.2f}-{max(loads):.2f} "
            f"on {os.cpu_count()} CPUs"
        )
    if NOTES:
        print("\nWhy a cell is n/a:")
        for i, msg in enumerate(NOTES, 1):
            print(f"[{i}] {msg}")
    out = Path(args.json) if args.json else WORK / f"dispatch-{time.strftime('%Y%m%d-%H%M%S')}.json"
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
