"""Every scenario of the benchmark in one run, ending with one summary table.

    python all.py              # ~25-30 minutes on 2 cores (run.sh all)
    python all.py --quick      # smoke sizes, ~5 minutes
    python all.py --repeat 3   # each scenario's own interleaved repeats; cells show min-max
    python all.py --only main,grow   # a subset (main, dispatch, starts, grow, big, fleet)

It runs, one after the other, each scenario's own script on PostgreSQL (the figures of issue 18
are PostgreSQL's), each printing its full tables as it finishes and writing its raw JSON to
``.work/all-<time>/``:

- ``main``: ``compare.py`` (throughput, one-step latency, the commit floor) with DBOS and
  Temporal;
- ``dispatch``: ``dispatch_compare.py``, local steps against steps dispatched through ``db://``
  and ``redis://``, against DBOS queues;
- ``starts``: ``starts_compare.py``, N runs started at once by a producer;
- ``grow``: ``grow_compare.py``, throughput and latency on empty databases and on ones seeded
  with 1,000,000 finished runs, durably's and DBOS's alike (``dbos_grow.py``);
- ``big``: ``big.py``, a fan of children and many sleeping runs, on both at 10,000 and on
  durably alone at 100,000;
- ``fleet``: ``fleet.py``, 1, 2 and 4 engine processes (DBOS: ``fleet_dbos.py``) on one
  PostgreSQL.

Then the summary: figure | durably | DBOS | durably vs DBOS (| Temporal | vs Temporal), where
"vs" is how many times durably is better (rates: durably ÷ other; times and memory: other ÷
durably). A cell is the median of the scenario's repeats with min-max in brackets when
repeated (``big`` runs once). Ratios compare figures of the same run; the 1-minute load around
the run is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compare import fmt, table

HERE = Path(__file__).resolve().parent

Row = list[str]


def sizes(quick: bool) -> dict[str, list[str]]:
    """Each scenario's arguments: chosen so the full run stays near 30 minutes on 2 cores."""
    if quick:
        return {
            "main": ["--quick", "--db", "postgres"],
            "dispatch": ["--quick", "--db", "postgres", "--transports", "inline,db,redis"],
            "starts": ["--quick"],
            "grow": ["--quick", "--mid", "0", "--no-buffers", "--no-explain"],
            "big": [
                "--quick",
                "--fan-sizes",
                "2000",
                "--suspended-sizes",
                "1000",
                "--dbos-sizes",
                "1000",
                "--lead",
                "15",
            ],
            "fleet": ["--quick", "--m", "500"],
        }
    return {
        "main": ["--db", "postgres", "--sizes", "2000"],
        "dispatch": ["--db", "postgres", "--transports", "inline,local,db,redis"],
        "starts": [],
        "grow": ["--mid", "0", "--no-buffers", "--no-explain"],
        "big": ["--fan-sizes", "100000", "--suspended-sizes", "100000", "--dbos-sizes", "10000"],
        "fleet": ["--m", "3000"],
    }


SCRIPTS = {
    "main": "compare.py",
    "dispatch": "dispatch_compare.py",
    "starts": "starts_compare.py",
    "grow": "grow_compare.py",
    "big": "big.py",
    "fleet": "fleet.py",
}


def run(name: str, argv: list[str], out: Path) -> tuple[dict[str, Any] | None, float]:
    """Run one scenario's script (its tables go to our stdout) and load its raw JSON."""
    sys.stderr.write(f"\n=== {name}: {SCRIPTS[name]} {' '.join(argv)}\n")
    sys.stdout.flush()
    t0 = time.perf_counter()
    path = out / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / SCRIPTS[name]), *argv, "--json", str(path)],
        cwd=HERE,
        check=False,
    )
    dt = time.perf_counter() - t0
    if proc.returncode != 0 or not path.exists():
        sys.stderr.write(f"=== {name}: failed (rc={proc.returncode})\n")
        return None, dt
    data: dict[str, Any] = json.loads(path.read_text())
    return data, dt


# -------------------------------------------------------------------------------- cell values


def values(runs: list[dict[str, Any]] | None, *path: str) -> list[float]:
    """The numbers at ``path`` in each successful run."""
    out: list[float] = []
    for r in runs or []:
        if "error" in r:
            continue
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            out.append(float(v))
    return out


def show(vs: list[float], digits: int = 1) -> str:
    """Median, with min-max when there are several."""
    if not vs:
        return "n/a"
    s = fmt(statistics.median(vs), digits)
    return s + (f" ({fmt(min(vs), digits)}-{fmt(max(vs), digits)})" if len(vs) > 1 else "")


def med(vs: list[float]) -> float | None:
    """The median, or None without values."""
    return statistics.median(vs) if vs else None


def better(d: float | None, o: float | None, lower: bool) -> str:
    """How many times durably is better than the other side (>1: durably ahead)."""
    if not d or not o:
        return "n/a"
    r = o / d if lower else d / o
    return f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


class Summary:
    """The rows of the one table, with a Temporal pair of columns where measured."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(
        self,
        figure: str,
        d: list[float],
        o: list[float] | None,
        lower: bool,
        digits: int = 1,
        t: list[float] | None = None,
        note: str = "",
    ) -> None:
        row = [figure, show(d, digits)]
        row += [show(o, digits), better(med(d), med(o), lower)] if o is not None else ["", ""]
        row += [show(t, digits), better(med(d), med(t), lower)] if t is not None else ["", ""]
        self.rows.append([*row, note])

    def section(self, title: str) -> None:
        """A bold row heading the next figures."""
        self.rows.append([f"**{title}**", "", "", "", "", "", ""])


# --------------------------------------------------------------------------- each scenario's rows


def main_rows(s: Summary, data: dict[str, Any]) -> None:
    """Throughput, one-step latency and the two-commit floor (compare.py)."""
    cells = data["cells"]
    n = (data["args"].get("sizes") or "").split(",")[-1] or "2000"
    sizes_ = [k.rsplit("=", 1)[1] for k in cells if k.startswith("durably postgres throughput")]
    n = sizes_[-1] if sizes_ else n
    k = data["args"].get("k", 5)

    def c(side: str, scen: str) -> list[dict[str, Any]] | None:
        got: list[dict[str, Any]] | None = cells.get(f"{side} postgres {scen}")
        return got

    temporal = "temporal" in (data["args"].get("sides") or "")
    s.section("throughput and latency (PostgreSQL)")
    tp = f"throughput n={n}"
    for key, label, digits in (
        ("workflows_per_s", f"workflows/s, N={n} K={k} started at once", 1),
        ("steps_per_s", f"steps/s, N={n} K={k}", 1),
    ):
        s.add(
            label,
            values(c("durably", tp), key),
            values(c("dbos", tp), key),
            False,
            digits,
            values(c("temporal", tp), key) if temporal else None,
        )
    for q in ("p50", "p99"):
        s.add(
            f"one-step latency {q} ms",
            values(c("durably", "latency"), f"{q}_ms"),
            values(c("dbos", "latency"), f"{q}_ms"),
            True,
            2,
            values(c("temporal", "latency"), f"{q}_ms") if temporal else None,
        )
    floor = med(values(c("floor", "seq"), "commit_latency", "p50_ms"))
    if floor:

        def over(side: str) -> list[float]:
            return [v / (2 * floor) for v in values(c(side, "latency"), "p50_ms")]

        s.add(
            f"one-step p50 ÷ two-commit floor (2 x {floor:.3f} ms)",
            over("durably"),
            over("dbos"),
            True,
            2,
            over("temporal") if temporal else None,
            "1.0 = two INSERT+COMMITs back to back",
        )


def dispatch_rows(s: Summary, data: dict[str, Any]) -> None:
    """Local steps and steps dispatched per transport, against DBOS queues."""
    cells = data["cells"]
    args = data["args"]

    def c(side: str, scen: str) -> list[dict[str, Any]] | None:
        got: list[dict[str, Any]] | None = cells.get(f"dispatch {side} postgres {scen}")
        return got

    n = 50 if args.get("quick") else args["n"]
    s.section(f"dispatched steps (ctx.step) vs local steps, N={n} K={args['k']}")
    dbos_tp = values(c("dbos", "throughput"), "steps_per_s")
    dbos_lat = values(c("dbos", "latency"), "p50_ms")
    local = values(c("inline", "throughput"), "steps_per_s")
    s.add("local steps (ctx.local_step): steps/s", local, None, False, 1)
    for t in ("local", "db", "redis"):
        tp = values(c(t, "throughput"), "steps_per_s")
        if not tp and c(t, "throughput") is None:
            continue
        s.add(
            f"dispatched via {t}://: steps/s",
            tp,
            dbos_tp,
            False,
            1,
            note=f"DBOS: a child workflow on a queue; local_step ÷ {t}:// = "
            + better(med(local), med(tp), False),
        )
        s.add(
            f"dispatched via {t}://: latency p50 ms",
            values(c(t, "latency"), "p50_ms"),
            dbos_lat,
            True,
            2,
        )


def starts_rows(s: Summary, data: dict[str, Any]) -> None:
    """Starts per second and commits per start."""
    cells = data["cells"]
    s.section(f"{data['n']:,} starts at once (a producer, nothing executes them)")
    d, b = cells.get("starts durably postgres"), cells.get("starts DBOS postgres")
    s.add("starts/s", values(d, "starts_per_s"), values(b, "starts_per_s"), False)
    key = "commits_per_start"
    s.add("commits per start", values(d, key), values(b, key), True, 3)


def grow_rows(s: Summary, data: dict[str, Any]) -> None:
    """Both sides on their full databases, and each one's full ÷ empty."""
    cells = data["cells"]
    args = data["args"]
    runs = args.get("runs") or (100_000 if args.get("quick") else 1_000_000)
    s.section(f"cost as work grows: {runs:,} finished runs vs empty")

    def c(label: str) -> list[dict[str, Any]] | None:
        got: list[dict[str, Any]] | None = cells.get(label)
        return got

    for scen, key, label, lower, digits in (
        ("throughput", "workflows_per_s", "workflows/s", False, 1),
        ("latency", "p50_ms", "latency p50 ms", True, 2),
    ):
        d = values(c(f"grown {scen}"), key)
        b = values(c(f"dbos grown {scen}"), key)
        s.add(f"{label} at {runs:,}", d, b, lower, digits)

        def ratio(side: str, scen: str = scen, key: str = key) -> list[float]:
            """Each round's full/empty, in % of the empty figure (100 = flat)."""
            e = c(f"{side}empty {scen}") or []
            g = c(f"{side}grown {scen}") or []
            return [
                100 * gr[key] / er[key]
                for er, gr in zip(e, g, strict=False)
                if "error" not in er and "error" not in gr and er.get(key) and gr.get(key)
            ]

        dr, br = ratio(""), ratio("dbos ")
        s.rows.append(
            [
                f"{label}: {runs:,} ÷ empty, %",
                show(dr),
                show(br),
                "",
                "",
                "",
                "100% = flat; each side against itself",
            ]
        )


def pick(run: dict[str, Any] | None) -> Callable[[str], list[float] | None]:
    """A reader of one side's figures; None (no column) when that side did not run."""
    return lambda key: values([run], key) if run is not None else None


def big_rows(s: Summary, data: dict[str, Any]) -> None:
    """The fan and the suspended runs, DBOS where it ran at the same size."""
    res = data["results"]
    s.section("big shapes")
    for n, r in sorted(res.get("fan", {}).items(), key=lambda kv: int(kv[0])):
        b = res.get("dbos_fan", {}).get(n)
        o = pick(b)
        nn = f"{int(n):,}"
        s.add(f"fan of {nn} children: seconds", values([r], "seconds"), o("seconds"), True, 2)
        s.add(f"fan of {nn}: peak RSS MiB", values([r], "peak_rss_mb"), o("peak_rss_mb"), True)
    for n, r in sorted(res.get("suspended", {}).items(), key=lambda kv: int(kv[0])):
        b = res.get("dbos_suspended", {}).get(n)
        get = pick(b)
        nn = f"{int(n):,}"
        for key, what in (
            ("rss_idle_suspended_mb", "RSS idle MiB"),
            ("rss_firing_peak_mb", "RSS while firing MiB"),
        ):
            s.add(f"{nn} suspended: {what}", values([r], key), get(key), True)
        s.add(f"{nn} suspended: lag p99 s", values([r], "lag_p99_s"), get("lag_p99_s"), True, 3)
        within = [100 * v for v in values([r], "within_one_poll")]
        bw = get("within_one_poll")
        s.add(
            f"{nn} suspended: fired within 1 poll interval, %",
            within,
            [100 * v for v in bw] if bw is not None else None,
            False,
            note=f"poll {r.get('poll_interval_s', 1.0)} s, timers due over {r.get('spread_s')} s",
        )


def fleet_rows(s: Summary, data: dict[str, Any]) -> None:
    """Steps/s per fleet size, both sides, with each side's gain over one process."""
    res = data["results"]
    d_all, b_all = res.get("durably", {}), res.get("dbos", {})
    args = data["args"]
    s.section(f"fleet on one PostgreSQL: {args.get('m') or 6000:,} runs x K={args.get('k', 5)}")
    one_d = med(values(d_all.get("1"), "steps_per_s"))
    one_b = med(values(b_all.get("1"), "steps_per_s"))
    for w in sorted(d_all, key=int):
        d = values(d_all.get(w), "steps_per_s")
        b = values(b_all.get(w), "steps_per_s") if w in b_all else None
        vs1 = f"vs 1 process: durably {better(med(d), one_d, False)}"
        if b is not None:
            vs1 += f", DBOS {better(med(b), one_b, False)}"
        s.add(f"{w} engine process{'es' if w != '1' else ''}: steps/s", d, b, False, note=vs1)


ROWS: dict[str, Callable[[Summary, dict[str, Any]], None]] = {
    "main": main_rows,
    "dispatch": dispatch_rows,
    "starts": starts_rows,
    "grow": grow_rows,
    "big": big_rows,
    "fleet": fleet_rows,
}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=1, help="passed to every scenario but big")
    p.add_argument("--only", default=",".join(SCRIPTS), help="comma list of scenarios")
    p.add_argument(
        "--from",
        dest="from_dir",
        default=None,
        help="run nothing: print the summary of the <scenario>.json files in this directory",
    )
    args = p.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    out = HERE / ".work" / f"all-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.from_dir:
        out = Path(args.from_dir)
        started = f"from {out.name}"
    out.mkdir(parents=True, exist_ok=True)
    plan = sizes(args.quick)
    wanted = [w for w in args.only.split(",") if w]
    results: dict[str, dict[str, Any] | None] = {}
    took: dict[str, float] = {}
    loads: dict[str, tuple[float, float]] = {}
    for name in wanted if not args.from_dir else []:
        argv = list(plan[name])
        if args.repeat > 1 and name != "big":
            argv += ["--repeat", str(args.repeat)]
        before = os.getloadavg()[0]
        results[name], took[name] = run(name, argv, out)
        loads[name] = (before, os.getloadavg()[0])
    if args.from_dir:
        for name in wanted:
            path = out / f"{name}.json"
            results[name] = json.loads(path.read_text()) if path.exists() else None
    s = Summary()
    failed = []
    for name in wanted:
        data = results.get(name)
        if data is None:
            failed.append(name)
            continue
        try:
            ROWS[name](s, data)
        except (KeyError, TypeError, ValueError) as exc:  # a missing figure: say so, go on
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    versions = dbos_version(results)
    print()
    print(
        f"Summary — durably vs DBOS Transact {versions} (and Temporal where it runs), "
        f"PostgreSQL, {started}, repeat={args.repeat}{' (quick)' if args.quick else ''}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "'vs': how many times durably is better (rates: durably ÷ other; times, memory: "
        "other ÷ durably). Cells: median (min-max when repeated)."
    )
    print(
        table(["figure", "durably", "DBOS", "vs DBOS", "Temporal", "vs Temporal", "note"], s.rows)
    )
    if took:
        print(
            f"Minutes per scenario (1-minute load average before-after, {os.cpu_count()} CPUs): "
            + ", ".join(
                f"{k} {v / 60:.1f} ({loads[k][0]:.1f}-{loads[k][1]:.1f})" for k, v in took.items()
            )
        )
    if failed:
        print("no figures from: " + ", ".join(failed))
    (out / "summary.json").write_text(
        json.dumps(
            {"started": started, "args": vars(args), "rows": s.rows, "took_s": took, "load1": loads}
        )
    )
    print(f"raw results: {out}")
    return 1 if failed else 0


def dbos_version(results: dict[str, dict[str, Any] | None]) -> str:
    """The DBOS version that ran, from the main comparison's results."""
    data = results.get("main") or {}
    for runs in (data.get("cells") or {}).values():
        for r in runs:
            if r.get("side") == "dbos" and r.get("version"):
                return str(r["version"])
    return ""


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
