"""The dashboard's pages in a real browser: the runs list, a finished
fan-out's timeline, live updates, and a hostile payload rendered inert."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from playwright.async_api import Page, expect
from starlette.applications import Starlette
from starlette.routing import Mount

import durably
import durably.dashboard
from durably.testing import eventually

from .conftest import Serve, finished, screenshot_path, settled


async def test_runs_list_counts_filters_searches_and_pages(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    for i in range(5):
        await engine.start("echo", i, run_id=f"echo-{i}", tags=["even" if i % 2 == 0 else "odd"])
    failed = await engine.start("boom", "x", run_id="boom-1")
    waiting = await engine.start("approval", "o-1", run_id="approval-1")
    fan = await engine.start("fanout", 3, run_id="fan-1")
    for run_id in [f"echo-{i}" for i in range(5)] + [failed.run_id, fan.run_id]:
        await finished(engine, run_id)
    await settled(engine, waiting.run_id)
    # Mounted at a prefix in a host app, as an application would.
    host = Starlette(routes=[Mount("/ops/durably", durably.dashboard.app(engine))])
    base = await serve(host)

    await page.goto(f"{base}/ops/durably/")

    await expect(page.locator("tr[data-run]")).to_have_count(8)
    await expect(page.locator("[data-count=completed] b")).to_have_text("6")
    await expect(page.locator("[data-count=failed] b")).to_have_text("1")
    await expect(page.locator("[data-count=suspended] b")).to_have_text("1")
    await page.screenshot(path=screenshot_path("runs-list.png"), full_page=True)

    # the status filter, through the form
    await page.select_option("select[name=status]", "failed")
    await page.click("form.filters button[type=submit]")
    await expect(page.locator("tr[data-run]")).to_have_count(1)
    await expect(page.locator("tr[data-run] a")).to_have_text("boom-1")

    # workflow and tag, and the search by id prefix
    await page.goto(f"{base}/ops/durably/?workflow=echo&tag=even")
    await expect(page.locator("tr[data-run]")).to_have_count(3)
    await page.goto(f"{base}/ops/durably/?q=echo-")
    await expect(page.locator("tr[data-run]")).to_have_count(5)

    # cursor paging: 3 + 3 + 2, newest first, no run twice
    await page.goto(f"{base}/ops/durably/?limit=3")
    seen: list[str] = []
    for expected in (3, 3, 2):
        rows = page.locator("tr[data-run]")
        await expect(rows).to_have_count(expected)
        seen += [await row.get_attribute("data-run") or "" for row in await rows.all()]
        if expected != 2:
            await page.click("#next-page")
    assert len(set(seen)) == 8
    await expect(page.locator("#next-page")).to_have_count(0)

    # a time range that holds nothing
    await page.goto(f"{base}/ops/durably/?until=2000-01-01T00:00:00")
    await expect(page.locator("tr[data-run]")).to_have_count(0)
    await expect(page.locator("td.empty")).to_be_visible()


async def test_run_page_shows_the_timeline_of_a_finished_fan_out(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    run = await engine.start("fanout", 4, run_id="fan-out:42")
    result = await finished(engine, run.run_id)
    assert result.status == "completed"
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/")
    await page.click("a:text('fan-out:42')")

    await expect(page.locator("#run-status")).to_have_text("completed")
    rows = page.locator(".gantt .row[data-seq]")
    await expect(rows).to_have_count(5)  # prepare + 4 parts
    # the four parts ran side by side: marked parallel, bars overlapping in time
    await expect(page.locator(".gantt .row .parallel")).to_have_count(4)
    lefts = [
        float((await bar.get_attribute("style") or "").split("left:")[1].split("%")[0])
        for bar in await page.locator(".gantt .row[data-seq] .bar").all()
    ]
    widths = [
        float((await bar.get_attribute("style") or "").split("width:")[1].split("%")[0])
        for bar in await page.locator(".gantt .row[data-seq] .bar").all()
    ]
    parts = list(zip(lefts[1:], widths[1:], strict=True))
    assert all(left >= lefts[0] + widths[0] - 1 for left, _ in parts)  # after prepare
    assert max(left for left, _ in parts) < min(left + width for left, width in parts)
    await expect(page.locator("#run-output")).to_contain_text("20")
    await page.screenshot(path=screenshot_path("run-fanout.png"), full_page=True)

    # the JSON API tells the same story
    response = await page.request.get(f"{base}/api/runs/fan-out%3A42")
    body = await response.json()
    assert [bar["name"] for bar in body["timeline"]] == [
        "prepare",
        "part-0",
        "part-1",
        "part-2",
        "part-3",
    ]
    assert body["run"]["status"] == "completed"


async def test_a_failed_run_shows_its_error_and_traceback(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("boom", {"n": 1}, run_id="boom/7?x=1#frag")  # a hostile id
    await finished(engine, "boom/7?x=1#frag")
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/")
    await page.click("a:text('boom/7?x=1#frag')")

    await expect(page.locator("#run-id")).to_have_text("boom/7?x=1#frag")
    await expect(page.locator("#run-error")).to_contain_text("kaput on {'n': 1}")
    await expect(page.locator("pre.traceback")).to_contain_text("Traceback")
    await expect(page.locator("pre.traceback")).to_contain_text("ValueError")


async def test_a_script_payload_renders_as_text(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    evil = "<script>window.__pwned = 1</script><img src=x onerror='window.__pwned = 2'>"
    await engine.start("echo", {"html": evil}, run_id=evil, tags=[evil])
    await finished(engine, evil)
    base = await serve(durably.dashboard.app(engine))
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))

    await page.goto(f"{base}/")
    await expect(page.locator("tr[data-run] a")).to_have_text(evil)
    await page.locator("tr[data-run] a").click()

    await expect(page.locator("#run-output")).to_contain_text("<script>window.__pwned = 1</script>")
    await expect(page.locator("#run-id")).to_have_text(evil)
    assert await page.evaluate("window.__pwned") is None
    assert await page.locator("main script, main img").count() == 0
    assert dialogs == []


async def test_the_run_page_follows_a_running_run_live(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    run = await engine.start("approval", "o-7", run_id="approval-7")
    await settled(engine, run.run_id)
    base = await serve(durably.dashboard.app(engine, poll_interval=0.2))

    await page.goto(f"{base}/runs/approval-7")
    await expect(page.locator("#run-status")).to_have_text("suspended")
    await expect(page.locator("#waits")).to_contain_text("approve:approval-7")
    await expect(page.locator("#live-dot.on")).to_have_count(1)  # the stream is open

    # another client (here: the engine) delivers the signal; no reload
    await engine.signal("approve:approval-7", {"ok": True})
    await finished(engine, run.run_id)

    await expect(page.locator("#run-status")).to_have_text("completed")
    await expect(page.locator("#run-output")).to_contain_text('"ok": true')
    assert await page.evaluate("performance.getEntriesByType('navigation').length") == 1


async def test_the_runs_list_shows_a_new_run_live(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("echo", 1, run_id="first")
    await finished(engine, "first")
    base = await serve(durably.dashboard.app(engine, poll_interval=0.2))
    await page.goto(f"{base}/")
    await expect(page.locator("tr[data-run]")).to_have_count(1)
    await expect(page.locator("#live-dot.on")).to_have_count(1)

    await engine.start("echo", 2, run_id="second")

    await expect(page.locator("tr[data-run='second']")).to_have_count(1)
    await expect(page.locator("tr[data-run]")).to_have_count(2)


async def test_schedules_page_lists_next_fire_times(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/schedules")

    row = page.locator("tr[data-schedule='nightly-report']")
    await expect(row).to_contain_text("0 3 * * *")
    await expect(row).to_contain_text("03:00:00")


async def test_a_dispatched_step_shows_attempts_progress_and_logs(
    tmp_path: Path, serve: Serve, page: Page
) -> None:
    engine = durably.Engine(store=f"sqlite:///{tmp_path / 'steps.db'}", transport="local://")
    attempts: list[int] = []

    @engine.step("crunch", retries=2, backoff="fixed", backoff_base=0.01)
    async def crunch(data: dict[str, Any], log: durably.StepLogger) -> int:
        attempts.append(1)
        log.info("starting <b>crunch</b>", rows=data["rows"])
        log.heartbeat({"done": 50})
        if len(attempts) == 1:
            raise RuntimeError("flaky")
        log.sub("load", "ok", "loaded")
        return int(data["rows"]) * 2

    @engine.workflow("pipeline")
    async def pipeline(ctx: durably.WorkflowContext) -> int:
        return await ctx.step(crunch, {"rows": 21})

    async with engine:
        await engine.start("pipeline", run_id="pipe-1")
        assert (await finished(engine, "pipe-1")).output == 42
        base = await serve(durably.dashboard.app(engine))

        await page.goto(f"{base}/runs/pipe-1")

        row = page.locator(".gantt .row[data-seq='0']")
        await expect(row).to_contain_text("crunch")
        await expect(row).to_contain_text("2 attempts")
        await page.click(".step-detail summary")
        await expect(page.locator(".step-detail .log").first).to_contain_text(
            "starting <b>crunch</b>"
        )
        await expect(page.locator(".step-detail")).to_contain_text("load")
        assert await page.locator(".step-detail b:text-is('crunch')").count() == 0
        await page.screenshot(path=screenshot_path("run-step.png"), full_page=True)


async def test_queues_page_shows_slots_and_waiters(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    for frame in range(3):
        await engine.start("render", frame, run_id=f"frame-{frame}")
    for frame in range(3):
        await settled(engine, f"frame-{frame}")
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/queues")

    row = page.locator("tr[data-queue='gpu'] td")
    await expect(row.nth(1)).to_have_text("1")
    await expect(row.nth(2)).to_have_text("2")
    details = []
    for frame in range(3):
        await page.goto(f"{base}/runs/frame-{frame}")
        details.append(await page.locator("#waits").inner_text())
    assert sum("holding a slot in queue gpu" in d for d in details) == 1
    assert sum("waiting for a flow-control slot" in d for d in details) == 2


async def test_the_run_page_follows_steps_finishing_inside_one_turn(
    tmp_path: Path, serve: Serve, page: Page
) -> None:
    engine = durably.Engine(store=f"sqlite:///{tmp_path / 'turn.db'}")
    gates = [asyncio.Event(), asyncio.Event()]

    @engine.workflow("two-steps")
    async def two_steps(ctx: durably.WorkflowContext) -> str:
        await ctx.local_step("first", gates[0].wait)
        await ctx.local_step("second", gates[1].wait)
        return "done"

    async with engine:
        await engine.start("two-steps", run_id="turn-1")

        async def first_running() -> bool:
            return len(await engine.history("turn-1")) == 1

        await eventually(first_running, what="the first step to start")
        base = await serve(durably.dashboard.app(engine, poll_interval=0.2))
        await page.goto(f"{base}/runs/turn-1")
        await expect(page.locator(".gantt .row[data-seq]")).to_have_count(1)
        await expect(page.locator("#live-dot.on")).to_have_count(1)

        gates[0].set()  # the run's row does not change: only its steps do

        await expect(page.locator(".gantt .row[data-seq='1']")).to_contain_text("second")
        await expect(page.locator(".gantt .row[data-seq='0']")).to_contain_text("completed")
        gates[1].set()
        await expect(page.locator("#run-status")).to_have_text("completed")
        assert await page.evaluate("performance.getEntriesByType('navigation').length") == 1


async def test_children_and_the_way_back_to_the_parent(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("parent", 2, run_id="fam")

    async def children_waiting() -> bool:
        kids = (await engine.list_runs(workflow="approval")).runs
        return len(kids) == 2 and all(k.status == "suspended" for k in kids)

    await eventually(children_waiting, what="both children to wait")
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/runs/fam")
    await expect(page.locator("section.children li")).to_have_count(3)
    await expect(page.locator("#waits li")).to_have_count(2)  # the echo child finished
    await page.locator("#waits a").first.click()

    await expect(page.locator("#run-status")).to_have_text("suspended")
    child_id = await page.locator("#run-id").inner_text()
    assert child_id.startswith("fam.child.")
    await page.click(".lineage a:text('fam')")
    await expect(page.locator("#run-id")).to_have_text("fam")


async def test_the_children_tree_shows_grandchildren(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("grandparent", run_id="elder")

    async def grandchild_waits() -> bool:
        kids = (await engine.list_runs(workflow="approval")).runs
        return len(kids) == 1 and kids[0].status == "suspended"

    await eventually(grandchild_waits, what="the grandchild to wait")
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/runs/elder")

    child = page.locator("section.children > ul > li")
    await expect(child).to_have_count(1)
    await expect(child.locator("ul > li")).to_have_count(2)  # the echo and the approval
    await expect(child.locator("ul > li").filter(has_text="approval")).to_contain_text("suspended")


async def test_lifecycle_events_wake_the_live_view_before_the_poll_interval(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    run = await engine.start("approval", "o-8", run_id="approval-8")
    await settled(engine, run.run_id)
    # a poll interval far longer than the page is given to update: only the
    # engine's lifecycle events can make the page follow in time
    base = await serve(durably.dashboard.app(engine, poll_interval=300))

    await page.goto(f"{base}/")
    await expect(page.locator("#live-dot.on")).to_have_count(1)
    await expect(page.locator("tr[data-run='approval-8'] .status")).to_have_text("suspended")

    await engine.signal("approve:approval-8", True)

    await expect(page.locator("tr[data-run='approval-8'] .status")).to_have_text("completed")

    # and a run's page the same way
    await engine.start("approval", "o-9", run_id="approval-9")
    await settled(engine, "approval-9")
    await page.goto(f"{base}/runs/approval-9")
    await expect(page.locator("#live-dot.on")).to_have_count(1)
    await engine.signal("approve:approval-9", True)
    await expect(page.locator("#run-status")).to_have_text("completed")
