"""CPU per sequential one-step run on PostgreSQL, of one or more durably trees, interleaved.

The latency scenario of ``compare.py`` (start one run, wait for its result, repeat) measured
by *process CPU time* (``time.process_time``) in a fresh interpreter per sample, alternating
the trees, so a busy machine inflates the wall clock but barely the CPU. Each sample also
reports its wall-clock p50 and, in a second pass of the same process, the event-loop
callbacks (``Handle._run``) and tasks created per run, and in a third pass the Python and C
function calls per run (``sys.setprofile``): counted, not timed, so a busy machine cannot move
them (a few background callbacks, the worker's ticks, can).

    python bench/pg_cpu.py --variants before=/tmp/before/src,after=src --repeat 5
    python bench/pg_cpu.py --variants after=src --store memory      # the engine alone

Each PostgreSQL sample also measures floor.py's statement (one 2-column row, one commit) N
times on its schema right after the timed runs, and prints p50 ÷ two floor commits per sample.

Each sample runs on a fresh schema of ``BENCH_PG_URL`` (default the local ``test`` database)
and drops it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import asyncio, asyncio.events, json, os, statistics, sys, time, uuid
import asyncpg
import durably

N, STORE, BASE = int(sys.argv[1]), sys.argv[2], sys.argv[3]

async def step(i):  # async, as compare.py's latency scenario (a sync step runs in a thread)
    return i

async def main():
    schema = f"durably_cpu_{uuid.uuid4().hex[:10]}"
    admin = None
    if STORE == "postgres":
        admin = await asyncpg.connect(BASE)
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        url = f"{BASE}?schema={schema}"
    else:
        url = "memory://"
    try:
        engine = durably.Engine(url)

        @engine.workflow("one_step", version="1")
        async def one_step(ctx, x):
            return await ctx.local_step("s0", step, x)

        async def one(i):
            run = await engine.start("one_step", i)
            res = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
            assert res.output == i, res

        async with engine:
            for i in range(50):
                await one(i)
            walls = []
            cpu0 = time.process_time()
            for i in range(N):
                t0 = time.perf_counter()
                await one(i)
                walls.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu0
            floor = []
            if admin is not None:
                # floor.py's statement on this schema, right after: one commit's round trip
                fc = await asyncpg.connect(BASE, server_settings={"search_path": schema})
                try:
                    await fc.execute(
                        "CREATE TABLE floor_t (id BIGSERIAL PRIMARY KEY, run_id TEXT, v TEXT)"
                    )
                    for i in range(N):
                        t0 = time.perf_counter()
                        await fc.execute(
                            "INSERT INTO floor_t (run_id, v) VALUES ($1, $2)", str(i), "x" * 100
                        )
                        floor.append(time.perf_counter() - t0)
                finally:
                    await fc.close()
            # second pass, counted: callbacks run by the loop and tasks created per run
            counts = {"callbacks": 0, "tasks": 0}
            orig_run = asyncio.events.Handle._run
            def _run(self):
                counts["callbacks"] += 1
                return orig_run(self)
            loop = asyncio.get_running_loop()
            orig_factory = loop.get_task_factory()
            def factory(loop, coro, **kw):
                counts["tasks"] += 1
                if orig_factory is not None:
                    return orig_factory(loop, coro, **kw)
                return asyncio.Task(coro, loop=loop, **kw)
            M = 200
            asyncio.events.Handle._run = _run
            loop.set_task_factory(factory)
            try:
                for i in range(M):
                    await one(i)
            finally:
                asyncio.events.Handle._run = orig_run
                loop.set_task_factory(orig_factory)
            # third pass: Python and C function calls per run (deterministic, unlike time)
            calls = [0]
            def prof(frame, event, arg):
                if event == "call" or event == "c_call":
                    calls[0] += 1
            sys.setprofile(prof)
            try:
                for i in range(M):
                    await one(i)
            finally:
                sys.setprofile(None)
            counts["calls"] = calls[0]
    finally:
        if admin is not None:
            await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await admin.close()
    print(json.dumps({
        "cpu_us": cpu / N * 1e6,
        "p50_ms": statistics.median(walls) * 1e3,
        "floor_ms": statistics.median(floor) * 1e3 if floor else 0.0,
        "callbacks": counts["callbacks"] / M,
        "tasks": counts["tasks"] / M,
        "calls": counts["calls"] / M,
    }))

asyncio.run(main())
"""


def sample(src: str, n: int, store: str, base: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(n), store, base],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", required=True, help="name=path/to/src,name=path/to/src")
    p.add_argument("--store", default="postgres", choices=["postgres", "memory"])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--pg", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    )
    args = p.parse_args()
    variants = [tuple(v.split("=", 1)) for v in args.variants.split(",")]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    load0 = os.getloadavg()[0]
    for r in range(args.repeat):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name, src in order:
            samples[name].append(sample(os.path.abspath(src), args.n, args.store, args.pg))
    load1 = os.getloadavg()[0]
    print(
        f"sequential one-step runs, {args.store}, N={args.n}, {args.repeat} samples each, "
        f"load {load0:.2f} -> {load1:.2f}"
    )
    base = statistics.median(s["cpu_us"] for s in samples[variants[0][0]])
    for name, _ in variants:
        rows = samples[name]
        cpu = [s["cpu_us"] for s in rows]
        p50 = [s["p50_ms"] for s in rows]
        ratio = [s["p50_ms"] / (2 * s["floor_ms"]) for s in rows if s["floor_ms"]]
        med = statistics.median(cpu)
        print(
            f"  {name:<10} CPU µs/run median {med:6.1f} ({min(cpu):.1f}-{max(cpu):.1f})"
            f" {med / base:5.2f}x | p50 ms {statistics.median(p50):.3f}"
            f" ({min(p50):.3f}-{max(p50):.3f}) | callbacks/run {rows[0]['callbacks']:.1f}"
            f" tasks/run {rows[0]['tasks']:.2f} | function calls/run"
            f" {statistics.median(s['calls'] for s in rows):.0f}"
        )
        if ratio:
            print(
                f"  {'':<10} p50 / two floor commits (floor measured right after, same schema):"
                f" median {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}),"
                f" floor p50 {statistics.median(s['floor_ms'] for s in rows):.3f} ms"
            )


if __name__ == "__main__":
    main()
