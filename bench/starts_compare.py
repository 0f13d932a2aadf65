"""Starts: 10,000 runs started at once by a producer, durably against DBOS (and a baseline).

    python starts_compare.py                          # PostgreSQL, N=10,000, 1 repeat
    python starts_compare.py --repeat 3               # min-max over 3 interleaved runs
    python starts_compare.py --baseline REV           # also durably at git revision REV
    bash run.sh starts --repeat 3 --baseline main     # the same through run.sh (its venv)

Each side is a fresh process on a freshly reset database (see starts_side.py): a durably
engine with ``consumers="never"`` gathering N ``engine.start`` calls, or a ``DBOSClient``
gathering N ``enqueue_async`` calls; the time is until every start has returned. With
``--baseline REV`` the durably side runs a second time with ``src/`` as of REV (exported with
``git archive`` into .work/), for before/after in the same run. Ratios are durably / DBOS in
starts per second (above 1x: durably is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from compare import (
    HERE,
    NOTES,
    WORK,
    Cell,
    durably_revision,
    fmt_cell,
    pg_reachable,
    run_side,
    table,
)


def export_src(revision: str) -> Path:
    """``src/`` as of ``revision``, exported under .work/ (re-used when already there)."""
    rev = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", revision],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest = WORK / f"src-{rev}"
    if not (dest / "src" / "durably").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(HERE.parent), "archive", rev, "src"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "src"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="N=1,000")
    p.add_argument("--db", default="postgres", help="comma list: sqlite,postgres")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--baseline", default=None, help="git revision to measure as 'before'")
    p.add_argument("--no-dbos", action="store_true")
    p.add_argument("--repeat", type=int, default=int(os.environ.get("BENCH_REPEAT", "1")))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write the raw results here")
    args = p.parse_args()

    n = 1000 if args.quick else args.n
    dbs = [d.strip() for d in args.db.split(",") if d.strip()]
    if "postgres" in dbs and not pg_reachable():
        sys.stderr.write("bench: PostgreSQL is not reachable; measuring SQLite only\n")
        dbs = [d for d in dbs if d != "postgres"] or ["sqlite"]
    sides: dict[str, list[str]] = {"durably": ["--side", "durably"]}
    if args.baseline:
        sides[f"durably@{args.baseline}"] = [
            "--side",
            "durably",
            "--src",
            str(export_src(args.baseline)),
        ]
    if not args.no_dbos:
        sides["DBOS"] = ["--side", "dbos"]
    cells: dict[tuple[str, str], Cell] = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for rep in range(args.repeat):
        for db in dbs:
            sys.stderr.write(f"[{rep + 1}/{args.repeat}] {db}\n")
            for side, argv in sides.items():
                c = cells.setdefault((side, db), Cell(f"starts {side} {db}"))
                cmd = ["starts_side.py", *argv, "--db", db, "--n", str(n)]
                c.runs.append(
                    run_side(c.label, [*cmd, "--timeout", str(args.timeout)], args.timeout)
                )

    header = ["db", *(f"{side} starts/s" for side in sides)]
    others = [side for side in sides if side != "durably"]
    header += [f"durably vs {side}" for side in others]
    header += [f"{side} commits/start" for side in sides]
    rows: list[list[str]] = []
    for db in dbs:
        ours = cells[("durably", db)].median("starts_per_s")
        row = [db, *(fmt_cell(cells[(side, db)], "starts_per_s") for side in sides)]
        for side in others:
            theirs = cells[(side, db)].median("starts_per_s")
            row.append(f"{ours / theirs:.1f}x" if ours and theirs else "n/a")
        row += [fmt_cell(cells[(side, db)], "commits_per_start", digits=3) for side in sides]
        rows.append(row)
    print(
        f"\n{n:,} starts at once (durably at {durably_revision()}, {started}, repeat={args.repeat})"
    )
    print(table(header, rows))
    if NOTES:
        print("\nWhy a cell is n/a:")
        for i, msg in enumerate(NOTES, 1):
            print(f"[{i}] {msg}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"started": started, "n": n, "cells": {c.label: c.runs for c in cells.values()}},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
