"""Messages per run when one instance starts runs in bursts while another consumes them and
sweeps for pending runs (``transport="db://"`` on PostgreSQL), of one or more durably trees,
interleaved (a fresh interpreter and schema per sample).

The consumer's sweep (once a second at most, while the queue holds no runs) can find a run the
producer has inserted and not pushed yet, and queue it too: a second message, claim and
delivery check. Counted, not timed (``sweeps``: calls of the sweep, most of them skipped
as within a second of the last; ``run_reads``: ``get_runs`` reads the consumer made for
them):

    python bench/dup_starts.py --variants before=/tmp/before/src,after=src --repeat 3

Each sample runs on a fresh schema of ``BENCH_PG_URL`` (default the local ``test`` database,
suffixed with ``BENCH_DB_SUFFIX``) and drops it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import asyncio, json, sys, uuid
import asyncpg
import durably

BURSTS, SIZE, GAP, BASE = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

async def main():
    schema = f"durably_dup_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(BASE)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    url = f"{BASE}?schema={schema}"
    try:
        producer = durably.Engine(url, transport="db://", drive=False)
        consumer = durably.Engine(url, transport="db://", poll_interval=0.05)
        for engine in (producer, consumer):
            @engine.workflow("short")
            async def short(ctx, n):
                return await ctx.local_step("a", lambda: n + 1)
        sweeps = [0, 0]
        sweep = consumer._worker.run_pending
        async def counted(limit=1000):
            n = await sweep(limit)
            sweeps[0] += 1
            sweeps[1] += n
            return n
        consumer._worker.run_pending = counted
        reads = [0]
        runs_of = consumer._router.runs_of
        async def read(ids):
            reads[0] += 1
            return await runs_of(ids)
        consumer._router.runs_of = read
        async with producer, consumer:
            ids = []
            for b in range(BURSTS):
                runs = await asyncio.gather(
                    *(producer.start("short", i, run_id=f"b{b}-{i}") for i in range(SIZE))
                )
                ids += [r.run_id for r in runs]
                await asyncio.sleep(GAP)
            for run_id in ids:
                res = await consumer.wait_for_run(run_id, terminal=True, timeout=120)
                assert res.status is durably.RunStatus.COMPLETED, res
            for _ in range(200):
                if consumer._run_queue.held == 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            out = {
                "runs": len(ids),
                "pushed_producer": producer._run_queue.pushed,
                "pushed_consumer": consumer._run_queue.pushed,
                "consumed": consumer._run_queue.consumed,
                "sweeps": sweeps[0],
                "swept": sweeps[1],
                "run_reads": reads[0],
            }
        print(json.dumps(out))
    finally:
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()

asyncio.run(main())
"""


def main() -> None:
    """Run the samples, alternating the variants, and print each and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="after=src", help="name=path/to/src,...")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=200)
    parser.add_argument("--size", type=int, default=10)
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between bursts")
    args = parser.parse_args()
    base = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    variants = [part.split("=", 1) for part in args.variants.split(",")]
    samples: dict[str, list[dict[str, int]]] = {name: [] for name, _ in variants}
    for _ in range(args.repeat):
        for name, src in variants:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            argv = [str(args.bursts), str(args.size), str(args.gap), base]
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, *argv],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            sample = json.loads(done.stdout.strip().splitlines()[-1])
            samples[name].append(sample)
            print(name, sample, flush=True)
    for name, got in samples.items():
        per_run = [(s["pushed_producer"] + s["pushed_consumer"]) / s["runs"] for s in got]
        delivered = [s["consumed"] / s["runs"] for s in got]
        dup = [s["pushed_consumer"] for s in got]
        print(
            f"{name}: messages/run median {statistics.median(per_run):.4f} "
            f"({min(per_run):.4f}-{max(per_run):.4f}), deliveries/run median "
            f"{statistics.median(delivered):.4f} ({min(delivered):.4f}-{max(delivered):.4f}), "
            f"sweep pushes median {statistics.median(dup)} ({min(dup)}-{max(dup)})"
        )


if __name__ == "__main__":
    main()
