"""Every action of the dashboard, clicked in a real browser, checked in the
store: cancel, cancel + compensate, retry, retry with new input, signal,
re-dispatch, the bulk actions and the schedule buttons."""

from __future__ import annotations

from playwright.async_api import Page, expect

import durably
import durably.dashboard
from durably.testing import eventually

from .conftest import Serve, finished, settled


async def test_cancel_and_cancel_with_compensation(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    for run_id in ("book-1", "book-2"):
        await engine.start("booking", run_id=run_id)
        await settled(engine, run_id)
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/runs/book-1")
    await expect(page.locator("#waits")).to_contain_text("timer")
    await page.click("button:text-is('Cancel')")
    await expect(page.locator("#notice")).to_have_text("cancel requested")
    assert (await finished(engine, "book-1")).status == "cancelled"

    await page.goto(f"{base}/runs/book-2")
    await page.click("button:text-is('Cancel + compensate')")
    await expect(page.locator("#notice")).to_have_text("cancel requested with compensation")
    assert (await finished(engine, "book-2")).status == "cancelled"
    kinds = [str(cp.kind) for cp in await engine.history("book-2")]
    assert "compensation" in kinds
    await page.reload()
    await expect(page.locator("#run-status")).to_have_text("cancelled")
    await expect(page.locator("button:text-is('Cancel')")).to_have_count(0)


async def test_retry_and_retry_with_new_input(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("boom", "bad", run_id="boom-1")
    await finished(engine, "boom-1")
    base = await serve(durably.dashboard.app(engine))
    before = (await engine.get_run("boom-1")).updated_at  # type: ignore[union-attr]

    await page.goto(f"{base}/runs/boom-1")
    await page.click("button:text-is('Retry')")
    await expect(page.locator("#notice")).to_have_text("retrying")

    async def failed_again() -> bool:
        run = await engine.get_run("boom-1")
        return run is not None and run.status == "failed" and run.updated_at > before

    await eventually(failed_again, what="the retried run to fail again")

    await page.click("summary:text('Retry with new input')")
    await page.fill("textarea[name=input]", '"good"')
    await page.click("button:text('Start a new run')")
    await expect(page.locator("#notice")).to_contain_text("started boom-1~retry~")
    notice = await page.locator("#notice").inner_text()
    new_id = notice.removeprefix("started ")
    new_run = await engine.get_run(new_id)
    assert new_run is not None and new_run.input == "good"
    # the new run's page links back to its origin
    await page.goto(f"{base}/runs/{new_id}")
    await expect(page.locator(".lineage")).to_contain_text("Retry of: boom-1")

    # bad JSON is refused with a sentence, and nothing starts
    await page.goto(f"{base}/runs/boom-1")
    await page.click("summary:text('Retry with new input')")
    await page.fill("textarea[name=input]", "{not json")
    await page.click("button:text('Start a new run')")
    await expect(page.locator("#notice")).to_contain_text("refused: the input is not valid JSON")
    assert len((await engine.list_runs(workflow="boom")).runs) == 2


async def test_send_a_signal_from_the_run_page(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    await engine.start("approval", "o-9", run_id="approval-9")
    await settled(engine, "approval-9")
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/runs/approval-9")
    # the form is open and holds the token the run waits on
    await expect(page.locator("input[name=token]")).to_have_value("approve:approval-9")
    await page.fill("input[name=payload]", '{"approved": true}')
    await page.click("button:text-is('Send')")

    await expect(page.locator("#notice")).to_have_text(
        "signal approve:approval-9 delivered to approval-9"
    )
    result = await finished(engine, "approval-9")
    assert result.output == {"order": "o-9", "decision": {"approved": True}}


async def test_redispatch_pending_steps(engine: durably.Engine, serve: Serve, page: Page) -> None:
    await engine.start("stuck", run_id="stuck-1")

    async def dispatched() -> bool:
        history = await engine.history("stuck-1")
        return bool(history) and history[0].dispatched_at is not None

    await eventually(dispatched, what="the step to go out")
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/runs/stuck-1")
    await expect(page.locator("#waits")).to_contain_text("unserved")
    await page.click("button:text('Re-dispatch pending steps')")

    await expect(page.locator("#notice")).to_have_text("sent 1 pending step(s) again")


async def test_bulk_cancel_and_retry_of_a_filter(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    for i in range(3):
        await engine.start("booking", run_id=f"b-{i}")
        await engine.start("boom", i, run_id=f"f-{i}")
    await engine.start("approval", "keep", run_id="keep-me")
    for i in range(3):
        await settled(engine, f"b-{i}")
        await finished(engine, f"f-{i}")
    await settled(engine, "keep-me")
    base = await serve(durably.dashboard.app(engine))

    await page.goto(f"{base}/?workflow=booking")
    await page.click("button:text('Cancel all')")
    await expect(page.locator("#notice")).to_have_text("cancel: matched 3, applied 3")
    for i in range(3):
        assert (await finished(engine, f"b-{i}")).status == "cancelled"
    assert (await engine.get_run("keep-me")).status == "suspended"  # type: ignore[union-attr]

    await page.goto(f"{base}/?status=failed")
    await page.click("button:text('Retry all')")
    await expect(page.locator("#notice")).to_have_text("retry: matched 3, applied 3")

    # through the API: a second bulk cancel finds nothing left to cancel
    csrf = next(c["value"] for c in await page.context.cookies() if c["name"] == "durably_csrf")
    response = await page.request.post(
        f"{base}/api/bulk/cancel?workflow=booking", headers={"X-Durably-CSRF": csrf}
    )
    assert await response.json() == {"matched": 3, "applied": 0, "cap": 500}


async def test_pause_resume_and_trigger_a_schedule(
    engine: durably.Engine, serve: Serve, page: Page
) -> None:
    base = await serve(durably.dashboard.app(engine))
    row = page.locator("tr[data-schedule='nightly-report']")

    await page.goto(f"{base}/schedules")
    await row.locator("button:text('Pause')").click()
    await expect(page.locator("#notice")).to_have_text("paused nightly-report")
    await expect(row).to_contain_text("paused")
    assert (await engine.get_schedule("nightly-report")).paused  # type: ignore[union-attr]

    await row.locator("button:text('Resume')").click()
    await expect(page.locator("#notice")).to_have_text("resumed nightly-report")
    assert not (await engine.get_schedule("nightly-report")).paused  # type: ignore[union-attr]

    await row.locator("button:text('Trigger now')").click()
    await expect(page.locator("#notice")).to_contain_text("started ")
    run_id = (await page.locator("#notice").inner_text()).removeprefix("started ")
    assert await engine.get_run(run_id) is not None
