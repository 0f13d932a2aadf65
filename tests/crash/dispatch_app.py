"""The engine process of the dispatched-step crash tests (``db://`` on SQLite).

It drives runs and settles step results but serves no step (the test process
does). ``CRASH_KILL_AT`` makes it SIGKILL itself once, at one moment:

- ``checkpoint``: right after a dispatched step's pending checkpoint committed
  (before anything else the engine does next);
- ``settle``: as it turns a batch of taken step results into the settle's
  resolutions (after the results were claimed, before they are settled);
- ``held``: once a turn holding across a step (``step_hold``) has heard its
  result: the receiver settled the step, the turn continued it in memory,
  and its next write may or may not have been queued;
- ``born``: this engine serves the step too (its handler never completes
  here), so its tasks are born claimed (inserted held by this process, with
  a 1 s lease); it dies once such an insert committed, before the handler
  runs. It prints ``born`` (or ``claimed``, had a claimed task reached its
  handler first) just before.

Configured by ``CRASH_DB``, ``CRASH_INSTANCE`` and ``CRASH_LEASE`` as ``app.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import durably
from durably.model import CheckpointStatus
from durably.steps import _dispatcher
from durably.stores import SqliteStore

DB = os.environ.get("CRASH_DB", "")
KILL_AT = os.environ.get("CRASH_KILL_AT", "")
STEPS = 3


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_after_dispatched_checkpoint() -> None:
    """Wrap every checkpoint write: SIGKILL once a pending dispatched one commits."""
    for name in ("save_checkpoint", "save_checkpoint_sending"):
        original = getattr(SqliteStore, name, None)
        if original is None:
            continue

        def wrapped(self: Any, checkpoint: Any, *args: Any, _original: Any = original) -> Any:
            future = _original(self, checkpoint, *args)
            if checkpoint.status is CheckpointStatus.PENDING and checkpoint.dispatched_at:
                future.add_done_callback(lambda f: _die() if not f.exception() else None)
            return future

        setattr(SqliteStore, name, wrapped)


def _kill_while_settling() -> None:
    """SIGKILL as results become resolutions: inside the settle's transaction
    where results are taken there, after their claim committed elsewhere."""
    resolutions = _dispatcher.StepDispatcher._resolutions

    def dying(self: Any, results: Any, marks: Any) -> Any:
        if results:  # a poll that found nothing settles nothing
            _die()
        return resolutions(self, results, marks)

    _dispatcher.StepDispatcher._resolutions = dying  # type: ignore[method-assign]
    original = _dispatcher.StepDispatcher.on_results

    async def on_results(self: Any, results: Any) -> None:
        _die()
        await original(self, results)

    _dispatcher.StepDispatcher.on_results = on_results  # type: ignore[method-assign]


def _kill_when_a_hold_hears() -> None:
    """SIGKILL inside the turn that just heard its step's result in memory."""
    from durably.steps._holds import LiveHolds

    def heard(self: Any, name: str, latency_ms: float) -> None:
        _die()

    LiveHolds.heard = heard  # type: ignore[method-assign]


def _kill_when_born() -> None:
    """SIGKILL once a write carrying a born claimed task committed."""
    from durably.transports.db import DbTransport

    born = DbTransport._born

    def dying(self: Any, messages: Any, generation: int, answer: Any, written: Any) -> None:
        if not written.cancelled() and written.exception() is None and written.result():
            print("born", flush=True)
            _die()
        born(self, messages, generation, answer, written)

    DbTransport._born = dying  # type: ignore[method-assign]


async def work(data: Any) -> int:
    """The step's handler in the ``born`` engine: never completes here."""
    print("claimed", flush=True)
    _die()
    raise AssertionError("unreachable")


async def pipeline(ctx: durably.WorkflowContext, n: int) -> int:
    total = n
    for seq in range(STEPS):
        total = int(await ctx.step("work", [ctx.run_id, seq, total]))
    return total


async def _serve() -> None:
    store: Any = f"sqlite:///{DB}"
    transport: Any = "db://"
    if KILL_AT == "born":
        from durably.transports.db import DbTransport

        store = SqliteStore(store)
        transport = DbTransport(store, lease_ms=1000, poll_interval=0.05)
    engine = durably.Engine(
        store,
        transport=transport,
        instance_id=os.environ.get("CRASH_INSTANCE") or None,
        lease=os.environ.get("CRASH_LEASE", "1s"),
        max_recovery_attempts=50,
        poll_interval=0.05,
        serve_steps=["work"] if KILL_AT == "born" else [],
        step_hold="250ms",  # at most a quarter of the 1 s lease
    )
    engine.register("pipeline", pipeline)
    if KILL_AT == "born":
        engine.register_step("work", work)
        _kill_when_born()
    if KILL_AT == "checkpoint":
        _kill_after_dispatched_checkpoint()
    elif KILL_AT == "settle":
        _kill_while_settling()
    elif KILL_AT == "held":
        _kill_when_a_hold_hears()
    async with engine:
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(_serve())
    except KeyboardInterrupt:
        sys.exit(0)
