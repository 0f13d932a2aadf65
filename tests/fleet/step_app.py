"""The process of the dispatched-step fleet tests: an engine, or a step worker,
on one PostgreSQL schema with the ``db`` transport.

Environment: ``STEPS_STORE`` (``postgresql://…?schema=NAME``), ``STEPS_LEDGER``
(a file every handler appends to), ``STEPS_ROLE`` (``engine``: drives runs and
serves no step; ``worker``: serves every step and drives nothing; ``both``),
``STEPS_INSTANCE`` (a name for the ledger).

Ledger lines: ``start <step_id> <attempt> <instance> <epoch ms>`` when a handler
begins and ``end <step_id> <attempt> <instance> <epoch ms>`` when it returns.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import durably

STORE = os.environ.get("STEPS_STORE", "")
LEDGER = os.environ.get("STEPS_LEDGER", "")
ROLE = os.environ.get("STEPS_ROLE", "both")
INSTANCE = os.environ.get("STEPS_INSTANCE", str(os.getpid()))

TIMEOUT_S = 1.0
THROTTLE_S = 1.0
WORK_S = 0.4
CAP = 2


def record(kind: str, log: durably.StepLogger) -> None:
    line = f"{kind} {log.step_id} {log.attempt} {INSTANCE} {int(time.time() * 1000)}\n"
    fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def build() -> durably.Engine:
    engine = durably.Engine(
        STORE,
        transport="db://",
        poll_interval=0.05,
        lease="5s",
        reconcile="3s",
        drive=ROLE != "worker",
        serve_steps=[] if ROLE == "engine" else None,
        remote_redispatch="3s",
        remote_redispatch_max=20,
        heartbeat_persist_throttle=THROTTLE_S,
        step_concurrency=8,
        instance_id=f"{INSTANCE}-{os.getpid()}",
    )
    engine.register_queue("cap", concurrency=CAP, retry="100ms")

    @engine.step("work")
    async def work(n: int, log: durably.StepLogger) -> int:
        record("start", log)
        await asyncio.sleep(WORK_S)
        record("end", log)
        return n * 2

    @engine.step("live", timeout=TIMEOUT_S, retries=5, backoff="fixed", backoff_base=0)
    async def live(n: int, log: durably.StepLogger) -> int:
        record("start", log)
        for _ in range(4):
            await asyncio.sleep(WORK_S / 4)
            log.heartbeat({"n": n})
        record("end", log)
        return n + 1

    @engine.step("capped", queue="cap")
    async def capped(n: int, log: durably.StepLogger) -> int:
        record("start", log)
        await asyncio.sleep(0.15)
        record("end", log)
        return n

    @engine.workflow("job")
    async def job(ctx: durably.WorkflowContext, n: int) -> int:
        doubled = await ctx.step("work", n)
        return int(await ctx.step("live", doubled))

    @engine.workflow("throttled")
    async def throttled(ctx: durably.WorkflowContext, n: int) -> int:
        return int(await ctx.step("capped", n))

    return engine


def expected_job(n: int) -> int:
    return n * 2 + 1


async def main() -> None:
    engine = build()
    async with engine:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
