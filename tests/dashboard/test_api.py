"""The JSON API and the live feed, without a browser: httpx over the ASGI
app, on the memory store, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path

import httpx
import pytest
from starlette.routing import Route

import durably
import durably.dashboard
from durably.dashboard._live import PollingChanges
from durably.model import Run, RunStatus
from durably.stores.memory import MemoryStore
from durably.testing import eventually

from .conftest import Serve, finished, make_engine, settled


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def api_engine(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> AsyncIterator[durably.Engine]:
    async with AsyncExitStack() as stack:
        if request.param == "memory":
            store = "memory://"
        elif request.param == "sqlite":
            store = f"sqlite:///{tmp_path / 'api.db'}"
        else:
            store = await stack.enter_async_context(isolated_postgres())
        engine = make_engine(store)

        @engine.workflow("loop")
        async def loop(ctx: durably.WorkflowContext, n: int) -> int:
            if n < 2:
                ctx.continue_as_new(n + 1)
            return n

        async with engine:
            yield engine


@pytest.fixture
async def client(api_engine: durably.Engine) -> AsyncIterator[httpx.AsyncClient]:
    app = durably.dashboard.app(api_engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://dash.test"
    ) as client:
        await client.get("/")  # the CSRF cookie
        client.headers["X-Durably-CSRF"] = client.cookies["durably_csrf"]
        yield client


async def test_runs_filters_counts_and_bad_filters(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    for i in range(4):
        await api_engine.start("echo", i, run_id=f"job/{i}", tags=[f"t{i % 2}"])
        await finished(api_engine, f"job/{i}")
    await api_engine.start("boom", 1, run_id="job-boom")
    await finished(api_engine, "job-boom")

    everything = (await client.get("/api/runs")).json()
    by_prefix = (await client.get("/api/runs", params={"q": "job/"})).json()
    tagged = (await client.get("/api/runs", params={"tag": "t1", "workflow": "echo"})).json()
    failed = (await client.get("/api/runs", params={"status": "failed"})).json()
    paged = (await client.get("/api/runs", params={"limit": 2})).json()
    rest = await client.get("/api/runs", params={"limit": 2, "cursor": paged["next_cursor"]})

    assert everything["counts"] == {"completed": 4, "failed": 1}
    assert [r["run_id"] for r in by_prefix["runs"]] == ["job/3", "job/2", "job/1", "job/0"]
    assert by_prefix["counts"] == {"completed": 4}
    assert [r["run_id"] for r in tagged["runs"]] == ["job/3", "job/1"]
    assert [r["run_id"] for r in failed["runs"]] == ["job-boom"]
    assert failed["counts"] == {"completed": 4, "failed": 1}  # counts ignore the status
    assert len(paged["runs"]) == 2
    assert {r["run_id"] for r in rest.json()["runs"]}.isdisjoint(
        {r["run_id"] for r in paged["runs"]}
    )
    for bad in ({"status": "nope"}, {"since": "yesterday"}, {"limit": "0"}, {"limit": "x"}):
        response = await client.get("/api/runs", params=bad)
        assert response.status_code == 400, bad
        assert "error" in response.json()


async def test_a_run_with_its_lineage_and_a_hostile_id(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    await api_engine.start("loop", 0, run_id="chain")

    async def last_link_done() -> bool:
        run = await api_engine.get_run("chain~2")
        return run is not None and run.status == "completed"

    await eventually(last_link_done, what="the chain to end")
    await api_engine.start("echo", "<b>", run_id="a/b?c#d e")
    await finished(api_engine, "a/b?c#d e")

    first = (await client.get("/api/runs/chain")).json()
    middle = (await client.get("/api/runs/chain~1")).json()
    last = (await client.get("/api/runs/chain~2")).json()
    hostile = await client.get("/api/runs/a%2Fb%3Fc%23d%20e")
    missing = await client.get("/api/runs/nope")

    assert first["lineage"]["next_link"] == "chain~1"
    assert first["lineage"]["previous_link"] is None
    assert middle["lineage"] == {
        "parent_id": None,
        "previous_link": "chain",
        "next_link": "chain~2",
        "retry_of": None,
    }
    assert last["lineage"]["previous_link"] == "chain~1"
    assert last["run"]["output"] == 2
    assert hostile.status_code == 200
    assert hostile.json()["run"]["output"] == "<b>"
    assert missing.status_code == 404


async def test_what_a_waiting_run_waits_for(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    await api_engine.start("approval", "o", run_id="w-1")
    await api_engine.start("booking", run_id="w-2")
    await settled(api_engine, "w-1")
    await settled(api_engine, "w-2")

    signal = (await client.get("/api/runs/w-1")).json()["waiting"]
    timer = (await client.get("/api/runs/w-2")).json()["waiting"]

    assert [(w["kind"], w["what"]) for w in signal] == [("signal", "approve:w-1")]
    assert signal[0]["due_at"] is not None  # its timeout
    assert [w["kind"] for w in timer] == ["timer"]
    run = await api_engine.get_run("w-2")
    assert run is not None
    assert timer[0]["due_at"] >= run.created_at + 3_600_000 - 1000


async def test_actions_answer_with_the_right_status(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    await api_engine.start("echo", 1, run_id="done")
    await finished(api_engine, "done")

    terminal = await client.post("/api/actions/cancel", json={"run_id": "done"})
    not_failed = await client.post("/api/actions/retry", json={"run_id": "done"})
    unknown_run = await client.post("/api/actions/cancel", json={"run_id": "ghost"})
    unknown_action = await client.post("/api/actions/explode", json={"run_id": "done"})
    not_json = await client.post(
        "/api/actions/cancel", content=b"{", headers={"content-type": "application/json"}
    )
    not_object = await client.post("/api/actions/cancel", json=["done"])
    buffered = await client.post(
        "/api/actions/signal", json={"token": "nobody-waits", "payload": {"x": 1}}
    )
    cross_site = await client.post(
        "/api/actions/cancel", json={"run_id": "done"}, headers={"Origin": "https://evil.test"}
    )

    assert terminal.status_code == 409
    assert not_failed.status_code == 409
    assert unknown_run.status_code == 404
    assert unknown_action.status_code == 404
    assert not_json.status_code == 400
    assert not_object.status_code == 400
    assert buffered.json() == {"ok": True, "message": "signal nobody-waits buffered"}
    assert cross_site.status_code == 403
    assert await api_engine.store.list_buffered_signals("nobody-waits") == [{"x": 1}]


async def test_schedules_through_the_api(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    listed = (await client.get("/api/schedules")).json()["schedules"]
    paused = await client.post("/api/schedules/pause", json={"name": "nightly-report"})
    unknown = await client.post("/api/schedules/pause", json={"name": "ghost"})

    assert [s["name"] for s in listed] == ["nightly-report"]
    assert listed[0]["next_fire_at"].endswith("T03:00:00.000+00:00")
    assert paused.status_code == 200
    assert unknown.status_code == 404


async def test_the_openapi_document_covers_every_api_route(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    document = (await client.get("/api/openapi.json")).json()
    app = durably.dashboard.app(api_engine)
    routes = {
        route.path.replace(":path}", "}")
        for route in app.routes
        if isinstance(route, Route) and route.path.startswith("/api/")
    }

    assert document["openapi"].startswith("3.")
    assert routes - {"/api/openapi.json"} == set(document["paths"])


@pytest.mark.parametrize("api_engine", ["memory"], indirect=True)
async def test_bulk_actions_stop_at_500_and_say_so(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    for i in range(520):
        await api_engine.start("approval", i, run_id=f"many-{i:03d}")
    for i in range(520):
        await settled(api_engine, f"many-{i:03d}")

    first = (await client.post("/api/bulk/cancel", params={"workflow": "approval"})).json()

    assert first == {"matched": 520, "applied": 500, "cap": 500}
    live = await api_engine.store.count_runs(durably.stores.RunQuery(workflow="approval"), 10_000)
    assert live.get("suspended", 0) + live.get("running", 0) + live.get("pending", 0) == 20


async def test_the_poller_reports_every_change_once_even_in_a_burst() -> None:
    store = MemoryStore()
    backend = durably.Engine(store=store, drive=False)
    await backend.open()
    now = 10_000_000

    def run(run_id: str, updated_at: int) -> Run:
        return Run(run_id, "wf", "1", RunStatus.PENDING, created_at=now, updated_at=updated_at)

    # 450 changes stamped in one millisecond: more than a batch, all inside
    # the overlap window the poller re-reads
    for i in range(450):
        await store.create_run(run(f"burst-{i:03d}", now + 5))
    seen: list[str] = []

    async def collect() -> None:
        async for batch in PollingChanges(backend, interval=0.01).changes(now):
            seen.extend(r.run_id for r in batch)
            if len(seen) >= 451:
                return

    task = asyncio.create_task(collect())
    await eventually(lambda: len(seen) >= 450, what="the burst")
    await store.create_run(run("late", now + 6))
    await asyncio.wait_for(task, 10)

    await backend.close()
    assert len(seen) == len(set(seen)) == 451
    assert seen[-1] == "late"


@pytest.mark.parametrize("api_engine", ["memory"], indirect=True)
async def test_every_response_forbids_framing_and_foreign_scripts(
    client: httpx.AsyncClient,
) -> None:
    for path in ("/", "/api/runs", "/static/live.js", "/runs/nope"):
        headers = (await client.get(path)).headers
        assert "script-src 'self'" in headers["content-security-policy"], path
        assert "frame-ancestors 'none'" in headers["content-security-policy"], path
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"


def test_durably_dashboard_is_reachable_from_import_durably() -> None:
    assert durably.dashboard.app is durably.dashboard.app  # loaded on first use
    with pytest.raises(AttributeError, match="no attribute 'dashbord'"):
        _ = durably.dashbord  # type: ignore[attr-defined]


@pytest.mark.parametrize("api_engine", ["sqlite"], indirect=True)
async def test_a_long_history_renders_its_start_and_links_the_rest(
    api_engine: durably.Engine, client: httpx.AsyncClient
) -> None:
    @api_engine.workflow("long")
    async def long(ctx: durably.WorkflowContext) -> int:
        for i in range(520):
            await ctx.local_step(f"s{i}", lambda: 1)
        return 520

    await api_engine.start("long", run_id="long-1")
    await finished(api_engine, "long-1")

    page = await client.get("/runs/long-1")
    full = (await client.get("/api/runs/long-1")).json()

    assert page.text.count('class="row" data-seq=') == 500
    assert "20 more operations" in page.text
    assert len(full["timeline"]) == 520


@pytest.mark.parametrize("api_engine", ["memory"], indirect=True)
async def test_a_blank_token_fails_at_boot_not_open(
    api_engine: durably.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="token is empty"):
        durably.dashboard.app(api_engine, token=" ")
    monkeypatch.setenv("DURABLY_DASHBOARD_TOKEN", "")
    with pytest.raises(ValueError, match="token is empty"):
        durably.dashboard.app(api_engine)
    monkeypatch.setenv("DURABLY_DASHBOARD_TOKEN", "s3cret")
    guarded = durably.dashboard.app(api_engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=guarded), base_url="http://dash.test"
    ) as client:
        assert (await client.get("/api/runs")).status_code == 401
        ok = await client.get("/api/runs", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_the_dashboard_over_a_client(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'client.db'}"
    engine = make_engine(store)  # executes the runs; the dashboard only sees the store
    client_backend = durably.Client(store)
    async with engine:
        await engine.start("approval", "o-1", run_id="via-client")
        await settled(engine, "via-client")
        await engine.start("boom", 1, run_id="fails")
        await finished(engine, "fails")
        app = durably.dashboard.app(client_backend)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://dash.test"
        ) as http:
            page = await http.get("/")
            http.headers["X-Durably-CSRF"] = http.cookies["durably_csrf"]
            listed = (await http.get("/api/runs")).json()
            one = (await http.get("/api/runs/via-client")).json()
            signalled = await http.post(
                "/api/actions/signal", json={"token": "approve:via-client", "payload": 1}
            )
            retried = await http.post(
                "/api/actions/retry-with-input", json={"run_id": "fails", "input": 2}
            )
            schedules = (await http.get("/api/schedules")).json()["schedules"]
        assert page.status_code == 200
        assert listed["counts"] == {"suspended": 1, "failed": 1}
        assert [w["kind"] for w in one["waiting"]] == ["signal"]
        assert signalled.json()["message"] == "signal approve:via-client delivered to via-client"
        assert retried.json()["message"].startswith("started fails~retry~")
        assert [s["name"] for s in schedules] == ["nightly-report"]
        assert (await finished(engine, "via-client")).output == {"order": "o-1", "decision": 1}
    await client_backend.close()


def test_engine_and_client_both_answer_every_method_the_dashboard_calls() -> None:
    wanted = {name for name in dir(durably.dashboard.DashboardBackend) if not name.startswith("_")}
    assert wanted >= {"store", "get_run", "history", "cancel", "retry", "signal"}
    for backend in (durably.Engine(store="memory://"), durably.Client("memory://")):
        assert wanted <= set(dir(backend)), backend


async def test_a_run_stream_from_a_rendered_page_misses_no_change_made_before_it_began() -> None:
    # The page is rendered, then its stream connects: a change committed in
    # between was in the stream's first reading, so it was never pushed and
    # the page stayed stale until some later change.
    store = MemoryStore()
    backend = durably.Engine(store=store, drive=False)
    await backend.open()
    now = 10_000_000
    await store.create_run(Run("r", "wf", "1", RunStatus.PENDING, created_at=now, updated_at=now))
    # ...the page renders here; then the run changes...
    await store.create_run(Run("r-child", "wf", "1", RunStatus.PENDING, parent_id="r"))
    stream = PollingChanges(backend, interval=0.01).run_changes("r", resync=True)
    try:
        await asyncio.wait_for(anext(stream), 5)  # the page re-reads
    finally:
        await stream.aclose()
        await backend.close()


@pytest.mark.parametrize("api_engine", ["memory"], indirect=True)
async def test_a_run_stream_opened_with_since_sends_one_event_at_once(
    api_engine: durably.Engine, serve: Serve
) -> None:
    """As the OpenAPI document says of ``/api/stream?run=ID&since=MS``, through
    a real server: one event comes at once though the run no longer changes
    (the page re-reads what changed before the stream's first reading)."""
    await api_engine.start("echo", 1, run_id="r")
    await finished(api_engine, "r")
    base = await serve(durably.dashboard.app(api_engine))
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        document = (await http.get("/api/openapi.json")).json()
        stream = document["paths"]["/api/stream"]["get"]
        assert "one such event at once" in stream["description"]
        async with http.stream("GET", "/api/stream", params={"run": "r", "since": "1"}) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            event: list[str] = []
            while not (event and event[-1] == ""):
                event.append(await asyncio.wait_for(anext(lines), 20))
    assert [line for line in event if line.startswith(("event:", "data:"))] == [
        "event: runs",
        'data: [{"run_id": "r"}]',
    ]
