"""The engine process the continue-as-new crash tests start; it SIGKILLs itself at one write.

Configured by environment variables:

- ``CAN_STORE``: the store URL (SQLite or PostgreSQL);
- ``CAN_LEDGER``: the effects file;
- ``CAN_INSTANCE``: the lease owner id (empty: a fresh one);
- ``CAN_KILL``: where to die, on the way from link ``KILL_LINK - 1`` to link
  ``KILL_LINK`` (empty: never):

  - ``before-create``: before the next link's row is inserted;
  - ``after-create``: once the next link's row is inserted, before the old
    link's terminal write;
  - ``after-settle``: once the old link's terminal write is done (the next
    link exists and was handed to this process's executor, which may or may
    not have started its first turn).

The hooks wrap the store object of *this* process only; the library is not
touched. Every link runs one step whose effect appends ``run_id seq pid`` to
the ledger, after checking the store: if that step's checkpoint already
completed it appends ``VIOLATION`` (a completed step executed again).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import durably
from durably.model import Run, RunStatus
from durably.stores.base import RunChanges

LINKS = 4
"""Links after the first: the chain is ``<id>``, ``<id>~1`` … ``<id>~LINKS``."""
KILL_LINK = 2

LEDGER = os.environ.get("CAN_LEDGER", "")
KILL = os.environ.get("CAN_KILL", "")


def expected_output(start: int) -> int:
    """What the last link of a chain started with ``{"n": 0, "acc": start}`` returns."""
    return start + sum(10 * n for n in range(LINKS + 1))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill_point(store: Any) -> None:
    """Wrap this process's store so it dies at ``CAN_KILL``."""
    target = f"~{KILL_LINK}"
    create_run, settle_run = store.create_run, store.settle_run

    async def create_run_then_maybe_die(run: Run) -> Any:
        if KILL == "before-create" and run.run_id.endswith(target):
            _die()
        result = await create_run(run)
        if KILL == "after-create" and run.run_id.endswith(target):
            _die()
        return result

    async def settle_run_then_maybe_die(
        run_id: str, owner: str, status: RunStatus, changes: RunChanges, now: int
    ) -> Any:
        result = await settle_run(run_id, owner, status, changes, now)
        continued = changes.output.get("continued_as") if isinstance(changes.output, dict) else None
        if KILL == "after-settle" and isinstance(continued, str) and continued.endswith(target):
            _die()
        return result

    store.create_run = create_run_then_maybe_die
    store.settle_run = settle_run_then_maybe_die


def build() -> durably.Engine:
    engine = durably.Engine(
        os.environ["CAN_STORE"],
        instance_id=os.environ.get("CAN_INSTANCE") or None,
        lease=os.environ.get("CAN_LEASE", "1s"),
        max_recovery_attempts=50,
        poll_interval=0.05,
    )

    async def effect(run_id: str, seq: int, value: int) -> int:
        """A side effect: recorded in the ledger, outside the engine."""
        line = f"{run_id} {seq} {os.getpid()}\n"
        done = await engine.store.get_checkpoint(run_id, seq)
        if done is not None and done.status.value == "completed":
            line = f"VIOLATION {line}"
        fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return value

    @engine.workflow("chain")
    async def chain(ctx: durably.WorkflowContext, state: dict[str, int]) -> int:
        n, acc = state["n"], state["acc"]
        acc += await ctx.local_step("work", effect, ctx.run_id, 0, 10 * n)
        if n < LINKS:
            ctx.continue_as_new({"n": n + 1, "acc": acc})
        return acc

    if KILL:
        _install_kill_point(engine.store)
    return engine


async def _serve() -> None:
    async with build():
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(_serve())
    except KeyboardInterrupt:
        sys.exit(0)
