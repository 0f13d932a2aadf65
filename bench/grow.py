"""Cost as work grows: a PostgreSQL store holding 1,000,000 finished runs.

    python grow.py --name bench_durably_grown seed --runs 1000000   # fill the tables (SQL)
    python grow.py --name bench_durably_grown explain               # plans of the hot queries

``seed`` resets the database, lets the engine run one real workflow of the throughput bench
(``bench``, K=5 local steps) as a template, then copies that run's row and its checkpoints
``--runs`` times with ``INSERT … SELECT … generate_series`` in the store's own tables (nothing
goes through the engine: seconds per 100,000 runs, not hours), spread over the last ~23 days,
every 20th one failed; then ``VACUUM ANALYZE`` (what autovacuum does to a table this size soon
after a load). ``grow_compare.py`` then runs ``durably_side.py --keep`` on it and on an empty
database.

``explain`` starts an engine on that database with every asyncpg statement recorded, drives the
paths whose queries run per turn or per poll (starts, claims, checkpoints, settles, a timer's
wake and replay, the orphan and due sweeps, the retention, deadline and stalled sweeps, the
default ``list_runs`` page, one of a workflow, of a parent, of completed and of failed runs,
and the per-status counts of a workflow), then prints
``EXPLAIN (ANALYZE, BUFFERS)`` of each distinct SQL
text under the generic plan the store's pool uses (``plan_cache_mode = force_generic_plan``;
the listings and counts under the custom plan they ask for),
inside a transaction that is rolled back. It writes the plans to ``--out`` (markdown) and one
JSON line: each query with whether its plan reads a durably table sequentially.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time
from pathlib import Path
from typing import Any

from common import (
    emit,
    error_result,
    make_target,
    prepare_workdir,
    reset_target,
    run_id_shape,
    use_run_id_shape,
)

HERE = Path(__file__).resolve().parent
SPREAD_MS = 2_000  # one seeded run every 2 s of history: 1,000,000 runs ≈ 23 days
CHUNK = 100_000


async def trivial(i: int) -> int:
    return i


def build_engine(url: str, **kwargs: Any) -> Any:
    import durably

    use_run_id_shape()
    engine = durably.Engine(store=url, **kwargs)

    @engine.workflow("bench", version="1")
    async def bench(ctx: Any, k: int) -> int:
        for i in range(k):
            await ctx.local_step(f"s{i}", trivial, i)
        return k

    @engine.workflow("one_step", version="1")
    async def one_step(ctx: Any, x: int) -> int:
        out: int = await ctx.local_step("s0", trivial, x)
        return out

    @engine.workflow("nap", version="1")
    async def nap(ctx: Any, x: int) -> int:
        await ctx.local_step("before", trivial, x)
        await ctx.sleep(0.3)
        out: int = await ctx.local_step("after", trivial, x)
        return out

    return engine


async def columns(conn: Any, table: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position",
        table,
    )
    return [r["column_name"] for r in rows]


async def seed(url: str, runs: int, k: int, last_workflow: str | None = None) -> dict[str, Any]:
    """Fill the database with ``runs`` finished copies of one real run (and its checkpoints);
    with ``last_workflow``, every other copy under that workflow name instead, so that the
    workflows measured afterwards do not sort last in the listing by workflow."""
    import asyncpg

    engine = build_engine(url)
    async with engine:
        run = await engine.start("bench", k)  # its id has the shape the engine makes
        template = run.run_id
        res = await engine.wait_for_run(run.run_id, terminal=True, timeout=60)
        if str(res.status) != "completed":
            raise RuntimeError(f"template run ended {res.status}")
    conn = await asyncpg.connect(url)
    t0 = time.perf_counter()
    try:
        now = int(time.time() * 1000)
        run_cols = await columns(conn, "durably_runs")
        created = f"$2::bigint - ($3::bigint - g.i) * {SPREAD_MS}"
        seeded_id = (
            f"lpad(to_hex({created}), 12, '0') || left(md5(g.i::text), 20)"
            if run_id_shape() == "time"
            else "md5(g.i::text)"
        )
        # every column copied from the template except these; the ids have the shape the
        # measured engine makes (run_id_shape): time first from created_at, or all random
        over = {
            "id": seeded_id,
            "created_at": created,
            "updated_at": f"{created} + 40",
            "status": "CASE WHEN g.i % 20 = 0 THEN 'failed' ELSE t.status END",
            "output": "CASE WHEN g.i % 20 = 0 THEN NULL ELSE t.output END",
            "error": (
                "CASE WHEN g.i % 20 = 0 THEN "
                '\'{"type": "ValueError", "message": "boom"}\' ELSE t.error END'
            ),
            "locked_by": "NULL",
            "locked_until": "NULL",
        }
        if last_workflow:
            over["workflow"] = "CASE WHEN g.i % 2 = 0 THEN t.workflow ELSE $6::text END"
        run_sql = (
            f"INSERT INTO durably_runs ({', '.join(run_cols)}) SELECT "
            + ", ".join(over.get(c, f"t.{c}") for c in run_cols)
            + " FROM durably_runs t CROSS JOIN generate_series($4::int, $5::int) AS g(i)"
            " WHERE t.id = $1"
        )
        cp_cols = await columns(conn, "durably_checkpoints")
        cp_over = {
            "run_id": seeded_id,
            "started_at": f"$2::bigint - ($3::bigint - g.i) * {SPREAD_MS} + c.seq * 5",
            "finished_at": f"$2::bigint - ($3::bigint - g.i) * {SPREAD_MS} + c.seq * 5 + 1",
        }
        cp_sql = (
            f"INSERT INTO durably_checkpoints ({', '.join(cp_cols)}) SELECT "
            + ", ".join(cp_over.get(c, f"c.{c}") for c in cp_cols)
            + " FROM durably_checkpoints c CROSS JOIN generate_series($4::int, $5::int) AS g(i)"
            " WHERE c.run_id = $1"
        )
        per_run = await conn.fetchval(
            "SELECT count(*) FROM durably_checkpoints WHERE run_id = $1", template
        )
        for lo in range(1, runs + 1, CHUNK):
            hi = min(runs, lo + CHUNK - 1)
            async with conn.transaction():
                await conn.execute(
                    run_sql,
                    template,
                    now,
                    runs,
                    lo,
                    hi,
                    *([last_workflow] if last_workflow else []),
                )
                await conn.execute(cp_sql, template, now, runs, lo, hi)
            print(f"seeded {hi:,} runs ({time.perf_counter() - t0:.0f} s)", flush=True)
        t_load = time.perf_counter() - t0
        await conn.execute("VACUUM ANALYZE durably_runs")
        await conn.execute("VACUUM ANALYZE durably_checkpoints")
        # write the 1.3 GB of fresh pages out now: otherwise the server's checkpointer flushes
        # them during the first measurement (measured: 57% of the empty database's throughput
        # right after the seed, flat a minute later)
        await conn.execute("CHECKPOINT")
        sizes = await conn.fetchrow(
            "SELECT pg_total_relation_size('durably_runs') AS runs_bytes, "
            "pg_total_relation_size('durably_checkpoints') AS checkpoints_bytes"
        )
        counts = await conn.fetchrow(
            "SELECT (SELECT count(*) FROM durably_runs) AS runs, "
            "(SELECT count(*) FROM durably_checkpoints) AS checkpoints"
        )
    finally:
        await conn.close()
    return {
        "runs": counts["runs"],
        "checkpoints": counts["checkpoints"],
        "checkpoints_per_run": per_run,
        "load_seconds": round(t_load, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "runs_mib": round(sizes["runs_bytes"] / 2**20),
        "checkpoints_mib": round(sizes["checkpoints_bytes"] / 2**20),
    }


# ----------------------------------------------------------------------------------- explain

SKIP = re.compile(
    r"^\s*(BEGIN|COMMIT|ROLLBACK|SET|RESET|LISTEN|UNLISTEN|SELECT pg_advisory|"
    r"CREATE|ALTER|DROP|SAVEPOINT|RELEASE|SHOW)",
    re.I,
)


def plan_mode(kind: str) -> str:
    """The plan cache mode the store runs a statement of ``kind`` under."""
    custom = kind.startswith(("list_runs", "count_runs"))
    return "force_custom_plan" if custom else "force_generic_plan"


# what each hot path is called in the report, by a piece of its SQL
KINDS = [
    ("recover orphans (recover_orphans)", "recovery_attempts = recovery_attempts + 1"),
    ("unclaimed sweep (list_unclaimed)", "AS unclaimed"),
    ("batched checkpoints and settles (write batcher)", "WITH locked AS"),
    ("final checkpoint and settle (one run)", "WITH settled AS"),
    ("checkpoint write", "durably_checkpoints c WHERE c.run_id = l.run_id"),
    ("count_runs of a workflow, per status", "::text AS status, (SELECT count(*)"),
    ("count pending", "SELECT count(*) FROM durably_runs WHERE (status = 'pending')"),
    ("claim pending (list_pending)", "WHERE (status = 'pending')"),
    ("due timers (list_due)", "wake_at <= $1"),
    ("claim due timers (claim_due_batch)", "UPDATE durably_runs SET wake_at = $1"),
    ("orphan / lease sweep (list_orphans)", "IS NOT FALSE AND (locked_until IS NULL"),
    (
        "checkpoint read for replay (load_checkpoints)",
        "FROM durably_checkpoints WHERE run_id = $1 ORDER BY seq",
    ),
    ("list_runs of completed runs", "WHERE status = 'completed' ORDER BY created_at DESC"),
    ("list_runs of failed runs", "WHERE status = 'failed' ORDER BY created_at DESC"),
    ("list_runs of a workflow", "WHERE workflow = $1 ORDER BY created_at DESC"),
    ("list_runs of a parent", "WHERE parent_id = $1 ORDER BY created_at DESC"),
    ("list_runs default page", "ORDER BY created_at DESC, id DESC"),
    ("retention sweep (list_finished_before)", "ORDER BY updated_at, id"),
    ("deadline sweep (list_expired)", "deadline_at <= $1"),
    ("stalled sweep (list_stalled)", "SELECT 1 FROM durably_checkpoints c"),
    ("blocked (list_blocked)", "status = 'blocked'"),
    ("start (create_run / create_runs)", "INSERT INTO durably_runs"),
    ("expire buffered signals/events", "DELETE FROM durably_buffered"),
    ("schedules poll", "FROM durably_schedules"),
    ("checkpoint write", "INSERT INTO durably_checkpoints"),
    ("turn start (start_turns)", "locked_by"),
]


def kind_of(sql: str) -> str:
    for name, needle in KINDS:
        if needle in sql:
            return name
    return "other"


def literal(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):  # an untyped array literal: coerced to the parameter's type

        def item(x: Any) -> str:
            if x is None:
                return "NULL"
            text = str(x).replace("\\", "\\\\").replace('"', '\\"')
            return '"' + text + '"'

        return "'{" + ",".join(item(x) for x in v).replace("'", "''") + "}'"
    return "'" + str(v).replace("'", "''") + "'"


class Recorder:
    """Every (sql, args) an asyncpg connection in this process sends, first args kept."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[Any, ...]] = {}
        self.counts: dict[str, int] = {}
        self.on = True

    def install(self) -> None:
        import asyncpg.connection

        cls = asyncpg.connection.Connection
        rec = self

        def wrap(name: str, many: bool = False) -> None:
            orig = getattr(cls, name)

            async def method(self: Any, query: str, *args: Any, **kw: Any) -> Any:
                first = tuple(args[0][0]) if many and args and args[0] else tuple(args)
                if rec.on and not SKIP.match(query) and (args or "$" not in query):
                    rec.seen.setdefault(query, first)
                    rec.counts[query] = rec.counts.get(query, 0) + 1
                return await orig(self, query, *args, **kw)

            setattr(cls, name, method)

        for name in ("fetch", "fetchrow", "fetchval", "execute"):
            wrap(name)
        wrap("executemany", many=True)


async def call_sweeps(store: Any, now: int) -> None:
    """Each sweep and per-poll read once, directly (the engine runs them on its own timers)."""
    from durably.stores import RunQuery

    await store.list_pending(now, 100)
    await store.list_due(now, 100)
    await store.list_orphans(now, 100)
    await store.recover_orphans(["old-0500000"], now, 3)
    await store.claim_due_batch(["old-0500000"], now, now + 30_000)
    await store.load_checkpoints("old-0500000")
    await store.list_runs(RunQuery())
    await store.list_runs(RunQuery(workflow="one_step"))
    await store.list_runs(RunQuery(parent_id="old-0500000"))
    await store.list_runs(RunQuery(status="completed"))
    await store.list_runs(RunQuery(status="failed"))
    await store.count_runs(RunQuery(workflow="one_step"), 1000)
    await store.list_finished_before(now - 7 * 86_400_000, 100)
    await store.list_expired(now, 100)
    await store.list_stalled(now - 60_000, 100)
    await store.count_pending()


async def explain(url: str, out: Path, k: int) -> dict[str, Any]:
    import asyncpg

    rec = Recorder()
    rec.install()
    engine = build_engine(url)
    async with engine:
        store: Any = engine.store
        # the per-turn paths: one at a time, then a gathered batch, then timers
        for i in range(10):
            r = await engine.start("one_step", i)
            await engine.wait_for_run(r.run_id, terminal=True, timeout=60)
        runs = await asyncio.gather(*(engine.start("bench", k) for _ in range(50)))
        naps = await asyncio.gather(*(engine.start("nap", i) for i in range(20)))
        for r in [*runs, *naps]:
            await engine.wait_for_run(r.run_id, terminal=True, timeout=60)
        await call_sweeps(store, int(time.time() * 1000))
    rec.on = False
    conn = await asyncpg.connect(url)
    held = f"{await conn.fetchval('SELECT count(*) FROM durably_runs'):,}"
    report: list[dict[str, Any]] = []
    lines = [
        f"# The engine's hot queries over {held} runs",
        "",
        'Written by `bench/grow.py explain` (see RESULTS.md, "Cost as work grows"). Every SQL '
        "text is one the store sent while an engine ran workflows (one at a time, 50 at once, "
        f"20 with a timer) on a PostgreSQL database holding {held} runs (all finished but the "
        "~80 this run adds) and "
        "their checkpoints, plus the sweeps called once each. Each is shown with "
        "`EXPLAIN (ANALYZE, BUFFERS)` with the settings of the store's pooled connections "
        "(`plan_cache_mode = force_generic_plan`, `max_parallel_workers_per_gather = 0`; "
        "`list_runs` and `count_runs` plan each call for its values: `force_custom_plan`), "
        "with the arguments of its first call, inside a transaction rolled back afterwards.",
        "",
    ]
    body: list[str] = []
    try:
        for n, (sql, args) in enumerate(list(rec.seen.items())):
            name = f"grow_q{n}"
            kind = kind_of(sql)
            tr = conn.transaction()
            await tr.start()
            try:
                # the settings of the store's pooled connections (stores/_pg_connection.py);
                # listings and counts ask for a plan of their own values (_fetch_planned)
                await conn.execute(f"SET LOCAL plan_cache_mode = {plan_mode(kind)}")
                await conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
                await conn.execute(f"PREPARE {name} AS {sql}")
                vals = ", ".join(literal(a) for a in args)
                call = f"EXECUTE {name}({vals})" if args else f"EXECUTE {name}"
                rows = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {call}")
                plan = "\n".join(r[0] for r in rows)
                err = None
            except Exception as exc:  # a statement that cannot be prepared alone
                plan, err = "", f"{type(exc).__name__}: {exc}"
            finally:
                await tr.rollback()
                with contextlib.suppress(Exception):
                    await conn.execute(f"DEALLOCATE {name}")
            seq = sorted(set(re.findall(r"Seq Scan on (durably_\w+)", plan)))
            sizes = {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in seq}
            ms = re.search(r"Execution Time: ([\d.]+) ms", plan)
            item = {
                "kind": kind,
                "calls": rec.counts.get(sql, 0),
                "seq_scans": seq,
                "index": bool(re.search(r"Index (Only )?Scan|Bitmap Index Scan", plan)),
                "ms": float(ms.group(1)) if ms else None,
                "sql": " ".join(sql.split())[:200],
            }
            if err:
                item["error"] = err[:200]
            # a sequential scan of a table of a few rows is the right plan, not a missing index
            item["seq_scans"] = [t for t in seq if sizes[t] >= 1000]
            item["seq_small"] = {t: sizes[t] for t in seq if sizes[t] < 1000}
            seq = item["seq_scans"]
            report.append(item)
            small = ", ".join(f"{t} ({n} rows)" for t, n in item["seq_small"].items())
            verdict = (
                f"**sequential scan of {', '.join(seq)}**"
                if seq
                else ("index" if item["index"] else "no table scan")
            ) + (f"; sequential scan of the small {small}" if small else "")
            body += [
                f"### {kind}: {verdict}, {item['ms']} ms, {item['calls']} calls in the run",
                "",
                "```sql",
                " ".join(sql.split()),
                "```",
                "```",
                plan or f"(not explained: {err})",
                "```",
                "",
            ]
    finally:
        await conn.close()
    summary = ["| query | calls | plan | ms |", "| --- | --- | --- | --- |"]
    for it in report:
        plan = (
            "seq scan: " + ", ".join(it["seq_scans"])
            if it["seq_scans"]
            else ("index" if it["index"] else "no table scan")
        ) + "".join(f"; seq scan of {t} ({n} rows)" for t, n in it["seq_small"].items())
        summary.append(
            f"| {it['kind']}: `{it['sql'][:70].replace('|', '/')}…` | {it['calls']} | {plan} "
            f"| {it['ms']} |"
        )
    await asyncio.to_thread(out.write_text, "\n".join(lines + summary + [""] + body) + "\n")
    bad = [it for it in report if it["seq_scans"]]
    return {"queries": len(report), "sequential": bad, "explained": report, "out": str(out)}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--name", default="bench_durably_grown")
    p.add_argument("--workdir", default=".work")
    sub = p.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("seed")
    sp.add_argument("--runs", type=int, default=1_000_000)
    sp.add_argument("--k", type=int, default=5)
    sp.add_argument(
        "--last-workflow", default=None, help="half the seeded runs under this workflow name"
    )
    ep = sub.add_parser("explain")
    ep.add_argument("--k", type=int, default=5)
    ep.add_argument("--out", default=str(HERE / "grow-explain.md"))
    args = p.parse_args()
    prepare_workdir(args.workdir)
    t = make_target("postgres", args.name, Path.cwd())
    base: dict[str, Any] = {"side": "durably", "db": "postgres", "scenario": f"grow-{args.what}"}
    try:
        if args.what == "seed":

            async def go() -> dict[str, Any]:
                await reset_target(t)
                return await seed(t.url, args.runs, args.k, args.last_workflow)

            emit({**base, **asyncio.run(go())})
        else:
            emit({**base, **asyncio.run(explain(t.url, Path(args.out), args.k))})
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
