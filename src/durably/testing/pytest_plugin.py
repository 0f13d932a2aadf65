"""durably's pytest plugin, loaded automatically once durably is installed
(the ``pytest11`` entry point); its fixtures need ``pytest-asyncio``.

Fixtures:

- ``test_env``: a :class:`~durably.testing.TestEnv` on ``memory://`` (virtual
  time; register workflows on ``test_env.engine`` before starting runs).
- ``durably_engine``: an :class:`~durably.Engine` on ``memory://`` with its
  worker running, closed after the test.
- ``durably_sqlite_engine``: the same on a SQLite file in the test's ``tmp_path``.

Disable it with ``-p no:durably``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from ..engine import Engine
from .env import TestEnv

__all__ = ["durably_engine", "durably_sqlite_engine", "test_env"]


def _fixture_decorator() -> Callable[..., Any]:
    """``pytest_asyncio.fixture``; without pytest-asyncio, fixtures that say it is missing."""
    try:
        import pytest_asyncio
    except ImportError:  # pragma: no cover - durably does not require pytest-asyncio

        def missing_asyncio(fn: Callable[..., Any]) -> Any:
            def missing(*args: Any, **kwargs: Any) -> None:
                pytest.skip("durably's async fixtures need pytest-asyncio")

            missing.__name__ = fn.__name__
            missing.__doc__ = fn.__doc__
            return pytest.fixture(missing)

        return missing_asyncio
    decorator: Callable[..., Any] = pytest_asyncio.fixture
    return decorator


_fixture = _fixture_decorator()


async def _running(engine: Engine) -> AsyncIterator[Engine]:
    await engine.start_worker()
    try:
        yield engine
    finally:
        await engine.close()


@_fixture
async def durably_engine() -> AsyncIterator[Engine]:
    """An engine on ``memory://`` with its worker loop running; closed after the test."""
    async for engine in _running(Engine("memory://", poll_interval=0.05)):
        yield engine


@_fixture
async def durably_sqlite_engine(tmp_path: Path) -> AsyncIterator[Engine]:
    """An engine on a SQLite file under ``tmp_path`` with its worker running; closed after."""
    url = f"sqlite:///{tmp_path / 'durably.db'}"
    async for engine in _running(Engine(url, poll_interval=0.05)):
        yield engine


@_fixture
async def test_env() -> AsyncIterator[TestEnv]:
    """A :class:`TestEnv` on ``memory://``; closed after the test."""
    async with TestEnv() as env:
        yield env
