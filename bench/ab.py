"""Before/after: two (or more) durably source trees and DBOS, interleaved in one run.

``compare.py`` measures one durably tree against DBOS; this measures several trees (e.g. a
``git worktree`` of the last commit and the working tree) in the same run, alternating them with
DBOS within every repeat (the order rotates each repeat), so the machine's noise hits each
variant alike. Throughput and latency only, with the same side scripts and settings as
``compare.py``; its own database names and work directory, so it can run beside other benches.

    git worktree add --detach /tmp/before HEAD
    .venv/bin/python ab.py --variants before=/tmp/before/src,after=../src \\
        --db postgres,sqlite --repeat 3 --sizes 500 --latency-count 200

Prints min-max (median) per cell and writes the raw JSON to ``.work/ab-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import compare

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", required=True, help="name=path/to/src,name=path/to/src")
    p.add_argument("--db", default="postgres,sqlite")
    p.add_argument("--sizes", default="500")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--latency-count", type=int, default=200)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-dbos", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    variants = [
        (name, Path(path).resolve())
        for name, _, path in (v.partition("=") for v in args.variants.split(","))
    ]
    sides: list[tuple[str, Path | None]] = [*variants] + ([] if args.no_dbos else [("dbos", None)])
    dbs = args.db.split(",")
    sizes = [int(x) for x in args.sizes.split(",")]
    workdir = HERE / ".work" / "ab"
    results: list[dict[str, Any]] = []
    default_src = compare.SRC
    sys.stderr.write(f"ab: {', '.join(f'{n}={s}' for n, s in variants)}\n")
    for rep in range(args.repeat):
        order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
        for db in dbs:
            sys.stderr.write(f"[{rep + 1}/{args.repeat}] {db}\n")
            scenarios: list[tuple[str, list[str]]] = [
                (
                    f"throughput n={n}",
                    ["throughput", "--n", str(n), "--k", str(args.k), "--warmup", "20"],
                )
                for n in sizes
            ]
            scenarios.append(
                ("latency", ["latency", "--count", str(args.latency_count), "--warmup", "10"])
            )
            for scen, scen_argv in scenarios:
                for name, src in order:
                    script = "dbos_side.py" if src is None else "durably_side.py"
                    compare.SRC = src or default_src
                    argv = [
                        script,
                        "--db",
                        db,
                        "--name",
                        f"bench_ab_{'dbos' if src is None else 'durably'}",
                        "--workdir",
                        str(workdir),
                        *scen_argv,
                    ]
                    if scen.startswith("throughput"):
                        argv += ["--timeout", str(args.timeout)]
                    res = compare.run_side(f"ab {name} {db} {scen}", argv, args.timeout)
                    results.append({"variant": name, "db": db, "cell": scen, "rep": rep, **res})
    out = Path(args.json or HERE / ".work" / f"ab-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))

    def spread(vals: list[float], digits: int) -> str:
        if not vals:
            return "n/a"
        f = f"{{:,.{digits}f}}"
        return f"{f.format(min(vals))}-{f.format(max(vals))} ({f.format(statistics.median(vals))})"

    header = ["db", "metric", *(name for name, _ in sides)]
    rows: list[list[str]] = []
    for db in dbs:
        metrics: list[tuple[str, str, str, float, int]] = [
            (f"throughput n={n}", f"steps/s N={n}", "steps_per_s", 1.0, 0) for n in sizes
        ]
        metrics += [
            ("latency", "latency p50 ms", "p50_ms", 1.0, 2),
            ("latency", "latency p99 ms", "p99_ms", 1.0, 2),
        ]
        for scen, label, key, scale, digits in metrics:
            row = [db, label]
            for name, _ in sides:
                vals = [
                    float(r[key]) * scale
                    for r in results
                    if r["variant"] == name
                    and r["db"] == db
                    and r["cell"] == scen
                    and isinstance(r.get(key), (int, float))
                ]
                failed = sum(
                    1
                    for r in results
                    if r["variant"] == name and r["db"] == db and r["cell"] == scen and "error" in r
                )
                row.append(spread(vals, digits) + (f" [{failed} failed]" if failed else ""))
            rows.append(row)
    loads = [x for r in results for x in r.get("load1", [])]
    print()
    print(f"min-max (median) over {args.repeat} interleaved repeats; raw: {out}")
    if loads:
        print(f"1-minute load average during the runs: {min(loads):.2f}-{max(loads):.2f}")
    print(compare.table(header, rows))


if __name__ == "__main__":
    main()
