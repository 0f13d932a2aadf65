"""Updates survive a SIGKILL around their handling.

A process (``upd_app.py``) executes a run that takes updates ``u1``…``u6``
(payloads 1…6) from a client in this test process, and kills itself with
SIGKILL while handling ``u3``: inside the handler, after the handler but
before its history entry and answer are written, or right after they were
committed. Another process (a fresh lease owner) takes over once the dead
one's lease expires.

Every update must then be applied exactly once (one history entry each, in
order; the handlers' state rebuilt on replay), and every caller gets its
answer — the one waiting on ``u3`` included — the same again when it retries
with the same ``update_id``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

import durably
from durably import RunStatus
from durably.model import CheckpointKind

from .upd_app import KILL_AT

APP = Path(__file__).with_name("upd_app.py")
ROOT = Path(__file__).resolve().parents[2]
_SPAWNED = itertools.count(1)
UPDATES = 6

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'upd.db'}"
        return
    isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
        "isolated_postgres"
    )
    async with isolated() as url:
        yield url


def _spawn(
    store: str, logs: Path, *, kill: str = "", instance: str = ""
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        UPD_STORE=store,
        UPD_KILL=kill,
        UPD_INSTANCE=instance,
        UPD_LEASE="1s",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]),
    )
    log = logs / f"upd-{next(_SPAWNED)}.log"
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, str(APP)], env=env, stdout=subprocess.PIPE, stderr=err
        )


async def _wait_ready(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=60)
    except TimeoutError:
        line = b""
    assert line == b"ready\n", f"the worker did not start: {line!r}"


async def _suspended(client: durably.Client, run_id: str) -> None:
    for _ in range(2400):
        run = await client.get_run(run_id)
        if run is not None and run.status is RunStatus.SUSPENDED:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{run_id} never suspended")


@pytest.mark.parametrize("kill", ["in-handler", "before-answer", "after-answer"])
async def test_an_update_is_applied_once_and_answered_after_a_sigkill(
    store: str, kill: str, tmp_path: Path
) -> None:
    first = _spawn(store, tmp_path, kill=kill, instance="doomed")
    survivor: subprocess.Popen[bytes] | None = None
    async with durably.Client(store=store) as client:
        try:
            await _wait_ready(first)
            await client.start("tally", run_id="t")
            await _suspended(client, "t")
            answers = {}
            for n in range(1, KILL_AT):
                answers[n] = await client.update("t", "add", n, update_id=f"u{n}", timeout=60)
            doomed = asyncio.ensure_future(
                client.update("t", "add", KILL_AT, update_id=f"u{KILL_AT}", timeout=120)
            )
            returncode = await asyncio.to_thread(first.wait, 60)
            assert returncode == -signal.SIGKILL, "the kill point was never reached"
            survivor = _spawn(store, tmp_path, instance="survivor")
            await _wait_ready(survivor)
            answers[KILL_AT] = await doomed
            for n in range(KILL_AT + 1, UPDATES + 1):
                answers[n] = await client.update("t", "add", n, update_id=f"u{n}", timeout=60)

            totals = [answers[n].result for n in range(1, UPDATES + 1)]
            assert all(answers[n].accepted for n in answers), answers
            assert totals == [sum(range(1, n + 1)) for n in range(1, UPDATES + 1)]
            for n in range(1, UPDATES + 1):
                again = await client.update("t", "add", n, update_id=f"u{n}", timeout=60)
                assert (again.outcome, again.result) == ("accepted", answers[n].result)
            history = await client.history("t")
            entries = [cp for cp in history if cp.kind == CheckpointKind.UPDATE]
            assert [cp.input["update_id"] for cp in entries] == [
                f"u{n}" for n in range(1, UPDATES + 1)
            ]
            await client.signal("done:t")
            handle = await client.get_handle("t")
            output = await handle.result(timeout=120)
            assert output == {
                "applied": list(range(1, UPDATES + 1)),
                "total": sum(range(1, UPDATES + 1)),
            }
        finally:
            for proc in (first, survivor):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.to_thread(proc.wait, 30)
