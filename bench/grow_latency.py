"""The issue-18 criterion, measured so that noise cannot decide it: empty database vs 1,000,000
finished runs, many interleaved rounds, side by side with the ratio.

    python grow.py --name bench_durably_grown seed --runs 1000000   # once; then reused
    python grow_latency.py --rounds 8 --count 300                   # latency only
    python grow_latency.py --rounds 6 --throughput 2000             # and N=2000 K=5 throughput
    python grow_latency.py --src /tmp/base/src ...                  # another durably tree

Each round runs ``grow_cost.py cpu latency`` (start one one-step run, wait for its result,
``--count`` times after a warm-up) once on the empty database (reset first) and once on the
grown one (as it is), in alternating order (empty first in even rounds, grown first in odd ones,
so a trend in the machine's load falls on both sides), each in its own process; with
``--throughput N`` each round also runs the N=N K=5 throughput scenario on both. Per measurement:
wall clock (p50, p99 or workflows/s), CPU per run of the engine process and of the PostgreSQL
client backends serving it (``/proc``: time on a CPU, which another process's work does not
add to), and the database's shared buffers hit + read per run (``pg_stat_database``: every
backend of that database, idle polls and autovacuum included).

The table gives, per metric, the median and min-max over the rounds on each side, the ratio of
the medians (grown / empty), and the "paired" ratio: the median (min-max) of each round's own
grown / empty ratio, whose two halves ran minutes apart at most. The grown database is left as
the measurements leave it (their runs stay, as they would in a deployment), so later rounds see
the dead index entries earlier rounds left and whatever autovacuum made of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

LATENCY = [
    ("p50_ms", "latency p50, ms (wall)"),
    ("p99_ms", "latency p99, ms (wall)"),
    ("engine_cpu_ms_per_run", "engine CPU, ms/run"),
    ("pg_cpu_ms_per_run", "PostgreSQL backends' CPU, ms/run"),
    ("total_cpu_ms_per_run", "engine + backends CPU, ms/run"),
    ("db_pages_per_run", "shared buffers hit + read per run"),
]
THROUGHPUT = [
    ("workflows_per_s", "throughput, workflows/s (wall)"),
    ("engine_cpu_ms_per_run", "engine CPU, ms/workflow"),
    ("pg_cpu_ms_per_run", "PostgreSQL backends' CPU, ms/workflow"),
    ("total_cpu_ms_per_run", "engine + backends CPU, ms/workflow"),
    ("db_pages_per_run", "shared buffers hit + read per workflow"),
]


def run(src: Path, name: str, keep: bool, argv: list[str], timeout: float) -> dict[str, Any]:
    """One ``grow_cost.py`` measurement in its own process, on ``src``'s durably."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), str(HERE)) if p)
    cmd = [sys.executable, "grow_cost.py", "--name", name, *(["--keep"] if keep else []), *argv]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    out: dict[str, Any] = {"error": f"no result: {proc.stderr.strip()[-300:]}"}
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            out = json.loads(line)
            break
        except ValueError:
            continue
    out["load"] = round(load, 2)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def pg_url(name: str) -> str:
    """The URL of database ``name`` (with BENCH_DB_SUFFIX, as the bench names it)."""
    from common import make_target

    return make_target("postgres", name, HERE).url


async def _autovacuum(url: str) -> list[dict[str, Any]]:
    import asyncpg

    conn = await asyncpg.connect(url)
    done = []
    try:
        settings = {
            r["name"]: float(r["setting"])
            for r in await conn.fetch(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('autovacuum_vacuum_threshold', 'autovacuum_vacuum_scale_factor')"
            )
        }
        for table in ("durably_runs", "durably_checkpoints"):
            row = await conn.fetchrow(
                "SELECT c.reltuples, c.reloptions, s.n_dead_tup FROM pg_class c "
                "JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = $1::regclass",
                table,
            )
            opts = dict(o.split("=", 1) for o in (row["reloptions"] or []))
            limit = float(
                opts.get("autovacuum_vacuum_threshold", settings["autovacuum_vacuum_threshold"])
            ) + float(
                opts.get(
                    "autovacuum_vacuum_scale_factor", settings["autovacuum_vacuum_scale_factor"]
                )
            ) * max(float(row["reltuples"]), 0.0)
            if row["n_dead_tup"] <= limit:
                continue
            blocks = (
                "SELECT blks_hit + blks_read FROM pg_stat_database"
                " WHERE datname = current_database()"
            )
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            b0 = await conn.fetchval(blocks)
            t0 = time.perf_counter()
            await conn.execute(f"VACUUM {table}")
            seconds = time.perf_counter() - t0
            await asyncio.sleep(0.2)
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            done.append(
                {
                    "table": table,
                    "dead": row["n_dead_tup"],
                    "limit": round(limit),
                    "seconds": round(seconds, 2),
                    "pages": int(await conn.fetchval(blocks)) - int(b0),
                }
            )
    finally:
        await conn.close()
    return done


def autovacuum(name: str) -> list[dict[str, Any]]:
    """What autovacuum would do now to the runs and checkpoints of database ``name`` (this
    server runs with ``autovacuum = off``): a plain VACUUM of each table whose dead rows exceed
    ``autovacuum_vacuum_threshold + autovacuum_vacuum_scale_factor * reltuples``, the table's
    own storage parameters first, else the server's (the VACUUM then follows the table's
    ``vacuum_index_cleanup``, as autovacuum does). Not emulated: ANALYZE, the insert trigger,
    the cost-based delay."""
    return asyncio.run(_autovacuum(pg_url(name)))


def span(xs: list[float]) -> str:
    """``median (min-max)`` of ``xs``, three significant figures."""
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def table(title: str, metrics: list[tuple[str, str]], pairs: list[tuple[dict, dict]]) -> str:
    """Markdown: per metric, empty and grown median (min-max), the medians' ratio, paired."""
    ok = [(e, g) for e, g in pairs if "error" not in e and "error" not in g]
    lines = [
        f"{title} ({len(ok)} rounds)",
        "",
        "| metric | empty | 1M | 1M / empty (medians) | (best rounds) | 1M / empty, paired |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, label in metrics:
        es = [float(e[key]) for e, _ in ok if e.get(key) is not None]
        gs = [float(g[key]) for _, g in ok if g.get(key) is not None]
        rs = [float(g[key]) / float(e[key]) for e, g in ok if e.get(key) and g.get(key) is not None]
        ratio = f"{100 * statistics.median(gs) / statistics.median(es):.0f}%" if es and gs else ""
        # noise only adds time: each side's least disturbed round (the lowest cost, the highest
        # throughput) is the nearest to a quiet machine
        best = max if key == "workflows_per_s" else min
        lows = f"{100 * best(gs) / best(es):.0f}%" if es and gs and best(es) else ""
        paired = (
            f"{100 * statistics.median(rs):.0f}% ({100 * min(rs):.0f}-{100 * max(rs):.0f}%)"
            if rs
            else "n/a"
        )
        lines.append(f"| {label} | {span(es)} | {span(gs)} | {ratio} | {lows} | {paired} |")
    return "\n".join(lines)


def relations(title: str, pairs: list[tuple[dict, dict]], top: int = 12) -> str:
    """Markdown: shared buffers per run of each durably table and index (the tables' own
    counters), medians over the rounds, the relations that differ most between the sides."""
    ok = [(e, g) for e, g in pairs if "error" not in e and "error" not in g]
    names = {n for e, g in ok for r in (e, g) for n in r.get("relation_pages_per_run", {})}

    def med(side: int, name: str) -> float:
        return statistics.median(
            [float(p[side].get("relation_pages_per_run", {}).get(name, 0.0)) for p in ok]
        )

    rows = sorted(names, key=lambda n: -abs(med(1, n) - med(0, n)))[:top]
    lines = [
        f"{title}: pages per run by table and index, medians ({len(ok)} rounds)",
        "",
        "| table or index | empty | 1M | 1M - empty |",
        "| --- | --- | --- | --- |",
    ]
    for n in rows:
        e, g = med(0, n), med(1, n)
        lines.append(f"| {n} | {e:.2f} | {g:.2f} | {g - e:+.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--count", type=int, default=300, help="one-step runs per latency sample")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--throughput", type=int, default=0, help="N of the N x K=5 scenario (0: off)")
    p.add_argument("--empty", default="bench_durably_empty")
    p.add_argument("--grown", default="bench_durably_grown")
    p.add_argument("--src", type=Path, default=SRC, help="the durably tree measured")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="also write every result here")
    p.add_argument(
        "--autovacuum",
        action="store_true",
        help="before each measurement on the grown database, vacuum as autovacuum would",
    )
    p.add_argument("--report", default=None, help="print the tables of a --json file; run nothing")
    args = p.parse_args()

    lat: list[tuple[dict, dict]] = []
    thr: list[tuple[dict, dict]] = []
    vacuums: list[dict[str, Any]] = []
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        lat, thr, vacuums = saved["latency"], saved["throughput"], saved.get("vacuums", [])
        args.rounds, args.autovacuum = 0, bool(vacuums) or args.autovacuum
        args.throughput = args.throughput or (2000 if thr else 0)
    scenarios: list[tuple[list[str], list[tuple[dict, dict]]]] = [
        (
            ["cpu", "latency", "--count", str(args.count), "--warmup", str(args.warmup)],
            lat,
        )
    ]
    if args.throughput:
        scenarios.append((["cpu", "throughput", "--n", str(args.throughput)], thr))
    for r in range(args.rounds):
        for argv, into in scenarios:
            got: dict[str, dict[str, Any]] = {}
            order = ("empty", "grown") if r % 2 == 0 else ("grown", "empty")
            for side in order:
                name = args.empty if side == "empty" else args.grown
                if side == "grown" and args.autovacuum:
                    for v in autovacuum(name):
                        vacuums.append({"round": r + 1, **v})
                        sys.stderr.write(f"round {r + 1} autovacuum {json.dumps(v)}\n")
                got[side] = run(args.src, name, side == "grown", argv, args.timeout)
                res = got[side]
                sys.stderr.write(
                    f"round {r + 1} {argv[1]:<10} {side:<5} load {res['load']:5.2f} "
                    + (
                        res["error"]
                        if "error" in res
                        else " ".join(
                            f"{k}={res.get(k)}"
                            for k in ("p50_ms", "workflows_per_s", "total_cpu_ms_per_run")
                            if k in res
                        )
                        + f" pages={res.get('db_pages_per_run')}"
                    )
                    + "\n"
                )
            into.append((got["empty"], got["grown"]))
    print(f"durably tree: {args.src}; grown database: {args.grown}; latency count {args.count}\n")
    print(table("Latency, one-step runs one at a time", LATENCY, lat))
    if thr:
        print()
        print(table(f"Throughput, N={args.throughput} K=5", THROUGHPUT, thr))
    print()
    print(relations("Latency", lat))
    if thr:
        print()
        print(relations("Throughput", thr))
    if args.autovacuum:
        print()
        print(f"Vacuums run as autovacuum would have ({len(vacuums)}):")
        for v in vacuums:
            print(f"- {json.dumps(v)}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"latency": lat, "throughput": thr, "vacuums": vacuums}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
