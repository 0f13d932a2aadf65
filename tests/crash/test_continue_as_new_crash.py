"""Continue-as-new survives a SIGKILL at each write of the hand-over.

Going from one link to the next writes twice: the next link's row (created
pending), then the old link's terminal write (``completed`` with
``{"continued_as": <next>}``). A process (``can_app.py``) kills itself with
SIGKILL at a chosen point — before the insert, between the two writes, or
after both — on the way from link 1 to link 2; another process (a fresh
lease owner, so the dead one's leases must expire first) takes over.

The chain must then continue exactly once: every link from the first to the
last exists once (no duplicate, no gap), every link but the last completed
handing over to the next, the last returns the right total, each link's
step effect ran (and none whose checkpoint had completed ran again).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

import durably
from durably import RunStatus

from .can_app import KILL_LINK, LINKS, expected_output

APP = Path(__file__).with_name("can_app.py")
ROOT = Path(__file__).resolve().parents[2]
_SPAWNED = itertools.count(1)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'can.db'}"
        return
    isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
        "isolated_postgres"
    )
    async with isolated() as url:
        yield url


def _spawn(
    store: str, ledger: Path, logs: Path, *, kill: str = "", instance: str = ""
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        CAN_STORE=store,
        CAN_LEDGER=str(ledger),
        CAN_KILL=kill,
        CAN_INSTANCE=instance,
        CAN_LEASE="1s",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]),
    )
    log = logs / f"can-{next(_SPAWNED)}.log"
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, str(APP)], env=env, stdout=subprocess.PIPE, stderr=err
        )


async def _wait_ready(proc: subprocess.Popen[bytes]) -> None:
    """Wait for the process's ``ready`` line (bounded only to fail with a message)."""
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=60)
    except TimeoutError:
        line = b""
    assert line == b"ready\n", f"the worker did not start: {line!r}"


def _links(root: str) -> list[str]:
    return [root] + [f"{root}~{k}" for k in range(1, LINKS + 1)]


@pytest.mark.parametrize("kill", ["before-create", "after-create", "after-settle"])
async def test_a_chain_continues_exactly_once_after_a_sigkill_mid_hand_over(
    store: str, kill: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    ledger.touch()
    client = durably.Engine(store, drive=False)

    @client.workflow("chain")
    async def chain(ctx: durably.WorkflowContext, state: dict[str, int]) -> int:
        raise AssertionError("the client process must not execute runs")  # pragma: no cover

    first = _spawn(store, ledger, tmp_path, kill=kill, instance="doomed")
    survivor: subprocess.Popen[bytes] | None = None
    try:
        await _wait_ready(first)
        await client.start("chain", {"n": 0, "acc": 5}, run_id="c")
        returncode = await asyncio.to_thread(first.wait, 60)
        assert returncode == -signal.SIGKILL, "the kill point was never reached"
        survivor = _spawn(store, ledger, tmp_path, instance="survivor")
        await _wait_ready(survivor)
        last = f"c~{LINKS}"
        deadline = asyncio.get_running_loop().time() + 120
        while await client.get_run(last) is None:
            assert asyncio.get_running_loop().time() < deadline, "the chain never reached its end"
            await asyncio.sleep(0.1)
        result = await client.wait_for_run(last, terminal=True, timeout=120)
        assert result.status is RunStatus.COMPLETED
        assert result.output == expected_output(5)
        for link in _links("c"):
            # A link killed before its terminal write settles once the dead
            # process's lease on it expires and the survivor replays it.
            await client.wait_for_run(link, terminal=True, timeout=120)
        page = await client.list_runs(limit=100)
        assert sorted(run.run_id for run in page.runs) == sorted(_links("c"))
        for link, following in itertools.pairwise(_links("c")):
            run = await client.get_run(link)
            assert run is not None and run.status is RunStatus.COMPLETED
            assert run.output == {"continued_as": following}
        lines = ledger.read_text().splitlines()
        violations = [line for line in lines if line.startswith("VIOLATION")]
        assert violations == [], f"completed steps executed again: {violations}"
        executions = Counter(line.split()[0] for line in lines)
        # Every link's step ran, and those of the links whose hand-over had
        # begun before the kill ran once: a link's results are durable before
        # the next link, built on them, exists. Only the link the doomed
        # process may have been executing at the kill (the new one) may have
        # run its step again, as any step interrupted before its checkpoint.
        again = {link for link, n in executions.items() if n > 1}
        assert set(executions) == set(_links("c")), lines
        assert again <= {_links("c")[KILL_LINK]}, lines
        # The links handed over before the kill ran in the doomed process.
        pids = {line.split()[0]: line.split()[2] for line in lines}
        assert all(pids[link] == str(first.pid) for link in _links("c")[:KILL_LINK]), lines
    finally:
        for proc in (first, survivor):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(proc.wait, 30)
        await client.close()
