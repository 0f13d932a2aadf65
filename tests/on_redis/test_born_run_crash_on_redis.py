"""A run born leased on the instance that started it on ``redis://`` (no
BullMQ job) survives a SIGKILL of that instance: the lease runs out and
another instance's recovery queues the run, which completes there."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import durably
from durably import RunStatus

from .redis_fixtures import REDIS_URL, delete_prefix
from .test_run_queue_on_redis import jobs_in

APP = Path(__file__).parents[1] / "crash" / "born_run_app.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    name = f"durably-born-{uuid.uuid4().hex[:10]}"
    yield name
    await delete_prefix(REDIS_URL, name)


@pytest.mark.slow
async def test_a_process_killed_holding_a_born_leased_run_on_redis_loses_it_to_another(
    tmp_path: Path, prefix: str
) -> None:
    db = tmp_path / "born.db"
    transport = f"{REDIS_URL}?prefix={prefix}"
    env = dict(os.environ)
    env.update(
        CRASH_DB=str(db),
        CRASH_INSTANCE="dying",
        CRASH_TRANSPORT=transport,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    with (tmp_path / "dying.log").open("wb") as err:
        app = await asyncio.create_subprocess_exec(
            sys.executable, str(APP), env=env, stdout=subprocess.PIPE, stderr=err
        )
        out, _ = await asyncio.wait_for(app.communicate(), timeout=120)
    assert app.returncode == -9, (tmp_path / "dying.log").read_text()
    assert out.decode().split() == ["lent"]
    with sqlite3.connect(db) as conn:
        status, locked_by = conn.execute(
            "SELECT status, locked_by FROM durably_runs WHERE id = 'b1'"
        ).fetchone()
    # Born leased to the dead process: never a job, and its lease still on.
    assert await jobs_in(prefix) == 0
    assert (status, locked_by) == ("running", "dying")

    rescuer = durably.Engine(
        f"sqlite:///{db}",
        transport=transport,
        instance_id="rescuer",
        lease="1s",
        poll_interval=0.05,
    )

    @rescuer.workflow("born")
    async def born(ctx: durably.WorkflowContext) -> str:
        return await ctx.local_step("die", lambda: "rescued")

    async with rescuer:
        result = await rescuer.wait_for_run("b1", terminal=True, timeout=60)
        run = await rescuer.get_run("b1")
    assert result.status is RunStatus.COMPLETED and result.output == "rescued"
    assert run is not None and run.recovery_attempts == 1
