"""Where does the one-step PostgreSQL latency go? (start -> wait_for_run(terminal=True))

Instruments durably and asyncpg by monkeypatching (nothing under src/ is edited), runs
sequential one-step workflows on a fresh schema and prints, for the median run, a timeline of
every store call, every SQL round trip (query + pool reset), batch writes, NOTIFYs heard and
the waiter's wake-up, plus per-phase medians over all runs.

    .venv/bin/python bench/profile_latency.py [--count 300] [--no-trace] [--profile out.txt]

It once also carried candidate fixes (``--fix``) as monkeypatches; the ones that paid off are in
``src/`` now (no pool reset, early batch answers, local wait_for_run, ignored own NOTIFY, leased
insert — see bench/RESULTS.md, 2026-12-01), so only the tracer remains.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(
    0, os.environ.get("DURABLY_SRC") or str(Path(__file__).resolve().parents[1] / "src")
)

import asyncpg
import asyncpg.connection
import asyncpg.pool

import durably
from durably import _turns, _watch
from durably.stores import _pg_batch, _pg_connection, postgres

BASE = "postgresql://postgres@127.0.0.1:5432/test"
PC = time.perf_counter

EV: list[tuple[float, str]] = []
TRACE = True


def ev(label: str) -> None:
    if TRACE:
        EV.append((PC(), label))


def wrap_async(owner: Any, name: str, label: str | None = None, detail: Any = None) -> None:
    orig = getattr(owner, name)
    lab = label or name

    async def wrapper(*a: Any, **k: Any) -> Any:
        extra = detail(*a, **k) if detail else ""
        ev(f"{lab}>{extra}")
        try:
            return await orig(*a, **k)
        finally:
            ev(f"{lab}<")

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _sql_name(query: str) -> str:
    q = " ".join(query.split())
    for key, name in (
        ("pg_advisory_unlock_all", "RESET-QUERY"),
        ("WITH locked AS", "BATCH"),
        ("WITH settled AS", "FINAL (last result + settle)"),
        ("WITH ins AS (INSERT INTO durably_runs", "create_run"),
        ("WITH r AS (UPDATE durably_runs SET status = 'running'", "start_turns"),
        ("= ANY($1::text[])", "get_runs"),
        ("WHERE id = $1", "get_run"),
    ):
        if key in q:
            return name
    return q[:40]


def instrument() -> None:
    # SQL round trips, at the connection level (pool calls and the batcher's conn.fetch)
    conn_cls = asyncpg.connection.Connection
    orig_execute = conn_cls._execute
    orig_plain_execute = conn_cls.execute

    async def _execute(self: Any, query: str, *a: Any, **k: Any) -> Any:
        n = _sql_name(query)
        ev(f"  sql>{n}")
        try:
            return await orig_execute(self, query, *a, **k)
        finally:
            ev(f"  sql<{n}")

    async def execute(self: Any, query: str, *args: Any, **k: Any) -> Any:
        n = _sql_name(query)
        ev(f"  sqlx>{n}")
        try:
            return await orig_plain_execute(self, query, *args, **k)
        finally:
            ev(f"  sqlx<{n}")

    conn_cls._execute = _execute  # type: ignore[method-assign]
    conn_cls.execute = execute  # type: ignore[method-assign]
    # statement preparation (a round trip each time the cache misses)
    orig_get_statement = conn_cls._get_statement

    async def _get_statement(self: Any, query: str, *a: Any, **k: Any) -> Any:
        key = (query, self._protocol.get_record_class(), k.get("ignore_custom_codec", False))
        if self._stmt_cache.get(key) is None:
            ev(f"  PREPARE {_sql_name(query)}")
        return await orig_get_statement(self, query, *a, **k)

    conn_cls._get_statement = _get_statement  # type: ignore[method-assign]

    wrap_async(asyncpg.pool.Pool, "_acquire", "  pool.acquire")
    wrap_async(asyncpg.pool.Pool, "release", "  pool.release")

    st = postgres.PostgresStore
    for name in ("create_run", "_create_one", "get_run", "get_runs", "start_turns"):
        wrap_async(st, name, f"store.{name}")
    pgc = _pg_connection.PgConnection
    orig_heard = pgc._heard

    def _heard(self: Any, conn: Any, pid: int, channel: str, payload: str) -> None:
        ev(f"NOTIFY heard {payload.split(':')[0]}")
        orig_heard(self, conn, pid, channel, payload)

    pgc._heard = _heard  # type: ignore[method-assign]

    b = _pg_batch.PgWriteBatcher
    orig_scp, orig_settle = b.save_checkpoint, b.settle

    def save_checkpoint(self: Any, params: Any, owner: str) -> Any:
        ev(f"queue checkpoint {params[4]}")
        return orig_scp(self, params, owner)

    def settle(self: Any, params: Any) -> Any:
        ev(f"queue settle {params[2]}")
        return orig_settle(self, params)

    b.save_checkpoint, b.settle = save_checkpoint, settle  # type: ignore[method-assign]
    wrap_async(
        b,
        "_write",
        "batch._write",
        lambda self, conn, cps, settles, *_: f" cps={len(cps)} settles={len(settles)}",
    )

    T = _turns.TurnDriver
    wrap_async(T, "execute", "turns.execute")
    wrap_async(T, "_turn", "turns._turn")
    wrap_async(T, "_settle", "turns._settle")

    w = _watch.RunWatcher
    orig_settled, orig_changed = w.settled, w.changed

    def settled(self: Any, result: Any) -> None:
        ev("watcher.settled (in-process hand-over)")
        orig_settled(self, result)

    def changed(self: Any, run_id: str) -> None:
        ev(f"watcher.changed waiting={run_id in self._waiting}")
        orig_changed(self, run_id)

    w.settled, w.changed = settled, changed  # type: ignore[method-assign]
    wrap_async(w, "_get_runs_dummy", None) if hasattr(w, "_get_runs_dummy") else None


# -- driver ------------------------------------------------------------------------------------


async def trivial(i: int) -> int:
    return i


async def main() -> None:
    global TRACE
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--show", type=int, default=1, help="timelines to print (median first)")
    p.add_argument("--profile", default="", help="pyinstrument html/txt output path")
    args = p.parse_args()
    if not args.no_trace:
        instrument()
    TRACE = False

    schema = f"durably_prof_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(BASE)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        engine = durably.Engine(store=f"{BASE}?schema={schema}")

        @engine.workflow("one_step", version="1")
        async def one_step(ctx: Any, x: int) -> int:
            out: int = await ctx.local_step("s0", trivial, x)
            return out

        samples: list[float] = []
        runs: list[tuple[float, list[tuple[float, str]]]] = []
        profiler = None
        async with engine:
            for i in range(args.warmup + args.count):
                if i == args.warmup and args.profile:
                    from pyinstrument import Profiler

                    profiler = Profiler(interval=0.0002, async_mode="disabled")
                    profiler.start()
                TRACE = i >= args.warmup and not args.no_trace
                EV.clear()
                t0 = PC()
                run = await engine.start("one_step", i)
                ev("start() returned")
                res = await engine.wait_for_run(run.run_id, terminal=True, timeout=10)
                t1 = PC()
                ev("wait_for_run returned")
                # let trailing callbacks (NOTIFY of the settle, poller) land in this trace
                TRACE = False
                if res.output != i:
                    raise RuntimeError(res)
                if i >= args.warmup:
                    samples.append(t1 - t0)
                    runs.append((t1 - t0, [(t - t0, lab) for t, lab in EV]))
                await asyncio.sleep(0)
            if profiler is not None:
                profiler.stop()
        TRACE = False
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.close()

    samples.sort()
    q = statistics.quantiles(samples, n=100)
    print(
        f"n={len(samples)} p50={statistics.median(samples) * 1e3:.2f} ms "
        f"p90={q[89] * 1e3:.2f} p99={q[98] * 1e3:.2f} mean={statistics.mean(samples) * 1e3:.2f}"
    )
    if profiler is not None:
        out = Path(args.profile)
        if out.suffix == ".html":
            out.write_text(profiler.output_html())  # noqa: ASYNC240 - after the timed part
        else:
            report = profiler.output_text(unicode=False, color=False, show_all=True)
            out.write_text(report)  # noqa: ASYNC240 - after the timed part
    if args.no_trace:
        return
    # per-label median time-from-t0 and per-span medians
    firsts: dict[str, list[float]] = defaultdict(list)
    spans: dict[str, list[float]] = defaultdict(list)
    rts: list[int] = []
    for _, evs in runs:
        open_: dict[str, float] = {}
        n_rt = 0
        seen: set[str] = set()
        for t, lab in evs:
            if lab not in seen:
                firsts[lab].append(t)
                seen.add(lab)
            if ">" in lab:
                key = lab.split(">")[0] + ">" + lab.split(">")[1].split(" cps")[0]
                open_[key] = t
                if "sql>" in lab or "sqlx>" in lab:
                    n_rt += 1
            elif "<" in lab:
                base, _, rest = lab.partition("<")
                k = base + ">" + rest
                if k in open_:
                    spans[base.strip() + " " + rest].append(t - open_.pop(k))
        rts.append(n_rt)
    print(f"SQL statements per run (incl. reset queries): median {statistics.median(rts)}")
    print("\nmedian span durations (ms), over all runs:")
    for k, v in sorted(spans.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {k:45s} n/run={len(v) / len(runs):4.1f} p50={statistics.median(v) * 1e3:6.3f}")
    order = sorted(runs, key=lambda r: r[0])
    mid = order[len(order) // 2]
    for idx, (dt, evs) in enumerate([mid, *order[len(order) // 2 + 1 :]][: args.show]):
        print(f"\n--- timeline of {'the median' if idx == 0 else 'a'} run ({dt * 1e3:.2f} ms) ---")
        last = 0.0
        for t, lab in evs:
            print(f"  {t * 1e3:7.3f}  (+{(t - last) * 1e3:6.3f})  {lab}")
            last = t


if __name__ == "__main__":
    asyncio.run(main())
