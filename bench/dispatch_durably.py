"""durably's dispatched steps (``ctx.step``) through one transport, the same workloads as
``dispatch_dbos.py``.

One process both drives the workflows and serves the step handler (``@engine.step``, a trivial
``async def``), so a task goes out through the transport, the run suspends durably (no
``timeout=``), the handler runs, its result comes back through the transport and resumes the run.

    python dispatch_durably.py --db sqlite --transport db throughput --n 200 --k 5
    python dispatch_durably.py --db postgres --transport local latency --count 200
    python dispatch_durably.py --db sqlite --transport memory fan --count 20 --width 100
    python dispatch_durably.py --db postgres --transport redis latency --count 200

``--transport inline`` runs the same workflows with ``ctx.local_step`` instead (no dispatch: the
baseline). ``--transport redis`` uses the Redis at ``BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``)
under a prefix of the process's own, deleted at the end.

Scenarios:

- ``throughput``: N workflows of K sequential ``await ctx.step(noop, i)``, all N started at once
  (``asyncio.gather`` of ``engine.start``), then all awaited; after untimed warm-up workflows.
- ``latency``: one workflow with one ``ctx.step`` at a time, start -> result.
- ``fan``: one workflow at a time whose body is ``ctx.all([ctx.step(noop, i) for i in
  range(width)])``, start -> result; also steps/s over the whole series.

Prints one JSON line (see common.py). ``--profile out.html`` wraps the timed part in pyinstrument
(``pip install pyinstrument`` into bench/.venv first).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
import uuid
from typing import Any

from common import (
    Target,
    emit,
    error_result,
    latency_summary,
    make_target,
    prepare_workdir,
    reset_target,
    throughput_result,
    timed_batch,
)

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_PREFIX = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
TRANSPORTS = {
    "memory": "memory://",
    "local": "local://",
    "db": "db://",
    # BullMQ queues and pub/sub under a prefix of this process's own (deleted after).
    "redis": f"{REDIS_URL}?prefix={REDIS_PREFIX}",
    # Not a transport: the same workloads with ``ctx.local_step`` (executed in the turn, one
    # batched write per step) on local://, the baseline dispatched steps are measured against.
    "inline": "local://",
}


async def forget_redis_prefix() -> None:
    """Delete this process's keys from the shared Redis."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for pattern in (f"bull:{REDIS_PREFIX}-*", f"{REDIS_PREFIX}-*"):
            keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
            if keys:
                await client.delete(*keys)
    finally:
        await client.aclose()


def dispatch_parser(description: str, default_name: str) -> argparse.ArgumentParser:
    """The command line of both dispatch sides."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--db", choices=["sqlite", "postgres"], required=True)
    p.add_argument("--name", default=default_name, help="database / file name")
    p.add_argument("--workdir", default=".work", help="SQLite files go here (the run's cwd)")
    p.add_argument("--profile", default=None, help="write a pyinstrument HTML profile here")
    sub = p.add_subparsers(dest="scenario", required=True)
    tp = sub.add_parser("throughput", help="N workflows of K sequential dispatched steps at once")
    tp.add_argument("--n", type=int, default=200)
    tp.add_argument("--k", type=int, default=5)
    tp.add_argument("--warmup", type=int, default=10)
    tp.add_argument("--timeout", type=float, default=600.0)
    lt = sub.add_parser("latency", help="one one-step workflow at a time")
    lt.add_argument("--count", type=int, default=200)
    lt.add_argument("--warmup", type=int, default=10)
    lt.add_argument("--timeout", type=float, default=60.0, help="per workflow")
    fn = sub.add_parser("fan", help="one workflow at a time, ctx.all of WIDTH steps")
    fn.add_argument("--count", type=int, default=20)
    fn.add_argument("--width", type=int, default=100)
    fn.add_argument("--warmup", type=int, default=2)
    fn.add_argument("--timeout", type=float, default=300.0, help="per workflow")
    return p


class Profiler:
    """pyinstrument around the timed part, if asked for; a no-op otherwise."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._p: Any = None

    def start(self) -> None:
        if self.path:
            from pyinstrument import Profiler as P

            self._p = P(async_mode="disabled", interval=0.0005)
            self._p.start()

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()
            assert self.path is not None
            with open(self.path, "w") as fh:
                fh.write(self._p.output_html())
            with open(self.path.rsplit(".", 1)[0] + ".txt", "w") as fh:
                fh.write(self._p.output_text(unicode=False, color=False, show_all=False))
            self._p = None


def build_engine(t: Target, transport: str) -> Any:
    import durably

    engine = durably.Engine(store=t.url, transport=TRANSPORTS[transport])

    @engine.step("noop")
    async def noop(x: int) -> int:
        return x

    async def local_noop(x: int) -> int:
        return x

    if transport == "inline":

        def call(ctx: Any, i: int) -> Any:
            return ctx.local_step("noop", local_noop, i)

    else:

        def call(ctx: Any, i: int) -> Any:
            return ctx.step(noop, i)

    @engine.workflow("steps", version="1")
    async def steps(ctx: Any, k: int) -> int:
        for i in range(k):
            await call(ctx, i)
        return k

    @engine.workflow("one_step", version="1")
    async def one_step(ctx: Any, x: int) -> int:
        out: int = await call(ctx, x)
        return out

    @engine.workflow("fan", version="1")
    async def fan(ctx: Any, width: int) -> int:
        outs = await ctx.all([call(ctx, i) for i in range(width)])
        return sum(outs)

    return engine


# Raised collector thresholds for ``--gc threshold|both``: fewer gen0 passes (and so fewer
# gen1/gen2 ones) for more young garbage-candidate objects held between passes.
GC_THRESHOLD = (10_000, 20, 20)


def apply_gc(mode: str) -> None:
    """The ``--gc`` variant, applied once the engine is open (before warm-up)."""
    if mode in ("threshold", "both"):
        gc.set_threshold(*GC_THRESHOLD)
    if mode in ("freeze", "both"):
        gc.collect()
        gc.freeze()


class GcTimer:
    """Process time spent in collections, per generation, while installed."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.process_time()
        else:
            self.seconds[info["generation"]] += time.process_time() - self._t0


def gc_counts() -> list[tuple[int, int]]:
    """(collections, collected) per generation so far."""
    return [(s["collections"], s["collected"]) for s in gc.get_stats()]


def check(res: Any, expected: int) -> None:
    status = str(getattr(res, "status", "?"))
    if status != "completed" or getattr(res, "output", None) != expected:
        raise RuntimeError(
            f"run {getattr(res, 'run_id', '?')} ended {status}: "
            f"output={getattr(res, 'output', None)!r} error={getattr(res, 'error', None)!r}"
        )


async def throughput(engine: Any, args: Any, prof: Profiler) -> dict[str, Any]:
    k = args.k

    async def start(_: int) -> Any:
        return await engine.start("steps", k)

    async def wait(run: Any) -> Any:
        res = await engine.wait_for_run(run.run_id, terminal=True, timeout=args.timeout)
        check(res, k)
        return res

    if args.warmup:
        await timed_batch(args.warmup, start, wait, args.timeout)
    prof.start()
    gc0 = gc_counts()
    timer = GcTimer()
    gc.callbacks.append(timer)
    cpu0 = time.process_time()
    t_started, elapsed, _ = await timed_batch(args.n, start, wait, args.timeout)
    cpu = time.process_time() - cpu0
    gc.callbacks.remove(timer)
    gc1 = gc_counts()
    prof.stop()
    # This process's CPU per step (engine, worker and transport all run here): unlike the
    # wall clock, it does not grow while other processes hold the machine's cores.
    return {
        **throughput_result(args.n, k, t_started, elapsed),
        "cpu_us_per_step": round(cpu * 1e6 / (args.n * k), 1),
        "gc": args.gc,
        "gc_collections": [b[0] - a[0] for a, b in zip(gc0, gc1, strict=True)],
        "gc_collected": [b[1] - a[1] for a, b in zip(gc0, gc1, strict=True)],
        "gc_frozen": gc.get_freeze_count(),
        "gc_us_per_step": [round(t * 1e6 / (args.n * k), 1) for t in timer.seconds],
    }


async def one_at_a_time(
    engine: Any,
    name: str,
    inputs: list[int],
    expect: Any,
    warmup: int,
    timeout: float,
    prof: Profiler,
) -> tuple[list[float], float]:
    samples: list[float] = []
    total = 0.0
    for i, x in enumerate(inputs):
        if i == warmup:
            prof.start()
        t0 = time.perf_counter()
        run = await engine.start(name, x)
        res = await engine.wait_for_run(run.run_id, terminal=True, timeout=timeout)
        dt = time.perf_counter() - t0
        check(res, expect(x))
        if i >= warmup:
            samples.append(dt)
            total += dt
    prof.stop()
    return samples, total


async def run_scenario(args: Any, t: Target) -> dict[str, Any]:
    await reset_target(t)
    engine = build_engine(t, args.transport)
    prof = Profiler(args.profile)
    try:
        return await _scenario(engine, args, prof)
    finally:
        if args.transport == "redis":
            await forget_redis_prefix()


async def _scenario(engine: Any, args: Any, prof: Profiler) -> dict[str, Any]:
    result = await _measure(engine, args, prof)
    # How many results continued a held turn (a tree before holds has none).
    holds = getattr(getattr(engine, "_steps", None), "holds", None)
    if holds is not None:
        result["holds"] = {
            "hits": holds.hits,
            "misses": holds.misses,
            "released": holds.released,
            "rechecks": getattr(holds, "rechecks", 0),
        }
    born = getattr(getattr(engine, "transport", None), "born", None)
    if born is not None:
        result["born_claimed"] = born
    return result


async def _measure(engine: Any, args: Any, prof: Profiler) -> dict[str, Any]:
    async with engine:
        apply_gc(args.gc)
        if args.scenario == "throughput":
            return await throughput(engine, args, prof)
        if args.scenario == "latency":
            xs = list(range(args.warmup + args.count))
            samples, _ = await one_at_a_time(
                engine, "one_step", xs, lambda x: x, args.warmup, args.timeout, prof
            )
            return latency_summary(samples)
        w = args.width
        xs = [w] * (args.warmup + args.count)
        samples, total = await one_at_a_time(
            engine, "fan", xs, lambda _: w * (w - 1) // 2, args.warmup, args.timeout, prof
        )
        return {
            **latency_summary(samples),
            "width": w,
            "steps_per_s": round(w * len(samples) / total, 2),
        }


def main() -> None:
    p = dispatch_parser(__doc__ or "", "bench_durably")
    p.add_argument("--transport", choices=sorted(TRANSPORTS), required=True)
    p.add_argument("--src", default=None, help="import durably from this src/ (a baseline)")
    p.add_argument(
        "--gc",
        choices=["default", "freeze", "threshold", "both"],
        default="default",
        help="once the engine is open: gc.freeze() the objects alive then, raise the "
        f"collector's thresholds to {GC_THRESHOLD}, both, or leave the collector alone",
    )
    args = p.parse_args()
    if args.src:
        sys.path.insert(0, os.path.abspath(args.src))
    if args.profile:  # relative to where it was asked, not the work dir
        args.profile = os.path.abspath(args.profile)
    wd = prepare_workdir(args.workdir)
    t = make_target(args.db, args.name, wd)
    base: dict[str, Any] = {
        "side": "durably",
        "db": args.db,
        "transport": args.transport,
        "scenario": args.scenario,
    }
    try:
        import durably

        base["version"] = str(getattr(durably, "__version__", "dev"))
        durably.Engine  # noqa: B018
    except (ImportError, AttributeError) as exc:
        emit(error_result(base, exc, skipped=True))
        return
    try:
        res = asyncio.run(run_scenario(args, t))
        emit({**base, **res})
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
