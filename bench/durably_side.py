"""The durably side of the comparison, the same workloads as ``dbos_side.py``.

Workflows are ``async def`` bodies whose steps are ``ctx.local_step`` calls of a trivial
``async def``; runs are started with ``engine.start`` (N at once, gathered) and awaited with
``engine.wait_for_run(run_id, terminal=True)``.

    python durably_side.py --db sqlite throughput --n 500 --k 5
    python durably_side.py --db postgres latency --count 200

durably is imported from the repository's ``src/`` (an editable install, or ``PYTHONPATH``), so
this measures the working tree. If the engine, or its PostgreSQL store, does not exist yet, the
side prints ``{"error": ..., "skipped": true}`` and the table shows ``n/a``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common import (
    Target,
    emit,
    error_result,
    latency_summary,
    make_target,
    prepare_workdir,
    reset_target,
    side_parser,
    throughput_result,
    timed_batch,
    use_run_id_shape,
)


async def trivial(i: int) -> int:
    return i


def build_engine(t: Target) -> Any:
    import durably

    use_run_id_shape()
    engine = durably.Engine(store=t.url)

    @engine.workflow("bench", version="1")
    async def bench(ctx: Any, k: int) -> int:
        for i in range(k):
            await ctx.local_step(f"s{i}", trivial, i)
        return k

    @engine.workflow("one_step", version="1")
    async def one_step(ctx: Any, x: int) -> int:
        out: int = await ctx.local_step("s0", trivial, x)
        return out

    return engine


def check(res: Any, expected: int) -> None:
    status = str(getattr(res, "status", "?"))
    if status != "completed" or getattr(res, "output", None) != expected:
        raise RuntimeError(
            f"run {getattr(res, 'run_id', '?')} ended {status}: "
            f"output={getattr(res, 'output', None)!r} error={getattr(res, 'error', None)!r}"
        )


async def throughput(t: Target, n: int, k: int, warmup: int, timeout: float) -> dict[str, Any]:
    engine = build_engine(t)
    async with engine:

        async def start(_: int) -> Any:
            return await engine.start("bench", k)

        async def wait(run: Any) -> Any:
            res = await engine.wait_for_run(run.run_id, terminal=True, timeout=timeout)
            check(res, k)
            return res

        if warmup:
            await timed_batch(warmup, start, wait, timeout)
        t_started, elapsed, _ = await timed_batch(n, start, wait, timeout)
    return throughput_result(n, k, t_started, elapsed)


async def latency(t: Target, count: int, warmup: int, timeout: float) -> dict[str, Any]:
    engine = build_engine(t)
    samples: list[float] = []
    async with engine:
        for i in range(warmup + count):
            t0 = time.perf_counter()
            run = await engine.start("one_step", i)
            res = await engine.wait_for_run(run.run_id, terminal=True, timeout=timeout)
            dt = time.perf_counter() - t0
            check(res, i)
            if i >= warmup:
                samples.append(dt)
    return latency_summary(samples)


async def run_scenario(args: Any, t: Target) -> dict[str, Any]:
    if not args.keep:
        await reset_target(t)
    if args.scenario == "throughput":
        return await throughput(t, args.n, args.k, args.warmup, args.timeout)
    return await latency(t, args.count, args.warmup, args.timeout)


def main() -> None:
    args = side_parser(__doc__ or "").parse_args()
    wd = prepare_workdir(args.workdir)
    t = make_target(args.db, args.name or "bench_durably", wd)
    base: dict[str, Any] = {"side": "durably", "db": args.db, "scenario": args.scenario}
    try:
        import durably

        base["version"] = str(getattr(durably, "__version__", "dev"))
        durably.Engine  # noqa: B018  (AttributeError while the engine is not written yet)
    except (ImportError, AttributeError) as exc:
        emit(error_result(base, exc, skipped=True))
        return
    try:
        res = asyncio.run(run_scenario(args, t))
        emit({**base, **res})
    except Exception as exc:  # e.g. no PostgreSQL store yet: the cell shows the reason
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
