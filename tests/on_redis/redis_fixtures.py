"""Redis for tests: a prefix of the test's own on the shared server, or a
``redis-server`` of the test's own (on a free port, no persistence) that a
test may kill and restart without touching anyone else's."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import redis.asyncio as aioredis

REDIS_URL = "redis://127.0.0.1:6379/0"


async def delete_prefix(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        for pattern in (f"bull:{prefix}-*", f"{prefix}-*"):
            keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
            if keys:
                await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A fresh prefix on the shared server; its keys are deleted after."""
    prefix = f"durably-fleet-{uuid.uuid4().hex[:10]}"
    yield prefix
    await delete_prefix(REDIS_URL, prefix)


@pytest.fixture(params=["sqlite", "postgres"])
async def store_url(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> AsyncIterator[str]:
    """Each test once on SQLite and once on a PostgreSQL database of its own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'durably.db'}"
    else:
        async with isolated_postgres() as url:
            yield url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedis:
    """A redis-server this test started, on its own port; kill and restart it at will."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError("the test's redis-server did not start")

    def kill(self) -> None:
        """SIGKILL: everything it held in memory is gone."""
        process, self.process = self.process, None
        if process is not None:
            process.kill()
            process.wait()

    async def restart(self, down_for: float = 0.0) -> None:
        self.kill()
        await asyncio.sleep(down_for)
        self.start()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
