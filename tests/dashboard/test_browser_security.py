"""Who gets in and what a hostile page can do: the token and its login form,
an auth hook failing closed, CSRF and cross-origin posts refused, the
read-only mode, and ``durably dashboard`` refusing to listen off localhost
without a token."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Page, expect
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

import durably
import durably.dashboard
from durably.testing import eventually

from .conftest import Serve, free_port, screenshot_path, settled

TOKEN = "correct horse battery staple"


async def test_a_token_needs_the_login_form_or_a_bearer_header(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("echo", 1, run_id="secret-run")
    base = await serve(durably.dashboard.app(engine, token=TOKEN))

    await page.goto(f"{base}/runs/secret-run")
    await expect(page).to_have_url(f"{base}/login")
    await expect(page.locator("body")).not_to_contain_text("secret-run")

    await page.fill("input[name=token]", "wrong")
    await page.click("button:text('Log in')")
    await expect(page.locator("#error")).to_have_text("Wrong token.")
    await page.screenshot(path=screenshot_path("login.png"))

    await page.fill("input[name=token]", TOKEN)
    await page.click("button:text('Log in')")
    await expect(page.locator("tr[data-run='secret-run']")).to_have_count(1)

    # a forged session cookie does not pass
    cookies = await page.context.cookies()
    session = next(c for c in cookies if c["name"] == "durably_session")
    expiry, _, signature = session["value"].partition(".")
    await page.context.add_cookies(
        [{**session, "value": f"{int(expiry) + 10**6}.{signature}"}]  # type: ignore[typeddict-item]
    )
    await page.goto(f"{base}/")
    await expect(page).to_have_url(f"{base}/login")

    async with httpx.AsyncClient(base_url=base) as client:
        refused = await client.get("/api/runs")
        wrong = await client.get("/api/runs", headers={"Authorization": "Bearer nope"})
        allowed = await client.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})
        # a bearer client is no browser: its POST needs no CSRF token
        cancel = await client.post(
            "/api/actions/cancel",
            json={"run_id": "secret-run"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert refused.status_code == 401
    assert refused.json()["error"] == "unauthorized"
    assert wrong.status_code == 401
    assert allowed.status_code == 200
    assert [r["run_id"] for r in allowed.json()["runs"]] == ["secret-run"]
    assert cancel.status_code in (200, 409)  # 409 if the run finished first


async def test_an_auth_hook_decides_and_fails_closed(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    calls: list[str] = []

    async def hook(request: Request) -> bool:
        calls.append(request.url.path)
        who = request.headers.get("x-user")
        if who == "crash":
            raise RuntimeError("the identity service is down")
        return who == "ops"

    base = await serve(durably.dashboard.app(engine, auth=hook))

    async with httpx.AsyncClient(base_url=base) as client:
        nobody = await client.get("/")
        crashed = await client.get("/", headers={"x-user": "crash"})
        crashed_api = await client.get("/api/runs", headers={"x-user": "crash"})
        ops = await client.get("/", headers={"x-user": "ops"})
    assert nobody.status_code == 403
    assert crashed.status_code == 403
    assert crashed_api.status_code == 401
    assert ops.status_code == 200
    assert len(calls) == 4


async def test_posts_without_the_csrf_token_or_from_another_origin_are_refused(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("approval", "x", run_id="victim")
    await settled(engine, "victim")
    base = await serve(durably.dashboard.app(engine))

    # a page on another origin auto-submits a form to the dashboard
    async def evil(request: Request) -> HTMLResponse:
        return HTMLResponse(
            f"""<form id=f method=post action="{base}/actions/cancel">
            <input name=run_id value=victim><input name=csrf value=guessed></form>
            <script>document.getElementById('f').submit()</script>"""
        )

    evil_base = await serve(Starlette(routes=[Route("/", evil)]))
    assert evil_base.split(":")[-1] != base.split(":")[-1]
    await page.goto(f"{base}/")  # the victim has the dashboard's cookies
    async with page.expect_navigation(url=f"{base}/actions/cancel"):
        await page.goto(f"{evil_base}/")
    await expect(page.locator("#error")).to_contain_text("cross-origin request refused")

    # same origin, but no token in the form / the wrong one
    missing = await page.request.post(f"{base}/actions/cancel", form={"run_id": "victim"})
    wrong = await page.request.post(
        f"{base}/actions/cancel", form={"run_id": "victim", "csrf": "x" * 43}
    )
    api = await page.request.post(f"{base}/api/actions/cancel", data={"run_id": "victim"})
    get = await page.request.get(f"{base}/actions/cancel")
    assert missing.status == 403
    assert "CSRF" in await missing.text()
    assert wrong.status == 403
    assert api.status == 403
    assert get.status == 405  # actions are POST only
    assert (await engine.get_run("victim")).status == "suspended"  # type: ignore[union-attr]


async def test_read_only_shows_no_action_and_refuses_every_post(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("approval", "x", run_id="ro")
    await settled(engine, "ro")
    base = await serve(durably.dashboard.app(engine, read_only=True))

    await page.goto(f"{base}/runs/ro")
    await expect(page.locator(".badge")).to_have_text("read-only")
    await expect(page.locator("section.actions")).to_have_count(0)
    await page.goto(f"{base}/")
    await expect(page.locator("form.bulk")).to_have_count(0)
    csrf = next(c["value"] for c in await page.context.cookies() if c["name"] == "durably_csrf")

    refused = await page.request.post(f"{base}/actions/cancel", form={"run_id": "ro", "csrf": csrf})

    assert refused.status == 403
    assert "read-only" in await refused.text()
    assert (await engine.get_run("ro")).status == "suspended"  # type: ignore[union-attr]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "durably", "dashboard", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.com"])
def test_the_command_refuses_to_listen_off_localhost_without_a_token(host: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DURABLY_DASHBOARD_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "durably", "dashboard", "--store", "memory://", "--host", host],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "refusing to serve the dashboard" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_the_command_serves_localhost_and_a_token_anywhere(
    tmp_path: Path, page: Page
) -> None:
    store = f"sqlite:///{tmp_path}/cli.db"
    engine = durably.Engine(store=store)
    await engine.open()  # creates the database the command opens
    await engine.close()
    open_port, token_port = free_port(), free_port()
    open_proc = _cli("--store", store, "--port", str(open_port))
    token_proc = _cli(
        "--store",
        store,
        "--host",
        "0.0.0.0",
        "--port",
        str(token_port),
        env={"DURABLY_DASHBOARD_TOKEN": TOKEN},
    )
    try:
        async with httpx.AsyncClient() as client:

            async def up(port: int) -> httpx.Response | None:
                try:
                    return await client.get(f"http://127.0.0.1:{port}/")
                except httpx.TransportError:
                    return None

            opened = await eventually(lambda: up(open_port), what="the dashboard", timeout=30)
            guarded = await eventually(lambda: up(token_port), what="the dashboard", timeout=30)
        assert opened.status_code == 200
        assert guarded.status_code == 303
        assert guarded.headers["location"] == "/login"
        await page.goto(f"http://127.0.0.1:{token_port}/")
        await expect(page.locator("input[name=token]")).to_be_visible()
    finally:
        for proc in (open_proc, token_proc):
            proc.terminate()
        for proc in (open_proc, token_proc):
            await asyncio.to_thread(proc.wait, 30)
