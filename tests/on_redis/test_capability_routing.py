"""Capability routing against hand-written worker announcements (as a
TypeScript worker writes them): protocol ranges, required capabilities,
legacy workers without descriptors, and hashes that do not match.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import durably
from durably import RunStatus
from durably._remote.handshake import descriptor_hash
from durably.testing import eventually

from .redis_fixtures import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    name = f"durably-caps-{uuid.uuid4().hex[:10]}"
    yield name
    await delete_prefix(REDIS_URL, name)


async def announce(
    prefix: str, token: str, iid: str, descriptor: dict[str, Any] | None, *, good_hash: bool = True
) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        digest = descriptor_hash(descriptor) if descriptor and good_hash else "0000000000000000"
        beat = {"ts": 1_700_000_000_000, "status": "up", "descriptorHash": digest}
        await client.set(f"{prefix}-worker-heartbeat:{token}:{iid}", json.dumps(beat), ex=60)
        if descriptor is not None:
            await client.set(
                f"{prefix}-worker-descriptor:{token}:{iid}", json.dumps(descriptor), ex=60
            )
    finally:
        await client.aclose()


def ts_descriptor(iid: str, low: int, high: int, capabilities: list[str]) -> dict[str, Any]:
    return {
        "instanceId": iid,
        "runtime": "node",
        "sdk": {"name": "@durable/worker", "version": "3.0.0"},
        "protocol": {"version": high, "range": [low, high]},
        "capabilities": capabilities,
        "workflows": ["ts.flow"],
        "steps": [],
        "startedAt": 1,
    }


async def blocked_reason(tmp_path: Path, prefix: str, **register: Any) -> dict[str, Any]:
    engine = durably.Engine(
        f"sqlite:///{tmp_path / 'caps.db'}",
        transport=f"{REDIS_URL}?prefix={prefix}",
        poll_interval=0.05,
    )
    engine.remote_workflow("ts.flow", **register)
    async with engine:
        run_id = (await engine.start("ts.flow", None)).run_id

        async def blocked() -> durably.Run | None:
            run = await engine.get_run(run_id)
            return run if run is not None and run.status is RunStatus.BLOCKED else None

        run = await eventually(blocked, timeout=30)
        assert run.error is not None
        return run.error


async def test_a_worker_on_a_protocol_we_do_not_speak_blocks_the_run(
    tmp_path: Path, prefix: str
) -> None:
    await announce(prefix, "ts.flow", "ts-a-1", ts_descriptor("ts-a-1", 2, 3, ["signals"]))
    error = await blocked_reason(tmp_path, prefix, requires=["signals"])
    assert error["code"] == "protocol_incompatible"
    assert error["message"].startswith("blocked: no protocol-compatible worker")


async def test_a_worker_missing_a_capability_blocks_the_run_with_diagnostics(
    tmp_path: Path, prefix: str
) -> None:
    await announce(prefix, "ts.flow", "ts-b-1", ts_descriptor("ts-b-1", 1, 2, ["signals"]))
    error = await blocked_reason(tmp_path, prefix, requires=["saga", "signals"])
    assert error["message"] == "blocked: no compatible worker (requires saga, signals)"
    assert error["details"]["workers"] == {"ts-b-1": ["signals"]}


async def test_worker_health_flags_a_descriptor_whose_hash_does_not_match(
    tmp_path: Path, prefix: str
) -> None:
    await announce(prefix, "ts.flow", "ts-c-1", ts_descriptor("ts-c-1", 1, 1, []))
    await announce(prefix, "ts.flow", "ts-c-2", ts_descriptor("ts-c-2", 1, 1, []), good_hash=False)
    await announce(prefix, "legacy", "old-1", None)  # a legacy worker: a beat, no descriptor
    engine = durably.Engine("memory://", transport=f"{REDIS_URL}?prefix={prefix}")
    async with engine:
        health = await engine.worker_health()
    checks = {w["instance_id"]: w["descriptor_hash_ok"] for w in health["workers"]}
    assert checks == {"ts-c-1": True, "ts-c-2": False, "old-1": None}
