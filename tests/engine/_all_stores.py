"""A ``store_url`` fixture over every store, PostgreSQL included.

Engine test modules about state shared through the store (schedules, events)
import it to override ``conftest.store_url``, which covers the embedded stores only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh store URL of every kind."""
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
