"""The replay checker: recorded histories against changed workflow code."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import durably
from durably._history import history_to_json
from durably.testing import TestEnv, assert_replayable
from durably.testing.replay import ReplayMismatch

APPS = Path(__file__).parent.parent / "apps"
EXECUTED: list[str] = []


def step(name: str) -> Any:
    def run() -> str:
        EXECUTED.append(name)
        return name

    return run


async def original(ctx: durably.WorkflowContext, order_id: str) -> str:
    await ctx.local_step("reserve", step("reserve"))
    await ctx.sleep("1d")
    await ctx.local_step("charge", step("charge"))
    return "done"


async def record(body: Any, *, finish: bool = False) -> dict[str, Any]:
    """Run ``body`` in a TestEnv (until it sleeps, or to the end) and export its history."""

    def register(engine: durably.Engine) -> None:
        engine.register("order", body)

    async with TestEnv(register) as env:
        run_id = await env.start("order", "o-1")
        if finish:
            await env.advance("1d")
        run = await env.engine.get_run(run_id)
        assert run is not None
        return history_to_json(run, await env.history(run_id))


async def test_an_unchanged_body_replays_without_executing_anything(tmp_path: Path) -> None:
    history = await record(original)
    path = tmp_path / "history.json"
    path.write_text(json.dumps(history))
    EXECUTED.clear()
    report = await assert_replayable(original, path)
    assert report.positions == 2 and report.run_id == history["run"]["run_id"]
    assert EXECUTED == []  # reserve came from the history; charge parked behind the sleep


async def test_a_step_inserted_before_recorded_ones_fails_naming_the_position() -> None:
    history = await record(original)

    async def inserted(ctx: durably.WorkflowContext, order_id: str) -> str:
        await ctx.local_step("reserve", step("reserve"))
        await ctx.local_step("fraud-check", step("fraud-check"))
        await ctx.sleep("1d")
        return "done"

    EXECUTED.clear()
    with pytest.raises(ReplayMismatch, match="position 1 holds sleep") as caught:
        await assert_replayable(inserted, history)
    assert caught.value.seq == 1
    assert caught.value.history == ("sleep", "sleep")
    assert caught.value.found == ("local", "fraud-check")
    assert EXECUTED == []


async def test_steps_added_after_the_recorded_history_pass() -> None:
    history = await record(original, finish=True)

    async def appended(ctx: durably.WorkflowContext, order_id: str) -> str:
        await ctx.local_step("reserve", step("reserve"))
        await ctx.sleep("1d")
        await ctx.local_step("charge", step("charge"))
        await ctx.local_step("receipt", step("receipt"))
        return "done"

    EXECUTED.clear()
    report = await assert_replayable(appended, history)
    assert report.positions == 3 and report.parked
    assert EXECUTED == []  # the new step parked instead of running


async def test_a_change_guarded_by_patched_passes() -> None:
    history = await record(original)

    async def patched(ctx: durably.WorkflowContext, order_id: str) -> str:
        await ctx.local_step("reserve", step("reserve"))
        if await ctx.patched("fraud-check"):
            await ctx.local_step("fraud-check", step("fraud-check"))
        await ctx.sleep("1d")
        await ctx.local_step("charge", step("charge"))
        return "done"

    await assert_replayable(patched, history)


async def test_a_recorded_step_removed_fails() -> None:
    history = await record(original, finish=True)

    async def shorter(ctx: durably.WorkflowContext, order_id: str) -> str:
        await ctx.local_step("reserve", step("reserve"))
        await ctx.sleep("1d")
        return "done"

    with pytest.raises(ReplayMismatch, match=r"position 2 holds local .charge.*ended before it"):
        await assert_replayable(shorter, history)


async def test_the_app_engine_replays_the_version_its_runs_are_pinned_to() -> None:
    history = await record(original)
    engine = durably.Engine("memory://")
    engine.register("order", original, version="1")
    await assert_replayable(engine, history)

    other = durably.Engine("memory://")
    other.register("order", original, version="2")
    with pytest.raises(ReplayMismatch, match=r"version .1.|not registered"):
        await assert_replayable(other, history)


async def test_bad_history_files_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read a history"):
        await assert_replayable(original, tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"run": {}}')
    with pytest.raises(ValueError, match="not a durably history"):
        await assert_replayable(original, tmp_path / "bad.json")
    history = await record(original)
    history["checkpoints"][0]["run_id"] = "someone-else"
    with pytest.raises(ValueError, match="belongs to another run"):
        await assert_replayable(original, history)


async def test_the_cli_exports_a_history_and_checks_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"

    def register(engine: durably.Engine) -> None:
        engine.register("order", original)

    async with TestEnv(register, store=url) as env:
        run_id = await env.start("order", "o-1")

    def durably_cli(*args: str, body: str = "original") -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "REPLAY_APP_BODY": body, "PYTHONPATH": str(APPS)}
        return subprocess.run(
            [sys.executable, "-m", "durably", *args],
            cwd=APPS,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    exported = durably_cli("runs", "export", run_id, "--store", url)
    assert exported.returncode == 0, exported.stderr
    path = tmp_path / "history.json"
    path.write_text(exported.stdout)
    assert [c["name"] for c in json.loads(exported.stdout)["checkpoints"]] == ["reserve", "sleep"]

    ok = durably_cli("replay-check", "--app", "replay_app:engine", str(path))
    assert ok.returncode == 0, ok.stderr
    assert f"ok {path}: run {run_id} (order v1) replays its 2 positions" in ok.stdout

    broken = durably_cli("replay-check", "--app", "replay_app:engine", str(path), body="inserted")
    assert broken.returncode == 1
    assert "position 1 holds sleep 'sleep' in history" in broken.stderr
    assert "now calls local 'fraud-check'" in broken.stderr

    missing = durably_cli("runs", "export", "nope", "--store", url)
    assert missing.returncode == 1 and "no run with id 'nope'" in missing.stderr


async def test_a_history_with_children_dispatched_steps_and_gather_replays_without_effects() -> (
    None
):
    served: list[str] = []

    def register(engine: durably.Engine) -> None:
        @engine.step("label")
        def label(order: str) -> str:
            served.append(order)
            return f"label {order}"

        @engine.workflow("child")
        async def child(ctx: durably.WorkflowContext, n: int) -> int:
            return n * 2

        @engine.workflow("order")
        async def order(ctx: durably.WorkflowContext, order_id: str) -> Any:
            doubled, tag = await asyncio.gather(
                ctx.child("child", 21, run_id=f"{ctx.run_id}:c"),
                ctx.local_step("tag", step("tag")),
            )
            printed = await ctx.step(label, order_id)
            await ctx.wait_for_signal(f"ship:{ctx.run_id}")
            return [doubled, tag, printed]

    async with TestEnv(register) as env:
        run_id = await env.start("order", "o-9")
        await env.assert_status(run_id, "suspended")  # waiting for the signal
        run = await env.engine.get_run(run_id)
        assert run is not None
        history = history_to_json(run, await env.history(run_id))
    assert [c["kind"] for c in history["checkpoints"]] == ["child", "local", "step", "signal"]

    EXECUTED.clear()
    served.clear()
    report = await assert_replayable(register, history)
    assert report.positions == 4 and report.parked
    assert EXECUTED == [] and served == []
