"""The engine worker process of the fleet tests: several of them share one
PostgreSQL schema, are killed with SIGKILL and restarted.

Configured by environment variables so the test and the processes agree:
``FLEET_STORE`` (``postgresql://…?schema=NAME``), ``FLEET_LEDGER`` (effects
file), ``FLEET_INSTANCE`` (lease owner id; empty for a fresh one per process),
``FLEET_NAMESPACE`` (the pool to drive; empty: every pool), ``FLEET_POLL``
(seconds between worker ticks), ``FLEET_RECONCILE`` (the engine's
``reconcile``), ``FLEET_GATES`` (directory of the files the ``gated``
workflow's step waits on and of the markers below), ``FLEET_STALL`` (a store
method, e.g. ``create_runs``: its first call writes ``<gates>/stalled.<method>``
and never returns, so the test can SIGKILL the process exactly there).

Every effect appends ``run_id seq pid`` to the ledger (one ``O_APPEND`` write)
and first reads its own checkpoint over a separate asyncpg connection: if it
is already ``completed``, the line starts with ``VIOLATION`` — a completed
step executed again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import durably

STORE = os.environ.get("FLEET_STORE", "")
LEDGER = os.environ.get("FLEET_LEDGER", "")
GATES = os.environ.get("FLEET_GATES", "")
STEP_DELAY = 0.005
SLEEP = 0.2
SIGNAL_ADD = 1000
WORKFLOWS = ("steps", "signal", "fan", "leaf", "where", "gated")

_pool: Any = None
_pool_lock: asyncio.Lock | None = None


def split_schema(url: str) -> tuple[str, str | None]:
    """Take the ``schema`` query parameter out of a store URL (asyncpg rejects it)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    schema = next((value for key, value in query if key == "schema"), None)
    rest = urlencode([(key, value) for key, value in query if key != "schema"])
    return urlunsplit(parts._replace(query=rest)), schema


async def _checkpoint_status(run_id: str, seq: int) -> str | None:
    """The stored status of checkpoint ``(run_id, seq)``, read outside the engine."""
    global _pool, _pool_lock
    if _pool is None:
        import asyncpg

        if _pool_lock is None:
            _pool_lock = asyncio.Lock()
        async with _pool_lock:
            if _pool is None:
                dsn, schema = split_schema(STORE)
                settings = {"search_path": f'"{schema}"'} if schema else {}
                _pool = await asyncpg.create_pool(
                    dsn, min_size=1, max_size=4, server_settings=settings
                )
    status: str | None = await _pool.fetchval(
        "SELECT status FROM durably_checkpoints WHERE run_id = $1 AND seq = $2", run_id, seq
    )
    return status


def append_ledger(line: str) -> None:
    fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


async def effect(run_id: str, seq: int, value: int) -> int:
    """A side effect: recorded in the ledger, outside the engine."""
    line = f"{run_id} {seq} {os.getpid()}\n"
    if await _checkpoint_status(run_id, seq) == "completed":
        line = f"VIOLATION {line}"
    await asyncio.sleep(random.uniform(0, STEP_DELAY))
    append_ledger(line)
    return value + seq


# -- the workflows (seqs are fixed, so the ledger can be checked position by position) --


async def steps(ctx: durably.WorkflowContext, n: int) -> int:
    """Two effects around a short durable sleep (seq 1)."""
    first = await ctx.local_step("first", effect, ctx.run_id, 0, n)
    await ctx.sleep(SLEEP)
    return await ctx.local_step("second", effect, ctx.run_id, 2, first)


async def signalled(ctx: durably.WorkflowContext, n: int) -> int:
    """An effect, a wait for ``sig:<run_id>`` (seq 1), an effect with its payload."""
    first = await ctx.local_step("first", effect, ctx.run_id, 0, n)
    payload = await ctx.wait_for_signal(f"sig:{ctx.run_id}")
    return await ctx.local_step("second", effect, ctx.run_id, 2, first + int(payload["add"]))


async def fan(ctx: durably.WorkflowContext, width: int) -> int:
    """``width`` children (seqs 0..width-1), then one effect at seq ``width``."""
    results = await ctx.all([ctx.child("leaf", i) for i in range(width)])
    return await ctx.local_step("total", effect, ctx.run_id, width, sum(results))


async def leaf(ctx: durably.WorkflowContext, i: int) -> int:
    return await ctx.local_step("leaf", effect, ctx.run_id, 0, i)


async def where(ctx: durably.WorkflowContext) -> int:
    """One effect: the ledger's pid tells which pool executed the run."""
    return await ctx.local_step("where", effect, ctx.run_id, 0, 0)


def _mark(path: Path) -> None:
    path.write_text(str(os.getpid()))


def _is_open(gate: Path) -> bool:
    return gate.exists()


async def wait_for_gate(run_id: str) -> str:
    """Say the step started (``<run_id>.started``), then hold until ``<run_id>.go``."""
    _mark(Path(GATES, f"{run_id}.started"))
    for _ in range(3000):
        if _is_open(Path(GATES, f"{run_id}.go")):
            return "slow-done"
        await asyncio.sleep(0.02)
    raise RuntimeError("the gate never opened")


async def gated(ctx: durably.WorkflowContext) -> dict[str, Any]:
    """A signal wait in parallel with a step that is held open by the test."""
    payload, slow = await asyncio.gather(
        ctx.wait_for_signal(f"gate:{ctx.run_id}"),
        ctx.local_step("slow", wait_for_gate, ctx.run_id),
    )
    return {"signal": payload, "slow": slow}


def register(engine: durably.Engine) -> None:
    engine.register("steps", steps)
    engine.register("signal", signalled)
    engine.register("fan", fan)
    engine.register("leaf", leaf)
    engine.register("where", where)
    engine.register("gated", gated)


def expected_steps(n: int) -> int:
    return n + 2


def expected_signal(n: int) -> int:
    return n + SIGNAL_ADD + 2


def expected_fan(width: int) -> int:
    return sum(range(width)) + width


class StallingStore:
    """A store whose ``method`` hangs forever once called: the process is
    stuck right before that write, where the test kills it."""

    def __init__(self, inner: Any, method: str) -> None:
        self._inner = inner
        self._method = method

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name != self._method:
            return attribute

        async def stall(*args: Any, **kwargs: Any) -> Any:
            _mark(Path(GATES, f"stalled.{name}"))
            await asyncio.Event().wait()

        return stall


async def _serve() -> None:
    options: dict[str, Any] = {}
    if os.environ.get("FLEET_NAMESPACE"):
        options["namespace"] = os.environ["FLEET_NAMESPACE"]
    if os.environ.get("FLEET_RECONCILE"):
        options["reconcile"] = os.environ["FLEET_RECONCILE"]
    store: Any = STORE
    if os.environ.get("FLEET_STALL"):
        from durably.stores.postgres import PostgresStore

        store = StallingStore(PostgresStore(STORE), os.environ["FLEET_STALL"])
    engine = durably.Engine(
        store,
        instance_id=os.environ.get("FLEET_INSTANCE") or None,
        lease=os.environ.get("FLEET_LEASE", "2s"),
        poll_interval=float(os.environ.get("FLEET_POLL", "0.05")),
        max_recovery_attempts=50,
        # Runs travel through the db transport's run queue (FLEET_TRANSPORT=local:// for the
        # poll-only path).
        transport=os.environ.get("FLEET_TRANSPORT", "db://"),
        **options,
    )
    register(engine)
    async with engine:
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        asyncio.run(_serve())
    except KeyboardInterrupt:
        sys.exit(0)
