"""One result the store cannot take fails alone, never the batch it came in.

Results are settled in batches (one transaction). A result naming a run id
PostgreSQL refuses (a NUL character), or carrying an output the store cannot
encode (a lone surrogate), used to undo the whole transaction: the batch was
handed back, delivered again, undone again, and every good result in it was
stuck with it. Now the batch is settled entry by entry when one row is
refused: the good results settle, an output that cannot be stored fails its
step (``result_not_stored``), and a result for a run that cannot exist is dropped.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably._queue import OutMessage
from durably.testing import eventually
from durably.transports.db import RESULTS_TOPIC
from durably.wire import StepResult

from .conftest import EngineFactory
from .test_late_results import out

pytestmark = pytest.mark.timeout(60)


async def test_a_hostile_result_does_not_hold_up_its_batch(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="local://", serve_steps=[])

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step("remote-step", retries=0)

    async with engine:
        for run_id in ("good-1", "surrogate", "good-2"):
            await engine.start("waits", run_id=run_id)
        for run_id in ("good-1", "surrogate", "good-2"):
            await out(engine, run_id, {0})
        # Sent without a yield in between: the local transport hands them to
        # the engine as one batch.
        await engine.transport.send_result(StepResult("good-1", 0, ok=True, output="one"))
        await engine.transport.send_result(StepResult("no\x00such-run", 0, ok=True, output=1))
        await engine.transport.send_result(StepResult("surrogate", 0, ok=True, output="\ud800"))
        await engine.transport.send_result(StepResult("good-2", 0, ok=True, output="two"))
        good = [
            await engine.wait_for_run(run_id, terminal=True, timeout=20)
            for run_id in ("good-1", "good-2")
        ]
        odd = await engine.wait_for_run("surrogate", terminal=True, timeout=20)

    assert [(r.status, r.output) for r in good] == [
        (RunStatus.COMPLETED, "one"),
        (RunStatus.COMPLETED, "two"),
    ]
    # The memory store keeps any str; the others cannot encode a lone surrogate.
    if odd.status is RunStatus.FAILED:
        # (memory: the step took it; the run then could not store it as its output)
        assert odd.error is not None
        assert odd.error.get("code") in ("result_not_stored", "unstorable_value")
    else:
        assert (odd.status, odd.output) == (RunStatus.COMPLETED, "\ud800")


async def test_a_hostile_result_taken_with_others_on_db_does_not_hold_them_up(
    make_engine: EngineFactory, store_url: str
) -> None:
    """On ``db://`` results are taken off the queue in the settle's own
    transaction: one refused row undoes that transaction (nothing taken), and
    the batch then goes the plain way, settled entry by entry."""
    if store_url == "memory://":
        pytest.skip("db:// needs a SQL store")
    engine = make_engine(transport="db://", serve_steps=[])

    @engine.workflow("waits")
    async def waits(ctx: durably.WorkflowContext) -> Any:
        return await ctx.step("remote-step", retries=0)

    async with engine:
        for run_id in ("good-1", "surrogate", "good-2"):
            await engine.start("waits", run_id=run_id)
        for run_id in ("good-1", "surrogate", "good-2"):
            await out(engine, run_id, {0})
        results = [
            StepResult("good-1", 0, ok=True, output="one"),
            StepResult("no\x00such-run", 0, ok=True, output=1),
            StepResult("surrogate", 0, ok=True, output="\ud800"),
            StepResult("good-2", 0, ok=True, output="two"),
        ]
        # One push: the consumer takes them together (json, not the codec,
        # which refuses to write a lone surrogate: a foreign worker may not).
        queue = engine.store.messages()  # type: ignore[attr-defined]
        await queue.push([OutMessage(RESULTS_TOPIC, json.dumps(r.to_wire())) for r in results])
        good = [
            await engine.wait_for_run(run_id, terminal=True, timeout=20)
            for run_id in ("good-1", "good-2")
        ]
        odd = await engine.wait_for_run("surrogate", terminal=True, timeout=20)

        async def acked() -> bool:
            return await queue.depth([RESULTS_TOPIC]) == {}

        # A held turn continues (and its run ends) as its result is handed
        # over, which the plain way does before it acks the batch: wait.
        await eventually(acked, what="the batch to be acked")

    assert [(r.status, r.output) for r in good] == [
        (RunStatus.COMPLETED, "one"),
        (RunStatus.COMPLETED, "two"),
    ]
    if odd.status is RunStatus.FAILED:
        assert odd.error is not None
        assert odd.error.get("code") in ("result_not_stored", "unstorable_value")
    else:
        assert (odd.status, odd.output) == (RunStatus.COMPLETED, "\ud800")
