"""``examples/fastapi_app``: the lifespan recipe under Starlette's TestClient and
under a real ``uvicorn --workers 2`` on one store, on SQLite and PostgreSQL."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import durably
from durably.testing import eventually

APP_DIR = Path(__file__).resolve().parents[2] / "examples" / "fastapi_app"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fastapi_app_example", APP_DIR / "app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.db'}"
        return
    isolated: Callable[[], AbstractAsyncContextManager[str]] = request.getfixturevalue(
        "isolated_postgres"
    )
    async with isolated() as url:
        yield url


def test_the_app_under_starlettes_test_client(store_url: str) -> None:
    app = load_example().create_app(store_url)
    with TestClient(app) as http:
        placed = http.post("/orders", json={"id": "o-1", "total": 1200})
        assert placed.status_code == 202 and placed.json()["run_id"] == "checkout:o-1"
        again = http.post("/orders", json={"id": "o-1", "total": 1200})
        assert again.json()["run_id"] == "checkout:o-1"  # idempotent by run id
        assert http.post("/orders", json={"id": "o-2"}).status_code == 422
        assert http.get("/orders/o-1/result", params={"timeout": 0.1}).status_code == 409
        for _ in range(600):  # the engine's poll finds a SQLite start within a second
            if http.get("/orders/o-1").json()["status"] == "suspended":
                break
            time.sleep(0.05)
        approved = http.post("/orders/o-1/approve", json={"by": "ada"})
        assert approved.json() == {"delivered_to": "checkout:o-1"}
        result = http.get("/orders/o-1/result", params={"timeout": 30})
        assert result.status_code == 200, result.text
        assert result.json()["output"]["approved_by"] == "ada"
        assert result.json()["output"]["charged"] == 1200
        assert http.get("/orders/o-1").json()["status"] == "completed"
        assert http.get("/orders/nope").status_code == 404


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def uvicorn_two_workers(store_url: str) -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "DURABLY_DATABASE_URL": store_url}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "app:app",
            "--app-dir",
            str(APP_DIR),
            "--workers",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


async def test_the_app_under_uvicorn_with_two_workers_on_one_store(
    uvicorn_two_workers: str, store_url: str
) -> None:
    async with httpx.AsyncClient(base_url=uvicorn_two_workers, timeout=60) as http:

        async def up() -> bool:
            try:
                return (await http.get("/health")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(up, what="uvicorn serves", timeout=60, interval=0.2)
        orders = [f"u-{i}" for i in range(12)]
        for i, order in enumerate(orders):
            placed = await http.post("/orders", json={"id": order, "total": i})
            assert placed.status_code == 202, placed.text
        for order in orders:
            # Buffered if the run has not reached its wait yet: it is consumed there.
            reply = await http.post(f"/orders/{order}/approve", json={"by": "ops"})
            assert reply.status_code == 200, reply.text
        outputs = []
        for i, order in enumerate(orders):
            result = await http.get(f"/orders/{order}/result", params={"timeout": 60})
            assert result.status_code == 200, result.text
            outputs.append(result.json()["output"])
            assert outputs[-1]["charged"] == i and outputs[-1]["approved_by"] == "ops"

    # Every run executed its steps once, with no recovery, whichever worker took it.
    async with durably.Client(store_url) as client:
        for order in orders:
            run = await client.get_run(f"checkout:{order}")
            assert run is not None and run.recovery_attempts == 0
            history = await client.history(f"checkout:{order}")
            assert [(c.name, c.attempts) for c in history if c.kind == "local"] == [
                ("reserve", 1),
                ("charge", 1),
            ]
