"""Flat cost as the tables grow: throughput and one-step latency on PostgreSQL, on an empty
database and on one already holding 1,000,000 finished runs (and their checkpoints), in one run.

    python grow_compare.py                 # seed 1,000,000 runs, measure both, explain (~5 min)
    python grow_compare.py --repeat 3      # empty, 1M, empty, 1M, ... interleaved
    python grow_compare.py --quick         # 100,000 runs, N=500, 50 latency samples
    python grow_compare.py --reuse         # keep the seeded database of the previous run

Each measurement is ``durably_side.py`` in its own process (as in the main comparison): on
``bench_durably_empty`` reset before each, and on ``bench_durably_grown`` with ``--keep``. The
seeding and the plans are ``grow.py``; the plans go to ``grow-explain.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from compare import NOTES, WORK, Cell, fmt_cell, note, pct, run_side, table

EMPTY, GROWN = "bench_durably_empty", "bench_durably_grown"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=None, help="finished runs seeded (1,000,000)")
    p.add_argument("--n", type=int, default=None, help="throughput: workflows (2000)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--latency-count", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--reuse", action="store_true", help="do not seed again")
    p.add_argument("--no-explain", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = args.runs or (100_000 if args.quick else 1_000_000)
    n = args.n or (500 if args.quick else 2000)
    lat = args.latency_count or (50 if args.quick else 200)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_all = time.perf_counter()
    cells: dict[str, Cell] = {}

    def cell(label: str) -> Cell:
        return cells.setdefault(label, Cell(label))

    if not args.reuse:
        c = cell("grow seed")
        c.runs.append(
            run_side(
                c.label,
                ["grow.py", "--name", GROWN, "seed", "--runs", str(runs), "--k", str(args.k)],
                3600,
            )
        )
    for _ in range(args.repeat):
        for state, name, keep in (("empty", EMPTY, []), ("grown", GROWN, ["--keep"])):
            c = cell(f"{state} throughput")
            c.runs.append(
                run_side(
                    c.label,
                    [
                        "durably_side.py",
                        "--db",
                        "postgres",
                        "--name",
                        name,
                        *keep,
                        "throughput",
                        "--n",
                        str(n),
                        "--k",
                        str(args.k),
                        "--timeout",
                        str(args.timeout),
                    ],
                    args.timeout,
                )
            )
            c = cell(f"{state} latency")
            c.runs.append(
                run_side(
                    c.label,
                    [
                        "durably_side.py",
                        "--db",
                        "postgres",
                        "--name",
                        name,
                        *keep,
                        "latency",
                        "--count",
                        str(lat),
                    ],
                    args.timeout,
                )
            )
    if not args.no_explain:
        c = cell("grow explain")
        c.runs.append(run_side(c.label, ["grow.py", "--name", GROWN, "explain"], 900))
    total = time.perf_counter() - t_all

    seed = (cell("grow seed").ok() or [{}])[0] if "grow seed" in cells else {}
    print()
    print(
        f"Cost as work grows (PostgreSQL) — {started}, repeat={args.repeat}; "
        + (
            f"seeded {seed.get('runs', '?'):,} runs / {seed.get('checkpoints', '?'):,} "
            f"checkpoints in {seed.get('seconds', '?')} s "
            f"({seed.get('runs_mib', '?')} + {seed.get('checkpoints_mib', '?')} MiB)"
            if seed.get("runs")
            else "seeded database reused"
        )
    )
    print("Cells: median (min-max when repeated). 'grown / empty': the cost of a full table.")
    rows = []
    for label, scen, path, digits, higher_better in (
        (f"workflows/s N={n} K={args.k}", "throughput", "workflows_per_s", 1, True),
        (f"steps/s     N={n} K={args.k}", "throughput", "steps_per_s", 1, True),
        ("latency p50 ms (1 step)", "latency", "p50_ms", 2, False),
        ("latency p99 ms (1 step)", "latency", "p99_ms", 2, False),
    ):
        e, g = cell(f"empty {scen}"), cell(f"grown {scen}")
        em, gm = e.median(path), g.median(path)
        within = ""
        if em and gm:
            worse = (em / gm - 1) if higher_better else (gm / em - 1)
            within = "yes" if worse <= 0.10 else f"no ({100 * worse:+.0f}%)"
        rows.append(
            [
                label,
                fmt_cell(e, path, digits=digits),
                fmt_cell(g, path, digits=digits),
                pct(gm, em),
                within,
            ]
        )
    print(table(["metric", "empty", f"{runs:,} finished", "grown / empty", "within 10%"], rows))
    loads = [x for c in cells.values() for r in c.runs for x in r.get("load1", [])]
    if loads:
        print(f"1-minute load average around the runs: {min(loads):.2f}-{max(loads):.2f}")
    if "grow explain" in cells:
        ex = cells["grow explain"]
        err = ex.error()
        if err:
            print(f"\nplans: n/a {note(err)}")
        else:
            r = ex.ok()[0]
            seqs = r.get("sequential") or []
            print(
                f"\nplans of {r.get('queries')} distinct hot queries at {runs:,} runs: "
                f"{r.get('out')}; "
                + (
                    "every one reads a durably table through an index or not at all"
                    if not seqs
                    else f"{len(seqs)} read a table sequentially:"
                )
            )
            for it in seqs:
                print(
                    f"  - {it['kind']}: {', '.join(it['seq_scans'])} ({it['ms']} ms) "
                    f"{it['sql'][:90]}"
                )
    if NOTES:
        print("\nWhy a cell is n/a:")
        for i, msg in enumerate(NOTES, 1):
            print(f"[{i}] {msg}")
    WORK.mkdir(parents=True, exist_ok=True)
    out = Path(args.json) if args.json else WORK / f"grow-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps(
            {
                "started": started,
                "args": vars(args),
                "total_s": round(total, 1),
                "cells": {c.label: c.runs for c in cells.values()},
            },
            indent=1,
        )
    )
    print(f"\nraw results: {out}   (total {total:.0f}s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
