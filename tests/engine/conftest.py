"""Fixtures for engine behaviour tests: every test runs on memory, SQLite and PostgreSQL.

PostgreSQL tables live in a fresh schema per test (``isolated_postgres`` in
``tests/conftest.py``), dropped at teardown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

import durably
from durably.testing import VirtualClock

EngineFactory = Callable[..., durably.Engine]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh store URL of each kind."""
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'durably.db'}"
    else:
        isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
            "isolated_postgres"
        )
        async with isolated() as url:
            yield url


@pytest.fixture
def clock() -> VirtualClock:
    """A clock that moves only when the test advances it."""
    return VirtualClock()


@pytest.fixture
async def make_engine(store_url: str) -> AsyncIterator[EngineFactory]:
    """Build engines on the test's store; all are closed at teardown.

    A memory store is shared by every engine the test builds, as a file would be.
    """
    engines: list[durably.Engine] = []
    shared: dict[str, Any] = {}

    def factory(**options: Any) -> durably.Engine:
        store: Any = options.pop("store", None)
        if store is None:
            if store_url == "memory://":
                store = shared.setdefault("memory", durably.Engine("memory://").store)
            else:
                store = store_url
        options.setdefault("poll_interval", 0.05)
        engine = durably.Engine(store, **options)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        await engine.close()
