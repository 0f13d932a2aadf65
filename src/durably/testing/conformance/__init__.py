"""The store and transport conformance suites, for any implementation (pytest).

durably's stores and transports are swappable because each one passes the
same contract suite. The suites ship here, in the package, so that a store or
transport written outside this repository proves itself the same way (the
model is ``sqlalchemy.testing.suite``). A third party writes two files.

``conftest.py``: load the plugin and provide the fixture the suite asks for::

    import pytest
    from durably.testing.conformance import store_factory_from

    pytest_plugins = ["durably.testing.conformance.plugin"]

    @pytest.fixture
    async def store_factory(tmp_path):
        # each call: another store object on the same, empty database
        async with store_factory_from(lambda: MyStore(f"my:///{tmp_path}/db")) as factory:
            yield factory

``test_my_store.py``: import the suite's tests, which pytest then collects::

    from durably.testing.conformance.stores import *  # noqa: F403

A transport does the same with a ``transport_factory`` fixture (see
:func:`transport_factory_from`) and ``durably.testing.conformance.transports``.
Each suite module can also be imported alone: the store suite by role
(``stores.runs``, ``stores.turns``, ``stores.sweeps``, ``stores.checkpoints``,
``stores.signals``, ``stores.lifecycle``, ``stores.children``, ``stores.steps``,
``stores.events``, ``stores.schedules``, ``stores.updates``) and ``transports.contract``. The
suites need ``pytest`` and ``pytest-asyncio`` (``asyncio_mode = "auto"``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import pytest

from ...stores.base import StateStore
from ...transports.base import Transport

# Before the suite modules are imported, so their asserts explain themselves.
pytest.register_assert_rewrite("durably.testing.conformance.stores")
pytest.register_assert_rewrite("durably.testing.conformance.transports")

__all__ = [
    "StoreFactory",
    "TransportFactory",
    "store_factory_from",
    "transport_factory_from",
    "wait_until",
]


class StoreFactory(Protocol):
    """The ``store_factory`` fixture: makes another store object on the
    test's one database (empty when the test starts)."""

    async def __call__(self, *, opened: bool = True) -> StateStore:
        """Another store object on the same database, opened unless ``opened=False``.

        A store with separate connections (SQLite, PostgreSQL) gives a new
        object each time, as another process would have; a process-local
        store may return the same object every time."""
        ...


class TransportFactory(Protocol):
    """The ``transport_factory`` fixture: makes another opened transport on
    the test's one medium."""

    inline: bool
    """The transport runs each task inside ``dispatch`` and holds nothing
    (like ``memory://``): see :class:`durably.transports.base.Transport` for
    the answers such a transport gives instead of queueing."""

    async def __call__(self, **options: Any) -> Transport:
        """Another opened transport on the same medium. ``options`` are the
        transport's own keywords, which a transport may ignore."""
        ...


@asynccontextmanager
async def store_factory_from(make: Callable[[], StateStore]) -> AsyncIterator[StoreFactory]:
    """A :class:`StoreFactory` from ``make``, which returns a new (unopened)
    store object on the test's database; every store made is closed on exit."""
    made: list[StateStore] = []

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


class _Transports:
    def __init__(self, make: Callable[..., Awaitable[Transport]], inline: bool) -> None:
        self.inline = inline
        self._make = make

    async def __call__(self, **options: Any) -> Transport:
        return await self._make(**options)


def transport_factory_from(
    make: Callable[..., Awaitable[Transport]], *, inline: bool = False
) -> TransportFactory:
    """A :class:`TransportFactory` from ``make(**options)``, which returns
    another opened transport on the test's medium (the caller closes them)."""
    return _Transports(make, inline)


async def wait_until(
    predicate: Callable[[], bool], timeout: float = 5.0, what: str = "the condition"
) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
