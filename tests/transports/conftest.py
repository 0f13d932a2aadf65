"""The transports this repository runs the transport conformance suite against.

The suite itself ships in the package
(:mod:`durably.testing.conformance.transports`) and asks for the
``transport_factory`` fixture defined here. To prove a new transport, add one
backend to ``TRANSPORTS``: an async context manager that, given the test's
fixture request, yields a function making another (opened) transport object
on the same medium; name it in ``INLINE`` too if it runs tasks inside
``dispatch``. In-process transports have no medium beyond the object, so their
"other" transport is the same one. Keyword options are for the ``db``
transport (``lease_ms``…); the others ignore them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from durably.stores import SqliteStore
from durably.testing.conformance import TransportFactory, transport_factory_from
from durably.testing.conformance import wait_until as wait_until  # for test modules here
from durably.transports.base import Transport
from durably.transports.local import LocalTransport
from durably.transports.memory import MemoryTransport

Maker = Callable[..., Awaitable[Transport]]
Backend = Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[Maker]]

DB_DEFAULTS: dict[str, Any] = {"redeliver_delay_ms": 50}
"""The db transport's options in tests: a handed-back task comes back soon."""


@asynccontextmanager
async def _shared(transport: Transport) -> AsyncIterator[Maker]:
    await transport.open()

    async def make(**_options: Any) -> Transport:
        return transport

    try:
        yield make
    finally:
        await transport.close()


@asynccontextmanager
async def memory_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """Inline: every "other" transport is the same object."""
    async with _shared(MemoryTransport()) as make:
        yield make


@asynccontextmanager
async def local_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """In-process queues: every "other" transport is the same object."""
    async with _shared(LocalTransport()) as make:
        yield make


@asynccontextmanager
async def _db_backend(new_store: Callable[[], Any]) -> AsyncIterator[Maker]:
    """Every transport has a store object of its own, as another process would."""
    from durably.transports.db import DbTransport

    made: list[tuple[Any, DbTransport]] = []

    async def make(**options: Any) -> Transport:
        store = new_store()
        await store.open()
        transport = DbTransport(store, **{**DB_DEFAULTS, **options})
        made.append((store, transport))
        await transport.open()
        return transport

    try:
        yield make
    finally:
        for store, transport in reversed(made):
            await transport.close()
            await store.close()


@asynccontextmanager
async def db_sqlite_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """``db://`` on a fresh SQLite file."""
    tmp_path: Path = request.getfixturevalue("tmp_path")
    url = f"sqlite:///{tmp_path / 'transport.db'}"
    async with _db_backend(lambda: SqliteStore(url)) as make:
        yield make


@asynccontextmanager
async def db_postgresql_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """``db://`` on a fresh PostgreSQL schema."""
    from durably.stores.postgres import PostgresStore

    async with (
        request.getfixturevalue("isolated_postgres")() as url,
        _db_backend(lambda: PostgresStore(url)) as make,
    ):
        yield make


# -- redis:// (BullMQ on the real server at 127.0.0.1:6379; scripts/test.sh starts it) ----
REDIS_TEST_URL = "redis://127.0.0.1:6379/0"
"""Shared with other test runs: every test uses a prefix of its own and deletes its keys."""
REDIS_DEFAULTS: dict[str, Any] = {"redeliver_delay_ms": 50}


@asynccontextmanager
async def redis_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """``redis://`` under a unique prefix; every transport is a separate object."""
    from durably.transports.redis import RedisTransport
    from on_redis.redis_fixtures import delete_prefix

    prefix = f"durably-test-{uuid.uuid4().hex[:12]}"
    made: list[RedisTransport] = []

    async def make(**options: Any) -> Transport:
        transport = RedisTransport(REDIS_TEST_URL, prefix=prefix, **{**REDIS_DEFAULTS, **options})
        made.append(transport)
        await transport.open()
        return transport

    try:
        yield make
    finally:
        for transport in reversed(made):
            await transport.close()
        await delete_prefix(REDIS_TEST_URL, prefix)


TRANSPORTS: dict[str, Backend] = {
    "memory": memory_backend,
    "local": local_backend,
    "db-sqlite": db_sqlite_backend,
    "db-postgresql": db_postgresql_backend,
    "redis": redis_backend,
}
DB_TRANSPORTS = ["db-sqlite", "db-postgresql"]
INLINE = {"memory"}
"""The transports of ``TRANSPORTS`` that run each task inside ``dispatch``."""


@pytest.fixture(params=list(TRANSPORTS))
async def transport_factory(request: pytest.FixtureRequest) -> AsyncIterator[TransportFactory]:
    """Make transports sharing one medium; all closed at teardown."""
    async with TRANSPORTS[request.param](request) as make:
        yield transport_factory_from(make, inline=request.param in INLINE)


@pytest.fixture(params=DB_TRANSPORTS)
async def db_factory(request: pytest.FixtureRequest) -> AsyncIterator[TransportFactory]:
    """Like ``transport_factory``, for the ``db`` transport only."""
    async with TRANSPORTS[request.param](request) as make:
        yield transport_factory_from(make)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A fresh key prefix on the test Redis; its keys are deleted afterwards."""
    # Imported here: it needs redis, which the other transports' tests run without.
    from on_redis.redis_fixtures import delete_prefix

    name = f"durably-test-{uuid.uuid4().hex[:12]}"
    yield name
    await delete_prefix(REDIS_TEST_URL, name)


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    """A client of the test Redis that decodes replies to ``str``."""
    import redis.asyncio as aioredis

    made = aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    yield made
    await made.aclose()
