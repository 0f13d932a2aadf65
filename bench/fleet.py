"""Fleet scaling on one PostgreSQL: steps/s with 1, 2 and 4 engine processes.

    python fleet.py                      # 1, 2, 4 processes; 6,000 runs of K=5 local steps
    python fleet.py --repeat 3           # interleaved 1, 2, 4, 1, 2, 4, ...
    python fleet.py --live               # the producer starts runs while the fleet works
    python fleet.py --quick              # 1,000 runs

For each fleet size W, on a freshly reset database: a producer process
(``Engine(url, consumers="never")``, it only stores runs) starts M runs of the throughput
workflow (``bench``: K trivial ``ctx.local_step``), then W engine processes, each
``durably.Engine(url)`` with the defaults, are started together (each imports, builds its engine,
says ready, and opens it on "go"), and the time from "go" until every run is completed is
measured (the orchestrator polls the run counts). With ``--live`` the producer starts together
with the fleet and the time counts from "go" too.

Reported per W: steps/s, each process's share of the steps and its CPU seconds (user+system)
over the window, the PostgreSQL backends' CPU (the connections of this database, from
``/proc/<pid>/stat``), commits per second (``pg_stat_database``), and how busy the machine was
(``/proc/stat``: CPU seconds used ÷ (cores x wall time)). Where the curve bends, those say why:
a saturated machine with PostgreSQL taking the larger share points at the database, each engine
process near 1.0 CPU-second per second at the GIL, neither at us.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import make_target, pg_base_url, reset_target

HERE = Path(__file__).resolve().parent
NAME = "bench_durably_fleet"
NAMES = {"durably": NAME, "dbos": "bench_dbos_fleet"}
# completed / all runs, per side's own tables
COUNTS = {
    "durably": "SELECT count(*) FILTER (WHERE status = 'completed') AS done, count(*) AS total "
    "FROM durably_runs",
    "dbos": "SELECT count(*) FILTER (WHERE status = 'SUCCESS') AS done, count(*) AS total "
    "FROM dbos.workflow_status WHERE name = 'fleet_wf'",
}
TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ the processes

STEPS = [0]


async def trivial(i: int) -> int:
    STEPS[0] += 1
    return i


def build(url: str, **kw: Any) -> Any:
    import durably

    engine = durably.Engine(store=url, **kw)

    @engine.workflow("bench", version="1")
    async def bench(ctx: Any, k: int) -> int:
        for i in range(k):
            await ctx.local_step(f"s{i}", trivial, i)
        return k

    return engine


async def producer(url: str, m: int, k: int) -> None:
    engine = build(url, consumers="never")
    t0 = time.perf_counter()
    async with engine:
        for lo in range(0, m, 1000):
            await asyncio.gather(*(engine.start("bench", k) for _ in range(lo, min(m, lo + 1000))))
    print(json.dumps({"started": m, "seconds": round(time.perf_counter() - t0, 3)}), flush=True)


async def worker(url: str) -> None:
    rec = None
    if os.environ.get("BENCH_FLEET_SQL"):  # count each statement the store sends, by kind
        from grow import Recorder

        rec = Recorder()
        rec.install()
    engine = build(url)
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    async with engine:
        await loop.run_in_executor(None, sys.stdin.readline)  # "stop"
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    by_kind: dict[str, int] = {}
    if rec is not None:
        from grow import kind_of

        for sql, n in rec.counts.items():
            by_kind[kind_of(sql)] = by_kind.get(kind_of(sql), 0) + n
        top = sorted(rec.counts.items(), key=lambda kv: -kv[1])[:3]
        sys.stderr.write("".join(f"{n:6d} {' '.join(q.split())[:300]}\n" for q, n in top))
    print(
        json.dumps(
            {
                "steps": STEPS[0],
                "cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 3),
                "peak_rss_mb": round(r1.ru_maxrss / 1024.0, 1),
                "statements": by_kind,
            }
        ),
        flush=True,
    )


# ---------------------------------------------------------------------------- the orchestrator


def machine_cpu() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / TICK, sum(fields) / TICK


def proc_cpu(pid: int) -> float:
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(parts[11]) + int(parts[12])) / TICK


async def pg_snapshot(url: str, side: str = "durably") -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        pids = [
            r["pid"]
            for r in await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            )
        ]
        st = await conn.fetchrow(
            "SELECT xact_commit, blks_hit, blks_read, tup_inserted, tup_updated "
            "FROM pg_stat_database WHERE datname = current_database()"
        )
        # exact at any moment, unlike pg_stat_database (flushed by each backend at most once
        # a second): the next transaction id counts write transactions, the WAL position bytes
        wal = await conn.fetchrow(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_xid, "
            "pg_current_wal_lsn() - '0/0'::pg_lsn AS wal_bytes"
        )
        counts = await conn.fetchrow(COUNTS[side])
    finally:
        await conn.close()
    return {
        "pids": pids,
        "backend_cpu": {p: proc_cpu(p) for p in pids},
        "stats": dict(st),
        "next_xid": wal["next_xid"],
        "wal_bytes": int(wal["wal_bytes"]),
        "done": counts["done"],
        "total": counts["total"],
    }


def spawn(argv: list[str], script: str = "fleet.py") -> subprocess.Popen[str]:
    env = dict(os.environ)
    # BENCH_DURABLY_SRC: measure another checkout's src/ (before/after)
    src = os.environ.get("BENCH_DURABLY_SRC") or str(HERE.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, str(HERE), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, str(HERE / script), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(HERE / ".work" / "fleet-child.log", "a"),
        text=True,
        cwd=HERE,
        env=env,
    )


async def measure(
    w: int, m: int, k: int, live: bool, timeout: float, side: str = "durably"
) -> dict[str, Any]:
    t = make_target("postgres", NAMES[side], HERE / ".work")
    await reset_target(t)
    # the schema first, so the processes do not all migrate at once
    script, extra = "fleet.py", []
    if side == "dbos":
        script, extra = "fleet_dbos.py", ["--url", t.url]
        schema = spawn(["schema", *extra], script)
        if schema.wait(300) != 0:
            raise RuntimeError("DBOS schema setup failed (see .work/fleet-child.log)")
    else:
        engine = build(t.url, consumers="never")
        async with engine:
            pass
    prod_argv = ["producer", "--m", str(m), "--k", str(k), *extra]
    produced: dict[str, Any] = {}
    prod = None
    if not live:
        prod = spawn(prod_argv, script)
        assert prod.stdout is not None
        produced = json.loads(prod.stdout.readline() or "{}")
        prod.wait()
    workers = [spawn(["worker", *extra], script) for _ in range(w)]
    for p in workers:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a worker failed to start (see .work/fleet-child.log)")
    load0 = os.getloadavg()[0]
    busy0, total0 = machine_cpu()
    before = await pg_snapshot(t.url, side)
    t0 = time.perf_counter()
    for p in workers:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    if live:
        prod = spawn(prod_argv, script)
    worker_cpu0 = {p.pid: proc_cpu(p.pid) for p in workers}
    last = before
    while True:
        await asyncio.sleep(0.1)
        last = await pg_snapshot(t.url, side)
        if last["done"] >= m:
            break
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"timeout: {last['done']}/{m} done")
    elapsed = time.perf_counter() - t0
    busy1, total1 = machine_cpu()
    worker_cpu = [round(proc_cpu(p.pid) - worker_cpu0[p.pid], 2) for p in workers]
    backend_cpu = sum(
        cpu - before["backend_cpu"].get(pid, 0.0) for pid, cpu in last["backend_cpu"].items()
    )
    per: list[dict[str, Any]] = []
    for p in workers:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("stop\n")
        p.stdin.flush()
    for p in workers:
        assert p.stdout is not None
        line = p.stdout.readline()
        per.append(json.loads(line) if line.strip() else {})
        p.wait(60)
    if prod is not None:
        if live and prod.stdout is not None:
            produced = json.loads(prod.stdout.readline() or "{}")
        prod.wait(60)
    commits = last["stats"]["xact_commit"] - before["stats"]["xact_commit"]
    # the server's, not only this database's: other work on the server shows up here too
    xacts = last["next_xid"] - before["next_xid"]
    wal_mb = (last["wal_bytes"] - before["wal_bytes"]) / 2**20
    cores = os.cpu_count() or 1
    return {
        "side": side,
        "workers": w,
        "runs": m,
        "k": k,
        "live": live,
        "seconds": round(elapsed, 3),
        "steps_per_s": round(m * k / elapsed, 1),
        "workflows_per_s": round(m / elapsed, 1),
        "steps_by_worker": [r.get("steps") for r in per],
        "worker_cpu_s": worker_cpu,
        "worker_cpu_per_s": [round(c / elapsed, 2) for c in worker_cpu],
        "pg_backend_cpu_s": round(backend_cpu, 2),
        "pg_backend_cpu_per_s": round(backend_cpu / elapsed, 2),
        "pg_backends": len(last["pids"]),
        "commits_per_s": round(commits / elapsed, 1),
        "write_xacts_per_s": round(xacts / elapsed, 1),
        "steps_per_write_xact": round(m * k / xacts, 1) if xacts else None,
        "wal_mb_per_s": round(wal_mb / elapsed, 2),
        "others_cpu_per_s": round((busy1 - busy0 - sum(worker_cpu) - backend_cpu) / elapsed, 2),
        "machine_busy": round((busy1 - busy0) / (total1 - total0), 3),
        "machine_cpu_per_s": round((busy1 - busy0) / elapsed, 2),
        "cores": cores,
        "producer": produced,
        "load1": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "peak_rss_mb": [r.get("peak_rss_mb") for r in per],
        "statements": merge([r.get("statements") or {} for r in per]),
    }


def merge(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for key, n in c.items():
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def median_run(runs: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[float]]:
    """The run of median steps/s among those that succeeded, and every success's steps/s."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["steps_per_s"])
    return (ok[len(ok) // 2] if ok else None), [r["steps_per_s"] for r in ok]


def side_table(sizes: list[int], results: dict[int, list[dict[str, Any]]]) -> str:
    """One side's curve: steps/s per fleet size, with where the CPU went."""
    from compare import fmt, table

    rows = []
    base = None
    for w in sizes:
        med, sps = median_run(results[w])
        if med is None:
            rows.append([str(w), "n/a: " + str(results[w][0].get("error"))[:60]] + [""] * 8)
            continue
        if base is None:
            base = med["steps_per_s"]
        rng = f" ({fmt(min(sps))}-{fmt(max(sps))})" if len(sps) > 1 else ""
        rows.append(
            [
                str(w),
                f"{fmt(med['steps_per_s'])}{rng}",
                f"{med['steps_per_s'] / base:.2f}x",
                " / ".join(f"{c:.2f}" for c in med["worker_cpu_per_s"]),
                f"{med['pg_backend_cpu_per_s']:.2f}",
                f"{med['machine_cpu_per_s']:.2f} ({100 * med['machine_busy']:.0f}%)",
                f"{med['others_cpu_per_s']:.2f}",
                f"{fmt(med['write_xacts_per_s'])} ({med['steps_per_write_xact']})",
                f"{med['wal_mb_per_s']:.1f}",
                " / ".join(str(s) for s in med["steps_by_worker"]),
            ]
        )
    return table(
        [
            "processes",
            "steps/s",
            "vs 1",
            "CPU s/s per engine",
            "PG backends CPU s/s",
            "machine CPU s/s (busy)",
            "everything else CPU s/s",
            "write xacts/s (steps per xact)",
            "WAL MiB/s",
            "steps per engine",
        ],
        rows,
    )


def orchestrate(args: Any) -> int:
    from compare import fmt, table

    sizes = [int(x) for x in args.workers.split(",")]
    sides = [s for s in args.sides.split(",") if s]
    m = args.m or (1000 if args.quick else 6000)
    results: dict[str, dict[int, list[dict[str, Any]]]] = {
        side: {w: [] for w in sizes} for side in sides
    }
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for _ in range(args.repeat):
        for w in sizes:
            for side in sides:  # interleaved: durably 1, DBOS 1, durably 2, ...
                sys.stderr.write(f"  {side} fleet of {w} ... ")
                sys.stderr.flush()
                try:
                    r = asyncio.run(measure(w, m, args.k, args.live, args.timeout, side))
                    sys.stderr.write(f"{r['steps_per_s']:,.0f} steps/s\n")
                except Exception as exc:
                    r = {"side": side, "workers": w, "error": f"{type(exc).__name__}: {exc}"}
                    sys.stderr.write(f"error: {exc}\n")
                results[side][w].append(r)
    print()
    print(
        f"Fleet on one PostgreSQL ({pg_base_url()}) — {started}; {m:,} runs x K={args.k}, "
        f"{'producer live' if args.live else 'runs stored by a producer first'}, "
        f"repeat={args.repeat}, {os.cpu_count()} CPUs"
    )
    for side in sides:
        print(f"\n{side}:" if len(sides) > 1 else "")
        print(side_table(sizes, results[side]))
    if "durably" in sides and "dbos" in sides:
        rows = []
        for w in sizes:
            d, dsps = median_run(results["durably"][w])
            b, bsps = median_run(results["dbos"][w])
            d1, _ = median_run(results["durably"][sizes[0]])
            b1, _ = median_run(results["dbos"][sizes[0]])

            def cell(med: dict[str, Any] | None, sps: list[float], one: Any) -> list[str]:
                if med is None:
                    return ["n/a", ""]
                rng = f" ({fmt(min(sps))}-{fmt(max(sps))})" if len(sps) > 1 else ""
                vs = f"{med['steps_per_s'] / one['steps_per_s']:.2f}x" if one else ""
                return [f"{fmt(med['steps_per_s'])}{rng}", vs]

            ratio = f"{d['steps_per_s'] / b['steps_per_s']:.2f}x" if d and b else "n/a"
            rows.append([str(w), *cell(d, dsps, d1), *cell(b, bsps, b1), ratio])
        print(
            "\nside by side (DBOS: one queue, worker_concurrency 256, polled every "
            f"{os.environ.get('BENCH_DBOS_FLEET_POLL', '0.05')} s; see fleet_dbos.py):"
        )
        print(
            table(
                ["processes", "durably steps/s", "vs 1", "DBOS steps/s", "vs 1", "durably / DBOS"],
                rows,
            )
        )
    if os.environ.get("BENCH_FLEET_SQL"):
        print("\nStatements the engines sent per 1,000 steps, by kind (median run of each size):")
        for w in sizes:
            med, _ = median_run(results.get("durably", {}).get(w, []))
            if med:
                per_k = {
                    k: round(1000 * n / (med["runs"] * med["k"]), 1)
                    for k, n in med["statements"].items()
                }
                print(f"  {w}: " + ", ".join(f"{k} {v}" for k, v in list(per_k.items())[:8]))
    loads = [
        x for per in results.values() for rs in per.values() for r in rs for x in r.get("load1", [])
    ]
    if loads:
        print(f"1-minute load average around the runs: {min(loads):.2f}-{max(loads):.2f}")
    out = (
        Path(args.json)
        if args.json
        else HERE / ".work" / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.write_text(
        json.dumps({"started": started, "args": vars(args), "results": results}, indent=1)
    )
    print(f"\nraw results: {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("role", nargs="?", default="all", choices=["all", "producer", "worker"])
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--m", type=int, default=0, help="runs (default 6000; quick 1000)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--live", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--sides", default="durably,dbos", help="durably, dbos or both")
    p.add_argument("--json", default=None, help="write the raw results here")
    args = p.parse_args()
    (HERE / ".work").mkdir(exist_ok=True)
    url = make_target("postgres", NAME, HERE / ".work").url
    if args.role == "producer":
        asyncio.run(producer(url, args.m, args.k))
        return 0
    if args.role == "worker":
        asyncio.run(worker(url))
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
