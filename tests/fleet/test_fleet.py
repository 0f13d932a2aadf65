"""Fleet tests: several engine processes and a producer share one PostgreSQL schema.

Workers are real processes (``app.py``), killed with SIGKILL and restarted;
the producer is this test process, an ``Engine(drive=False)`` that only
creates runs and sends signals. Effects go to a ledger outside the engine, one
line per execution with the pid that did it, and a ``VIOLATION`` line if a
step whose checkpoint had completed was executed again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import durably
from durably import RunStatus
from durably.testing import eventually
from on_redis.redis_fixtures import delete_prefix

from .app import (
    SIGNAL_ADD,
    WORKFLOWS,
    expected_fan,
    expected_signal,
    expected_steps,
    split_schema,
)

APP = Path(__file__).with_name("app.py")
ROOT = Path(__file__).resolve().parents[2]
LIVE = ("pending", "running", "suspended", "blocked")
NO_INPUT = frozenset({"where", "gated"})
REDIS_URL = "redis://127.0.0.1:6379/0"


# -- the processes ---------------------------------------------------------------------------


@dataclass
class Worker:
    """One engine process of the fleet."""

    name: str
    instance: str
    process: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-chars:]


@dataclass
class Fleet:
    """Spawns, kills and reaps the worker processes of one test."""

    url: str
    tmp: Path
    ledger: Path
    workers: list[Worker] = field(default_factory=list)
    spawned: int = 0
    transport: str = "db://"

    async def spawn(
        self,
        name: str,
        instance: str,
        *,
        namespace: str = "",
        poll: float = 0.05,
        reconcile: str = "",
        stall: str = "",
    ) -> Worker:
        self.spawned += 1
        log = self.tmp / f"{name}-{self.spawned}.log"
        env = dict(os.environ)
        env.update(
            FLEET_STORE=self.url,
            FLEET_LEDGER=str(self.ledger),
            FLEET_INSTANCE=instance,
            FLEET_NAMESPACE=namespace,
            FLEET_POLL=str(poll),
            FLEET_GATES=str(self.tmp),
            FLEET_RECONCILE=reconcile,
            FLEET_STALL=stall,
            FLEET_TRANSPORT=self.transport,
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
        )
        with log.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(APP), env=env, stdout=asyncio.subprocess.PIPE, stderr=err
            )
        worker = Worker(name, instance, process, log)
        self.workers.append(worker)
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
        except TimeoutError:
            line = b""
        assert line == b"ready\n", f"worker {name} did not start:\n{worker.log_tail()}"
        return worker

    async def kill(self, worker: Worker) -> None:
        worker.process.send_signal(signal.SIGKILL)
        await worker.process.wait()

    async def stop_all(self) -> None:
        for worker in self.workers:
            if worker.process.returncode is None:
                worker.process.send_signal(signal.SIGKILL)
        for worker in self.workers:
            await worker.process.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} (pid {w.pid}) ---\n{w.log_tail()}" for w in self.workers)


@asynccontextmanager
async def fleet(url: str, tmp: Path, transport: str = "db://") -> AsyncIterator[Fleet]:
    crew = Fleet(url, tmp, tmp / "ledger.txt", transport=transport)
    crew.ledger.touch()
    try:
        yield crew
    except BaseException:
        print(crew.logs())
        raise
    finally:
        await crew.stop_all()


# -- the producer ----------------------------------------------------------------------------


def producer(url: str, calls: list[str], **options: Any) -> durably.Engine:
    """An engine that only creates runs (``drive=False`` unless told
    otherwise): a workflow body called here records the run in ``calls`` and
    raises."""
    options.setdefault("drive", False)
    options.setdefault("transport", "db://")
    engine = durably.Engine(url, **options)

    def refuse(ctx: durably.WorkflowContext) -> None:
        calls.append(ctx.run_id)
        raise AssertionError("a drive=False engine executed a run")

    async def with_input(ctx: durably.WorkflowContext, value: Any) -> None:
        refuse(ctx)

    async def without_input(ctx: durably.WorkflowContext) -> None:
        refuse(ctx)

    for name in WORKFLOWS:
        engine.register(name, without_input if name in NO_INPUT else with_input)
    return engine


# -- the store and the ledger, read from outside ----------------------------------------------


class Observer:
    """A plain asyncpg connection on the test's schema, for counting statuses."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: Any = None

    async def __aenter__(self) -> Observer:
        dsn, schema = split_schema(self.url)
        self.conn = await asyncpg.connect(dsn, server_settings={"search_path": f'"{schema}"'})
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.close()

    async def counts(self) -> Counter[str]:
        rows = await self.conn.fetch("SELECT status, count(*) AS n FROM durably_runs GROUP BY 1")
        return Counter({row["status"]: row["n"] for row in rows})

    async def describe(self, run_ids: list[str]) -> str:
        """The rows and checkpoints of ``run_ids``, for a failure message."""
        lines = [f"now={int(time.time() * 1000)}"]
        for row in await self.conn.fetch(
            "SELECT id, status, namespace, wake_at, wake_requested_at, locked_by, "
            "locked_until, recovery_attempts, updated_at FROM durably_runs "
            "WHERE id = ANY($1::text[]) ORDER BY id",
            run_ids,
        ):
            lines.append(str(dict(row)))
            checkpoints = await self.conn.fetch(
                "SELECT c.seq, c.kind, c.status, c.output, (c.kind = 'child' AND NOT EXISTS "
                " (SELECT 1 FROM durably_runs r WHERE r.id = c.input::jsonb ->> 'run_id')"
                ") AS unborn FROM durably_checkpoints c WHERE c.run_id = $1 ORDER BY c.seq",
                row["id"],
            )
            lines.append(
                "    checkpoints: "
                + " ".join(f"{c['seq']}:{c['kind']}:{c['status']}" for c in checkpoints)
            )
            unborn = sum(1 for c in checkpoints if c["unborn"] and c["status"] == "pending")
            if unborn:
                lines.append(
                    f"    {unborn} child checkpoints name runs that do not exist: the parent "
                    "died between storing them and creating the children (see "
                    "test_a_fan_whose_spawner_died_before_creating_its_children_completes)"
                )
        for table in ("durably_signal_waiters", "durably_buffered_signals"):
            rows = await self.conn.fetch(f"SELECT * FROM {table} LIMIT 20")
            lines.append(f"{table}: {[dict(r) for r in rows]}")
        return "\n".join(lines)

    async def describe_live(self) -> str:
        rows = await self.conn.fetch(
            "SELECT id FROM durably_runs WHERE status = ANY($1::text[]) ORDER BY id LIMIT 20",
            list(LIVE),
        )
        return await self.describe([row["id"] for row in rows])

    async def live(self) -> int:
        counts = await self.counts()
        return sum(counts[s] for s in LIVE)

    async def wait_settled(self, total: int, timeout: float) -> Counter[str]:
        """Wait until ``total`` runs exist and none is live."""

        async def settled() -> Counter[str]:
            counts = await self.counts()
            assert sum(counts.values()) >= total, f"runs by status: {dict(counts)}"
            assert not any(counts[s] for s in LIVE), f"runs by status: {dict(counts)}"
            return counts

        try:
            return await eventually(
                settled, what=f"{total} runs, none live", timeout=timeout, interval=0.25
            )
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}\n{await self.describe_live()}") from None


@dataclass
class Ledger:
    executions: Counter[tuple[str, int]]
    violations: list[str]
    by_pid: Counter[int]
    pids: dict[tuple[str, int], set[int]]


def read_ledger(path: Path) -> Ledger:
    ledger = Ledger(Counter(), [], Counter(), {})
    for line in path.read_text().splitlines():
        if line.startswith("VIOLATION"):
            ledger.violations.append(line)
            continue
        run_id, seq, pid = line.split()
        key = (run_id, int(seq))
        ledger.executions[key] += 1
        ledger.by_pid[int(pid)] += 1
        ledger.pids.setdefault(key, set()).add(int(pid))
    return ledger


async def all_runs(engine: durably.Engine) -> dict[str, durably.Run]:
    runs: dict[str, durably.Run] = {}
    cursor: str | None = None
    while True:
        page = await engine.list_runs(limit=1000, cursor=cursor)
        runs.update((run.run_id, run) for run in page.runs)
        cursor = page.next_cursor
        if cursor is None:
            return runs


async def bounded(jobs: Iterable[Any], limit: int) -> None:
    """Await coroutines with at most ``limit`` in flight."""
    gate = asyncio.Semaphore(limit)

    async def one(job: Any) -> None:
        async with gate:
            await job

    await asyncio.gather(*(one(job) for job in jobs))


# -- 1. the fleet under SIGKILL ----------------------------------------------------------------

STEPS_RUNS = 1200
SIGNAL_RUNS = 400
FANS = 8
FAN_WIDTH = 50
KILLS = 4
# A child whose worker dies between its terminal settle and telling its parent
# leaves the parent to the reconcile fallback (see the xfail test below); the
# default 5 minutes would outlast the test.
RECONCILE = "5s"


@pytest.fixture(params=["db", "redis"])
async def fleet_transport(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The fleet's transport: ``db://``, or Redis under a prefix of the test's own."""
    if request.param == "db":
        yield "db://"
        return
    prefix = f"durably-chaos-{uuid.uuid4().hex[:10]}"
    yield f"{REDIS_URL}?prefix={prefix}"
    await delete_prefix(REDIS_URL, prefix)


@pytest.mark.slow
async def test_fleet_of_three_survives_sigkill(
    postgres_url: str, tmp_path: Path, fleet_transport: str
) -> None:
    """Three workers and a producer on one schema (and, on Redis, one prefix);
    workers are SIGKILLed and restarted (same stable id or a fresh one) while
    ~2,000 runs of steps, durable sleeps, signals and fan-outs execute. Every
    run completes with the right output, no completed step runs again, and all
    three did work. The producer never executes (on Redis it never consumes either)."""
    calls: list[str] = []
    never = {"consumers": "never"} if fleet_transport != "db://" else {}
    client = producer(postgres_url, calls, transport=fleet_transport, **never)
    await client.open()  # the schema exists before the workers race to migrate it
    try:
        await _run_the_fleet(client, calls, postgres_url, tmp_path, fleet_transport)
    finally:
        await client.close()


async def _run_the_fleet(
    client: durably.Engine,
    calls: list[str],
    postgres_url: str,
    tmp_path: Path,
    transport: str = "db://",
) -> None:
    rng = random.Random()
    began = time.monotonic()
    crew_of = fleet(postgres_url, tmp_path, transport)
    async with crew_of as crew, Observer(postgres_url) as store:
        slots = list(
            await asyncio.gather(
                *(crew.spawn(f"w{i}", f"fleet-{i}", reconcile=RECONCILE) for i in range(3))
            )
        )
        initial = [w.pid for w in slots]
        jobs: list[tuple[str, int, str]] = [
            *(("steps", i, f"steps-{i:04}") for i in range(STEPS_RUNS)),
            *(("signal", i, f"signal-{i:04}") for i in range(SIGNAL_RUNS)),
            *(("fan", FAN_WIDTH, f"fan-{i}") for i in range(FANS)),
        ]
        rng.shuffle(jobs)
        total = STEPS_RUNS + SIGNAL_RUNS + FANS * (1 + FAN_WIDTH)
        kills: list[str] = []

        async def produce() -> None:
            await bounded((client.start(wf, n, run_id=rid) for wf, n, rid in jobs), 16)
            print(f"{len(jobs)} runs created in {time.monotonic() - began:.1f}s", flush=True)
            # Signals go out while the workers run (and die): some reach a
            # waiter, some wait in the buffer for theirs.
            tokens = [f"sig:signal-{i:04}" for i in range(SIGNAL_RUNS)]
            rng.shuffle(tokens)
            for start in range(0, len(tokens), 20):
                await asyncio.gather(
                    *(client.signal(t, {"add": SIGNAL_ADD}) for t in tokens[start : start + 20])
                )
                await asyncio.sleep(0.05)

        async def chaos() -> None:
            # Let every initial worker pick up work from its own poll first
            # (bounded: the final assertion says so if one never did).
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if all(read_ledger(crew.ledger).by_pid[pid] for pid in initial):
                    break
                await asyncio.sleep(0.1)
            for k in range(KILLS):
                await asyncio.sleep(rng.uniform(1.0, 2.0))
                slot = rng.randrange(len(slots))
                live = await store.live()
                victim = slots[slot]
                await crew.kill(victim)
                # Alternate the stable id (reclaims its runs at once) with a
                # fresh one (its predecessor's runs wait out the lease).
                instance = f"fleet-{slot}" if k % 2 == 0 else ""
                slots[slot] = await crew.spawn(f"w{slot}", instance, reconcile=RECONCILE)
                kills.append(
                    f"t={time.monotonic() - began:.1f}s SIGKILL {victim.name} pid {victim.pid} "
                    f"with {live} runs live; restarted as pid {slots[slot].pid} "
                    f"{'same id' if instance else 'fresh id'}"
                )
                print(kills[-1], flush=True)

        await asyncio.gather(produce(), chaos())
        counts = await store.wait_settled(total, timeout=60)
        elapsed = time.monotonic() - began

        assert dict(counts) == {"completed": total}
        runs = await all_runs(client)
        expected: dict[str, int] = {}
        effects: list[tuple[str, int]] = []
        for wf, n, rid in jobs:
            if wf == "steps":
                expected[rid] = expected_steps(n)
                effects += [(rid, 0), (rid, 2)]
            elif wf == "signal":
                expected[rid] = expected_signal(n)
                effects += [(rid, 0), (rid, 2)]
            else:
                expected[rid] = expected_fan(FAN_WIDTH)
                effects.append((rid, FAN_WIDTH))
                for i in range(FAN_WIDTH):
                    expected[f"{rid}.child.{i}"] = i
                    effects.append((f"{rid}.child.{i}", 0))
        assert set(runs) == set(expected)
        wrong = [
            (rid, run.status.value, run.output, expected[rid])
            for rid, run in runs.items()
            if run.status is not RunStatus.COMPLETED or run.output != expected[rid]
        ]
        assert wrong == []

        ledger = read_ledger(crew.ledger)
        assert ledger.violations == [], f"completed steps executed again: {ledger.violations[:5]}"
        missing = [key for key in effects if ledger.executions[key] == 0]
        assert missing == []
        assert set(ledger.executions) == set(effects)
        assert calls == [], "the producer (drive=False) executed a run body"
        assert os.getpid() not in ledger.by_pid, "the producer executed a step"
        assert set(ledger.by_pid) <= {w.pid for w in crew.workers}
        assert len(kills) == KILLS
        rerun = sum(1 for n in ledger.executions.values() if n > 1)
        labels = {w.pid: f"{w.name}/{w.instance or 'fresh'}" for w in crew.workers}
        split = {f"{labels[pid]} pid {pid}": n for pid, n in sorted(ledger.by_pid.items())}
        print(
            f"{total} runs, {sum(ledger.executions.values())} effects in {elapsed:.1f}s; "
            f"{len(kills)} SIGKILLs; {rerun} interrupted steps re-ran (never a completed one)"
        )
        print(f"effects per process: {split}")
        idle = [pid for pid in initial if ledger.by_pid[pid] == 0]
        assert idle == [], f"initial workers that did no work: {idle}; split {split}"


# -- 2. a producer never executes ----------------------------------------------------------------


async def test_a_drive_false_producer_never_executes(postgres_url: str, tmp_path: Path) -> None:
    """The producer creates runs, signals them and waits for them; only the
    worker executes: no body call here, every effect by the worker's pid."""
    calls: list[str] = []
    client = producer(postgres_url, calls)
    try:
        await client.open()
        async with fleet(postgres_url, tmp_path) as crew:
            for i in range(20):
                await client.start("steps", i, run_id=f"steps-{i}")
                await client.start("signal", i, run_id=f"signal-{i}")
            await client.start("fan", 5, run_id="fan")
            # Signals before any waiter exist: buffered, never executed here.
            for i in range(10):
                assert await client.signal(f"sig:signal-{i}", {"add": SIGNAL_ADD}) is None
            await client.start("steps", 0, run_id="steps-0")  # a start of a pending run
            await asyncio.sleep(1.0)
            counts = Counter(r.status.value for r in (await all_runs(client)).values())
            assert counts == {"pending": 41}, "runs moved with no worker running"
            assert calls == []

            worker = await crew.spawn("worker", "only-worker")
            for i in range(10, 20):  # delivered to a waiter, or buffered for it
                await client.signal(f"sig:signal-{i}", {"add": SIGNAL_ADD})
            results = await asyncio.gather(
                *(
                    client.wait_for_run(rid, terminal=True, timeout=30)
                    for rid in [f"steps-{i}" for i in range(20)]
                    + [f"signal-{i}" for i in range(20)]
                    + ["fan"]
                )
            )
            assert all(r.status is RunStatus.COMPLETED for r in results), results
            assert {r.run_id: r.output for r in results} == {
                **{f"steps-{i}": expected_steps(i) for i in range(20)},
                **{f"signal-{i}": expected_signal(i) for i in range(20)},
                "fan": expected_fan(5),
            }
            ledger = read_ledger(crew.ledger)
            assert ledger.violations == []
            assert set(ledger.by_pid) == {worker.pid}
            assert calls == []
    finally:
        await client.close()


# -- 3. a wake refused by a held lease --------------------------------------------------------


@pytest.mark.parametrize("sender_drives", [False, True], ids=["stamp", "refused-lease"])
async def test_a_wake_refused_by_a_held_lease_is_not_lost(
    postgres_url: str, tmp_path: Path, sender_drives: bool
) -> None:
    """Process A holds the run, mid-step, while the run also waits on a signal
    in a parallel branch. This process sends the signal: the wake cannot take
    the lease, so it stamps ``wake_requested_at``. When the step finishes, A
    must see the stamp and run one more turn, which receives the payload.

    A polls once (at start) and then not for 10 minutes, so the run can only
    complete through the holder's extra turn, not through a later poll.
    ``refused-lease``: the sender is a driving engine whose wake tries to
    lease the run and is refused; ``stamp``: a ``drive=False`` one.
    """
    calls: list[str] = []
    client = producer(postgres_url, calls)
    sender = producer(postgres_url, calls, drive=sender_drives)
    try:
        await client.start("gated", run_id="gated")
        async with fleet(postgres_url, tmp_path) as crew:
            await crew.spawn("holder", "holder", poll=600)

            async def parked() -> bool:
                if not (tmp_path / "gated.started").exists():
                    return False
                history = await client.history("gated")
                return any(c.kind == "signal" and c.status.value == "pending" for c in history)

            await eventually(
                parked, what="the step to start and the signal wait to register", timeout=20
            )
            run = await client.get_run("gated")
            assert run is not None and run.status is RunStatus.RUNNING
            assert run.locked_by == "holder" and run.wake_requested_at is None

            assert await sender.signal("gate:gated", {"approved": True}) == "gated"

            async def stamped() -> durably.Run | None:
                run = await client.get_run("gated")
                return run if run is not None and run.wake_requested_at is not None else None

            run = await eventually(stamped, what="the wake request to be stamped", timeout=5)
            assert run.status is RunStatus.RUNNING and run.locked_by == "holder"

            (tmp_path / "gated.go").touch()  # the step finishes; the turn goes quiescent
            result = await client.wait_for_run("gated", terminal=True, timeout=15)
            assert result.status is RunStatus.COMPLETED, result
            assert result.output == {"signal": {"approved": True}, "slow": "slow-done"}
            assert calls == []
    finally:
        await sender.close()
        await client.close()


# -- 4. namespaces ---------------------------------------------------------------------------


async def test_namespaces_keep_pools_apart(postgres_url: str, tmp_path: Path) -> None:
    """Two worker processes, ``namespace="a"`` and ``"b"``, on one schema:
    each executes only its own pool's runs (steps, timers, signals, children),
    and a pool left without workers is not served by the other."""
    calls: list[str] = []
    client = {ns: producer(postgres_url, calls, namespace=ns) for ns in "ab"}
    # A driving engine of a third pool sends the signals: its wakes of runs
    # of pools a and b must hand them back, never execute them here.
    sender = producer(postgres_url, calls, namespace="c", drive=True)
    ids: dict[str, list[str]] = {"a": [], "b": []}

    async def start_pool(ns: str) -> None:
        for i in range(10):
            await client[ns].start("where", run_id=f"{ns}-where-{i}")
            await client[ns].start("steps", i, run_id=f"{ns}-steps-{i}")
            await client[ns].start("signal", i, run_id=f"{ns}-signal-{i}")
            ids[ns] += [f"{ns}-where-{i}", f"{ns}-steps-{i}", f"{ns}-signal-{i}"]
        await client[ns].start("fan", 10, run_id=f"{ns}-fan")
        ids[ns] += [f"{ns}-fan", *(f"{ns}-fan.child.{i}" for i in range(10))]

    try:
        await client["a"].open()
        await client["b"].open()
        async with fleet(postgres_url, tmp_path) as crew:
            pool = {"a": await crew.spawn("pool-a", "pool-a", namespace="a")}
            await start_pool("b")
            await asyncio.sleep(1.5)
            runs = await all_runs(client["b"])
            taken = {rid: r.status.value for rid, r in runs.items() if r.status.value != "pending"}
            assert taken == {}, "pool a's worker took pool b's runs"
            assert read_ledger(crew.ledger).by_pid == {}, "pool a's worker executed b's steps"

            pool["b"] = await crew.spawn("pool-b", "pool-b", namespace="b")
            await start_pool("a")
            for ns in "ab":
                for i in range(10):
                    await sender.signal(f"sig:{ns}-signal-{i}", {"add": SIGNAL_ADD})
            async with Observer(postgres_url) as store:
                await store.wait_settled(len(ids["a"]) + len(ids["b"]), timeout=30)
            runs = await all_runs(client["a"])
            bad = [r for r in runs.values() if r.status is not RunStatus.COMPLETED]
            assert bad == []
            ledger = read_ledger(crew.ledger)
            assert ledger.violations == []
            for ns in "ab":
                for rid in ids[ns]:
                    assert runs[rid].namespace == ns
                    for (run_id, _seq), pids in ledger.pids.items():
                        if run_id == rid:
                            assert pids == {pool[ns].pid}, f"{rid} executed outside pool {ns}"
            assert set(ledger.by_pid) == {pool["a"].pid, pool["b"].pid}
            assert calls == []
            print(
                f"effects per pool: a={ledger.by_pid[pool['a'].pid]} "
                f"b={ledger.by_pid[pool['b'].pid]}"
            )
    finally:
        await sender.close()
        for engine in client.values():
            await engine.close()


async def test_retention_of_one_pool_keeps_other_pools_runs(postgres_url: str) -> None:
    """An engine of pool a with a retention must not delete pool b's runs."""
    pool_b = durably.Engine(postgres_url, namespace="b")
    pool_a = durably.Engine(postgres_url, namespace="a", retention=0.001)
    for engine in (pool_a, pool_b):
        engine.register("done", _done)
    try:
        await pool_b.start("done", run_id="b-done")
        assert (await pool_b.wait_for_run("b-done", terminal=True, timeout=10)).ok
        await asyncio.sleep(0.05)
        await pool_a.sweep_retention(force=True)
        assert await pool_b.get_run("b-done") is not None, "pool a's retention deleted b's run"
    finally:
        await pool_a.close()
        await pool_b.close()


async def test_stalled_hooks_of_one_pool_hear_only_its_runs(postgres_url: str) -> None:
    """An engine of pool a reports only pool a's stalled runs to its hooks."""
    pool_b = durably.Engine(postgres_url, namespace="b", reconcile=0, stalled_after=0.001)
    pool_a = durably.Engine(postgres_url, namespace="a", stalled_after=0.001)
    heard: list[str] = []
    heard_b: list[str] = []

    async def hook(run: durably.Run) -> None:
        heard.append(run.run_id)

    async def hook_b(run: durably.Run) -> None:
        heard_b.append(run.run_id)

    pool_a.on_stalled(hook)
    pool_b.on_stalled(hook_b)
    for engine in (pool_a, pool_b):
        engine.register("stranded", _stranded)
    try:
        await pool_b.open()
        await pool_b.start("stranded", run_id="b-stranded")  # waits for a signal nobody sends
        await pool_b.join()
        await asyncio.sleep(0.05)
        await pool_a.sweep_stalled(force=True)
        assert heard == [], "pool a's stalled hook heard of pool b's run"
        await pool_b.sweep_stalled(force=True)
        assert heard_b == ["b-stranded"]  # it is stalled, in pool b
    finally:
        await pool_a.close()
        await pool_b.close()


async def _done(ctx: durably.WorkflowContext) -> str:
    return "done"


async def _stranded(ctx: durably.WorkflowContext) -> Any:
    return await ctx.wait_for_signal("nobody-sends-it")


# -- a wake that races the holder's settle ------------------------------------------------------


class _LookHook:
    """A store proxy that runs ``hook`` when a refused ``start_turns`` is
    followed by a ``get_run``: it lets a test put the holder's settle exactly
    between the waker's refused lease and its look at the run."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.hook: Any = None
        self.refused = False
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def start_turns(self, run_ids: list[str], *args: Any, **kwargs: Any) -> Any:
        leased = await self.inner.start_turns(run_ids, *args, **kwargs)
        self.refused = any(run_id not in leased for run_id in run_ids)
        return leased

    async def get_run(self, run_id: str) -> Any:
        if self.refused and self.hook is not None:
            hook, self.hook = self.hook, None
            self.fired = True
            await hook()
        return await self.inner.get_run(run_id)


async def test_a_wake_racing_the_holders_settle_is_not_lost(postgres_url: str) -> None:
    """Engine B signals a run engine A holds; B's wake cannot lease it, and
    before B looks at the run again A's turn ends and suspends it (A saw no
    stamp yet). B must still wake it, not conclude that nobody holds it and
    drop the wake: the signal's checkpoint is complete and nothing else
    would wake the run before the 5-minute reconcile."""
    from durably.stores.postgres import PostgresStore

    gate, started = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        await gate.wait()
        return "slow-done"

    async def gated(ctx: durably.WorkflowContext) -> dict[str, Any]:
        payload, done = await asyncio.gather(
            ctx.wait_for_signal("race"), ctx.local_step("slow", slow)
        )
        return {"signal": payload, "slow": done}

    holder = durably.Engine(postgres_url, instance_id="holder")
    proxy = _LookHook(PostgresStore(postgres_url))
    waker = durably.Engine(proxy, instance_id="waker")
    for engine in (holder, waker):
        engine.register("gated", gated)
    try:
        await holder.start("gated", run_id="race")  # no worker loops: no polls at all

        async def parked() -> bool:
            history = await holder.history("race")
            return started.is_set() and any(c.kind == "signal" for c in history)

        await eventually(
            parked, what="the step to start and the signal wait to register", timeout=10
        )

        async def holder_settles() -> None:
            gate.set()

            async def suspended() -> bool:
                run = await proxy.inner.get_run("race")
                return run.status is RunStatus.SUSPENDED

            await eventually(suspended, what="the holder to suspend the run", timeout=10)

        proxy.hook = holder_settles
        assert await waker.signal("race", {"approved": True}) == "race"
        result = await waker.wait_for_run("race", terminal=True, timeout=5)
        assert proxy.fired, "the race was not staged"
        assert result.output == {"signal": {"approved": True}, "slow": "slow-done"}
    finally:
        await waker.close()
        await holder.close()


# -- a spawner or a reporter SIGKILLed at the worst moment --------------------------------------


async def _kill_when_stalled(crew: Fleet, worker: Worker, method: str) -> None:
    marker = crew.tmp / f"stalled.{method}"

    async def stalled() -> bool:
        return marker.exists()

    await eventually(stalled, what=f"the worker to reach {method}", timeout=20)
    await crew.kill(worker)


@pytest.mark.slow
async def test_a_fan_whose_spawner_died_before_creating_its_children_completes(
    postgres_url: str, tmp_path: Path
) -> None:
    """The worker running the fan's first turn stores the children's
    placeholders, then is SIGKILLed before the child runs are created. The
    recovered parent must create them (they exist nowhere) and complete."""
    calls: list[str] = []
    client = producer(postgres_url, calls)
    try:
        await client.start("fan", 5, run_id="fan")
        async with fleet(postgres_url, tmp_path) as crew:
            spawner = await crew.spawn("spawner", "spawner", stall="create_runs")
            await _kill_when_stalled(crew, spawner, "create_runs")
            history = await client.history("fan")
            assert [c.kind for c in history] == ["child"] * 5  # the placeholders are stored
            assert await client.get_run("fan.child.0") is None  # the children are not
            await crew.spawn("rescuer", "spawner")  # the same id: reclaims the run at once
            result = await client.wait_for_run("fan", terminal=True, timeout=10)
            assert result.output == expected_fan(5)
    finally:
        await client.close()


@pytest.mark.slow
async def test_a_fan_whose_reporter_died_completes_promptly(
    postgres_url: str, tmp_path: Path
) -> None:
    """The fan's children finish their bodies, then their worker is SIGKILLed
    while writing their ends. A child records its end and tells its parent in
    one write (which also stamps the parent's wake), so no crash can leave a
    finished child whose parent was not told: the restarted worker replays
    the children, reports, and the parent completes long before its
    ``reconcile`` fallback (5 min)."""
    calls: list[str] = []
    client = producer(postgres_url, calls)
    try:
        await client.start("fan", 3, run_id="fan")
        async with fleet(postgres_url, tmp_path) as crew:
            reporter = await crew.spawn("reporter", "reporter", stall="end_child_runs")

            async def parent_suspended() -> bool:
                run = await client.get_run("fan")
                return run is not None and run.status is RunStatus.SUSPENDED

            await eventually(
                parent_suspended, what="the parent to suspend on its children", timeout=20
            )
            await _kill_when_stalled(crew, reporter, "end_child_runs")
            children = [await client.get_run(f"fan.child.{i}") for i in range(3)]
            # Killed while reporting: no child has recorded its end yet.
            assert all(c is not None and not c.status.is_terminal for c in children)
            await crew.spawn("rescuer", "reporter")
            result = await client.wait_for_run("fan", terminal=True, timeout=10)
            assert result.output == expected_fan(3)
    finally:
        await client.close()
