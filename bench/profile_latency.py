"""Where does the one-step PostgreSQL latency go? (start -> wait_for_run(terminal=True))

Instruments durably and asyncpg by monkeypatching (nothing under src/ is edited), runs
sequential one-step workflows on a fresh schema and prints, for the median run, a timeline of
every store call, every SQL round trip (query + pool reset), batch writes, NOTIFYs heard and
the waiter's wake-up, plus per-phase medians over all runs.

    .venv/bin/python bench/profile_latency.py [--count 300] [--fix reset,watch,batch] [--no-trace]

``--fix`` applies candidate fixes, also by monkeypatching:
  reset  pool connections are released without asyncpg's reset query (one RT per pool call)
  watch  wait_for_run: no get_run before registering and no immediate poll when the run is
         executing in this process (the settle hands over the result)
  batch  the group-commit batcher lingers one loop turn ... (see FIXES below)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import os  # noqa: E402

sys.path.insert(0, os.environ.get("DURABLY_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

import asyncpg  # noqa: E402
import asyncpg.connection  # noqa: E402
import asyncpg.pool  # noqa: E402

import durably  # noqa: E402
from durably import _watch  # noqa: E402
from durably import engine as engine_mod  # noqa: E402
from durably.stores import _pg_batch, postgres  # noqa: E402

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
        ("WITH v AS", "BATCH"),
        ("WITH ins AS (INSERT INTO durably_runs", "create_run"),
        ("WITH r AS (UPDATE durably_runs SET status = 'running'", "start_turn"),
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
    for name in ("create_run", "get_run", "get_runs", "start_turn"):
        wrap_async(st, name, f"store.{name}")
    orig_heard = st._heard

    def _heard(self: Any, conn: Any, pid: int, channel: str, payload: str) -> None:
        ev(f"NOTIFY heard {payload.split(':')[0]}")
        orig_heard(self, conn, pid, channel, payload)

    st._heard = _heard  # type: ignore[method-assign]

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
        lambda self, conn, cps, settles: f" cps={len(cps)} settles={len(settles)}",
    )

    E = engine_mod.Engine
    wrap_async(E, "_execute", "engine._execute")
    wrap_async(E, "_turn", "engine._turn")
    wrap_async(E, "_settle", "engine._settle")

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


# -- candidate fixes ---------------------------------------------------------------------------


def fix_reset() -> None:
    """PostgresStore._connect: asyncpg.create_pool(..., reset=_no_reset)."""
    orig = asyncpg.create_pool

    async def _no_reset(_conn: Any) -> None:
        return None

    def create_pool(*a: Any, **k: Any) -> Any:
        k.setdefault("reset", _no_reset)
        return orig(*a, **k)

    postgres.asyncpg.create_pool = create_pool  # type: ignore[attr-defined]


def fix_watch() -> None:
    """Engine.wait_for_run: a run executing here is handed over by its settle; skip the
    get_run and the immediate poll for it."""

    async def wait_for_run(
        self: Any, run_id: str, *, terminal: bool = False, timeout: float | None = None
    ) -> Any:
        await self.open()
        statuses = engine_mod.TERMINAL_STATUSES if terminal else engine_mod._SETTLED
        if self._executor is not None and self._executor.knows(run_id):
            return await self._watcher.wait_local(run_id, statuses, timeout)
        return await self._watcher.wait(await self._require(run_id), statuses, timeout)

    async def wait_local(self: Any, run_id: str, statuses: Any, timeout: float | None) -> Any:
        # Registered before the settle can happen (we are on the loop, the turn is queued);
        # the poller still runs, but only after its interval, as the safety net.
        future = asyncio.get_running_loop().create_future()
        entry = (future, statuses)
        self._waiting.setdefault(run_id, []).append(entry)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_later())
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            entries = self._waiting.get(run_id)
            if entries is not None:
                if entry in entries:
                    entries.remove(entry)
                if not entries:
                    del self._waiting[run_id]

    async def _poll_later(self: Any) -> None:
        await asyncio.sleep(self.interval)
        await self._poll()

    # RunExecutor._pump: a run counts as executing from the moment its task is created
    # (knows() was False between submit() and the task's first step).
    from durably import _executor as executor_mod

    def _pump(self: Any) -> None:
        while self._waiting and len(self._tasks) < self._limit:
            run_id = self._waiting.popleft()
            wake = self._waiting_ids.pop(run_id)
            self._executing.add(run_id)
            task = asyncio.create_task(self._run(run_id, wake), name=f"durably-run:{run_id}")
            self._tasks.add(task)
            self._idle.clear()

    executor_mod.RunExecutor._pump = _pump  # type: ignore[method-assign]
    # A 'settled' NOTIFY for a run whose turn is in this process: its settle hands over.
    orig_event = engine_mod.Engine._on_store_event

    def _on_store_event(self: Any, kind: str, run_id: str) -> None:
        if kind == "settled" and self._executor is not None and self._executor.executing(run_id):
            return
        orig_event(self, kind, run_id)

    engine_mod.Engine._on_store_event = _on_store_event  # type: ignore[method-assign]
    _watch.RunWatcher.wait_local = wait_local  # type: ignore[attr-defined]
    _watch.RunWatcher._poll_later = _poll_later  # type: ignore[attr-defined]
    engine_mod.Engine.wait_for_run = wait_for_run  # type: ignore[method-assign]


def fix_defer() -> None:
    """PgWriteBatcher: a result checkpoint written with ctx's write_later does not kick the
    batcher; it rides with the next awaited write (the settle, the next step's running
    checkpoint) or a flush, with a 2 ms timer as the bound."""
    from durably import context as context_mod
    from durably import replay as replay_mod
    from durably.stores._shared import checkpoint_params

    b = _pg_batch.PgWriteBatcher
    orig_kick = b._kick

    def save_deferred(self: Any, params: Any, owner: str) -> Any:
        future = asyncio.get_running_loop().create_future()
        key = (params[0], params[1])
        waiting = self._checkpoints.pop(key, None)
        futures = [*waiting[1], future] if waiting else [future]
        self._checkpoints[key] = ((*params, owner), futures)
        self._idle.clear()
        if getattr(self, "_timer", None) is None:
            self._timer = asyncio.get_running_loop().call_later(0.002, self._kick)
        return future

    def _kick(self: Any) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None
        orig_kick(self)

    b.save_deferred = save_deferred  # type: ignore[attr-defined]
    b._kick = _kick  # type: ignore[method-assign]
    BATCHERS: list[Any] = []
    orig_writes = postgres.PostgresStore._writes

    def _writes(self: Any) -> Any:
        w = orig_writes(self)
        if w not in BATCHERS:
            BATCHERS.append(w)
        return w

    postgres.PostgresStore._writes = _writes  # type: ignore[method-assign]

    def _save_later(self: Any, checkpoint: Any) -> None:
        store = self._services.store
        if isinstance(store, postgres.PostgresStore):
            fut = store._writes().save_deferred(checkpoint_params(checkpoint), self._turn.owner)
            self._turn.write_later(fut)
        else:
            self._turn.write_later(store.save_checkpoint(checkpoint, self._turn.owner))

    context_mod.WorkflowContext._save_later = _save_later  # type: ignore[method-assign]
    orig_flush = replay_mod.Turn.flush

    async def flush(self: Any) -> None:
        if self._unflushed:
            for w in BATCHERS:
                if w._checkpoints and w._timer is not None:
                    w._kick()
        await orig_flush(self)

    replay_mod.Turn.flush = flush  # type: ignore[method-assign]


def fix_pending() -> None:
    """Engine: our own start's NOTIFY 'pending' does not trigger a pending-run poll."""
    E = engine_mod.Engine
    orig_start, orig_event = E.start, E._on_store_event
    orig_create = postgres.PostgresStore.create_run
    OWN: set[str] = set()

    async def create_run(self: Any, run: Any) -> Any:
        OWN.add(run.run_id)
        return await orig_create(self, run)

    def _on_store_event(self: Any, kind: str, run_id: str) -> None:
        if kind == "pending" and run_id in OWN:
            OWN.discard(run_id)
            return
        orig_event(self, kind, run_id)

    postgres.PostgresStore.create_run = create_run  # type: ignore[method-assign]
    E._on_store_event = _on_store_event  # type: ignore[method-assign]


def fix_lease() -> None:
    """Engine.start: insert the run already leased to this instance (status running) and
    hand it to the executor with an empty history: no start_turn round trip."""
    E = engine_mod.Engine
    orig_start, orig_execute = E.start, E._execute
    from durably.model import Run, RunStatus

    async def start(self: Any, workflow: str, input: Any = None, **kw: Any) -> Any:
        if kw or not self.drive or self._draining or self._executor is None or (
            self._executor.busy >= self._executor_limit
        ):
            return await orig_start(self, workflow, input, **kw)
        definition = self._registry.get(workflow, None)
        stored_input = definition.validate_input(input) if definition.takes_input else None
        await self.open()
        now = self.clock.now_ms()
        run = Run(
            run_id=engine_mod._new_run_id(),
            workflow=definition.name,
            workflow_version=definition.version,
            status=RunStatus.RUNNING,
            input=stored_input,
            namespace=self.namespace,
            locked_by=self.instance_id,
            locked_until=now + self.lease_ms,
            deadline_at=(
                now + definition.execution_timeout_ms
                if definition.execution_timeout_ms is not None
                else None
            ),
            created_at=now,
            updated_at=now,
        )
        stored, created = await self.store.create_run(run)
        if created:
            self._preleased = getattr(self, "_preleased", {})
            self._preleased[run.run_id] = run
            self._executor.submit(run.run_id)
            return run.replace(status=RunStatus.PENDING, locked_by=None, locked_until=None)
        return stored

    async def _execute(self: Any, run_id: str, wake: bool) -> None:
        run = getattr(self, "_preleased", {}).pop(run_id, None)
        if run is not None:
            await self._drive(run, {})
            return
        await orig_execute(self, run_id, wake)

    E.start, E._execute = start, _execute  # type: ignore[method-assign]


def fix_early() -> None:
    """PgWriteBatcher._run: resolve the batch's futures before releasing the connection."""
    b = _pg_batch.PgWriteBatcher
    _resolve, _fail, _log = _pg_batch._resolve, _pg_batch._fail, _pg_batch._log

    async def _run(self: Any) -> None:
        while True:
            await self._wakeup.wait()
            for _ in range(LINGER):
                # only results queued (write_later), nobody waiting on a settle: give the
                # turn a few loop steps to queue its settle (or next running checkpoint)
                if self._settles or any(
                    row[4] not in ("completed", "failed") for row, _ in self._checkpoints.values()
                ):
                    break
                await asyncio.sleep(0)
            self._wakeup.clear()
            checkpoints, self._checkpoints = self._checkpoints, {}
            settles, self._settles = self._settles, []
            if not checkpoints and not settles:
                self._idle.set()
                continue
            try:
                async with self._acquire() as conn:
                    held, settled = await self._write(conn, checkpoints, settles)
                    for key, (_, futures) in checkpoints.items():
                        for future in futures:
                            _resolve(future, key in held)
                    for (_, settle_future), result in zip(settles, settled, strict=True):
                        _resolve(settle_future, result)
            except Exception as exc:
                _log.warning("a batch failed: %s", exc)
                for _, futures in checkpoints.values():
                    for future in futures:
                        _fail(future, exc)
                for _, settle_future in settles:
                    _fail(settle_future, exc)
                continue
            if not self._checkpoints and not self._settles:
                self._idle.set()

    b._run = _run  # type: ignore[method-assign]


LINGER = 0


def fix_linger() -> None:
    global LINGER
    LINGER = 6
    fix_early()


FIXES = {
    "linger": fix_linger,
    "early": fix_early,
    "reset": fix_reset,
    "watch": fix_watch,
    "defer": fix_defer,
    "pending": fix_pending,
    "lease": fix_lease,
}


# -- driver ------------------------------------------------------------------------------------


async def trivial(i: int) -> int:
    return i


async def main() -> None:
    global TRACE
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--fix", default="")
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--show", type=int, default=1, help="timelines to print (median first)")
    p.add_argument("--profile", default="", help="pyinstrument html/txt output path")
    args = p.parse_args()
    for f in filter(None, args.fix.split(",")):
        FIXES[f]()
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
        f"fix={args.fix or '-'} n={len(samples)} p50={statistics.median(samples) * 1e3:.2f} ms "
        f"p90={q[89] * 1e3:.2f} p99={q[98] * 1e3:.2f} mean={statistics.mean(samples) * 1e3:.2f}"
    )
    if profiler is not None:
        out = Path(args.profile)
        if out.suffix == ".html":
            out.write_text(profiler.output_html())
        else:
            out.write_text(profiler.output_text(unicode=False, color=False, show_all=True))
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
