"""An engine process that SIGKILLs itself at one write of a composition feature.

Configured by environment variables:

- ``COMPOSE_STORE``: the store URL (SQLite or PostgreSQL);
- ``COMPOSE_LEDGER``: a file each child body / undo appends one line to;
- ``COMPOSE_RUN``: the workflow to start (``spawner-join``, ``spawner-forget``,
  ``saga``, ``batch``);
- ``COMPOSE_KILL``: where to die:

  - ``before-create``: as the children's rows are about to be inserted
    (their placeholders are stored already);
  - ``after-create``: once the children's rows are inserted, before the
    parent's turn ends;
  - ``after-first-undo``: once the result of the first dispatched undo of the
    ``saga`` run (at seq -3: the stack unwinds last in, first out) is stored,
    before the run is woken for the next one;
  - ``after-second-item``: once the ``batch`` run's wait for its second event
    took a buffered one (the store recorded it), before anything else.

The hooks wrap the store object of *this* process only; the test builds the
same engine (:func:`build`) as the survivor that takes the run over.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import durably
from durably.model import Run
from durably.stores.base import Resolution

KIDS = 3
"""Children each spawner starts."""


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _append(ledger: str, line: str) -> None:
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def install_kill_point(store: Any, kill: str) -> None:
    """Wrap ``store`` so this process dies at ``kill``."""
    create_runs = store.create_runs

    async def create_runs_then_maybe_die(runs: list[Run]) -> Any:
        kids = any(run.run_id.startswith("kid-") for run in runs)
        if kill == "before-create" and kids:
            _die()
        created = await create_runs(runs)
        if kill == "after-create" and kids:
            _die()
        return created

    resolve_checkpoints = store.resolve_checkpoints

    async def resolve_then_maybe_die(resolutions: list[Resolution], now: int) -> Any:
        answers = await resolve_checkpoints(resolutions, now)
        if kill == "after-first-undo" and any(r.seq == -3 for r in resolutions):
            _die()
        return answers

    # Results may settle through either call (resolve_and_lease also leases
    # the runs they wake): the kill point must follow both.
    resolve_and_lease = store.resolve_and_lease

    async def resolve_and_lease_then_maybe_die(
        resolutions: list[Resolution], now: int, lease: Any
    ) -> Any:
        answers = await resolve_and_lease(resolutions, now, lease)
        if kill == "after-first-undo" and any(r.seq == -3 for r in resolutions):
            _die()
        return answers

    wait_event = store.wait_event

    async def wait_event_then_maybe_die(checkpoint: Any, *args: Any) -> Any:
        answer = await wait_event(checkpoint, *args)
        # Positions: 0 the first event, 1 the window's opening, 2 the second event.
        if kill == "after-second-item" and checkpoint.seq == 2:
            _die()
        return answer

    store.wait_event = wait_event_then_maybe_die
    store.create_runs = create_runs_then_maybe_die
    store.resolve_checkpoints = resolve_then_maybe_die
    store.resolve_and_lease = resolve_and_lease_then_maybe_die


def build(store: str, ledger: str, **options: Any) -> durably.Engine:
    """The app's engine (the doomed process's and the survivor's)."""
    # A run suspended mid-unwind whose wake died with its process is found by
    # the reconcile wake: kept short so the survivor finds it soon.
    engine = durably.Engine(store, poll_interval=0.05, reconcile="2s", **options)

    @engine.workflow("kid")
    async def kid(ctx: durably.WorkflowContext, n: int) -> int:
        _append(ledger, f"kid {ctx.run_id}")
        return n * 10

    @engine.workflow("spawner-join")
    async def spawner_join(ctx: durably.WorkflowContext) -> int:
        handles = [ctx.start_child("kid", n, run_id=f"kid-{n}") for n in range(KIDS)]
        return sum(await ctx.all([h.result() for h in handles]))

    @engine.workflow("spawner-forget")
    async def spawner_forget(ctx: durably.WorkflowContext) -> str:
        for n in range(KIDS):
            ctx.start_child("kid", n, run_id=f"kid-{n}", detached=True)
        return "started"

    @engine.step("book")
    async def book(what: str) -> str:
        return f"booked {what}"

    @engine.step("unbook", retries=0)
    async def unbook(data: dict[str, Any]) -> None:
        _append(ledger, f"undo {data['output']}")

    @engine.step("fail", retries=0)
    async def fail(_: Any) -> None:
        raise durably.FatalError("nothing left", code="sold_out")

    @engine.workflow("saga")
    async def saga(ctx: durably.WorkflowContext) -> None:
        await ctx.step(book, "a", compensate=unbook)
        await ctx.step(book, "b", compensate="unbook")
        await ctx.step(fail, None)

    @engine.workflow("batch")
    async def batch(ctx: durably.WorkflowContext) -> list[Any]:
        return await ctx.wait_for_events("item", max_items=3, window="1h")

    return engine


async def main() -> None:
    engine = build(
        os.environ["COMPOSE_STORE"], os.environ["COMPOSE_LEDGER"], lease="1s", instance_id="doomed"
    )
    install_kill_point(engine.store, os.environ.get("COMPOSE_KILL", ""))
    async with engine:
        if os.environ["COMPOSE_RUN"] == "batch":
            for n in range(2):
                await engine.publish_event("item", n)  # buffered for the run
        await engine.start(os.environ["COMPOSE_RUN"], run_id="parent")
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
