"""The stores every conformance test runs against.

To prove a new store, add one backend to ``BACKENDS``: an async context manager
that, given the test's fixture request, yields a function making a fresh store
object on one shared, empty database.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Protocol

import pytest

from durably.stores import MemoryStore, SqliteStore, StateStore

Maker = Callable[[], StateStore]
Backend = Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[Maker]]


class StoreFactory(Protocol):
    """Makes another store object on the same database as the test's ``store``."""

    async def __call__(self, *, opened: bool = True) -> StateStore: ...


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
    made: list[StateStore] = []
    async with BACKENDS[request.param](request) as make:

        async def factory(*, opened: bool = True) -> StateStore:
            store = make()
            made.append(store)
            if opened:
                await store.open()
            return store

        try:
            yield factory
        finally:
            for store in reversed(made):
                await store.close()


@pytest.fixture
async def store(store_factory: StoreFactory) -> StateStore:
    """An open store on an empty database."""
    return await store_factory()
