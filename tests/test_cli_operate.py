"""``durably start``, ``runs retry|resume|delete``, ``runs list --stale``,
``events publish``, ``--json`` and shell completion, each through the real
command in a subprocess (``python -m durably``), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
import pytest

import durably
from durably import RunStatus
from durably.cli import cli
from durably.testing import VirtualClock
from test_cli import (
    APPS,
    Worker,
    _cli_app,
    _env,
    acli,
    client,
    run_cli,
    wait_until,
)
from test_cli import workers as workers  # the fixture (an explicit re-export)

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def db(tmp_path: Path) -> str:
    """A store URL for a fresh SQLite file (created, as ``durably`` wants one that exists)."""
    (tmp_path / "cli.db").touch()
    return f"sqlite:///{tmp_path / 'cli.db'}"


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    return json.loads(result.stdout)


# -- durably start ------------------------------------------------------------------------


async def _start_then_a_worker_runs_it(url: str, workers: Callable[..., Worker]) -> None:
    first = as_json(
        await acli(
            "start", "pipeline", '"o7"', "--run-id", "p1", "--tag", "cli", "--priority", "2",
            "--json", "--store", url,
        )
    )  # fmt: skip
    assert first["created"] is True
    run = first["run"]
    assert (run["run_id"], run["workflow"], run["status"]) == ("p1", "pipeline", "pending")
    assert (run["input"], run["tags"], run["priority"]) == ("o7", ["cli"], 2)
    # No --version: unpinned until the first engine executing it pins its version.
    assert run["workflow_version"] == ""
    assert ISO.match(run["created_at"]), run["created_at"]
    # Idempotent by id: the second start keeps the first run and its input.
    again = as_json(await acli("start", "pipeline", '"other"', "--run-id", "p1", "--json",
                               "--store", url))  # fmt: skip
    assert again["created"] is False
    assert again["run"]["input"] == "o7"

    worker = workers(url, app="cli_app")  # --app MODULE means MODULE:engine
    async with client(url) as engine:
        done = await wait_until(engine, "p1", lambda r, _: r.status.is_terminal, worker=worker)
        assert done.status is RunStatus.COMPLETED, done
        assert done.output == "stored o7"
        assert done.workflow_version == "1"  # pinned by the worker that ran it
    assert await worker.stop() == 0


async def test_start_by_name_is_run_by_a_worker_on_sqlite(
    db: str, workers: Callable[..., Worker]
) -> None:
    await _start_then_a_worker_runs_it(db, workers)


async def test_start_by_name_is_run_by_a_worker_on_postgres(
    postgres_url: str, workers: Callable[..., Worker]
) -> None:
    async with client(postgres_url):
        pass  # creates the schema, as the application's first start does
    await _start_then_a_worker_runs_it(postgres_url, workers)


async def test_start_later_and_pinned_or_unpinned(db: str) -> None:
    later = as_json(await acli("start", "pipeline", "--start-at", "1h", "--json", "--store", db))
    run = later["run"]
    assert run["status"] == "suspended"
    wake = datetime.fromisoformat(run["wake_at"])
    created = datetime.fromisoformat(run["created_at"])
    assert wake - created == timedelta(hours=1)

    at = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S+00:00")
    dated = as_json(await acli("start", "slow", "1", "--start-at", at, "--json", "--store", db))
    assert dated["run"]["wake_at"].startswith(at[:19])

    # --version pins the run; without it the first engine executing it pins it.
    pinned = as_json(
        await acli("start", "greeting", '"a"', "--version", "7", "--json", "--store", db)
    )
    assert pinned["run"]["workflow_version"] == "7"
    unpinned = as_json(await acli("start", "greeting", '"b"', "--json", "--store", db))
    assert unpinned["run"]["workflow_version"] == ""


async def test_start_a_run_id_with_control_characters(db: str) -> None:
    evil = "evil\x1b]8;;http://x\x07\u202e"
    started = await acli("start", "pipeline", "--run-id", evil, "--store", db)
    assert started.returncode == 0, started.stderr
    assert "\x1b" not in started.stdout and "\u202e" not in started.stdout
    assert "evil\\x1b]8;;http://x\\x07\\u202e" in started.stdout
    data = as_json(await acli("start", "pipeline", "--run-id", evil, "--json", "--store", db))
    assert (data["run"]["run_id"], data["created"]) == (evil, False)  # JSON keeps the id exact
    listed = await acli("runs", "list", "--stale", "0s", "--store", db)
    assert "\x1b" not in listed.stdout and "evil\\x1b" in listed.stdout


async def test_start_through_the_app_checks_the_workflow(db: str) -> None:
    started = await acli("start", "pipeline", '"o1"', "--app", "cli_app", "--store", db, cwd=APPS)
    assert started.returncode == 0, started.stderr
    assert "started run" in started.stdout
    typo = await acli("start", "pipelin", "--app", "cli_app", "--store", db, cwd=APPS)
    assert typo.returncode == 2
    assert "registers no workflow 'pipelin'" in typo.stderr
    assert len(typo.stderr.splitlines()) == 1
    async with client(db) as engine:
        page = await engine.list_runs()
        assert [r.workflow for r in page.runs] == ["pipeline"]  # the typo made no run


# -- runs retry / resume / delete ---------------------------------------------------------


async def test_retry_resume_and_delete(db: str, workers: Callable[..., Worker]) -> None:
    worker = workers(db)
    await worker.ready()
    as_json(await acli("start", "complaint", '"cold soup"', "--run-id", "c1", "--json",
                       "--store", db))  # fmt: skip
    async with client(db) as engine:
        failed = await wait_until(engine, "c1", lambda r, _: r.status.is_terminal, worker=worker)
        assert failed.status is RunStatus.FAILED, failed

        retried = as_json(await acli("runs", "retry", "c1", "--json", "--store", db))
        assert retried["run"]["status"] == "pending"
        assert retried["run"]["error"] is None
        # The worker runs it again; the step fails again (a real retry, not a replay).
        again = await wait_until(
            engine,
            "c1",
            lambda r, h: r.status is RunStatus.FAILED and len(h) > 0,
            worker=worker,
        )
        assert again.error is not None

        refused = await acli("runs", "retry", "c1x", "--store", db)
        assert (refused.returncode, refused.stderr.count("\n")) == (1, 1)
        assert "no run with id 'c1x'" in refused.stderr

        resumed = as_json(await acli("runs", "resume", "c1", "--json", "--store", db))
        assert resumed == {"run_id": "c1", "was": "failed", "action": "finished"}
        text = await acli("runs", "resume", "c1", "--store", db)
        assert "durably runs retry" in text.stdout

        # A live run is not deleted; a finished one is, with its history.
        as_json(await acli("start", "approval", '"o9"', "--run-id", "a1", "--json",
                           "--store", db))  # fmt: skip
        await wait_until(engine, "a1", lambda r, _: r.status is RunStatus.SUSPENDED, worker=worker)
        live = await acli("runs", "delete", "a1", "--store", db)
        assert live.returncode == 1
        assert "cancel it before deleting it" in live.stderr
        deleted = as_json(await acli("runs", "delete", "c1", "--json", "--store", db))
        assert deleted == {"run_id": "c1", "deleted": True}
        assert await engine.get_run("c1") is None
        gone = await acli("runs", "delete", "c1", "--store", db)
        assert gone.returncode == 1
        assert "no run with id 'c1'" in gone.stderr
    assert await worker.stop() == 0


async def test_resume_wakes_a_waiting_run_and_unblocks_a_blocked_one(db: str) -> None:
    async with client(db, drive=True) as engine:
        await engine.start_worker()
        await engine.start("approval", "o1", run_id="waits")
        await wait_until(engine, "waits", lambda r, _: r.status is RunStatus.SUSPENDED)
    clock = VirtualClock(datetime.now(UTC))
    producer = _cli_app().register(durably.Engine(db, clock=clock, consumers="never"))
    old = durably.Engine(db, clock=clock)  # an older release: none of the app's workflows

    @old.workflow("legacy")
    async def legacy(ctx: durably.WorkflowContext) -> None:
        return None

    async with producer, old:
        await producer.start("pipeline", "o7", run_id="stuck")
        clock.advance("31s")
        await old.tick()
        blocked = await old.get_run("stuck")
        assert blocked is not None and blocked.status is RunStatus.BLOCKED, blocked

    woken = as_json(await acli("runs", "resume", "waits", "--json", "--store", db))
    assert woken == {"run_id": "waits", "was": "suspended", "action": "woken"}
    unblocked = as_json(await acli("runs", "resume", "stuck", "--json", "--store", db))
    assert unblocked["action"] == "unblocked"
    async with client(db) as engine:
        waits = await engine.get_run("waits")
        assert waits is not None and waits.wake_requested_at is not None  # due for a worker
        stuck = await engine.get_run("stuck")
        assert stuck is not None and stuck.status is RunStatus.PENDING and stuck.error is None
    queued = as_json(await acli("runs", "resume", "stuck", "--json", "--store", db))
    assert queued["action"] == "queued"


# -- runs list --stale --------------------------------------------------------------------


async def _seed_stale(url: str) -> None:
    """Three runs nothing moved for two hours: pending, waiting for a signal,
    waiting for an event; and a fresh pending one."""
    past = VirtualClock(datetime.now(UTC) - timedelta(hours=2))
    engine = _cli_app().register(durably.Engine(url, clock=past, poll_interval=0.05))
    async with engine:
        await engine.start("approval", "o1", run_id="wants-signal")
        await engine.start("await-event", "o2", run_id="wants-event")
        for run_id in ("wants-signal", "wants-event"):
            await wait_until(engine, run_id, lambda r, _: r.status is RunStatus.SUSPENDED)
    producer = _cli_app().register(durably.Engine(url, clock=past, consumers="never"))
    async with producer:
        await producer.start("pipeline", "o3", run_id="nobody-took-it")
        await producer.start("pipeline", "o8", run_id="orphan")
        # Its worker died holding it (twice now): the lease ran out long ago.
        changes = {
            "status": RunStatus.RUNNING,
            "locked_by": "worker-7",
            "locked_until": past.now_ms() + 30_000,
            "recovery_attempts": 2,
        }
        now = past.now_ms()
        assert await producer.store.update_run_if(
            "orphan", frozenset({RunStatus.PENDING}), changes, now
        )
    async with client(url) as fresh:
        await fresh.start("pipeline", "o4", run_id="just-started")


async def _stale_lists_idle_runs_with_hints(url: str) -> None:
    await _seed_stale(url)
    data = as_json(await acli("runs", "list", "--stale", "1h", "--json", "--store", url))
    by_id = {entry["run"]["run_id"]: entry for entry in data["stale"]}
    assert set(by_id) == {"wants-signal", "wants-event", "nobody-took-it", "orphan"}
    orphan = by_id["orphan"]
    assert orphan["recovery_attempts"] == 2
    assert "worker-7 stopped renewing the lease" in orphan["hint"]
    assert "recovered 2 time(s)" in orphan["hint"]
    pending = by_id["nobody-took-it"]
    assert pending["idle_seconds"] >= 7000
    assert pending["recovery_attempts"] == 0
    assert pending["oldest_pending_step"] is None
    assert "is a worker running" in pending["hint"]
    signal = by_id["wants-signal"]
    assert signal["oldest_pending_step"]["name"] == "signal:approve:o1"
    assert ISO.match(signal["oldest_pending_step"]["since"])
    assert "durably signal approve:o1" in signal["hint"]
    assert "durably events publish order.paid" in by_id["wants-event"]["hint"]

    table = await acli("runs", "list", "--stale", "1h", "--store", url)
    assert table.returncode == 0, table.stderr
    for column in ("IDLE", "RECOVERIES", "OLDEST PENDING STEP", "HINT"):
        assert column in table.stdout
    assert "just-started" not in table.stdout
    only = as_json(await acli("runs", "list", "--stale", "1h", "--status", "pending", "--json",
                              "--store", url))  # fmt: skip
    assert [e["run"]["run_id"] for e in only["stale"]] == ["nobody-took-it"]
    running = as_json(await acli("runs", "list", "--stale", "1h", "--status", "running", "--json",
                                 "--store", url))  # fmt: skip
    assert [e["run"]["run_id"] for e in running["stale"]] == ["orphan"]
    # The filters choose among every stale run before the page is cut.
    first = as_json(await acli("runs", "list", "--stale", "1h", "--status", "suspended",
                               "--limit", "1", "--json", "--store", url))  # fmt: skip
    assert [e["run"]["run_id"] for e in first["stale"]] == ["wants-event"]
    none = await acli("runs", "list", "--stale", "--store", url)  # default: 15m
    assert "nobody-took-it" in none.stdout
    quiet = await acli("runs", "list", "--stale", "3h", "--store", url)
    assert "No live run has been idle for 3h" in quiet.stdout


async def test_stale_runs_on_sqlite(db: str) -> None:
    await _stale_lists_idle_runs_with_hints(db)


async def test_stale_runs_on_postgres(postgres_url: str) -> None:
    await _stale_lists_idle_runs_with_hints(postgres_url)


# -- events publish -----------------------------------------------------------------------


async def test_events_publish_reaches_the_waiting_run(
    db: str, workers: Callable[..., Worker]
) -> None:
    worker = workers(db)
    as_json(await acli("start", "await-event", '"o5"', "--run-id", "e1", "--json",
                       "--store", db))  # fmt: skip
    async with client(db) as engine:
        await wait_until(engine, "e1", lambda r, _: r.status is RunStatus.SUSPENDED, worker=worker)
        other = as_json(await acli("events", "publish", "order.paid", '{"order": "o6"}',
                                   "--no-buffer", "--json", "--store", db))  # fmt: skip
        assert other == {"event": "order.paid", "id": None, "received": 0}
        sent = as_json(await acli("events", "publish", "order.paid",
                                  '{"order": "o5", "paid": 12}', "--id", "pay-1", "--json",
                                  "--store", db))  # fmt: skip
        assert sent["received"] == 1
        done = await wait_until(engine, "e1", lambda r, _: r.status.is_terminal, worker=worker)
        assert done.output == {"order": "o5", "paid": 12}
    repeat = await acli("events", "publish", "order.paid", '{"order": "o5"}', "--id", "pay-1",
                        "--store", db)  # fmt: skip
    assert repeat.returncode == 0, repeat.stderr
    assert "to 1 run(s)" in repeat.stdout  # idempotent: the first count, delivered once
    assert await worker.stop() == 0


# -- --json everywhere, errors, completion -------------------------------------------------


def _commands(group: click.Group, path: str = "durably") -> list[tuple[str, click.Command]]:
    found: list[tuple[str, click.Command]] = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += _commands(command, f"{path} {name}")
        else:
            found.append((f"{path} {name}", command))
    return found


def test_every_command_takes_json() -> None:
    commands = _commands(cli)
    assert len(commands) >= 15
    lacking = [
        path for path, command in commands if "as_json" not in {p.name for p in command.params}
    ]
    assert lacking == []


def _hostile_cases(tmp: Path, db: str) -> list[tuple[list[str], int, str]]:
    evil = "a\x1b[2Jb\nc"
    return [
        (["start", "pipeline", "{not json", "--store", db], 2, "input is not valid JSON"),
        (["start", "pipeline", "--store", "nosuch://x/y"], 2, "unknown store URL"),
        (["start", "pipeline", "--store", db, "--start-at", "soon"], 2, "--start-at"),
        (["start", "pipeline", "--store", db, "--start-at", "2030-01-01T09:00"], 2, "time zone"),
        (["start", "pipeline", "--store", db, "--run-id", ""], 2, "run_id"),
        (["start", "pipeline", "--store", db, "--priority", "high"], 2, "--priority"),
        (["start", "pipeline", "--app", "no_such_app_xyz", "--store", db], 2, "no_such_app_xyz"),
        (["runs", "retry", "nope", "--store", db], 1, "no run with id 'nope'"),
        (["runs", "resume", "nope", "--store", db], 1, "no run with id 'nope'"),
        (["runs", "delete", "nope", "--store", db], 1, "no run with id 'nope'"),
        (["runs", "retry", evil, "--store", db], 1, "no run with id 'a\\x1b[2Jb\\nc'"),
        (["runs", "list", "--stale", "soon", "--store", db], 2, "--stale"),
        (["events", "publish", "order.paid", "[1,", "--store", db], 2, "not valid JSON"),
        (["events", "publish", "", "--store", db], 2, "event"),
        (["events", "publish", "x", "--store", "postgresql://u:pw@127.0.0.1:1/x"], 1, "cannot"),
    ]


def test_hostile_input_is_one_line(tmp_path: Path, db: str) -> None:
    cases = _hostile_cases(tmp_path, db)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda case: run_cli(*case[0], cwd=APPS), cases))
        json_results = list(pool.map(lambda case: run_cli(*case[0], "--json", cwd=APPS), cases))
    for (args, code, message), result, result_json in zip(
        cases, results, json_results, strict=True
    ):
        context = f"durably {args!r}: rc={result.returncode} stderr={result.stderr!r}"
        assert result.returncode == code, context
        assert result.stdout == "", context
        assert "Traceback" not in result.stderr, context
        assert "\x1b" not in result.stderr, context
        assert "pw@" not in result.stderr, context
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, context
        assert lines[0].startswith("durably: error: "), context
        assert message in lines[0], context
        # The same failure with --json: one line of JSON, same exit code.
        assert result_json.returncode == code, result_json.stderr
        (line,) = result_json.stderr.strip().splitlines()
        error = json.loads(line)["error"]
        assert error["exit_code"] == code
        assert message in error["message"], error


async def _seed_for_completion(url: str) -> None:
    async with client(url) as engine:
        for run_id in ("order-1", "order-2", "other", "order-\x1b[2J"):
            await engine.start("approval", "o", run_id=run_id)


def test_shell_completion(db: str) -> None:
    asyncio.run(_seed_for_completion(db))

    def complete(words: str, cword: int) -> list[str]:
        env = {**_env(), "COMP_WORDS": words, "COMP_CWORD": str(cword),
               "_DURABLY_COMPLETE": "bash_complete"}  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "durably"], capture_output=True, text=True, env=env,
            timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return [line.split(",", 1)[1] for line in result.stdout.splitlines() if line]

    assert "start" in complete("durably st", 1)
    assert {"retry", "resume", "delete", "list", "show"} <= set(complete("durably runs ", 2))
    assert "--stale" in complete("durably runs list --st", 3)
    # Run ids from the store (the newest, by prefix); one with an escape is never offered.
    assert sorted(complete(f"durably runs show --store {db} ord", 5)) == ["order-1", "order-2"]
    assert complete("durably runs retry --store sqlite:///no/such.db ord", 5) == []
    script = subprocess.run(
        [sys.executable, "-m", "durably"],
        capture_output=True,
        text=True,
        env={**_env(), "_DURABLY_COMPLETE": "bash_source"},
        timeout=60,
        check=False,
    )
    assert "complete -o nosort -F" in script.stdout or "complete " in script.stdout


def test_worker_logs_json_lines(db: str, tmp_path: Path) -> None:
    env = _env()
    process = subprocess.Popen(
        [sys.executable, "-m", "durably", "worker", "--app", "cli_app", "--store", db, "--json"],
        cwd=APPS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        first = process.stderr.readline()
    finally:
        process.terminate()
        _, rest = process.communicate(timeout=60)
    lines = [first, *rest.splitlines()]
    records = [json.loads(line) for line in lines if line.strip()]
    assert any("serving" in r["message"] for r in records), records
    assert all(ISO.match(r["time"]) and r["level"] for r in records)
    assert process.returncode == 0
    assert os.environ.get("DURABLY_DATABASE_URL") != db  # the test did not leak its store
