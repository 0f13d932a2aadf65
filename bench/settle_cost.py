"""Client CPU and wall time of one ``claim_and_resolve`` (PostgreSQL): results settled off
the message queue in batches of B, each batch leasing the runs it wakes.

    python settle_cost.py --batch 1 --batches 300
    PYTHONPATH=/tmp/before/src python settle_cost.py ...   # another tree (before/after)

Each batch: B suspended runs parked on a dispatched step, their B results queued, then one
timed ``claim_and_resolve`` taking and settling them. Counts asyncpg round trips too.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from common import make_target, prepare_workdir, reset_target

from durably._queue import Message, OutMessage
from durably.model import CheckpointStatus
from durably.stores.base import Resolution
from durably.testing.conformance.stores.steps import (
    _make_cp,
    dispatched_cp,
    lease_to,
    parked,
)

_trips = [0]


def _count_trips() -> None:
    from asyncpg.connection import Connection

    execute, do_execute = Connection.execute, Connection._do_execute

    async def counted_execute(self: Any, query: str, *args: Any, **kw: Any) -> Any:
        if not args:
            _trips[0] += 1
        return await execute(self, query, *args, **kw)

    async def counted_do_execute(self: Any, *args: Any, **kw: Any) -> Any:
        _trips[0] += 1
        return await do_execute(self, *args, **kw)

    Connection.execute = counted_execute  # type: ignore[method-assign]
    Connection._do_execute = counted_do_execute  # type: ignore[method-assign]


def _decode(messages: list[Message]) -> tuple[None, list[Resolution]]:
    out = []
    for m in messages:
        run_id, seq = m.body.rsplit(":", 1)
        out.append(Resolution(run_id, int(seq), CheckpointStatus.COMPLETED, output={"n": m.body}))
    return None, out


async def main(args: argparse.Namespace) -> None:
    from durably.stores.postgres import PostgresStore

    target = make_target("postgres", "bench_settle", prepare_workdir(".work"))
    await reset_target(target)
    store = PostgresStore(target.url)
    await store.open()
    try:
        await store.messages().depth([])
        cpu = wall = 0.0
        trips = 0
        for b in range(args.warmup + args.batches):
            runs = [f"r{b}-{i}" for i in range(args.batch)]
            for run_id in runs:
                step = dispatched_cp(run_id, 1, queue=None)
                await parked(store, _make_cp(run_id, 0, output=0), step)
            await store.messages().push([OutMessage("results", f"{r}:1") for r in runs])
            _trips[0] = 0
            c0, w0 = time.process_time(), time.perf_counter()
            got = await store.claim_and_resolve(
                ["results"], 256, 2**62, _decode, 1_700_000_000_100, lease_to()
            )
            c1, w1 = time.process_time(), time.perf_counter()
            assert len(got.leased) == args.batch, got
            if b >= args.warmup:
                cpu += c1 - c0
                wall += w1 - w0
                trips += _trips[0]
        n = args.batches
        print(
            f"batch of {args.batch}: client CPU {cpu * 1e6 / n:.0f} us,"
            f" wall {wall * 1e6 / n:.0f} us, round trips {trips / n:.1f} per claim_and_resolve"
        )
    finally:
        await store.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    parsed = p.parse_args()
    _count_trips()
    asyncio.run(main(parsed))
