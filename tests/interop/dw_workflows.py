"""A ``durable-worker`` 0.26.1 worker serving *workflows* (remote turns) and
their steps, run by the interop virtualenv's Python (see ``dw_steps.py``).

Usage: ``python dw_workflows.py REDIS_URL PREFIX [PARTITION | split:GROUP]``: a
unified ``Worker`` (of a partition), or a split ``WorkflowWorker(group=GROUP)``
beside a step ``Worker``. Prints
``READY`` once its queues are consumed, and ``turn <workflow> <runId>`` at
the start of each turn, so a test can follow (or kill it mid-turn).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from durable_worker import FatalError, Worker, WorkflowWorker
from durable_worker.redis_runner import run_redis_worker, run_redis_workflow_worker


def say(line: str) -> None:
    print(line, flush=True)


def build(worker: Any, flows: Any) -> None:

    @worker.step("py-echo")
    def py_echo(data: Any, ctx: Any) -> Any:
        return {"echoed": data, "nPlusOne": data["n"] + 1}

    @worker.step("py-slow")
    def py_slow(data: Any) -> Any:
        time.sleep(data.get("seconds", 1))
        return {"slept": data.get("seconds", 1)}

    @worker.step("py-decline")
    def py_decline(data: Any) -> Any:
        raise FatalError("card declined", code="declined", details={"last4": "4242"})

    @flows.workflow("py.declined")
    def declined(ctx: Any, data: Any) -> Any:
        return ctx.step("py-decline", data, group="default")

    @flows.workflow("py.order")
    def order(ctx: Any, data: Any) -> Any:
        say(f"turn py.order {ctx.run_id}")
        started = ctx.now()
        first = ctx.step("py-echo", {"n": data["n"]}, group="default")
        ctx.sleep(200)
        approval = ctx.wait_signal(f"approve-{ctx.run_id}")
        child = ctx.start_child("py.child", {"n": first["nPlusOne"]})
        pair = ctx.gather_calls(
            [
                {"name": "py-echo", "input": {"n": 10}, "group": "default"},
                {"name": "py-echo", "input": {"n": 20}, "group": "default"},
            ]
        )
        return {
            "first": first["nPlusOne"],
            "approval": approval,
            "child": child,
            "pair": [p["nPlusOne"] for p in pair],
            "startedIsMs": started > 10**12,
        }

    @flows.workflow("py.child")
    def child(ctx: Any, data: Any) -> Any:
        say(f"turn py.child {ctx.run_id}")
        return ctx.step("py-echo", {"n": data["n"]}, group="default")["nPlusOne"]

    @flows.workflow("py.slowturn")
    def slowturn(ctx: Any, data: Any) -> Any:
        say(f"turn py.slowturn {ctx.run_id}")
        # A local step that runs inside the turn: killing the process here
        # loses the turn (no decision ever comes).
        ctx.side_effect(lambda: time.sleep(data.get("seconds", 3)) or "slept")
        return ctx.step("py-echo", {"n": data["n"]}, group="default")["nPlusOne"]


async def main() -> None:
    url, prefix = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else None
    handles = []
    if mode is not None and mode.startswith("split:"):
        group = mode.removeprefix("split:")
        steps, flows = Worker(auto_register=False), WorkflowWorker(group=group, auto_register=False)
        build(steps, flows)
        handles.append(await run_redis_worker(steps, connection=url, prefix=prefix, concurrency=8))
        handles.append(
            await run_redis_workflow_worker(flows, group=group, connection=url, prefix=prefix)
        )
    else:
        worker = Worker(auto_register=False)
        build(worker, worker)
        handles.append(
            await run_redis_worker(
                worker, connection=url, prefix=prefix, partition=mode, concurrency=8
            )
        )
    say("READY")
    try:
        await asyncio.Event().wait()
    finally:
        for handle in handles:
            await handle.close()


if __name__ == "__main__":
    asyncio.run(main())
