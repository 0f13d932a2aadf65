"""durably.SyncClient: the client for synchronous code, safe from any thread and
across requests, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

import durably


@pytest.fixture(params=["sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sync.db'}"
        return
    isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
        "isolated_postgres"
    )
    async with isolated() as url:
        yield url


@contextmanager
def worker_thread(url: str) -> Iterator[None]:
    """An engine executing ``double`` on its own loop in a thread: the
    application's worker process, as far as the sync client can tell."""
    ready, stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    async def serve() -> None:
        engine = durably.Engine(url, poll_interval=0.05)

        @engine.workflow("double")
        async def double(ctx: durably.WorkflowContext, n: int) -> int:
            return 2 * n

        @engine.workflow("cart")
        async def cart(ctx: durably.WorkflowContext) -> list[str]:
            items: list[str] = []
            ctx.on_update("add", lambda item: items.append(item) or len(items))
            await ctx.wait_for_signal(f"checkout:{ctx.run_id}")
            return items

        engine.entity(
            "tally",
            initial_state=0,
            handlers={"add": lambda state, n: (state + n, state + n)},
        )

        async with engine:
            ready.set()
            await asyncio.to_thread(stop.wait)

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30) and not failure, failure
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not failure, failure


def test_a_second_request_from_another_thread_works(store_url: str) -> None:
    """The issue's case: ``asyncio.run(engine.start(...))`` per request fails
    at the second request on PostgreSQL (the pool is bound to the first loop)."""
    client = durably.SyncClient(store_url)
    handles: dict[str, durably.SyncRunHandle[Any]] = {}
    errors: list[BaseException] = []

    def request(n: int) -> None:
        try:
            handles[f"r{n}"] = client.start("double", n, run_id=f"r{n}")
        except BaseException as exc:
            errors.append(exc)

    for n in (1, 2):  # one request after the other, each on a thread of its own
        thread = threading.Thread(target=request, args=(n,))
        thread.start()
        thread.join()
    assert not errors, errors
    with worker_thread(store_url):
        assert [handles[f"r{n}"].result(timeout=30) for n in (1, 2)] == [2, 4]
        assert client.wait_for_run("r2", terminal=True).output == 4
    client.close()


def test_many_threads_share_one_sync_client(store_url: str) -> None:
    with worker_thread(store_url), durably.SyncClient(store_url) as client:
        with ThreadPoolExecutor(8) as pool:
            handles = list(pool.map(lambda n: client.start("double", n), range(40)))
            results = list(pool.map(lambda h: h.result(timeout=60), handles))
        assert results == [2 * n for n in range(40)]
        assert handles[0].status() is durably.RunStatus.COMPLETED
        assert len(client.list_runs(workflow="double", limit=100).runs) == 40
        run = client.get_run(handles[0].run_id)
    assert run is not None and run.recovery_attempts == 0


def test_errors_cross_the_thread_and_a_closed_client_says_so(store_url: str) -> None:
    client = durably.SyncClient(store_url, schemas={"double": int}, strict=True)
    with pytest.raises(durably.SchemaValidationError):
        client.start("double", "not a number")
    with pytest.raises(durably.WorkflowNotRegistered):
        client.start("triple", 1)
    with pytest.raises(durably.RunNotFound):
        client.get_handle("missing")
    assert client.list_runs().runs == []
    client.close()
    client.close()  # idempotent
    assert client.closed
    with pytest.raises(durably.DurablyError, match="closed"):
        client.get_run("any")


async def test_a_sync_client_called_from_a_running_event_loop_refuses_instead_of_deadlocking(
    tmp_path: Path,
) -> None:
    client = durably.SyncClient(f"sqlite:///{tmp_path / 'loop.db'}")
    try:
        with pytest.raises(durably.WrongEventLoop, match=r"durably\.Client"):
            client.start("double", 1)
        with pytest.raises(durably.WrongEventLoop, match="list_runs"):
            client.list_runs()
        # From a thread it is fine, and the refused start created nothing.
        page = await asyncio.to_thread(client.list_runs)
        assert page.runs == []
    finally:
        await asyncio.to_thread(client.close)


def test_a_sync_client_refuses_calls_from_its_own_loop_too(tmp_path: Path) -> None:
    """A call made on the client's own loop thread (a callback scheduled
    there) would wait for itself forever."""
    client = durably.SyncClient(f"sqlite:///{tmp_path / 'own.db'}")
    outcome: list[BaseException] = []

    async def nested() -> None:
        try:
            client.get_run("x")
        except BaseException as exc:
            outcome.append(exc)

    try:
        client._loop.call(nested(), "test")
        assert len(outcome) == 1 and isinstance(outcome[0], durably.WrongEventLoop)
    finally:
        client.close()


def _start_in_child(client: durably.SyncClient, handle: durably.SyncRunHandle[Any]) -> None:
    started = client.start("double", 21, run_id="from-child")
    assert started.run_id == "from-child"
    with pytest.raises(durably.DurablyError, match="another process"):
        handle.status()  # the parent's: refused rather than waiting forever
    client.close()


def test_a_sync_client_made_before_a_fork_works_in_the_child(store_url: str) -> None:
    """gunicorn --preload, a multiprocessing pool: the loop thread stays in the
    parent, so the child's first call starts one of its own instead of hanging."""
    import multiprocessing

    client = durably.SyncClient(store_url)
    parents = client.start("double", 1, run_id="from-parent")
    child = multiprocessing.get_context("fork").Process(
        target=_start_in_child, args=(client, parents)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    with worker_thread(store_url):
        assert client.get_handle("from-child").result(timeout=30) == 42
        assert parents.result(timeout=30) == 2
    client.close()


def test_a_sync_client_sends_updates_and_calls_entities(store_url: str) -> None:
    with worker_thread(store_url), durably.SyncClient(store=store_url) as client:
        client.start("cart", run_id="cart-sync")
        first = client.update("cart-sync", "add", "apple", timeout=30)
        assert (first.outcome, first.result) == ("accepted", 1)
        assert client.update("cart-sync", "add", "pear", timeout=30).result == 2
        client.signal("checkout:cart-sync")
        assert client.get_handle("cart-sync").result(timeout=30) == ["apple", "pear"]

        assert client.call_entity("tally", "k", "add", 5, timeout=30) == 5
        client.signal_entity("tally", "k", "add", 2, update_id="two")
        client.signal_entity("tally", "k", "add", 2, update_id="two")
        assert client.call_entity("tally", "k", "add", 0, timeout=30) == 7
        assert client.get_entity_state("tally", "k") == 7
