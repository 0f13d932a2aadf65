"""The stores this repository runs the conformance suite against.

The suite itself ships in the package (:mod:`durably.testing.conformance`);
its plugin (loaded by ``-p`` in pyproject.toml's pytest options) builds the ``store`` fixture on
the ``store_factory`` defined here. To prove another store, add one backend to
``BACKENDS``: an async context manager that, given the test's fixture request,
yields a function making a fresh store object on one shared, empty database.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest

from durably.stores import MemoryStore, SqliteStore, StateStore
from durably.testing.conformance import StoreFactory, store_factory_from

Maker = Callable[[], StateStore]
Backend = Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[Maker]]


@asynccontextmanager
async def memory_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """Process-local: every "other" store object is the same one."""
    shared = MemoryStore()
    yield lambda: shared


@asynccontextmanager
async def sqlite_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """A fresh SQLite file; every store object opens it separately."""
    tmp_path: Path = request.getfixturevalue("tmp_path")
    url = f"sqlite:///{tmp_path / 'conformance.db'}"
    yield lambda: SqliteStore(url)


@asynccontextmanager
async def postgresql_backend(request: pytest.FixtureRequest) -> AsyncIterator[Maker]:
    """A fresh schema on the test server; every store object has its own pool."""
    from durably.stores.postgres import PostgresStore

    async with request.getfixturevalue("isolated_postgres")() as url:
        yield lambda: PostgresStore(url)


BACKENDS: dict[str, Backend] = {
    "memory": memory_backend,
    "sqlite": sqlite_backend,
    "postgresql": postgresql_backend,
}


@pytest.fixture(params=list(BACKENDS))
async def store_factory(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Make store objects sharing one empty database; all closed at teardown."""
    async with BACKENDS[request.param](request) as make, store_factory_from(make) as factory:
        yield factory
