"""``durably schedules …`` (the click group in ``durably._cli_schedules``), in process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

import durably
from durably._cli_schedules import schedules
from durably.testing import VirtualClock


def _app(url: str, clock: VirtualClock | None = None) -> durably.Engine:
    engine = durably.Engine(url, clock=clock, drive=False)

    @engine.workflow("report")
    async def report(ctx: durably.WorkflowContext, data: Any = None) -> Any:
        return data

    engine.schedule("nightly", "report", cron="0 3 * * *", tz="Europe/Paris", input={"x": 1})
    engine.schedule("often", "report", every="15m", overlap="allow")
    return engine


def _invoke(*args: str) -> Any:
    # The table is checked as piped output renders it (wide): a COLUMNS the
    # caller's environment sets (pytest-xdist sets 80) would fold its cells.
    runner = CliRunner(env={"COLUMNS": None})
    return runner.invoke(schedules, list(args), catch_exceptions=False)


def test_list_pause_resume_trigger_remove(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"

    async def setup() -> None:
        engine = _app(url)
        await engine.open()
        await engine.close()

    asyncio.run(setup())

    listed = _invoke("list", "--store", url)
    assert listed.exit_code == 0, listed.output
    assert "nightly" in listed.output and "0 3 * * * (Europe/Paris)" in listed.output
    assert "every 15m" in listed.output and "overlap=allow" in listed.output

    assert _invoke("pause", "nightly", "--store", url).output == "paused schedule nightly\n"
    data = json.loads(_invoke("list", "--store", url, "--json").output)
    assert {s["name"]: s["paused"] for s in data} == {"nightly": True, "often": False}
    assert "resumed schedule nightly" in _invoke("resume", "nightly", "--store", url).output

    triggered = _invoke("trigger", "often", "--store", url)
    assert "queued run sched:often:manual:" in triggered.output
    run_id = triggered.output.split()[2]

    async def worker_pass() -> Any:
        engine = _app(url)
        await engine.open()
        started = await engine.fire_schedules()
        run = await engine.get_run(run_id)
        await engine.close()
        return started, run

    started, run = asyncio.run(worker_pass())
    assert started == 1 and run is not None and run.workflow == "report"

    assert _invoke("remove", "often", "--store", url).output == "removed schedule often\n"
    missing = _invoke("remove", "often", "--store", url)
    assert missing.exit_code == 1 and "no schedule named 'often'" in missing.output
    unknown = _invoke("pause", "nope", "--store", url)
    assert unknown.exit_code == 1 and "no schedule named 'nope'" in unknown.output
    assert [s["name"] for s in json.loads(_invoke("list", "--store", url, "--json").output)] == [
        "nightly"
    ]


def test_list_with_no_schedules(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"

    async def setup() -> None:
        engine = durably.Engine(url, drive=False)
        await engine.open()
        await engine.close()

    asyncio.run(setup())
    assert _invoke("list", "--store", url).output == "No schedules.\n"
