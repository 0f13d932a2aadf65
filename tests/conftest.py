"""Fixtures shared by every test directory.

PostgreSQL tests run against a real server: ``DURABLY_TEST_POSTGRES_URL``, by
default ``postgresql://postgres@127.0.0.1:5432/test`` (``.ci/run`` starts it).
They never skip: an unreachable server fails them with a message saying so.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest

POSTGRES_URL = os.environ.get(
    "DURABLY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


async def _connect_postgres() -> Any:
    import asyncpg

    try:
        return await asyncpg.connect(POSTGRES_URL, timeout=10)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    pytest.fail(
        f"PostgreSQL is not reachable at {POSTGRES_URL} ({problem}). "
        "PostgreSQL tests never skip: start the server (.ci/run does) or set "
        "DURABLY_TEST_POSTGRES_URL to one that runs.",
        pytrace=False,
    )


@asynccontextmanager
async def isolated_postgres_url() -> AsyncIterator[str]:
    """A store URL whose tables live in a fresh schema, dropped on exit."""
    schema = f"durably_test_{uuid.uuid4().hex[:16]}"
    conn = await _connect_postgres()
    await conn.close()
    separator = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{separator}schema={schema}"
    finally:
        conn = await _connect_postgres()
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


@pytest.fixture(autouse=True)
def _sticky_runs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DURABLY_TEST_STICKY_RUNS=0`` runs the tests with the sticky-run cache
    off (the default size of every engine a test builds without naming one);
    ``DURABLY_TEST_STEP_HOLD=0`` with turns never held across a dispatched
    step (every step without ``timeout`` parks its run at once)."""
    size = os.environ.get("DURABLY_TEST_STICKY_RUNS")
    hold = os.environ.get("DURABLY_TEST_STEP_HOLD")
    if size is not None or hold is not None:
        import durably

        defaults = dict(durably.Engine.__init__.__kwdefaults__ or {})
        if size is not None:
            defaults["sticky_runs"] = int(size)
        if hold is not None:
            defaults["step_hold"] = float(hold) if hold.replace(".", "").isdigit() else hold
        monkeypatch.setattr(durably.Engine.__init__, "__kwdefaults__", defaults)


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A PostgreSQL store URL isolated in its own schema for this test."""
    async with isolated_postgres_url() as url:
        yield url


@pytest.fixture
def isolated_postgres() -> Callable[[], AbstractAsyncContextManager[str]]:
    """``async with isolated_postgres() as url:`` — a URL in a fresh schema, dropped after."""
    return isolated_postgres_url


@pytest.fixture
async def postgres_store(postgres_url: str) -> AsyncIterator[Any]:
    """An open ``PostgresStore`` in a fresh schema, closed after the test."""
    from durably.stores.postgres import PostgresStore

    store = PostgresStore(postgres_url)
    await store.open()
    try:
        yield store
    finally:
        await store.close()
