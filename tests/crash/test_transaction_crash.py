"""A SIGKILL inside ``ctx.transaction`` keeps neither the app's row nor the checkpoint;
the recovered run then commits both, once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from durably import RunStatus
from durably.testing import eventually

from .tx_app import build

APP = Path(__file__).with_name("tx_app.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tx.db'}"
        return
    isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
        "isolated_postgres"
    )
    async with isolated() as url:
        yield url


async def _orders(engine: Any, store: str) -> list[str]:
    if store.startswith("sqlite"):
        import sqlite3

        path = store.removeprefix("sqlite:///")

        def read() -> list[str]:
            with sqlite3.connect(path) as conn:
                try:
                    return [r[0] for r in conn.execute("SELECT id FROM orders")]
                except sqlite3.OperationalError:  # the table was rolled back too
                    return []

        return await asyncio.to_thread(read)
    pool = engine.store._db.pool()
    async with pool.acquire() as conn:
        exists = await conn.fetchval("SELECT to_regclass('orders') IS NOT NULL")
        if not exists:
            return []
        return [r["id"] for r in await conn.fetch("SELECT id FROM orders")]


def _spawn(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, str(APP)], env=env, stderr=out, stdout=out)


async def test_a_kill_inside_a_transaction_keeps_neither_the_row_nor_the_checkpoint(
    store: str, tmp_path: Path
) -> None:
    marker = tmp_path / "inside"
    env = dict(os.environ)
    env.update(
        TX_STORE=store,
        TX_MARKER=str(marker),
        TX_HANG="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]),
    )
    proc = _spawn(env, tmp_path / "app.log")
    try:
        await eventually(
            lambda: marker.exists() or proc.poll() is not None,
            what="the app's INSERT to run inside the transaction",
            timeout=60,
        )
        assert proc.poll() is None, (tmp_path / "app.log").read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()

    engine = build(store, lease="1s", poll_interval=0.05)
    async with engine:
        assert await _orders(engine, store) == []
        history = await engine.history("order:o-1")
        assert history == []  # no checkpoint either: both or neither
        # The dead process's lease runs out; the run is recovered and retried.
        result = await engine.wait_for_run("order:o-1", terminal=True, timeout=60)
        assert result.status is RunStatus.COMPLETED, result
        assert result.output == 1
        assert await _orders(engine, store) == ["o-1"]
        [checkpoint] = await engine.history("order:o-1")
        assert (checkpoint.kind, checkpoint.status) == ("transaction", "completed")
