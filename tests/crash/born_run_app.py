"""The process of the born-leased-run crash test (``db://``, or ``redis://``
when ``CRASH_TRANSPORT`` names one, on SQLite).

It drives runs and consumes the run queue, so a run it starts while a slot is
free is inserted already leased to it and run here, with no run-queue message
or job
(:meth:`durably._run_queue.RunQueue.lend`). The run's first local step
SIGKILLs this process, which so dies holding that run's lease. It prints
``lent`` once the start returned with the run born leased here (and ``queued``
had the run gone through the queue instead).

Configured by ``CRASH_DB`` (the SQLite file), ``CRASH_INSTANCE`` and
``CRASH_TRANSPORT`` (default ``db://``); the lease is 1 s.
"""

from __future__ import annotations

import asyncio
import os
import signal

import durably

DB = os.environ.get("CRASH_DB", "")


def _die() -> str:
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


async def main() -> None:
    engine = durably.Engine(
        f"sqlite:///{DB}",
        transport=os.environ.get("CRASH_TRANSPORT", "db://"),
        instance_id=os.environ.get("CRASH_INSTANCE", "born-app"),
        lease="1s",
        poll_interval=0.05,
    )
    gate = asyncio.Event()

    async def die_after_start() -> str:
        await gate.wait()  # the start has returned and said how it went
        return _die()

    @engine.workflow("born")
    async def born(ctx: durably.WorkflowContext) -> str:
        return await ctx.local_step("die", die_after_start)

    async with engine:
        run_queue = engine._run_queue
        assert run_queue is not None and run_queue.consuming
        for _ in range(200):  # until the consumer's first take found the queue empty
            if run_queue.lend("default"):
                run_queue.give_back()
                break
            await asyncio.sleep(0.05)
        await engine.start("born", run_id="b1")
        print("lent" if run_queue.lent == 1 else "queued", flush=True)
        gate.set()
        await asyncio.sleep(60)  # killed before


asyncio.run(main())
