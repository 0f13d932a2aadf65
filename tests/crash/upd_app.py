"""The engine process the update crash tests start; it SIGKILLs itself around one update.

Configured by environment variables:

- ``UPD_STORE``: the store URL (SQLite or PostgreSQL);
- ``UPD_INSTANCE``: the lease owner id (empty: a fresh one);
- ``UPD_KILL``: where to die while handling update ``u{KILL_AT}`` (empty: never):

  - ``in-handler``: inside the handler, after it changed the workflow's state;
  - ``before-answer``: the handler ran, nothing of it is written yet;
  - ``after-answer``: the history entry and the answer are committed, and
    nothing after that happened.

The hooks wrap the store object of *this* process only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import durably

KILL_AT = 3
KILL = os.environ.get("UPD_KILL", "")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill_point(store: Any) -> None:
    answer_update = store.answer_update

    async def answer_then_maybe_die(
        run_id: str, update_id: str, answer: Any, now: int, **kwargs: Any
    ) -> Any:
        doomed = update_id == f"u{KILL_AT}"
        if KILL == "before-answer" and doomed:
            _die()
        result = await answer_update(run_id, update_id, answer, now, **kwargs)
        if KILL == "after-answer" and doomed:
            _die()
        return result

    store.answer_update = answer_then_maybe_die


def build() -> durably.Engine:
    engine = durably.Engine(
        os.environ["UPD_STORE"],
        instance_id=os.environ.get("UPD_INSTANCE") or None,
        lease=os.environ.get("UPD_LEASE", "1s"),
        max_recovery_attempts=50,
        poll_interval=0.05,
    )

    @engine.workflow("tally")
    async def tally(ctx: durably.WorkflowContext) -> dict[str, Any]:
        applied: list[int] = []

        def add(n: int) -> int:
            applied.append(n)
            if KILL == "in-handler" and n == KILL_AT:
                _die()
            return sum(applied)

        ctx.on_update("add", add)
        await ctx.wait_for_signal(f"done:{ctx.run_id}")
        return {"applied": applied, "total": sum(applied)}

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
