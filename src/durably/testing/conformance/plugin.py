"""The pytest plugin of the conformance suites: the fixtures every suite
test builds on, given the one fixture an implementation provides.

Load it with ``pytest_plugins = ["durably.testing.conformance.plugin"]`` in
a ``conftest.py``. A store suite then needs a ``store_factory`` fixture
(:class:`~durably.testing.conformance.StoreFactory`), a transport suite a
``transport_factory`` (:class:`~durably.testing.conformance.TransportFactory`).
"""

from __future__ import annotations

import pytest

from ...stores.base import StateStore
from . import StoreFactory

__all__ = ["store"]


@pytest.fixture
async def store(store_factory: StoreFactory) -> StateStore:
    """An open store on an empty database (the first of ``store_factory``'s)."""
    return await store_factory()
