"""One run's unstorable value never fails the runs whose writes share its batch.

PostgreSQL commits the writes of all concurrent turns in one statement, so a
row the database refuses (a lone surrogate, a NUL in a name, an over-long id)
once failed every neighbour in the batch. Every store must refuse such a value
for the one run or step it belongs to — before it reaches a batch — and the
other runs must complete as if it never happened.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import durably
from durably import RunStatus

INNOCENT = 200
# What os.listdir() returns for a Latin-1 file name on a UTF-8 system.
SURROGATE = "caf\udce9.txt"


@pytest.mark.parametrize(
    "poison", ["surrogate_result", "surrogate_error", "nul_step_name", "long_run_id"]
)
async def test_one_poisoned_run_never_fails_its_batch_neighbours(
    store_url: str,
    poison: str,
) -> None:
    engine = durably.Engine(store_url, poll_interval=0.05)
    gate = asyncio.Event()
    arrived = 0
    expected = INNOCENT + 1

    async def gated(n: int) -> int:
        # Every run reaches this step, then all go on at once, so their next
        # writes (the poisoned one among them) queue up in the same batches.
        nonlocal arrived
        arrived += 1
        if arrived >= expected:
            gate.set()
        await gate.wait()
        return n

    async def echo(value: Any) -> Any:
        return value

    async def fail(path: str) -> None:
        raise RuntimeError(f"cannot open {path}")  # the raw name, not its repr

    @engine.workflow("innocent")
    async def innocent(ctx: durably.WorkflowContext, n: int) -> int:
        first = await ctx.local_step("gated", gated, n)
        second = await ctx.local_step("echo", echo, n)
        return int(first) + int(second)

    @engine.workflow("poisoned")
    async def poisoned(ctx: durably.WorkflowContext, kind: str) -> str:
        await ctx.local_step("gated", gated, -1)
        if kind == "surrogate_result":
            await ctx.local_step("list files", echo, SURROGATE)
        elif kind == "surrogate_error":
            await ctx.local_step("open file", fail, SURROGATE)
        elif kind == "nul_step_name":
            await ctx.local_step("bad\x00name", echo, 1)
        else:
            await ctx.local_step("echo", echo, 1)
        return "done"

    async with engine:
        poisoned_id: str | None = "poisoned"
        if poison == "long_run_id":
            long_id = "p" * 8192
            rejected: str | None = None
            try:
                await engine.start("poisoned", poison, run_id=long_id)
            except ValueError as exc:
                rejected = str(exc)
            if rejected is None:
                poisoned_id = long_id
            else:
                assert "run_id" in rejected, rejected
                poisoned_id = None
                expected = INNOCENT
        else:
            await engine.start("poisoned", poison, run_id="poisoned")
        for n in range(INNOCENT):
            await engine.start("innocent", n, run_id=f"innocent-{n}")

        results = await asyncio.gather(
            *(
                engine.wait_for_run(f"innocent-{n}", terminal=True, timeout=120)
                for n in range(INNOCENT)
            )
        )
        failed = [
            (r.run_id, r.status, r.error) for r in results if r.status is not RunStatus.COMPLETED
        ]
        assert failed == []
        assert [r.output for r in results] == [2 * n for n in range(INNOCENT)]

        if poisoned_id is not None:
            bad = await engine.wait_for_run(poisoned_id, terminal=True, timeout=120)
            assert bad.status is RunStatus.FAILED, (bad.status, bad.error)
            message = str((bad.error or {}).get("message"))
            if poison == "surrogate_result":
                assert "step result" in message and "list files" in message, message
            elif poison == "surrogate_error":
                # The failure is stored whatever its text holds, escaped.
                assert "open file" in message and "caf\\udce9.txt" in message, message
            elif poison == "nul_step_name":
                assert "step name" in message and "NUL" in message, message

        # The engine is still serving: a run started now completes.
        gate.set()
        after = await engine.start("innocent", 7, run_id="after")
        done = await engine.wait_for_run(after.run_id, terminal=True, timeout=60)
        assert done.status is RunStatus.COMPLETED
