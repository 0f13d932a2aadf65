"""Big shapes on PostgreSQL: a 100,000-child fan, and 100,000 suspended runs.

    python big.py                        # fan at 10k and 100k; 1k and 100k suspended (~8 min)
    python big.py --quick                # fan 2k/10k, suspended 1k/10k
    python big.py --fan-sizes 10000,100000 --suspended-sizes 1000,100000 --spread 60

**fan**: ``scale.py fanout`` (one parent, ``ctx.all`` of N ``ctx.child``) at each size, its own
process: seconds and peak RSS, and the RSS per child between the two sizes.

**suspended**: a first process ("park") starts N runs of ``await ctx.sleep_until(due)`` then a
local step recording the wall-clock time it ran, waits until all N are suspended, and exits.
Due times are spread evenly over ``--spread`` seconds starting ``--lead`` seconds after the park
began. A fresh engine process ("wake") then opens the store: its RSS is sampled every 0.25 s
while the N runs sit suspended (idle, before the first timer is due), while the timers fire,
and at the end. The lag of each run is (wall clock of its first step after the sleep) - (its
due time), both read back from the store: p50/p90/p99/max, and the share within one poll
interval (``Engine(poll_interval=...)``, 1.0 s by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    RssSampler,
    emit,
    error_result,
    make_target,
    prepare_workdir,
    reset_target,
    rss_mb,
    wake_result,
)

HERE = Path(__file__).resolve().parent


async def stamp() -> int:
    return int(time.time() * 1000)


def build(url: str, poll: float) -> Any:
    import durably

    engine = durably.Engine(store=url, poll_interval=poll)

    @engine.workflow("nap", version="1")
    async def nap(ctx: Any, due_ms: int) -> int:
        await ctx.sleep_until(due_ms / 1000.0)
        woke: int = await ctx.local_step("woke", stamp)
        return woke

    return engine


async def count_status(url: str) -> dict[str, int]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT status, count(*) AS n FROM durably_runs GROUP BY status")
    finally:
        await conn.close()
    return {r["status"]: r["n"] for r in rows}


async def park(url: str, n: int, lead: float, spread: float, poll: float) -> dict[str, Any]:
    t0 = time.time()
    base_ms = int((t0 + lead) * 1000)
    engine = build(url, poll)
    async with engine:
        for lo in range(0, n, 5000):
            hi = min(n, lo + 5000)
            await asyncio.gather(
                *(
                    engine.start("nap", base_ms + int(spread * 1000 * i / n), run_id=f"nap-{i:06d}")
                    for i in range(lo, hi)
                )
            )
        while (await count_status(url)).get("suspended", 0) < n:
            if time.time() > t0 + lead:
                raise RuntimeError(f"not all {n} runs suspended {lead} s after the park began")
            await asyncio.sleep(0.5)
    return {"parked": n, "park_seconds": round(time.time() - t0, 1), "first_due_ms": base_ms}


async def wake(
    url: str, n: int, first_due_ms: int, spread: float, poll: float, timeout: float
) -> dict[str, Any]:
    import asyncpg

    rss_before_engine = rss_mb()
    engine = build(url, poll)
    sampler = RssSampler()
    sampler.start()
    t_open = time.time()
    cpu0 = time.process_time()
    async with engine:
        deadline = time.time() + timeout
        while True:
            st = await count_status(url)
            if st.get("completed", 0) >= n:
                break
            if time.time() > deadline:
                raise RuntimeError(f"timeout: {st}")
            await asyncio.sleep(0.5)
        t_done = time.time()
        # the engine's CPU: on a busy machine, lag with little CPU used is waiting for a core
        cpu_s = time.process_time() - cpu0
    sampler.stop()
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT s.wake_at AS due, r.output::bigint AS woke FROM durably_runs r "
            "JOIN durably_checkpoints s ON s.run_id = r.id AND s.kind = 'sleep' "
            "WHERE r.workflow = 'nap'"
        )
    finally:
        await conn.close()
    lags = [(r["woke"] - r["due"]) / 1000.0 for r in rows]
    return {
        **wake_result(
            n,
            lags,
            sampler,
            poll=poll,
            spread=spread,
            first_due_ms=first_due_ms,
            rss_before=rss_before_engine,
            t_open=t_open,
            t_done=t_done,
        ),
        "engine_cpu_s": round(cpu_s, 2),
        "engine_cpu_per_s": round(cpu_s / max(t_done - t_open, 1e-9), 3),
    }


# ---------------------------------------------------------------------------- orchestration


def sub(argv: list[str], timeout: float) -> dict[str, Any]:
    from compare import run_side

    return run_side(" ".join(a for a in argv[:6] if not a.startswith("/")), argv, timeout)


def suspended(script: str, n: int, args: Any, lead: float) -> dict[str, Any]:
    """Park N sleeping runs with ``script`` (big.py or big_dbos.py), then wake them in a fresh
    process; the two JSON results merged."""
    lead = args.lead or lead
    common = ["--n", str(n), "--spread", str(args.spread), "--poll", str(args.poll)]
    park_r = sub([script, "park", *common, "--lead", str(lead)], lead + 600)
    if "error" in park_r:
        return park_r
    return {
        **park_r,
        **sub(
            [script, "wake", *common, "--first-due-ms", str(park_r["first_due_ms"])],
            lead + args.spread + 1200,
        ),
    }


# (label, results key, field, digits, lower is better)
COMPARED = (
    ("fan: seconds", "fan", "seconds", 2, True),
    ("fan: peak RSS MiB", "fan", "peak_rss_mb", 1, True),
    ("suspended: RSS idle MiB", "suspended", "rss_idle_suspended_mb", 1, True),
    ("suspended: RSS firing peak MiB", "suspended", "rss_firing_peak_mb", 1, True),
    ("suspended: lag p50 s", "suspended", "lag_p50_s", 3, True),
    ("suspended: lag p99 s", "suspended", "lag_p99_s", 3, True),
    ("suspended: lag max s", "suspended", "lag_max_s", 3, True),
    ("suspended: within 1 poll %", "suspended", "within_one_poll", 1, False),
)


def side_by_side(results: dict[str, Any], sizes: list[int]) -> tuple[list[str], list[list[str]]]:
    """durably and DBOS at the same sizes: each figure and how many times durably is better."""
    from compare import fmt

    rows = []
    for n in sizes:
        for label, key, field, digits, lower in COMPARED:
            d = results[key].get(n, {}).get(field)
            b = results["dbos_" + key].get(n, {}).get(field)
            if field == "within_one_poll":
                d = None if d is None else 100 * d
                b = None if b is None else 100 * b
            better = "n/a"
            if d is not None and b is not None and (b if lower else d):
                better = f"{(b / d if lower else d / b):.2f}x" if (d if lower else b) else "n/a"
            rows.append([f"{n:,}", label, fmt(d, digits), fmt(b, digits), better])
    return ["runs", "figure", "durably", "DBOS", "durably better by"], rows


def orchestrate(args: Any) -> int:
    from compare import NOTES, fmt, table

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    dbos_sizes = [int(x) for x in args.dbos_sizes.split(",") if x]
    # durably also runs at DBOS's sizes, so the side-by-side is like for like
    fan_sizes = sorted({int(x) for x in args.fan_sizes.split(",") if x} | set(dbos_sizes))
    sus_sizes = sorted({int(x) for x in args.suspended_sizes.split(",") if x} | set(dbos_sizes))
    results: dict[str, Any] = {"fan": {}, "suspended": {}, "dbos_fan": {}, "dbos_suspended": {}}
    shapes = set(args.shapes.split(","))
    if "fan" not in shapes:
        fan_sizes = []
    if "suspended" not in shapes:
        sus_sizes = []
    for n in fan_sizes:
        results["fan"][n] = sub(["scale.py", "--db", "postgres", "fanout", "--n", str(n)], 3600)
        if n in dbos_sizes:
            results["dbos_fan"][n] = sub(["big_dbos.py", "fan", "--n", str(n)], 3600)
    for n in sus_sizes:
        # the lead covers parking N runs on a busy machine (100,000: ~80 s at load 10)
        results["suspended"][n] = suspended("big.py", n, args, max(30.0, n / 500.0 + 20.0))
        if n in dbos_sizes:  # DBOS starts ~200 workflows/s here: a longer lead to park them
            results["dbos_suspended"][n] = suspended(
                "big_dbos.py", n, args, max(30.0, n / 150.0 + 20.0)
            )
    print()
    print(f"Big shapes on PostgreSQL — {started}")
    rows = []
    ok = [(n, r) for n, r in results["fan"].items() if "error" not in r]
    for n, r in results["fan"].items():
        rows.append(
            [
                f"{n:,}",
                fmt(r.get("seconds"), 2),
                fmt(r.get("per_s")),
                fmt(r.get("peak_rss_mb")),
                r.get("error", "")[:80],
            ]
        )
    if len(ok) >= 2:
        (n1, r1), (n2, r2) = ok[0], ok[-1]
        per = (r2["peak_rss_mb"] - r1["peak_rss_mb"]) * 1024 / (n2 - n1)
        rows.append([f"{n1:,} → {n2:,}", "", "", f"+{per:.2f} KiB/child", ""])
    if rows:  # none with --fan-sizes , (the suspended scenario alone)
        print("fan: one parent, ctx.all of N ctx.child")
        print(table(["children", "seconds", "children/s", "peak RSS MiB", "error"], rows))
    rows = []
    for n, r in results["suspended"].items():
        if "error" in r:
            rows.append([f"{n:,}", "n/a: " + str(r["error"])[:60]] + [""] * 7)
            continue
        rows.append(
            [
                f"{n:,}",
                fmt(r.get("park_seconds")),
                fmt(r.get("rss_before_engine_mb")),
                fmt(r.get("rss_idle_suspended_mb")),
                fmt(r.get("rss_firing_peak_mb")),
                " / ".join(str(r.get(f"lag_{q}_s")) for q in ("p50", "p90", "p99", "max")),
                f"{100 * r.get('within_one_poll', 0):.1f}%",
                fmt(r.get("done_after_last_due_s"), 2),
                f"{n / r['spread_s']:,.0f}/s",
            ]
        )
    print(
        f"\nsuspended: N runs asleep, timers due evenly over {args.spread:.0f} s, "
        f"poll_interval {args.poll} s"
    )
    print(
        table(
            [
                "runs",
                "park s",
                "RSS no engine",
                "RSS idle, N suspended",
                "RSS firing peak",
                "lag p50/p90/p99/max s",
                "within 1 poll",
                "done after last due s",
                "due rate",
            ],
            rows,
        )
    )
    if dbos_sizes:
        print(
            "\nside by side with DBOS (fan: one parent workflow gathering N child workflows; "
            "suspended: N workflows in DBOS.sleep_async, recovered by a fresh process):"
        )
        print(table(*side_by_side(results, dbos_sizes)))
    loads = [x for part in results.values() for r in part.values() for x in r.get("load1", [])]
    if loads:
        print(f"1-minute load average around the runs: {min(loads):.2f}-{max(loads):.2f}")
    if NOTES:
        print("\n".join(NOTES))
    out = (
        Path(args.json)
        if args.json
        else HERE / ".work" / f"big-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.write_text(json.dumps({"started": started, "results": results}, indent=1, default=str))
    print(f"\nraw results: {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--name", default="bench_durably_big")
    p.add_argument("--workdir", default=".work")
    p.add_argument("what", nargs="?", default="all", choices=["all", "park", "wake"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--fan-sizes", default=None)
    p.add_argument("--suspended-sizes", default=None)
    p.add_argument("--n", type=int, default=0)
    p.add_argument("--lead", type=float, default=0.0, help="first due time, s after the park")
    p.add_argument("--spread", type=float, default=60.0)
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--first-due-ms", type=int, default=0)
    p.add_argument(
        "--dbos-sizes",
        default=None,
        help="sizes run on DBOS too, and on durably alike (10000; quick 1000; '' for none)",
    )
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--shapes", default="fan,suspended", help="which of fan,suspended to run")
    args = p.parse_args()
    if args.dbos_sizes is None:
        args.dbos_sizes = "1000" if args.quick else "10000"
    if args.what == "all":
        args.fan_sizes = args.fan_sizes or ("2000,10000" if args.quick else "10000,100000")
        args.suspended_sizes = args.suspended_sizes or (
            "1000,10000" if args.quick else "1000,100000"
        )
        if args.quick:
            args.spread = min(args.spread, 10.0)
        return orchestrate(args)
    prepare_workdir(args.workdir)
    t = make_target("postgres", args.name, Path.cwd())
    base = {"side": "durably", "db": "postgres", "scenario": f"big-{args.what}", "n": args.n}
    try:
        if args.what == "park":

            async def go() -> dict[str, Any]:
                await reset_target(t)
                return await park(t.url, args.n, args.lead, args.spread, args.poll)

            emit({**base, **asyncio.run(go())})
        else:
            emit(
                {
                    **base,
                    **asyncio.run(
                        wake(t.url, args.n, args.first_due_ms, args.spread, args.poll, 1800.0)
                    ),
                }
            )
    except Exception as exc:
        emit(error_result(base, exc))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
