"""Quickstart: a workflow with local steps, a signal and a durable sleep, on SQLite.

Run it with ``python examples/quickstart.py``.
"""

import asyncio
import tempfile

import durably

workdir = tempfile.TemporaryDirectory()  # removed when the script exits
engine = durably.Engine(f"sqlite:///{workdir.name}/quickstart.db")


def add_tax(amount: float) -> float:  # a step: any function, sync or async
    return round(amount * 1.2, 2)


@engine.workflow("invoice")
async def invoice(ctx: durably.WorkflowContext, amount: float) -> dict[str, object]:
    total = await ctx.local_step("add-tax", add_tax, amount)  # checkpointed
    approval = await ctx.wait_for_signal("approve-invoice")  # suspends durably
    await ctx.sleep("1s")  # a durable timer: survives restarts
    return {"total": total, "approved_by": approval["by"]}


async def main() -> None:
    async with engine:  # opens the store and runs the worker loop in this process
        run = await engine.start("invoice", 100.0)
        await engine.wait_for_run(run.run_id)  # returns once the run waits for the signal
        await engine.signal("approve-invoice", {"by": "ada"})
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
        print(result.status, result.output)  # completed {'total': 120.0, 'approved_by': 'ada'}


asyncio.run(main())
