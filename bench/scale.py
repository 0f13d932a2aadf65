"""Scale scenarios, durably only: time and peak memory at 10,000 runs.

    python scale.py --db sqlite fanout   --n 10000   # one parent, ctx.all of 10,000 ctx.child
    python scale.py --db sqlite sleepers --n 10000   # 10,000 runs sleep, then wake together
    python scale.py --db sqlite recovery --n 10000   # a process holding 10,000 runs is SIGKILLed;
                                                     # a fresh engine recovers and finishes them

Each prints one JSON line: ``seconds`` (the part that scales: see each scenario), ``per_s``
(runs per second over that part) and ``peak_rss_mb`` of the measuring process. A feature the
engine does not have yet (``ctx.child``, ``ctx.sleep``, …) is reported as
``{"skipped": true, "error": "..."}`` instead of failing.

``BENCH_ENGINE_KWARGS`` (JSON) is passed to ``durably.Engine`` in every phase, e.g.
``'{"lease_ms": 2000}'`` so orphaned leases expire quickly in the recovery scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from common import Target, emit, error_result, make_target, prepare_workdir, reset_target

HERE = Path(__file__).resolve().parent


class MissingFeature(Exception):
    """The engine under test does not have what the scenario needs yet."""


def engine_kwargs(**defaults: Any) -> dict[str, Any]:
    """``defaults`` overridden by the JSON object in BENCH_ENGINE_KWARGS."""
    raw = os.environ.get("BENCH_ENGINE_KWARGS", "").strip()
    return {**defaults, **(dict(json.loads(raw)) if raw else {})}


def require(*names: str) -> None:
    """Import durably and check that WorkflowContext has every ``ctx`` operation named."""
    try:
        import durably
    except ImportError as exc:
        raise MissingFeature(f"durably is not importable: {exc}") from exc
    for attr in ("Engine", "WorkflowContext"):
        if not hasattr(durably, attr):
            raise MissingFeature(f"durably has no {attr} yet")
    missing = [n for n in names if not hasattr(durably.WorkflowContext, n)]
    if missing:
        raise MissingFeature(
            "durably.WorkflowContext has no " + ", ".join(f"ctx.{n}" for n in missing) + " yet"
        )


def check_completed(res: Any) -> None:
    if str(getattr(res, "status", "?")) != "completed":
        raise RuntimeError(
            f"run {getattr(res, 'run_id', '?')} ended {getattr(res, 'status', '?')}: "
            f"{getattr(res, 'error', None)!r}"
        )


WAITERS = int(os.environ.get("BENCH_WAITERS", "64"))


async def wait_all(engine: Any, run_ids: list[str], timeout: float) -> None:
    """Wait for every run with at most WAITERS ``wait_for_run`` calls in flight.

    10,000 simultaneous waiters would each poll the store: the scenario would measure the polls,
    not the engine's wake-up or recovery. With a bounded pool the waiters walk through the runs
    as they finish, and a run already finished costs one read.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = iter(run_ids)

    async def waiter() -> None:
        for r in pending:
            left = max(deadline - loop.time(), 0.001)
            check_completed(await engine.wait_for_run(r, terminal=True, timeout=left))

    await asyncio.gather(*(waiter() for _ in range(max(1, min(WAITERS, len(run_ids))))))


# ------------------------------------------------------------------------------------- fan-out


async def fanout(t: Target, n: int, timeout: float) -> dict[str, Any]:
    """One parent starts n children and waits for them all:
    ``await ctx.all([ctx.child("leaf", i) for i in range(n)])`` (children are started together
    and cost the parent one suspension), or ``ctx.child`` calls gathered without ``ctx.all``."""
    require("child")
    import durably

    how = (
        "ctx.all of ctx.child" if hasattr(durably.WorkflowContext, "all") else "gather of ctx.child"
    )
    engine = durably.Engine(store=t.url, **engine_kwargs())

    @engine.workflow("leaf", version="1")
    async def leaf(ctx: Any, i: int) -> int:
        return i

    @engine.workflow("fan", version="1")
    async def fan(ctx: Any, count: int) -> int:
        calls = [ctx.child("leaf", i) for i in range(count)]
        if how.startswith("ctx.all"):
            outs = await ctx.all(calls)
        else:
            outs = await asyncio.gather(*calls)
        if list(outs) != list(range(count)):
            raise RuntimeError("children's outputs are not in input order")
        return len(outs)

    async with engine:
        t0 = time.perf_counter()
        run = await engine.start("fan", n, run_id="fan")
        res = await engine.wait_for_run(run.run_id, terminal=True, timeout=timeout)
        elapsed = time.perf_counter() - t0
    check_completed(res)
    if res.output != n:
        raise RuntimeError(f"parent returned {res.output!r}, expected {n}")
    return {"n": n, "via": how, "seconds": round(elapsed, 3), "per_s": round(n / elapsed, 1)}


# ------------------------------------------------------------------------------------ sleepers


async def sleepers(t: Target, n: int, sleep_s: float, timeout: float) -> dict[str, Any]:
    require("sleep")
    import durably

    engine = durably.Engine(store=t.url, **engine_kwargs())

    @engine.workflow("sleeper", version="1")
    async def sleeper(ctx: Any, i: int) -> int:
        await ctx.sleep(sleep_s)
        return i

    ids = [f"sleep-{i}" for i in range(n)]
    async with engine:
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.start("sleeper", i, run_id=r) for i, r in enumerate(ids)))
        t_started = time.perf_counter() - t0
        await wait_all(engine, ids, timeout)
        elapsed = time.perf_counter() - t0
    # what scales is the wake: everything after the timers came due
    wake = max(elapsed - sleep_s, 1e-6)
    return {
        "n": n,
        "sleep_s": sleep_s,
        "start_seconds": round(t_started, 3),
        "total_seconds": round(elapsed, 3),
        "seconds": round(wake, 3),
        "per_s": round(n / wake, 1),
        "note": "seconds = total - sleep: starting, then waking and finishing every run",
    }


# ------------------------------------------------------------------------------------ recovery


def build_orphan_engine(t: Target, hang: bool, lease: str) -> tuple[Any, list[int]]:
    require("local_step")
    import durably

    engine = durably.Engine(store=t.url, **engine_kwargs(lease=lease))
    entered: list[int] = [0]

    async def work(i: int) -> int:
        entered[0] += 1
        if hang:
            await asyncio.sleep(3600)  # the victim never finishes: it is SIGKILLed
        return i

    @engine.workflow("orphan", version="1")
    async def orphan(ctx: Any, i: int) -> int:
        out: int = await ctx.local_step("work", work, i)
        return out

    return engine, entered


async def victim(t: Target, n: int, settle_s: float, lease: str) -> None:
    """Start n runs whose step hangs, say 'ready' once no more are being picked up, then wait."""
    engine, entered = build_orphan_engine(t, hang=True, lease=lease)
    async with engine:
        await asyncio.gather(*(engine.start("orphan", i, run_id=f"orphan-{i}") for i in range(n)))
        last, still = -1, 0.0
        while entered[0] < n and still < settle_s:
            await asyncio.sleep(0.2)
            still = still + 0.2 if entered[0] == last else 0.0
            last = entered[0]
        print(json.dumps({"ready": True, "started": n, "in_step": entered[0]}), flush=True)
        await asyncio.sleep(3600)


async def recovery(
    t: Target, name: str, n: int, timeout: float, settle_s: float, lease: str
) -> dict[str, Any]:
    require("local_step")
    argv = [
        sys.executable,
        str(HERE / "scale.py"),
        "--db",
        t.db,
        "--name",
        name,
        "--workdir",
        os.getcwd(),
        "recovery-victim",
        "--n",
        str(n),
        "--settle",
        str(settle_s),
        "--lease",
        lease,
    ]
    victim_log = Path(os.getcwd()) / "recovery-victim.log"
    err = victim_log.open("w")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=err, cwd=HERE
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout)).decode()
            info = json.loads(line) if line.strip() else {}
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)  # the crash being recovered from
            await proc.wait()
    finally:
        err.close()
    if not info.get("ready"):
        tail = (victim_log.read_text().strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the process to be killed failed first (rc={proc.returncode}): {tail}")
    engine, _ = build_orphan_engine(t, hang=False, lease=lease)
    ids = [f"orphan-{i}" for i in range(n)]
    t0 = time.perf_counter()
    async with engine:
        await wait_all(engine, ids, timeout)
        elapsed = time.perf_counter() - t0
    return {
        "n": n,
        "in_step_when_killed": info.get("in_step"),
        "seconds": round(elapsed, 3),
        "per_s": round(n / elapsed, 1),
        "engine_kwargs": engine_kwargs(lease=lease),
        "note": "seconds from the new engine's start, including waiting out the dead leases",
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--db", choices=["sqlite", "postgres"], required=True)
    p.add_argument("--name", default="bench_durably_scale")
    p.add_argument("--workdir", default=".work")
    sub = p.add_subparsers(dest="scenario", required=True)
    for name in ("fanout", "sleepers", "recovery", "recovery-victim"):
        sp = sub.add_parser(name)
        sp.add_argument("--n", type=int, default=10_000)
        sp.add_argument("--timeout", type=float, default=1200.0)
        sp.add_argument("--sleep", type=float, default=10.0, help="sleepers: seconds asleep")
        sp.add_argument(
            "--settle",
            type=float,
            default=3.0,
            help="recovery: kill once no new run entered its step for this long",
        )
        sp.add_argument(
            "--lease",
            default="5s",
            help="recovery: Engine(lease=...) in both processes (how long a dead "
            "process's runs stay locked)",
        )
    args = p.parse_args()
    wd = prepare_workdir(args.workdir)
    t = make_target(args.db, args.name, wd)
    if args.scenario == "recovery-victim":  # internal: the process that gets SIGKILLed
        asyncio.run(victim(t, args.n, args.settle, args.lease))
        return
    base: dict[str, Any] = {"side": "durably", "db": args.db, "scenario": f"scale-{args.scenario}"}

    async def go() -> dict[str, Any]:
        await reset_target(t)
        if args.scenario == "fanout":
            return await fanout(t, args.n, args.timeout)
        if args.scenario == "sleepers":
            return await sleepers(t, args.n, args.sleep, args.timeout)
        return await recovery(t, args.name, args.n, args.timeout, args.settle, args.lease)

    try:
        emit({**base, **asyncio.run(go())})
    except MissingFeature as exc:
        emit({**base, "error": f"skipped: {exc}", "skipped": True})
    except AttributeError as exc:  # an operation exists in name only, or a store lacks a method
        emit(error_result(base, exc, skipped=True))
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
