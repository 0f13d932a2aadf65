"""Cost per run that machine noise cannot move: pages and CPU time, empty database vs full.

    python grow_cost.py --name bench_durably_grown --keep buffers     # grow.py's 1,000,000
    python grow_cost.py --name bench_durably_empty buffers            # reset first
    python grow_cost.py --name bench_durably_grown --keep cpu throughput --n 2000 --k 5
    python grow_cost.py --name bench_durably_empty cpu latency --count 200

Wall-clock time on two shared cores moves by +-50% from one minute to the next, so "within 10%
of an empty database" cannot be read off it. These two measures do not depend on what else runs.

``buffers``: the store's pooled connections load ``auto_explain`` (``session_preload_libraries``
as a connection setting, nothing installed on the server) and send back, as a NOTICE, the
executed plan of every statement with its shared buffer hits and reads and the rows its scans
examined (kept + removed by filter or recheck, times loops). The engine runs ``--one`` one-step
runs one at a time, ``--seq`` K-step runs one at a time, then ``--gathered`` K-step runs started
at once (the throughput bench's shape: batched writes); each statement is charged to the phase it
ran in. Statements the engine also sends while idle are its polls (timers, not runs): reported
per call, left out of the per-run sums, as are asyncpg's own catalog queries (once per new
connection). Then the sweeps are called once each (as ``grow.py explain`` does). Pages per run
are counts: the same on every run of the same database (the batched phase up to which runs share
a batch). Each phase also reads the database's own block counters (``pg_statio_user_tables`` and
``_indexes``: heap, TOAST and every index of every durably table), waiting out the backends'
reporting delay: their sum against the plans' is the coverage check (a statement's work the top
plan node does not show would leave a gap), and they split a run's pages into heap and index
pages. The B-tree ``level`` of every index on the runs and checkpoints is read too
(``pageinspect``): one more level is one more page per descent.

``cpu``: the throughput or the latency scenario of ``durably_side.py`` (same workflows, warm-up,
timing), plus the CPU time the engine process and the PostgreSQL backends serving this database
spent on the measured runs: ``time.process_time()`` here, ``/proc/<pid>/schedstat`` (time on a
CPU, in ns) of every client backend of the database (``pg_stat_activity``; one started during
the measurement counts from zero), before and after. PostgreSQL's background processes (WAL
writer, checkpointer, autovacuum) are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from common import (
    emit,
    error_result,
    latency_summary,
    make_target,
    prepare_workdir,
    reset_target,
    throughput_result,
    timed_batch,
)
from grow import build_engine, call_sweeps, kind_of

# what every pooled connection of the instrumented store is opened with (PGOPTIONS-style
# startup settings: a superuser may name session_preload_libraries there)
AUTO_EXPLAIN = {
    "session_preload_libraries": "auto_explain",
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_buffers": "on",
    "auto_explain.log_timing": "off",  # counts, not clocks: cheaper, and nothing here reads them
    "auto_explain.log_format": "json",
    "auto_explain.log_level": "notice",  # to the client that ran the statement, not the server log
    "client_min_messages": "notice",
}

# the plan nodes that read rows from a table (a Bitmap Index Scan's rows are read again by its
# Bitmap Heap Scan, counted there)
SCANS = {"Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Tid Scan"}
COUNTS = ("hit", "read", "dirtied", "written", "rows")


def examined(node: dict[str, Any]) -> int:
    """Rows the scans under (and at) ``node`` looked at: kept or filtered out, every loop."""
    total = 0
    if node.get("Node Type") in SCANS:
        loops = node.get("Actual Loops", 1) or 0
        per_loop = (
            node.get("Actual Rows", 0)
            + node.get("Rows Removed by Filter", 0)
            + node.get("Rows Removed by Index Recheck", 0)
        )
        total += round(per_loop * loops)
    for child in node.get("Plans", []):
        total += examined(child)
    return total


def walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", []):
        out += walk(child)
    return out


def plan_counts(plan: dict[str, Any]) -> dict[str, int]:
    """Buffers of the whole statement, and the rows its scans examined.

    The top node's buffers include every node run inside it, but a data-modifying ``WITH``
    that nothing reads (``saved AS (INSERT …)``) runs after it, at the executor's finish:
    its own node's buffers are added."""
    top = plan["Plan"]
    nodes = walk(top)
    read_ctes = {n.get("CTE Name") for n in nodes if n.get("Node Type") == "CTE Scan"}
    parts = [top] + [
        n
        for n in nodes
        if str(n.get("Subplan Name", "")).startswith("CTE ")
        and n["Subplan Name"][4:] not in read_ctes
    ]
    return {
        "hit": sum(int(n.get("Shared Hit Blocks", 0)) for n in parts),
        "read": sum(int(n.get("Shared Read Blocks", 0)) for n in parts),
        "dirtied": sum(int(n.get("Shared Dirtied Blocks", 0)) for n in parts),
        "written": sum(int(n.get("Shared Written Blocks", 0)) for n in parts),
        "rows": examined(top),
    }


class PlanLog:
    """The plans auto_explain sends back, summed per (phase, statement text)."""

    def __init__(self) -> None:
        self.phase = "open"
        self.stats: dict[tuple[str, str], dict[str, int]] = {}
        self.unparsed = 0

    def heard(self, _conn: Any, msg: Any) -> None:
        text = str(getattr(msg, "message", ""))
        brace = text.find("{")
        if "plan:" not in text or brace < 0:
            return
        try:
            plan = json.loads(text[brace:])
            counts = plan_counts(plan)
        except (ValueError, KeyError):
            self.unparsed += 1
            return
        sql = " ".join(str(plan.get("Query Text", "")).split())
        s = self.stats.setdefault((self.phase, sql), dict.fromkeys(("calls", *COUNTS), 0))
        s["calls"] += 1
        for k, v in counts.items():
            s[k] += v

    def install(self) -> None:
        """Hear every NOTICE any asyncpg connection of this process receives, as it arrives.

        At the class, not with ``add_log_listener``: the pool drops a connection's listeners
        each time it is released."""
        import asyncpg.connection
        import asyncpg.exceptions

        cls: Any = asyncpg.connection.Connection
        orig = cls._process_log_message
        log = self

        def process(conn: Any, fields: Any, last_query: Any) -> None:
            log.heard(conn, asyncpg.exceptions.PostgresLogMessage.new(fields, query=last_query))
            orig(conn, fields, last_query)

        cls._process_log_message = process


async def statio(conn: Any) -> dict[str, int]:
    """Shared blocks hit + read so far, per durably table (heap and TOAST) and per index."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = await conn.fetch(
        "SELECT relname AS name, coalesce(heap_blks_hit, 0) + coalesce(heap_blks_read, 0)"
        " + coalesce(toast_blks_hit, 0) + coalesce(toast_blks_read, 0)"
        " + coalesce(tidx_blks_hit, 0) + coalesce(tidx_blks_read, 0) AS n"
        " FROM pg_statio_user_tables WHERE relname LIKE 'durably%'"
        " UNION ALL SELECT indexrelname, coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0)"
        " FROM pg_statio_user_indexes WHERE relname LIKE 'durably%'"
    )
    return {r["name"]: int(r["n"]) for r in rows}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


async def btree_levels(conn: Any) -> dict[str, int]:
    """The B-tree level (0: the root is the leaf) of each index on runs and checkpoints."""
    await conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " JOIN pg_class t ON t.oid = i.indrelid JOIN pg_am a ON a.oid = c.relam"
        " WHERE t.relname IN ('durably_runs', 'durably_checkpoints') AND a.amname = 'btree'"
        " ORDER BY c.relname"
    )
    out = {}
    for r in rows:
        out[r["relname"]] = int(await conn.fetchval("SELECT level FROM bt_metap($1)", r["relname"]))
    return out


async def buffers(
    url: str, one: int, seq: int, gathered: int, k: int, idle: float, flush: float
) -> dict[str, Any]:
    import asyncpg

    from durably.stores.postgres import PostgresStore

    log = PlanLog()
    log.install()
    async with build_engine(url):  # create the schema (an empty database) outside the window
        pass
    mon = await asyncpg.connect(url)
    held = int(await mon.fetchval("SELECT count(*) FROM durably_runs"))
    phases: dict[str, dict[str, Any]] = {}
    engine = build_engine(PostgresStore(url, server_settings=dict(AUTO_EXPLAIN)))

    mark: dict[str, int] = {}

    async def phase(name: str, runs: int, body: Callable[[], Awaitable[Any]]) -> None:
        # A backend sends its block counters when it goes idle, at most once a second; one
        # that sent them less than a second ago sends them after 10 s idle (PGSTAT_IDLE_INTERVAL
        # in PostgreSQL 15). The phase lasts until every pooled backend has sent them, so the
        # tables' counters cover exactly this phase, and the polls during it.
        nonlocal mark
        log.phase = name
        await body()
        await asyncio.sleep(flush)
        now = await statio(mon)
        phases[name] = {"runs": runs, "statio": delta(now, mark)}
        mark = now

    async def one_at_a_time(workflow: str, n: int, arg: Callable[[int], int]) -> None:
        for i in range(n):
            r = await engine.start(workflow, arg(i))
            await engine.wait_for_run(r.run_id, terminal=True, timeout=60)

    async def at_once() -> None:
        runs = await asyncio.gather(*(engine.start("bench", k) for _ in range(gathered)))
        for r in runs:
            await engine.wait_for_run(r.run_id, terminal=True, timeout=120)

    async with engine:
        store: Any = engine.store
        # warm: asyncpg's type introspection and each statement's first (planning) execution
        log.phase = "open"
        await one_at_a_time("one_step", 3, int)
        warm = await asyncio.gather(*(engine.start("bench", k) for _ in range(20)))
        for r in warm:
            await engine.wait_for_run(r.run_id, terminal=True, timeout=60)
        await asyncio.sleep(flush)
        mark = await statio(mon)
        await phase("idle", 0, lambda: asyncio.sleep(idle))
        await phase("one-step", one, lambda: one_at_a_time("one_step", one, int))
        await phase("k-step", seq, lambda: one_at_a_time("bench", seq, lambda _: k))
        await phase("gathered", gathered, at_once)
        await phase("sweeps", 0, lambda: call_sweeps(store, int(time.time() * 1000)))
        log.phase = "close"
    levels = await btree_levels(mon)
    runs_now = int(await mon.fetchval("SELECT count(*) FROM durably_runs"))
    await mon.close()

    polls = {sql for (ph, sql) in log.stats if ph == "idle"}
    per_statement: dict[str, dict[str, Any]] = {}
    for (ph, sql), s in log.stats.items():
        if ph not in phases:
            continue
        role = "poll" if sql in polls else ("sweep" if ph == "sweeps" else "run")
        it = per_statement.setdefault(
            sql, {"kind": kind_of(sql), "role": role, "sql": sql[:300], "phases": {}}
        )
        it["phases"][ph] = dict(s)
    per_run: dict[str, dict[str, Any]] = {}
    coverage: dict[str, Any] = {}
    for ph, info in phases.items():
        tot = dict.fromkeys(("statements", *COUNTS), 0)
        poll_tot = dict.fromkeys(("statements", *COUNTS), 0)
        for (p2, sql), s in log.stats.items():
            # asyncpg's own catalog queries (type introspection, once per new connection) are
            # the driver's, not the store's
            if p2 != ph or "durably_" not in sql:
                continue
            dst = poll_tot if sql in polls else tot
            dst["statements"] += s["calls"]
            for c in COUNTS:
                dst[c] += s[c]
        # asyncpg's type introspection reads the catalogs, which pg_statio leaves out
        plans = sum(
            s["hit"] + s["read"]
            for (p2, sql), s in log.stats.items()
            if p2 == ph and "durably_" in sql
        )
        tables = sum(info["statio"].values())
        coverage[ph] = {
            "plans": plans,
            "statio": tables,
            "ratio": round(plans / tables, 3) if tables else None,
        }
        n = info["runs"]
        if n:
            per_run[ph] = {
                "runs": n,
                **{c: round(v / n, 2) for c, v in tot.items()},
                "polls_in_phase": poll_tot,
                # the tables' own counters, per run: polls in the phase included
                "statio": {rel: round(v / n, 2) for rel, v in sorted(info["statio"].items())},
            }
    return {
        "runs_held": held,
        "runs_after": runs_now,
        "k": k,
        "per_run": per_run,
        "statements": per_statement,
        "btree_levels": levels,
        # hit + read in each phase: the plans' sum vs the tables' own counters
        "coverage": coverage,
        "unparsed": log.unparsed,
    }


# --------------------------------------------------------------------------------------- cpu

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float | None:
    """CPU seconds process ``pid`` has run so far (None once it has gone).

    ``/proc/<pid>/schedstat`` (nanoseconds on a CPU) where the kernel keeps it, else user +
    system time from ``/proc/<pid>/stat`` (clock ticks: 10 ms, coarse for 200 runs)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # after "(comm) ": state is field 3 of stat(5), utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / TICK


class Backends:
    """CPU time of the client backends serving one database, from ``/proc``."""

    def __init__(self, mon: Any) -> None:
        self.mon = mon
        self.start: dict[int, float] = {}

    async def pids(self) -> list[int]:
        rows = await self.mon.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
        return [int(r["pid"]) for r in rows]

    async def mark(self) -> None:
        self.start = {p: c for p in await self.pids() if (c := proc_cpu(p)) is not None}

    async def spent(self) -> tuple[float, int]:
        """CPU seconds since :meth:`mark`, and how many backends served."""
        pids = set(await self.pids()) | set(self.start)
        total = 0.0
        for p in pids:
            now = proc_cpu(p)
            if now is not None:
                total += now - self.start.get(p, 0.0)
        return total, len(pids)


async def db_blocks(url: str) -> tuple[int, dict[str, int]]:
    """Shared buffers hit + read so far by every backend of the database that has reported (a
    backend reports on exit, and otherwise at most once a second and up to 10 s late:
    PostgreSQL 15's PGSTAT_MIN_INTERVAL and PGSTAT_IDLE_INTERVAL), in all and per durably
    table and index."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        per = await statio(conn)
        total = await conn.fetchval(
            "SELECT blks_hit + blks_read FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(total), per
    finally:
        await conn.close()


async def closed_blocks(url: str, before: tuple[int, dict[str, int]], runs: int) -> dict[str, Any]:
    """Shared buffers hit + read per run since ``before``, once the engine's connections have
    closed (so every one of its backends has reported): the engine's start, warm-up, idle polls
    and stop included, and anything else using the database meanwhile (autovacuum); in all and
    per durably table and index."""
    await asyncio.sleep(0.5)  # the closed connections' backends exit and report
    total, per = await db_blocks(url)
    return {
        "db_pages_per_run": round((total - before[0]) / runs, 2),
        "relation_pages_per_run": {k: round(v / runs, 2) for k, v in delta(per, before[1]).items()},
    }


async def measured(
    url: str, body: Callable[[Any], Any], engine: Any
) -> tuple[Any, dict[str, float]]:
    """``body``'s result, and the CPU seconds it cost this process and the database's client
    backends."""
    import asyncpg

    mon = await asyncpg.connect(url)
    try:
        backends = Backends(mon)
        await backends.mark()
        c0 = time.process_time()
        out = await body(engine)
        engine_s = time.process_time() - c0
        pg_s, nb = await backends.spent()
    finally:
        await mon.close()
    return out, {"engine_cpu_s": engine_s, "pg_cpu_s": pg_s, "backends": nb}


async def cpu_throughput(url: str, n: int, k: int, warmup: int, timeout: float) -> dict[str, Any]:
    blocks0 = await db_blocks(url)
    engine = build_engine(url)
    async with engine:

        async def start(_: int) -> Any:
            return await engine.start("bench", k)

        async def wait(run: Any) -> Any:
            res = await engine.wait_for_run(run.run_id, terminal=True, timeout=timeout)
            if str(res.status) != "completed" or res.output != k:
                raise RuntimeError(f"run {run.run_id} ended {res.status}")
            return res

        if warmup:
            await timed_batch(warmup, start, wait, timeout)

        async def body(_: Any) -> tuple[float, float]:
            t_started, elapsed, _r = await timed_batch(n, start, wait, timeout)
            return t_started, elapsed

        (t_started, elapsed), cpu = await measured(url, body, engine)
    return {
        **throughput_result(n, k, t_started, elapsed),
        **per_run(cpu, n),
        **await closed_blocks(url, blocks0, n + warmup),
    }


async def cpu_latency(url: str, count: int, warmup: int, timeout: float) -> dict[str, Any]:
    blocks0 = await db_blocks(url)
    engine = build_engine(url)
    samples: list[float] = []
    async with engine:

        async def one(i: int) -> float:
            t0 = time.perf_counter()
            run = await engine.start("one_step", i)
            res = await engine.wait_for_run(run.run_id, terminal=True, timeout=timeout)
            if str(res.status) != "completed" or res.output != i:
                raise RuntimeError(f"run {run.run_id} ended {res.status}")
            return time.perf_counter() - t0

        for i in range(warmup):
            await one(i)

        async def body(_: Any) -> None:
            for i in range(count):
                samples.append(await one(warmup + i))

        _, cpu = await measured(url, body, engine)
    return {
        **latency_summary(samples),
        **per_run(cpu, count),
        **await closed_blocks(url, blocks0, count + warmup),
    }


def per_run(cpu: dict[str, float], n: int) -> dict[str, Any]:
    return {
        "engine_cpu_ms_per_run": round(1000 * cpu["engine_cpu_s"] / n, 4),
        "pg_cpu_ms_per_run": round(1000 * cpu["pg_cpu_s"] / n, 4),
        "total_cpu_ms_per_run": round(1000 * (cpu["engine_cpu_s"] + cpu["pg_cpu_s"]) / n, 4),
        "backends": cpu["backends"],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--name", default="bench_durably_grown")
    p.add_argument("--workdir", default=".work")
    p.add_argument("--keep", action="store_true", help="measure the database as it is")
    sub = p.add_subparsers(dest="what", required=True)
    bp = sub.add_parser("buffers")
    bp.add_argument("--one", type=int, default=100, help="one-step runs, one at a time")
    bp.add_argument("--seq", type=int, default=50, help="K-step runs, one at a time")
    bp.add_argument("--gathered", type=int, default=500, help="K-step runs started at once")
    bp.add_argument("--k", type=int, default=5)
    bp.add_argument("--idle", type=float, default=3.0, help="seconds idle: what the polls cost")
    bp.add_argument("--flush", type=float, default=11.0, help="seconds for counters to arrive")
    cp = sub.add_parser("cpu")
    csub = cp.add_subparsers(dest="scenario", required=True)
    tp = csub.add_parser("throughput")
    tp.add_argument("--n", type=int, default=2000)
    tp.add_argument("--k", type=int, default=5)
    tp.add_argument("--warmup", type=int, default=20)
    tp.add_argument("--timeout", type=float, default=600.0)
    lp = csub.add_parser("latency")
    lp.add_argument("--count", type=int, default=200)
    lp.add_argument("--warmup", type=int, default=10)
    lp.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    prepare_workdir(args.workdir)
    t = make_target("postgres", args.name, Path.cwd())
    scen = args.what if args.what == "buffers" else f"cpu-{args.scenario}"
    base: dict[str, Any] = {"side": "durably", "db": "postgres", "scenario": scen}

    async def go() -> dict[str, Any]:
        if not args.keep:
            await reset_target(t)
            if args.what == "cpu":
                # create the schema now: its pages are no run's (a kept database has it)
                async with build_engine(t.url):
                    pass
        if args.what == "buffers":
            return await buffers(
                t.url, args.one, args.seq, args.gathered, args.k, args.idle, args.flush
            )
        if args.scenario == "throughput":
            return await cpu_throughput(t.url, args.n, args.k, args.warmup, args.timeout)
        return await cpu_latency(t.url, args.count, args.warmup, args.timeout)

    try:
        emit({**base, **asyncio.run(go())})
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()


# ------------------------------------------------------------------------------ report pieces

TABLES = ("durably_runs", "durably_checkpoints")


def split_pages(statio: dict[str, float]) -> tuple[float, float]:
    """(heap + TOAST pages of the two big tables, pages of every index and other table)."""
    heap = sum(v for k, v in statio.items() if k in TABLES)
    return heap, sum(statio.values()) - heap


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The per-statement and per-run buffer counts of several ``buffers`` results, side by side
    (``results``: a label such as ``"empty"`` or ``"1,000,000"`` to one result each)."""
    labels = list(results)
    lines = [
        "## Pages and rows per statement and per run: "
        + " vs ".join(labels)
        + " (`grow_cost.py buffers`)",
        "",
        "Shared buffers (hit + read) and rows examined (scanned rows kept or filtered out, every "
        "loop) of every statement the engine sent, from `auto_explain` on the store's own "
        "connections: one-step runs one at a time, K-step runs one at a time, K-step runs "
        "started together (batched writes); polls are the statements the engine also sends "
        "while idle, per call. Counts, not times: the same on every run of the same database "
        "(the batched phase up to how runs share batches).",
        "",
        "| phase | per run | " + " | ".join(labels) + " |",
        "| --- | --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    phases = ("one-step", "k-step", "gathered")
    for ph in phases:
        rows: dict[str, list[str]] = {
            "statements": [],
            "pages (plans)": [],
            "rows examined": [],
            "pages, tables' counters": [],
            "  of which heap": [],
            "  of which index": [],
        }
        for lab in labels:
            pr = results[lab].get("per_run", {}).get(ph, {})
            heap, idx = split_pages(pr.get("statio", {}))
            rows["statements"].append(f"{pr.get('statements', 0):.2f}")
            rows["pages (plans)"].append(f"{pr.get('hit', 0) + pr.get('read', 0):.1f}")
            rows["rows examined"].append(f"{pr.get('rows', 0):.1f}")
            rows["pages, tables' counters"].append(f"{heap + idx:.1f}")
            rows["  of which heap"].append(f"{heap:.1f}")
            rows["  of which index"].append(f"{idx:.1f}")
        for name, cells in rows.items():
            lines.append(f"| {ph} | {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "B-tree levels (0: the root is the leaf; each level is one more page per probe or insert):",
        "",
        "| index | " + " | ".join(labels) + " |",
        "| --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    names = sorted({n for r in results.values() for n in r.get("btree_levels", {})})
    for n in names:
        lines.append(
            f"| {n} | "
            + " | ".join(str(results[lab].get("btree_levels", {}).get(n, "-")) for lab in labels)
            + " |"
        )
    lines += [
        "",
        "Per statement, per call (pages hit + read / rows examined):",
        "",
        "| statement | role | phase | calls | " + " | ".join(labels) + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    sqls: dict[str, dict[str, Any]] = {}
    for r in results.values():
        for sql, it in r.get("statements", {}).items():
            sqls.setdefault(sql, it)
    order = {"run": 0, "poll": 1, "sweep": 2}
    for sql, it in sorted(sqls.items(), key=lambda x: (order.get(x[1]["role"], 3), x[1]["kind"])):
        seen = sorted(
            {ph for r in results.values() for ph in r["statements"].get(sql, {}).get("phases", {})}
        )
        for ph in seen:
            if it["role"] == "poll" and ph != "idle":
                continue
            cells = []
            calls = ""
            for lab in labels:
                s = results[lab].get("statements", {}).get(sql, {}).get("phases", {}).get(ph)
                if not s or not s["calls"]:
                    cells.append("-")
                    continue
                calls = calls or str(s["calls"])
                pages = (s["hit"] + s["read"]) / s["calls"]
                cells.append(f"{pages:.1f} / {s['rows'] / s['calls']:.1f}")
            short = " ".join(sql.split())[:60].replace("|", "/")
            lines.append(
                f"| {it['kind']}: `{short}…` | {it['role']} | {ph} | {calls} | "
                + " | ".join(cells)
                + " |"
            )
    cov = [
        f"{lab} {ph} {c['ratio']}"
        for lab, r in results.items()
        for ph, c in r.get("coverage", {}).items()
        if ph in phases and c.get("ratio") is not None
    ]
    lines += [
        "",
        "Coverage (the plans' pages over the tables' own counters, `pg_statio_user_tables` + "
        "`pg_statio_user_indexes`, per phase; polls included in both): " + ", ".join(cov) + ".",
        "",
    ]
    return "\n".join(lines)
