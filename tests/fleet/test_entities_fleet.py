"""Entities and updates across processes: two engine processes hammer one
entity on PostgreSQL; a caller in one process updates a run executing in another."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import durably
from durably.model import CheckpointKind

APP = Path(__file__).with_name("entity_app.py")
ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def engine_process(
    url: str, tmp: Path, name: str, **env_extra: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """One ``entity_app.py`` process, killed at the end (its log printed on failure)."""
    env = dict(os.environ)
    env.update(
        ENTITY_STORE=url,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
        **env_extra,
    )
    log = tmp / f"{name}.log"
    with log.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(APP),
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=60)
        assert line == b"ready\n", log.read_text(errors="replace")[-3000:]
        yield process
    except BaseException:
        print(f"--- {name} ---\n" + log.read_text(errors="replace")[-3000:])
        raise
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        await process.wait()


async def _replies(process: asyncio.subprocess.Process) -> list[int]:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout=300)
    assert line.startswith(b"replies "), line
    replies: list[int] = json.loads(line[len(b"replies ") :])
    return replies


async def test_an_entity_hammered_by_two_processes_counts_every_call_once(
    postgres_url: str, tmp_path: Path
) -> None:
    common = {"ENTITY_CALLS": "500", "ENTITY_OPS": "100"}
    async with (
        engine_process(postgres_url, tmp_path, "a", **common) as a,
        engine_process(postgres_url, tmp_path, "b", **common) as b,
    ):
        for process in (a, b):
            assert process.stdin is not None
            process.stdin.write(b"go\n")
            await process.stdin.drain()
        first, second = await asyncio.gather(_replies(a), _replies(b))

        replies = first + second
        assert len(replies) == 1000
        assert sorted(replies) == list(range(1, 1001))  # every caller a distinct reply
        async with durably.Client(store=postgres_url) as client:
            assert await client.get_entity_state("counter", "hot") == {"count": 1000}
            # History bounded: ten links of at most 100 operations each.
            link, applied, links = "entity:counter:hot", 0, 0
            while await client.get_run(link) is not None:
                links += 1
                history = await client.history(link)
                ops = [cp for cp in history if cp.kind == CheckpointKind.UPDATE]
                assert len(ops) <= 100
                applied += len(ops)
                link = f"entity:counter:hot~{links}"
            assert applied == 1000 and links >= 10


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_an_update_from_another_process_reaches_the_executing_engine(
    kind: str, postgres_url: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'fleet.db'}" if kind == "sqlite" else postgres_url
    async with (
        engine_process(url, tmp_path, "executor"),
        durably.Client(store=url, transport="db://") as client,
    ):
        await client.start("cart", run_id="cart-1")
        answers: list[Any] = []
        for item in ("apple", "pear", "fig"):
            answers.append(await client.update("cart-1", "add", item, timeout=60))
        assert [(a.outcome, a.result) for a in answers] == [
            ("accepted", 1),
            ("accepted", 2),
            ("accepted", 3),
        ]
        again = await client.update("cart-1", "add", "apple", update_id=answers[0].update_id)
        assert again.result == 1
        await client.signal("checkout:cart-1")
        handle = await client.get_handle("cart-1")
        assert await handle.result(timeout=60) == ["apple", "pear", "fig"]
        late = await client.update("cart-1", "add", "kiwi", timeout=60)
        assert late.outcome == "ended"
