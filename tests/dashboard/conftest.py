"""The dashboard served by a real uvicorn on a free port, over a real engine
(SQLite in a temporary directory), driven by Debian's chromium through
Playwright. Everything runs on the test's event loop: the engine executing
runs, uvicorn answering, Playwright steering the browser process."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("playwright")
uvicorn = pytest.importorskip("uvicorn")

from playwright.async_api import Browser, Page, async_playwright, expect  # noqa: E402

import durably  # noqa: E402
from durably.testing import eventually  # noqa: E402

CHROMIUM = os.environ.get("DURABLY_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
HAVE_CHROMIUM = Path(CHROMIUM).exists()
# The machine is shared and noisy: assertions wait up to 20 s for the page to
# reach the state (they return as soon as it does), instead of 5.
expect.set_options(timeout=20_000)
# Where the tests save their screenshots: a git-ignored folder by default, so a
# test run leaves the tree clean; DURABLY_SCREENSHOTS=docs/screenshots
# refreshes the ones docs/operating.md shows.
SCREENSHOTS = Path(
    os.environ.get("DURABLY_SCREENSHOTS") or Path(__file__).resolve().parents[2] / ".screenshots"
).resolve()

Serve = Callable[..., Awaitable[str]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(asgi_app)`` -> the base URL of a uvicorn serving it."""
    servers: list[tuple[Any, asyncio.Task[None]]] = []

    async def start(app: Any, host: str = "127.0.0.1") -> str:
        port = free_port()
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=1
        )
        server = uvicorn.Server(config)
        # uvicorn's own signal handlers would take the test runner's Ctrl-C.
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        task = asyncio.create_task(server.serve())
        servers.append((server, task))
        await eventually(lambda: server.started, what="uvicorn to start")
        return f"http://{host}:{port}"

    yield start
    for server, task in servers:
        server.should_exit = True
        await task


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not HAVE_CHROMIUM:
        pytest.fail(
            f"no chromium at {CHROMIUM}: apt-get install -y chromium (scripts/test.sh does)"
        )
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser
        finally:
            await browser.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1360, "height": 900})
    page = await context.new_page()
    page.set_default_timeout(15_000)
    page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    try:
        yield page
    finally:
        await context.close()


def make_engine(store: str) -> durably.Engine:
    """An engine with the workflows the dashboard tests look at; no step
    handler is served, so a dispatched step stays pending."""
    engine = durably.Engine(store=store, transport="local://", serve_steps=[])

    async def pause(ms: int) -> int:
        await asyncio.sleep(ms / 1000)
        return ms

    @engine.workflow("fanout")
    async def fanout(ctx: durably.WorkflowContext, n: int) -> list[int]:
        first = await ctx.local_step("prepare", pause, 20)
        parts = await ctx.all([ctx.local_step(f"part-{i}", pause, 30 + 15 * i) for i in range(n)])
        return [first, *parts]

    @engine.workflow("approval")
    async def approval(ctx: durably.WorkflowContext, order: str) -> dict[str, Any]:
        decision = await ctx.wait_for_signal(f"approve:{ctx.run_id}", timeout="1d")
        return {"order": order, "decision": decision}

    @engine.workflow("boom")
    async def boom(ctx: durably.WorkflowContext, data: Any) -> Any:
        async def explode() -> None:
            raise ValueError(f"kaput on {data!r}")

        await ctx.local_step("explode", explode, retries=0)

    @engine.workflow("booking")
    async def booking(ctx: durably.WorkflowContext) -> str:
        await ctx.local_step("reserve", lambda: "R1", compensate=lambda r: None)
        await ctx.sleep("1h")
        return "done"

    @engine.workflow("stuck")
    async def stuck(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step("unserved", {"n": 1})

    @engine.workflow("parent")
    async def parent(ctx: durably.WorkflowContext, n: int) -> list[Any]:
        return await ctx.all(
            [ctx.child("echo", 1), *(ctx.child("approval", f"o-{i}") for i in range(n))]
        )

    @engine.workflow("grandparent")
    async def grandparent(ctx: durably.WorkflowContext) -> Any:
        return await ctx.child("parent", 1)

    engine.register_queue("gpu", concurrency=1)

    @engine.workflow("render")
    async def render(ctx: durably.WorkflowContext, frame: int) -> Any:
        return await ctx.step("unserved", {"frame": frame}, queue="gpu")

    @engine.workflow("echo")
    async def echo(ctx: durably.WorkflowContext, value: Any) -> Any:
        return value

    engine.schedule("nightly-report", "fanout", cron="0 3 * * *", input=2)
    return engine


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[durably.Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'dash.db'}")
    async with engine:
        yield engine


async def finished(engine: durably.Engine, run_id: str) -> durably.RunResult:
    return await engine.wait_for_run(run_id, terminal=True, timeout=20)


async def settled(engine: durably.Engine, run_id: str) -> durably.RunResult:
    return await engine.wait_for_run(run_id, timeout=20)


def screenshot_path(name: str) -> str:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return str(SCREENSHOTS / name)
