"""Counts per dispatched step over ``redis://`` (or ``--transport db|local|inline``): CPU
(user/sys), the client's writes (round trips) and bytes, where each write came from, and
Redis's ``INFO commandstats`` deltas; on PostgreSQL also asyncpg's round trips (statements
sent, each ``BEGIN``/``COMMIT`` one; a pipelined ``executemany`` one) and where they came from.

    python dispatch_counts.py --db sqlite --n 600 --k 5
    python dispatch_counts.py --db postgres --sites           # which code sent each write
    python dispatch_counts.py --db sqlite --cprofile out.prof  # CPU-time cProfile of the window
    python dispatch_counts.py --db postgres --transport db --sites  # asyncpg round trips
    python dispatch_counts.py --db postgres --transport db --k 1 --n 100 --one-at-a-time
    PYTHONPATH=/tmp/before/src python dispatch_counts.py ...   # another tree (before/after)
    python dispatch_counts.py --db postgres --transport db --n 1000 --callbacks --max-held 256
        # loop callbacks by target (unprofiled), with the run queue's MAX_HELD at 256
    python dispatch_counts.py --db postgres --batches   # settle batch sizes (deciles)

One process drives N workflows of K sequential ``ctx.step`` and serves them (as
dispatch_durably.py's throughput scenario), after 20 untimed warm-up workflows. The
commandstats count commands run inside scripts too and every client of the server: on a shared
Redis read them as an upper bound; the client-side counts are this process's own.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import time
import traceback
from typing import Any

import dispatch_durably as dd
from common import make_target, prepare_workdir, reset_target, timed_batch

_writes = [0, 0, 0]
"""Writes (round trips), bytes and ``EVALSHA`` calls this process sent."""
_sites: dict[str, int] = {}
_count_sites = False


def _count_writes() -> None:
    """Wrap redis-py's socket write: one call is one write (a pipeline is one)."""
    from redis.asyncio.connection import AbstractConnection

    original = AbstractConnection.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        _writes[0] += 1
        chunks = [command] if isinstance(command, bytes | str) else command
        _writes[1] += sum(len(c) for c in chunks)
        # this process's script calls (the server's commandstats count every client's)
        _writes[2] += sum(
            c.count(b"\r\nEVALSHA\r\n") if isinstance(c, bytes | bytearray) else 0 for c in chunks
        )
        if _count_sites:
            site = "?"
            # the first caller outside the batch plumbing (every write goes through it)
            for frame in reversed(traceback.extract_stack(limit=40)):
                if "durably/" in frame.filename or "bullmq/" in frame.filename:
                    if frame.filename.endswith("/_batched.py"):
                        continue
                    site = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
                    break
            _sites[site] = _sites.get(site, 0) + 1
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


_pg_trips = [0]
_pg_sites: dict[str, int] = {}
_callbacks: dict[str, int] = {}
_counting_callbacks = [False]


def _count_callbacks() -> None:
    """Wrap the loop's ``_call_soon`` (every ``call_soon``, a task's step, a
    future's done callback): counted by what it calls, unprofiled."""
    from asyncio import base_events

    original = base_events.BaseEventLoop._call_soon

    def counted(self: Any, callback: Any, args: Any, context: Any) -> Any:
        if _counting_callbacks[0]:
            target = getattr(callback, "__self__", None)
            if isinstance(target, asyncio.Task):
                coro = target.get_coro()
                name = "task " + getattr(coro, "__qualname__", type(coro).__name__)
            else:
                name = getattr(callback, "__qualname__", type(callback).__name__)
            _callbacks[name] = _callbacks.get(name, 0) + 1
        return original(self, callback, args, context)

    base_events.BaseEventLoop._call_soon = counted  # type: ignore[method-assign]


def _site() -> str:
    for frame in reversed(traceback.extract_stack(limit=40)):
        if "durably/" in frame.filename and "/asyncpg/" not in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
    return "?"


def _count_pg_trips() -> None:
    """Wrap asyncpg's two ways to the server: a simple query (``execute`` with no
    arguments: ``BEGIN``, ``COMMIT``) and an extended one (``_do_execute``: every
    statement with arguments, and one pipelined ``executemany``). Statement
    preparations on a cache miss are not counted (none after the warm-up)."""
    from asyncpg.connection import Connection

    execute, do_execute = Connection.execute, Connection._do_execute

    def count() -> None:
        _pg_trips[0] += 1
        if _count_sites:
            site = _site()
            _pg_sites[site] = _pg_sites.get(site, 0) + 1

    async def counted_execute(self: Any, query: str, *args: Any, **kw: Any) -> Any:
        if not args:
            count()
        return await execute(self, query, *args, **kw)

    async def counted_do_execute(self: Any, *args: Any, **kw: Any) -> Any:
        count()
        return await do_execute(self, *args, **kw)

    Connection.execute = counted_execute  # type: ignore[method-assign]
    Connection._do_execute = counted_do_execute  # type: ignore[method-assign]


def _commandstats() -> dict[str, tuple[int, int]]:
    import redis

    client = redis.Redis.from_url(dd.REDIS_URL)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {k: (v["calls"], v["usec"]) for k, v in stats.items()}


_quiet = [0]
_settles: list[int] = []
_counting_settles = [False]
_net = [0, 0]  # the waiters' safety net: status reads, runs read


def _count_settles() -> None:
    """Record the size of each batch of results the engine settles (any transport)."""
    from durably.steps import _dispatcher

    original = _dispatcher.StepDispatcher.on_results

    async def counted(self: Any, results: Any) -> None:
        if _counting_settles[0]:
            _settles.append(len(results))
        await original(self, results)

    _dispatcher.StepDispatcher.on_results = counted  # type: ignore[method-assign]


def _count_net(engine: Any) -> None:
    """Count the waiters' safety-net status reads (``RunWatcher``'s ``get_statuses``)."""
    watcher = engine._watcher
    original = watcher._get_statuses
    if original is None:
        return

    async def counted(run_ids: list[str]) -> Any:
        _net[0] += 1
        _net[1] += len(run_ids)
        return await original(run_ids)

    watcher._get_statuses = counted


def _count_quiescence() -> None:
    """Count quiescence checks (``_QuietWatch``s made: each counts up to 20 ticks)."""
    from durably import _replay

    original = _replay._QuietWatch.__init__

    def counted(self: Any, *a: Any) -> None:
        _quiet[0] += 1
        original(self, *a)

    _replay._QuietWatch.__init__ = counted  # type: ignore[method-assign]


async def main(args: argparse.Namespace) -> None:
    if args.max_held is not None:
        from durably import _run_queue

        _run_queue.MAX_HELD = args.max_held
    target = make_target(args.db, "bench_counts", prepare_workdir(".work"))
    await reset_target(target)
    engine = dd.build_engine(target, args.transport)
    _count_net(engine)
    if args.batches:
        _count_settles()
    if args.step_concurrency is not None:
        engine.step_concurrency = args.step_concurrency
    k = args.k
    try:
        async with engine:

            async def start(_: int) -> Any:
                return await engine.start("steps", k)

            async def wait(run: Any) -> Any:
                res = await engine.wait_for_run(run.run_id, terminal=True, timeout=600)
                dd.check(res, k)
                return res

            await timed_batch(20, start, wait, 600)
            before = _commandstats()
            _writes[0] = _writes[1] = _writes[2] = _pg_trips[0] = _net[0] = _net[1] = 0
            _counting_settles[0] = True
            _sites.clear()
            _pg_sites.clear()
            profile = cProfile.Profile(time.process_time) if args.cprofile else None
            t0 = os.times()
            if profile:
                profile.enable()
            _counting_callbacks[0] = args.callbacks
            misses0, quiet0 = engine._steps.holds.misses, _quiet[0]
            if args.one_at_a_time:
                for i in range(args.n):
                    await wait(await start(i))
            else:
                await timed_batch(args.n, start, wait, 600)
            if profile:
                profile.disable()
            t1 = os.times()
            _counting_callbacks[0] = _counting_settles[0] = False
            net_reads, net_runs = _net
            misses = engine._steps.holds.misses - misses0
            quiet = _quiet[0] - quiet0
            holds = engine._steps.holds
            sticky = engine._turns.sticky
            counters = (
                f"holds: hits {holds.hits}, misses {holds.misses}, released {holds.released}; "
                f"kept bodies resumed {sticky.resumed if sticky is not None else 0}, "
                f"replayed {sticky.replayed if sticky is not None else 0}"
            )
            writes, sent, scripts = _writes
            trips = _pg_trips[0]
            after = _commandstats()
    finally:
        await dd.forget_redis_prefix()
    steps = args.n * k
    user, system = (t1.user - t0.user) * 1e6 / steps, (t1.system - t0.system) * 1e6 / steps
    wall = t1.elapsed - t0.elapsed
    print(
        f"CPU us/step {user + system:.1f} (user {user:.0f}, sys {system:.0f}),",
        f"{steps / wall:.0f} steps/s",
    )
    print(counters, "(cumulative, warm-up included)")
    print(
        f"timed window: hold misses {misses}, quiescence checks {quiet} ({quiet / steps:.3f}/step)"
    )
    print(
        f"waiters' net: status reads/step {net_reads / steps:.4f},",
        f"runs read/step {net_runs / steps:.2f}",
    )
    if _settles:
        sizes = sorted(_settles)
        deciles = [sizes[len(sizes) * q // 10] for q in range(10)] + [sizes[-1]]
        print(
            f"settles/step {len(sizes) / steps:.4f}, batch mean {sum(sizes) / len(sizes):.1f},",
            f"deciles (0-100%) {deciles}",
        )
    if args.callbacks:
        total = sum(_callbacks.values())
        print(f"loop callbacks/step {total / steps:.2f}")
        for name, n in sorted(_callbacks.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {n / steps:.3f}/step {name}")
    print(f"client writes (round trips)/step {writes / steps:.3f}", end=", ")
    print(f"bytes sent/step {sent / steps:.0f}, EVALSHA calls sent/step {scripts / steps:.3f}")
    for site, n in sorted(_sites.items(), key=lambda kv: -kv[1]):
        print(f"  {n / steps:.3f}/step from {site}")
    if args.db == "postgres":
        print(f"PostgreSQL round trips/step {trips / steps:.3f}")
        for site, n in sorted(_pg_sites.items(), key=lambda kv: -kv[1]):
            print(f"  {n / steps:.3f}/step from {site}")
    print("Redis commandstats per step (all clients; commands inside scripts included):")
    for name in sorted(after):
        calls = after[name][0] - before.get(name, (0, 0))[0]
        usec = after[name][1] - before.get(name, (0, 0))[1]
        if calls:
            print(f"  {name:32s} {calls / steps:7.3f} calls  {usec / steps:7.1f} us")
    if profile is not None:
        profile.dump_stats(args.cprofile)


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--db", choices=["sqlite", "postgres"], required=True)
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--transport", choices=["redis", "db", "local", "inline"], default="redis")
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="each workflow started once the one before ended (the latency scenario's path)",
    )
    p.add_argument("--sites", action="store_true", help="say which code sent each write")
    p.add_argument("--cprofile", default=None, help="write a CPU-time cProfile here")
    p.add_argument("--callbacks", action="store_true", help="count loop callbacks by target")
    p.add_argument("--batches", action="store_true", help="settle batch sizes")
    p.add_argument("--max-held", type=int, default=None, help="the run queue's MAX_HELD")
    p.add_argument("--step-concurrency", type=int, default=None, help="the engine's")
    parsed = p.parse_args()
    _count_quiescence()
    if parsed.callbacks:
        _count_callbacks()
    _count_sites = parsed.sites
    _count_writes()
    if parsed.db == "postgres":
        _count_pg_trips()
    asyncio.run(main(parsed))
