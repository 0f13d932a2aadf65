"""Composition survives a SIGKILL: ``ctx.start_child`` creates each child once,
a saga's dispatched undos each run once across a kill mid-unwind, and a
batch of events loses and repeats no item across a kill between two items.

A process (``compose_app.py``) starts a parent and kills itself with SIGKILL
while its turn creates the children — after their placeholders are stored,
before or after their rows are inserted. This process then builds the same
engine under another lease owner and takes the parent over once the dead
one's lease expires. No child may be lost (each exists and ran) or doubled
(exactly the expected ids, each body run once).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from durably import RunStatus
from durably.testing import eventually

from .compose_app import KIDS, build

APP = Path(__file__).with_name("compose_app.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'compose.db'}"
        return
    isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
        "isolated_postgres"
    )
    async with isolated() as url:
        yield url


def _spawn(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:
        return subprocess.Popen([sys.executable, str(APP)], env=env, stderr=err)


async def _run_doomed(store: str, ledger: Path, tmp_path: Path, run: str, kill: str) -> None:
    env = dict(os.environ)
    env.update(
        COMPOSE_STORE=store,
        COMPOSE_LEDGER=str(ledger),
        COMPOSE_RUN=run,
        COMPOSE_KILL=kill,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]),
    )
    log = tmp_path / "doomed.log"
    proc = _spawn(env, log)
    try:
        returncode = await asyncio.to_thread(proc.wait, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == -signal.SIGKILL, f"the kill point was never reached:\n{log.read_text()}"


@pytest.mark.parametrize("kill", ["before-create", "after-create"])
@pytest.mark.parametrize("run", ["spawner-join", "spawner-forget"])
async def test_start_child_creates_each_child_once_across_a_sigkill(
    store: str, run: str, kill: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    ledger.touch()
    await _run_doomed(store, ledger, tmp_path, run, kill)
    survivor = build(store, str(ledger), lease="1s", instance_id="survivor")
    async with survivor:
        result = await survivor.wait_for_run("parent", terminal=True, timeout=120)
        assert result.status is RunStatus.COMPLETED, result.error
        kids = [f"kid-{n}" for n in range(KIDS)]
        for kid in kids:
            child = await survivor.wait_for_run(kid, terminal=True, timeout=120)
            assert child.status is RunStatus.COMPLETED, (kid, child.error)
        page = await survivor.list_runs(limit=100)
        history = await survivor.history("parent")
    assert sorted(r.run_id for r in page.runs) == sorted(["parent", *kids])
    assert result.output == (
        sum(10 * n for n in range(KIDS)) if run == "spawner-join" else "started"
    )
    runs = Counter(line.split()[1] for line in ledger.read_text().splitlines())
    assert runs == Counter(dict.fromkeys(kids, 1)), runs
    children = [cp for cp in history if cp.kind == "child"]
    assert [cp.input["run_id"] for cp in children] == kids


async def test_a_finished_dispatched_undo_does_not_run_again_after_a_sigkill_mid_unwind(
    store: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    ledger.touch()
    await _run_doomed(store, ledger, tmp_path, "saga", "after-first-undo")
    assert ledger.read_text().splitlines() == ["undo booked b"]
    survivor = build(store, str(ledger), lease="1s", instance_id="survivor")
    async with survivor:
        result = await survivor.wait_for_run("parent", terminal=True, timeout=120)
        history = await survivor.history("parent")
    assert result.status is RunStatus.FAILED and result.error is not None
    assert result.error["code"] == "sold_out"
    assert "compensation_failures" not in str(result.error.get("details"))
    assert ledger.read_text().splitlines() == ["undo booked b", "undo booked a"]
    undos = {cp.seq: (cp.name, cp.status.value, cp.attempts) for cp in history if cp.seq < 0}
    assert undos == {-2: ("unbook", "completed", 1), -3: ("unbook", "completed", 1)}


async def test_a_batch_of_events_loses_no_item_across_a_sigkill(store: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.txt"
    ledger.touch()
    await _run_doomed(store, ledger, tmp_path, "batch", "after-second-item")
    survivor = build(store, str(ledger), lease="1s", instance_id="survivor")
    async with survivor:
        assert await survivor.store.list_buffered_events("item") == []  # both were taken

        async def waiting() -> bool:
            history = {cp.seq: cp for cp in await survivor.history("parent")}
            return 3 in history and history[3].status.value == "pending"

        await eventually(waiting, timeout=120)  # the survivor took the run over
        assert await survivor.publish_event("item", 2) == 1
        result = await survivor.wait_for_run("parent", terminal=True, timeout=120)
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == [0, 1, 2]
