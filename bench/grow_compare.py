"""Flat cost as the tables grow: throughput and one-step latency on PostgreSQL, on an empty
database and on one already holding 1,000,000 finished runs (and their checkpoints), in one run.

    python grow_compare.py                 # seed 1,000,000 (and 100,000) runs, measure, explain
    python grow_compare.py --repeat 5      # empty, 1M, empty, 1M, ... interleaved
    python grow_compare.py --quick         # 100,000 runs, N=500, 50 latency samples
    python grow_compare.py --reuse         # keep the seeded databases of the previous run

Three measures, side by side:

- wall clock (workflows/s, latency p50/p99), which on a shared machine moves by ±50%;
- CPU time per run of the engine process and of the PostgreSQL backends serving it, from the
  same runs (``grow_cost.py cpu``: the throughput and latency scenarios of ``durably_side.py``),
  empty and full interleaved: far steadier than wall time, since another process's work does
  not count in it; the "paired" column is the median of each round's full/empty ratio;
- pages and rows per run (``grow_cost.py buffers``): every statement's executed plan with its
  shared buffers and the rows its scans examined, on the empty database, on one of 100,000 runs
  and on the 1,000,000: counts, not times. The B-tree levels of the indexes say how much of a
  difference is one more page per index descent.

Each measurement is its own process: on ``bench_durably_empty`` reset before each, and on the
seeded databases as they are. The seeding and the plans are ``grow.py``; the plans, with the
page counts appended, go to ``grow-explain.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from compare import NOTES, WORK, Cell, fmt_cell, note, pct, run_side, table
from grow_cost import markdown, split_pages

EMPTY, GROWN, MID = "bench_durably_empty", "bench_durably_grown", "bench_durably_grown_mid"
DBOS_EMPTY, DBOS_GROWN = "bench_dbos_empty", "bench_dbos_grown"


def within(worse: float | None) -> str:
    """``yes`` when ``worse`` (the full database's excess cost, 0.05 = 5% worse) is at most 10%."""
    if worse is None:
        return ""
    return "yes" if worse <= 0.10 else f"no ({100 * worse:+.0f}%)"


def paired(empty: Cell, full: Cell, path: str) -> tuple[float | None, str]:
    """Median of each round's full/empty ratio (rounds where both ran), and its range."""
    rs = [
        f[path] / e[path]
        for e, f in zip(empty.runs, full.runs, strict=False)
        if "error" not in e and "error" not in f and e.get(path) and f.get(path) is not None
    ]
    if not rs:
        return None, "n/a"
    med = statistics.median(rs)
    return med, f"{100 * med:.1f}%" + (
        f" ({100 * min(rs):.0f}-{100 * max(rs):.0f}%)" if len(rs) > 1 else ""
    )


def dbos_version(cells: dict[str, Cell]) -> str:
    """The DBOS version that ran (from any of its results)."""
    for label, c in cells.items():
        if label.startswith("dbos"):
            for r in c.ok():
                if r.get("version"):
                    return str(r["version"])
    return "?"


def side_by_side(
    cells: dict[str, Cell], n: int, k: int, runs: int
) -> tuple[list[str], list[list[str]]]:
    """Each engine's full/empty ratio, and durably against DBOS on the full database.

    ``full / empty`` is each side's own cost of a full table (100% = flat); ``durably / DBOS``
    is how many times durably is better on the seeded databases (rates: durably ÷ DBOS; times:
    DBOS ÷ durably).
    """
    rows = []
    for label, scen, path, digits, higher_better in (
        (f"workflows/s N={n} K={k}", "throughput", "workflows_per_s", 1, True),
        ("latency p50 ms (1 step)", "latency", "p50_ms", 2, False),
        ("latency p99 ms (1 step)", "latency", "p99_ms", 2, False),
    ):
        de, dg = cells.get(f"empty {scen}"), cells.get(f"grown {scen}")
        be, bg = cells.get(f"dbos empty {scen}"), cells.get(f"dbos grown {scen}")
        if not (de and dg and be and bg):
            continue
        dgm, bgm = dg.median(path), bg.median(path)
        better = None
        if dgm and bgm:
            better = dgm / bgm if higher_better else bgm / dgm
        rows.append(
            [
                label,
                fmt_cell(de, path, digits=digits),
                fmt_cell(dg, path, digits=digits),
                pct(dgm, de.median(path)),
                fmt_cell(be, path, digits=digits),
                fmt_cell(bg, path, digits=digits),
                pct(bgm, be.median(path)),
                f"{better:.2f}x" if better else "n/a",
            ]
        )
    head = [
        "metric",
        "durably empty",
        f"durably {runs:,}",
        "durably full/empty",
        "DBOS empty",
        f"DBOS {runs:,}",
        "DBOS full/empty",
        "durably vs DBOS (full)",
    ]
    return head, rows


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=None, help="finished runs seeded (1,000,000)")
    p.add_argument("--mid", type=int, default=None, help="a second database (runs / 10; 0: none)")
    p.add_argument("--n", type=int, default=None, help="throughput: workflows (2000)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--latency-count", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--reuse", action="store_true", help="do not seed again")
    p.add_argument("--no-explain", action="store_true")
    p.add_argument("--no-buffers", action="store_true")
    p.add_argument("--no-dbos", action="store_true", help="durably only (no DBOS seeded alike)")
    p.add_argument(
        "--last-workflow",
        default=None,
        help="seed half the runs under this name (zz_bench: the measured workflows sort mid-range)",
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = args.runs or (100_000 if args.quick else 1_000_000)
    mid = runs // 10 if args.mid is None else args.mid
    n = args.n or (500 if args.quick else 2000)
    lat = args.latency_count or (50 if args.quick else 200)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_all = time.perf_counter()
    cells: dict[str, Cell] = {}

    def cell(label: str) -> Cell:
        return cells.setdefault(label, Cell(label))

    def measure(label: str, argv: list[str], timeout: float) -> None:
        c = cell(label)
        c.runs.append(run_side(c.label, argv, timeout))

    seeded = [(GROWN, runs)] + ([(MID, mid)] if mid else [])
    if not args.reuse:
        for name, count in seeded:
            measure(
                f"grow seed {count:,}",
                [
                    "grow.py",
                    "--name",
                    name,
                    "seed",
                    "--runs",
                    str(count),
                    "--k",
                    str(args.k),
                    *(["--last-workflow", args.last_workflow] if args.last_workflow else []),
                ],
                3600,
            )
        if not args.no_dbos:
            measure(
                f"dbos seed {runs:,}",
                [
                    "dbos_grow.py",
                    "--name",
                    DBOS_GROWN,
                    "seed",
                    "--runs",
                    str(runs),
                    "--k",
                    str(args.k),
                ],
                3600,
            )
    for _ in range(args.repeat):
        for state, name, keep in (("empty", EMPTY, []), ("grown", GROWN, ["--keep"])):
            base = ["grow_cost.py", "--name", name, *keep, "cpu"]
            tp = ["throughput", "--n", str(n), "--k", str(args.k)]
            measure(
                f"{state} throughput", [*base, *tp, "--timeout", str(args.timeout)], args.timeout
            )
            measure(f"{state} latency", [*base, "latency", "--count", str(lat)], args.timeout)
            if args.no_dbos:
                continue
            # DBOS right after durably on the same state, so drift hits both alike
            dbase = ["dbos_side.py", "--db", "postgres", "--name", DBOS_EMPTY]
            if state == "grown":
                dbase = ["dbos_side.py", "--db", "postgres", "--name", DBOS_GROWN, "--keep"]
            measure(
                f"dbos {state} throughput",
                [*dbase, *tp, "--timeout", str(args.timeout)],
                args.timeout,
            )
            measure(f"dbos {state} latency", [*dbase, "latency", "--count", str(lat)], args.timeout)
    buffers: dict[str, dict[str, Any]] = {}
    if not args.no_buffers:
        for label, name, keep in (
            ("empty", EMPTY, []),
            *([(f"{mid:,}", MID, ["--keep"])] if mid else []),
            (f"{runs:,}", GROWN, ["--keep"]),
        ):
            c = cell(f"buffers {label}")
            measure(
                c.label, ["grow_cost.py", "--name", name, *keep, "buffers", "--k", str(args.k)], 900
            )
            ok = c.ok()
            if ok:
                buffers[label] = ok[-1]
    if not args.no_explain:
        measure("grow explain", ["grow.py", "--name", GROWN, "explain"], 900)
    total = time.perf_counter() - t_all

    seeds = [c.ok()[0] for label, c in cells.items() if label.startswith("grow seed") and c.ok()]
    print()
    print(
        f"Cost as work grows (PostgreSQL) — {started}, repeat={args.repeat}; "
        + (
            "; ".join(
                f"seeded {sd['runs']:,} runs / {sd['checkpoints']:,} checkpoints in "
                f"{sd['seconds']} s ({sd['runs_mib']} + {sd['checkpoints_mib']} MiB)"
                for sd in seeds
            )
            if seeds
            else "seeded databases reused"
        )
    )
    for label, c in cells.items():
        if label.startswith("dbos seed") and c.ok():
            sd = c.ok()[0]
            print(
                f"DBOS {sd.get('version')}: seeded {sd['runs']:,} workflows in {sd['seconds']} s "
                "(rows, MiB: "
                + ", ".join(f"{t} {n:,} {sd['mib'].get(t, '?')}" for t, n in sd["rows"].items())
                + ")"
            )
    print("Cells: median (min-max when repeated). 'full / empty': the cost of a full table.")
    print("\nWall clock (noisy on a shared machine):")
    rows = []
    for label, scen, path, digits, higher_better in (
        (f"workflows/s N={n} K={args.k}", "throughput", "workflows_per_s", 1, True),
        (f"steps/s     N={n} K={args.k}", "throughput", "steps_per_s", 1, True),
        ("latency p50 ms (1 step)", "latency", "p50_ms", 2, False),
        ("latency p99 ms (1 step)", "latency", "p99_ms", 2, False),
    ):
        e, g = cell(f"empty {scen}"), cell(f"grown {scen}")
        em, gm = e.median(path), g.median(path)
        worse = None
        if em and gm:
            worse = (em / gm - 1) if higher_better else (gm / em - 1)
        rows.append(
            [
                label,
                fmt_cell(e, path, digits=digits),
                fmt_cell(g, path, digits=digits),
                pct(gm, em),
                within(worse),
            ]
        )
    print(table(["metric", "empty", f"{runs:,} finished", "full / empty", "within 10%"], rows))
    if not args.no_dbos:
        print(f"\nSide by side with DBOS {dbos_version(cells)}, seeded alike ({runs:,} workflows):")
        print(table(*side_by_side(cells, n, args.k, runs)))

    print("\nCPU time per run, ms (engine process; PostgreSQL backends serving it):")
    rows = []
    for scen, what in (("throughput", f"N={n} K={args.k}"), ("latency", "1 step, one at a time")):
        e, g = cell(f"empty {scen}"), cell(f"grown {scen}")
        for path, who in (
            ("engine_cpu_ms_per_run", "engine"),
            ("pg_cpu_ms_per_run", "PostgreSQL"),
            ("total_cpu_ms_per_run", "both"),
        ):
            em, gm = e.median(path), g.median(path)
            pr, pr_text = paired(e, g, path)
            rows.append(
                [
                    f"{scen} {what}: {who}",
                    fmt_cell(e, path, digits=3),
                    fmt_cell(g, path, digits=3),
                    pct(gm, em),
                    pr_text,
                    within(pr - 1 if pr is not None else None),
                ]
            )
    print(
        table(
            ["per run", "empty", f"{runs:,} finished", "full / empty", "paired", "within 10%"],
            rows,
        )
    )

    if buffers:
        labels = list(buffers)
        print(
            "\nPages (shared buffers hit + read) and rows examined per run, every statement's "
            "executed plan:"
        )
        rows = []
        for ph, what in (
            ("one-step", "one-step runs, one at a time"),
            ("k-step", f"{args.k}-step runs, one at a time"),
            ("gathered", f"{args.k}-step runs started together"),
        ):
            for key, name in (
                ("statements", "statements"),
                ("pages", "pages"),
                ("heap", "  heap pages (tables' counters)"),
                ("index", "  index pages (tables' counters)"),
                ("rows", "rows examined"),
            ):
                vals: list[float | None] = []
                for lab in labels:
                    pr = buffers[lab].get("per_run", {}).get(ph)
                    if not pr:
                        vals.append(None)
                        continue
                    heap, idx = split_pages(pr.get("statio", {}))
                    vals.append(
                        {
                            "statements": pr["statements"],
                            "pages": pr["hit"] + pr["read"],
                            "heap": heap,
                            "index": idx,
                            "rows": pr["rows"],
                        }[key]
                    )
                first, last = vals[0], vals[-1]
                rows.append(
                    [f"{what}: {name}"]
                    + [f"{v:,.1f}" if v is not None else "n/a" for v in vals]
                    + [pct(last, first)]
                    + ([pct(last, vals[-2])] if len(vals) > 2 else [])
                )
        head = ["per run", *labels, f"{labels[-1]} / {labels[0]}"]
        if len(labels) > 2:
            head.append(f"{labels[-1]} / {labels[-2]}")
        print(table(head, rows))
        levels = {lab: buffers[lab].get("btree_levels", {}) for lab in labels}
        deeper = sorted(
            n for n in levels[labels[-1]] if levels[labels[-1]][n] != levels[labels[0]].get(n)
        )
        print(
            "B-tree levels, "
            + " / ".join(labels)
            + ": "
            + ", ".join(
                f"{n.removeprefix('durably_')} "
                + "/".join(str(levels[lab].get(n, "-")) for lab in labels)
                for n in deeper
            )
        )
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
            if buffers and r.get("out"):
                out = Path(r["out"])
                out.write_text(out.read_text() + "\n" + markdown(buffers))
                print(f"pages per statement, {' vs '.join(buffers)}: appended to {out}")
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
