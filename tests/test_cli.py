"""The ``durably`` command line, run as a real subprocess against a temporary SQLite file."""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType

import pytest

import durably
from durably import CheckpointStatus, RunStatus
from durably._cli_worker import freeze_start_up_objects
from durably.testing import VirtualClock, eventually

APPS = Path(__file__).parent / "apps"
SRC = Path(__file__).resolve().parent.parent / "src"


def _cli_app() -> ModuleType:
    if str(APPS) not in sys.path:
        sys.path.insert(0, str(APPS))
    return importlib.import_module("cli_app")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DURABLY_DATABASE_URL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env["COLUMNS"] = "250"
    return env


def run_cli(
    *args: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m durably ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "durably", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=_env(),
        input=stdin,
        check=False,
    )


async def acli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """:func:`run_cli` for async tests (the event loop keeps running)."""
    return await asyncio.to_thread(run_cli, *args, cwd=cwd)


@pytest.fixture
def db(tmp_path: Path) -> str:
    """A store URL for a fresh SQLite file."""
    return f"sqlite:///{tmp_path / 'cli.db'}"


@asynccontextmanager
async def client(url: str, *, drive: bool = False) -> AsyncIterator[durably.Engine]:
    """An engine on ``url`` with the test app's workflows registered."""
    engine: durably.Engine = _cli_app().register(
        durably.Engine(url, drive=drive, poll_interval=0.05)
    )
    await engine.open()
    try:
        yield engine
    finally:
        await engine.close()


async def wait_until(
    engine: durably.Engine,
    run_id: str,
    check: Callable[[durably.Run, list[durably.Checkpoint]], bool],
    timeout: float = 30.0,
    worker: Worker | None = None,
) -> durably.Run:
    """Poll the store until ``check(run, history)`` holds; a timeout shows the
    run as last read and the worker's output."""

    async def holds() -> durably.Run:
        run = await engine.get_run(run_id)
        assert run is not None, f"no run {run_id}"
        assert check(run, await engine.history(run_id)), f"run is {run}"
        return run

    try:
        return await eventually(holds, what=f"run {run_id}", timeout=timeout, interval=0.05)
    except AssertionError as timed_out:
        log = worker.output() if worker is not None else ""
        raise AssertionError(f"{timed_out}\n{log}") from None


class Worker:
    """A ``durably worker --app APP`` subprocess (``cli_app:engine`` by default)."""

    def __init__(self, url: str, log: Path, *extra: str, app: str = "cli_app:engine") -> None:
        self.log = log
        self._out = log.open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "durably",
                "worker",
                "--app",
                app,
                "--store",
                url,
                "--interval",
                "0.1",
                *extra,
            ],
            cwd=APPS,
            env=_env(),
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    async def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; return the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return await self.wait(timeout)

    async def wait(self, timeout: float) -> int:
        """Wait for the process to exit; return its exit code."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the worker did not exit:\n{self.output()}")
            await asyncio.sleep(0.05)
        return self.process.returncode

    async def ready(self, timeout: float = 30.0) -> None:
        """Wait until the worker logged that it serves; fail if it exits first."""
        deadline = time.monotonic() + timeout
        while "serving" not in self.output():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the worker is not serving:\n{self.output()}")
            await asyncio.sleep(0.05)

    def output(self) -> str:
        """What the worker logged."""
        self._out.flush()
        return self.log.read_text()

    def close(self) -> None:
        """Kill the worker if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._out.close()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start ``durably worker`` subprocesses; any left running are killed afterwards."""
    started: list[Worker] = []

    def start(url: str, *extra: str, app: str = "cli_app:engine") -> Worker:
        worker = Worker(url, tmp_path / f"worker-{len(started)}.log", *extra, app=app)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


# -- runs list / show ---------------------------------------------------------------------


async def test_runs_list_shows_runs_filters_and_pages(db: str) -> None:
    clock = VirtualClock()  # distinct created_at, so the order is certain
    engine: durably.Engine = _cli_app().register(durably.Engine(db, drive=False, clock=clock))
    try:
        for n in range(3):
            await engine.start(
                "approval", f"o{n}", run_id=f"run-{n}", tags=["blue" if n == 1 else "red"]
            )
            clock.advance("1s")
        await engine.cancel("run-2")
    finally:
        await engine.close()

    out = (await acli("runs", "list", "--store", db)).stdout
    assert all(f"run-{n}" in out for n in range(3))
    assert "pending" in out
    assert "cancelled" in out
    assert "approval" in out
    assert out.index("run-2") < out.index("run-1") < out.index("run-0")  # newest first

    out = (await acli("runs", "list", "--store", db, "--tag", "blue")).stdout
    assert "run-1" in out
    assert "run-0" not in out
    assert "run-2" not in out

    out = (await acli("runs", "list", "--store", db, "--status", "cancelled")).stdout
    assert "run-2" in out
    assert "run-0" not in out

    out = (await acli("runs", "list", "--store", db, "--workflow", "slow")).stdout
    assert "No runs match" in out

    first = await acli("runs", "list", "--store", db, "--limit", "2")
    assert first.returncode == 0
    assert "run-2" in first.stdout
    assert "run-1" in first.stdout
    assert "run-0" not in first.stdout
    match = re.search(r"^next cursor: (\S+)$", first.stdout, re.MULTILINE)
    assert match is not None, first.stdout
    second = await acli("runs", "list", "--store", db, "--limit", "2", "--cursor", match.group(1))
    assert "run-0" in second.stdout
    assert "run-1" not in second.stdout
    assert "next cursor" not in second.stdout

    data = json.loads((await acli("runs", "list", "--store", db, "--json")).stdout)
    assert [r["run_id"] for r in data["runs"]] == ["run-2", "run-1", "run-0"]
    assert data["next_cursor"] is None
    assert data["runs"][0]["status"] == "cancelled"


async def test_store_comes_from_the_environment_by_default(tmp_path: Path) -> None:
    async with client(f"sqlite:///{tmp_path / 'durably.db'}") as engine:
        await engine.start("approval", "o1", run_id="from-default-file")
    # No --store, no DURABLY_DATABASE_URL: ./durably.db in the working directory.
    result = await acli("runs", "list", cwd=tmp_path)
    assert "from-default-file" in result.stdout


async def test_runs_show_prints_the_timeline(db: str) -> None:
    async with client(db, drive=True) as engine:
        await engine.start_worker()
        await engine.start("pipeline", "o7", run_id="pipe-1", tags=["t1"])
        result = await engine.wait_for_run("pipe-1", terminal=True, timeout=30)
        assert result.ok, result

    shown = await acli("runs", "show", "pipe-1", "--store", db)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "pipe-1" in out
    assert "pipeline" in out
    assert "completed" in out
    assert "stored o7" in out  # the run's output
    for column in ("SEQ", "NAME", "KIND", "STATUS", "STARTED", "FINISHED", "DURATION"):
        assert column in out
    lines = out.splitlines()
    fetch = next(line for line in lines if " fetch " in line)
    assert "local" in fetch
    assert "completed" in fetch
    assert '{"order":"o7","items":3}' in fetch
    assert any(" sleep " in line for line in lines)
    assert any(" store " in line for line in lines)
    assert out.index(" fetch ") < out.index(" sleep ") < out.index(" store ")

    data = json.loads((await acli("runs", "show", "pipe-1", "--store", db, "--json")).stdout)
    assert data["run"]["status"] == "completed"
    assert [c["name"] for c in data["checkpoints"]] == ["fetch", "sleep", "store"]
    assert all(c["status"] == "completed" for c in data["checkpoints"])


async def test_runs_list_and_show_say_why_a_run_is_blocked(db: str) -> None:
    clock = VirtualClock()
    producer = _cli_app().register(durably.Engine(db, clock=clock, consumers="never"))
    # An instance of an older release: it lacks every workflow of the app.
    old = durably.Engine(db, clock=clock)

    @old.workflow("legacy")
    async def legacy(ctx: durably.WorkflowContext) -> None:
        return None

    async with producer, old:
        await producer.start("pipeline", "o7", run_id="pipe-1")
        clock.advance("31s")  # nobody took it for a lease
        await old.tick()
        run = await old.get_run("pipe-1")
        assert run is not None and run.status is durably.RunStatus.BLOCKED, run

    listed = await acli("runs", "list", "--status", "blocked", "--store", db)
    assert listed.returncode == 0, listed.stderr
    assert "pipe-1" in listed.stdout and "blocked" in listed.stdout
    shown = await acli("runs", "show", "pipe-1", "--store", db)
    assert shown.returncode == 0, shown.stderr
    assert "Blocked" in shown.stdout
    assert "no instance that registers workflow 'pipeline'" in shown.stdout
    assert "Error" not in shown.stdout


# -- signal / cancel ----------------------------------------------------------------------


async def test_signal_reaches_a_run_waiting_in_a_worker(
    db: str, workers: Callable[..., Worker]
) -> None:
    async with client(db) as engine:
        worker = workers(db, "--instance-id", "cli-test-worker")
        await engine.start("approval", "o42", run_id="approve-me")
        await wait_until(
            engine,
            "approve-me",
            lambda run, cps: (
                run.status is RunStatus.SUSPENDED and any(cp.kind == "signal" for cp in cps)
            ),
        )
        sent = await acli("signal", "approve:o42", '{"ok": true, "by": "ada"}', "--store", db)
        assert sent.returncode == 0, sent.stderr
        assert "delivered" in sent.stdout
        assert "approve-me" in sent.stdout
        run = await wait_until(
            engine, "approve-me", lambda run, _: run.status.is_terminal, worker=worker
        )
        assert run.status is RunStatus.COMPLETED, worker.output()
        assert run.output == {"order": "o42", "decision": {"ok": True, "by": "ada"}}
        assert await worker.stop() == 0, worker.output()
    assert "cli-test-worker" in worker.output()


def test_signal_without_a_waiter_is_buffered_and_reads_stdin(db: str, tmp_path: Path) -> None:
    (tmp_path / "cli.db").touch()
    sent = run_cli("signal", "nobody:waits", "-", "--store", db, stdin='{"n": 1}')
    assert sent.returncode == 0, sent.stderr
    assert "buffered" in sent.stdout


async def test_cancel_cancels_a_run(db: str) -> None:
    async with client(db) as engine:
        await engine.start("approval", "o1", run_id="doomed")

        result = await acli("cancel", "doomed", "--store", db)
        assert result.returncode == 0, result.stderr
        assert "cancelled run doomed (it was pending)" in result.stdout
        run = await engine.get_run("doomed")
        assert run is not None
        assert run.status is RunStatus.CANCELLED

        again = await acli("runs", "cancel", "doomed", "--store", db)
        assert again.returncode == 0
        assert "already cancelled" in again.stdout


# -- worker -------------------------------------------------------------------------------


async def test_worker_serves_the_steps_it_is_told_to(
    db: str, workers: Callable[..., Worker]
) -> None:
    async with client(db) as engine:
        worker = workers(db, "--steps", "greet", "--group", "front", "--concurrency", "2")
        await engine.start("greeting", "ada", run_id="greet-ada")
        run = await wait_until(
            engine, "greet-ada", lambda run, _: run.status.is_terminal, worker=worker
        )
        assert run.status is RunStatus.COMPLETED, worker.output()
        assert run.output == "hello ada"
        assert await worker.stop() == 0, worker.output()
    assert "steps greet" in worker.output()


def _steps_app() -> ModuleType:
    if str(APPS) not in sys.path:
        sys.path.insert(0, str(APPS))
    return importlib.import_module("steps_app")


@asynccontextmanager
async def step_driver(url: str) -> AsyncIterator[durably.Engine]:
    """An engine that drives runs of ``shouting`` on ``url`` and serves no step,
    so each ``shout`` it dispatches must be served by another process (db://)."""
    engine = durably.Engine(url, transport="db://", poll_interval=0.05, serve_steps=[])
    engine.workflow("shouting")(_steps_app().shouting)
    await engine.start_worker()
    try:
        yield engine
    finally:
        await engine.close()


async def test_worker_serves_the_steps_of_a_drive_false_app(
    db: str, workers: Callable[..., Worker]
) -> None:
    worker = workers(db, app="steps_app:engine")
    await worker.ready()
    async with step_driver(db) as engine:
        await engine.start("shouting", "hi", run_id="shout-1")
        run = await wait_until(
            engine, "shout-1", lambda run, _: run.status.is_terminal, worker=worker
        )
    assert run.status is RunStatus.COMPLETED, (run, worker.output())
    assert run.output == {"text": "HI!", "pid": worker.process.pid}  # served by the worker
    assert await worker.stop() == 0, worker.output()
    assert "steps shout" in worker.output()


async def test_worker_freezes_its_start_up_objects_unless_told_not_to(
    db: str, workers: Callable[..., Worker]
) -> None:
    frozen = workers(db, app="steps_app:engine")
    left_alone = workers(db, "--no-gc-freeze", app="steps_app:engine")
    await frozen.ready()
    await left_alone.ready()
    assert await frozen.stop() == 0, frozen.output()
    assert await left_alone.stop() == 0, left_alone.output()
    found = re.search(r"froze (\d+) start-up objects", frozen.output())
    assert found is not None, frozen.output()
    assert int(found.group(1)) > 1000  # the modules and registries, not a handful
    assert "froze" not in left_alone.output()


def test_freeze_start_up_objects_moves_the_live_objects_out_of_the_collector() -> None:
    try:
        assert freeze_start_up_objects() > 1000
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()  # the test process keeps its collector as it was


async def test_worker_no_drive_serves_steps_and_executes_no_run(
    db: str, workers: Callable[..., Worker]
) -> None:
    worker = workers(db, "--no-drive", app="steps_app:full_engine")
    await worker.ready()
    creator = durably.Engine(db, drive=False)
    creator.workflow("shouting")(_steps_app().shouting)
    await creator.open()  # only opened: it consumes nothing
    try:
        await creator.start("shouting", "ho", run_id="shout-2")
        await asyncio.sleep(1.5)  # 15 of the worker's ticks
        run = await creator.get_run("shout-2")
        assert run is not None
        assert run.status is RunStatus.PENDING, (run, worker.output())  # not driven by it
    finally:
        await creator.close()
    async with step_driver(db) as engine:
        run = await wait_until(
            engine, "shout-2", lambda run, _: run.status.is_terminal, worker=worker
        )
    assert run.status is RunStatus.COMPLETED, (run, worker.output())
    assert run.output == {"text": "HO!", "pid": worker.process.pid}
    assert await worker.stop() == 0, worker.output()
    assert "steps shout" in worker.output()


def test_worker_refuses_an_app_with_nothing_to_serve(tmp_path: Path) -> None:
    (tmp_path / "idle_app.py").write_text(
        "import durably\n"
        "producer = durably.Engine(consumers='never')\n"
        "no_steps = durably.Engine(drive=False)\n"
    )
    db = f"sqlite:///{tmp_path / 'idle.db'}"
    for app, extra in (
        ("idle_app:producer", ()),
        ("idle_app:no_steps", ()),
        ("cli_app:engine", ("--no-drive", "--steps", "")),
    ):
        cwd = APPS if app.startswith("cli_app") else tmp_path
        result = run_cli("worker", "--app", app, "--store", db, *extra, cwd=cwd)
        context = f"{app} {extra}: rc={result.returncode} stderr={result.stderr!r}"
        assert result.returncode == 2, context
        assert "nothing to serve" in result.stderr, context


def test_worker_refuses_steps_the_app_does_not_register(db: str, tmp_path: Path) -> None:
    result = run_cli(
        "worker", "--app", "cli_app:engine", "--store", db, "--steps", "greet,nope", cwd=APPS
    )
    assert result.returncode == 2
    assert "does not register: nope" in result.stderr


@pytest.mark.parametrize(
    ("workflow", "nap", "drain", "expected"),
    [
        pytest.param("slow", 60.0, "0.5", RunStatus.PENDING, id="handed-back"),
        pytest.param("slow-sync", 60.0, "0.5", RunStatus.PENDING, id="handed-back-sync-step"),
        pytest.param("slow", 1.0, "20", RunStatus.COMPLETED, id="finished"),
    ],
)
async def test_worker_drains_on_sigterm_mid_step(
    db: str,
    workers: Callable[..., Worker],
    workflow: str,
    nap: float,
    drain: str,
    expected: RunStatus,
) -> None:
    async with client(db) as engine:
        worker = workers(db, "--drain-timeout", drain)
        await engine.start(workflow, nap, run_id="mid-step")
        await wait_until(
            engine,
            "mid-step",
            lambda run, cps: (
                run.status is RunStatus.RUNNING
                and any(cp.name == "nap" and cp.status is CheckpointStatus.RUNNING for cp in cps)
            ),
        )
        # Within the drain bound (plus start-up slack), even for a step that
        # runs in a thread and cannot be interrupted.
        assert await worker.stop(timeout=15.0) == 0, worker.output()
        run = await engine.get_run("mid-step")
        assert run is not None
        assert run.status is expected, worker.output()
        assert run.locked_by is None
        assert "draining" in worker.output()
        assert "Traceback" not in worker.output()


# -- errors -------------------------------------------------------------------------------


def _error_cases(tmp: Path, db: str) -> list[tuple[list[str], int, str]]:
    garbage = tmp / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    return [
        (["signal", "tok", "{not json", "--store", db], 2, "not valid JSON"),
        (["runs", "show", "no-such-run", "--store", db], 1, "no run with id 'no-such-run'"),
        (["cancel", "no-such-run", "--store", db], 1, "no run with id 'no-such-run'"),
        (["runs", "list", "--store", "nosuch://host/db"], 2, "unknown store URL"),
        (["runs", "list", "--store", str(tmp / "absent.db")], 1, "no SQLite database"),
        (["runs", "list", "--store", f"sqlite:///{tmp}"], 1, "cannot open the store"),
        (["runs", "list", "--store", f"sqlite:///{garbage}"], 1, "cannot open the store"),
        (["runs", "list", "--store", db, "--status", "bogus"], 2, "bogus"),
        (["runs", "list", "--store", db, "--cursor", "%%%"], 2, "invalid cursor"),
        (["runs", "list", "--store", db, "--limit", "0"], 2, "--limit"),
        (["runs", "show"], 2, "RUN_ID"),
        (["no-such-command"], 2, "no-such-command"),
        (["worker", "--app", ":engine"], 2, "module:attribute"),
        (["worker", "--app", "cli_app:"], 2, "module:attribute"),
        (["worker", "--app", "no_such_module_xyz:engine"], 2, "no_such_module_xyz"),
        (["worker", "--app", "cli_app:missing"], 2, "has no attribute 'missing'"),
        (["worker", "--app", "cli_app:NOT_AN_ENGINE"], 2, "not a durably.Engine"),
        (["worker"], 2, "--app"),
    ]


def test_errors_are_one_line_without_a_traceback(tmp_path: Path, db: str) -> None:
    asyncio.run(_seed(db))
    cases = _error_cases(tmp_path, db)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda case: run_cli(*case[0], cwd=APPS), cases))
    for (args, code, message), result in zip(cases, results, strict=True):
        context = f"durably {' '.join(args)}: rc={result.returncode} stderr={result.stderr!r}"
        assert result.returncode == code, context
        assert "Traceback" not in result.stderr + result.stdout, context
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, context
        assert lines[0].startswith("durably: error: "), context
        assert message in lines[0], context


async def _seed(url: str) -> None:
    async with client(url) as engine:
        await engine.start("approval", "o1", run_id="seed")


def test_unreachable_postgres_is_one_line() -> None:
    result = run_cli("runs", "list", "--store", "postgresql://nobody:secret@127.0.0.1:1/none")
    assert result.returncode in (1, 2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stderr  # the password is never printed


def test_help_and_version() -> None:
    helped = run_cli("--help")
    assert helped.returncode == 0
    for command in ("worker", "runs", "signal", "cancel", "demo"):
        assert command in helped.stdout
    bare = run_cli()
    assert bare.returncode == 0
    assert "Commands:" in bare.stdout
    version = run_cli("--version")
    assert version.returncode == 0
    assert durably.__version__ in version.stdout


def test_errors_do_not_leak_a_traceback_for_a_broken_app(tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('boom at import')\n")
    result = run_cli("worker", "--app", "broken_app:engine", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "boom at import" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
