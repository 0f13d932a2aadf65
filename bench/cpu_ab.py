"""CPU time per step of two durably trees, robust to a busy machine.

Wall-clock benchmarks (``compare.py``, ``ab.py``) measure what users feel, but on a shared
2-core machine under load their spread hides a 20% change. This measures *process CPU time*
(``time.process_time``) of N workflows of K local steps on the memory or SQLite store, in a
fresh interpreter per sample, alternating the trees, so waiting for the CPU costs nothing.
It sees the Python cost of the engine's hot path; it does not see the database's.

    python bench/cpu_ab.py --variants before=/tmp/before/src,after=src --store sqlite
    python bench/cpu_ab.py ... --payload model   # each step returns an annotated pydantic model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import asyncio, json, os, sys, time
import durably

N, K, STORE, PAYLOAD = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

if PAYLOAD == "model":
    import datetime, decimal, pydantic

    class Receipt(pydantic.BaseModel):
        order: int
        total: decimal.Decimal
        paid_at: datetime.datetime
        lines: list[str]

    def step(i) -> Receipt:  # typed: decoded into Receipt where the tree can
        return Receipt(order=i, total=decimal.Decimal("9.90"), lines=["a", "b"],
                       paid_at=datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc))
else:
    def step(i):
        return i

async def main():
    engine = durably.Engine(STORE, poll_interval=0.2)

    @engine.workflow("wf")
    async def wf(ctx, n):
        total = 0
        for i in range(K):
            await ctx.local_step(f"s{i}", step, i)
        return total

    async with engine:
        warm = [await engine.start("wf", 0) for _ in range(20)]
        for run in warm:
            await engine.wait_for_run(run.run_id, terminal=True, timeout=60)
        cpu0 = time.process_time()
        runs = await asyncio.gather(*(engine.start("wf", i) for i in range(N)))
        for run in runs:
            await engine.wait_for_run(run.run_id, terminal=True, timeout=300)
        cpu = time.process_time() - cpu0
    print(json.dumps({"cpu_us_per_step": cpu / (N * K) * 1e6}))

asyncio.run(main())
"""


def sample(src: str, n: int, k: int, store: str, payload: str = "int") -> float:
    with tempfile.TemporaryDirectory() as tmp:
        url = "memory://" if store == "memory" else f"sqlite:///{tmp}/b.db"
        env = {**os.environ, "PYTHONPATH": src}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(n), str(k), url, payload],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["cpu_us_per_step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", required=True, help="name=path/to/src,name=path/to/src")
    p.add_argument("--store", default="sqlite", choices=["memory", "sqlite"])
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--payload",
        default="int",
        choices=["int", "model"],
        help="what each step returns: an int, or a pydantic model (a typed step)",
    )
    args = p.parse_args()
    variants = [tuple(v.split("=", 1)) for v in args.variants.split(",")]
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(args.repeat):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name, src in order:
            samples[name].append(
                sample(os.path.abspath(src), args.n, args.k, args.store, args.payload)
            )
    print(
        f"CPU µs per step, {args.store}, N={args.n} K={args.k}, payload {args.payload}, "
        f"{args.repeat} samples each"
    )
    base = statistics.median(samples[variants[0][0]])
    for name, _ in variants:
        values = samples[name]
        med = statistics.median(values)
        print(
            f"  {name:<10} median {med:7.1f}  min {min(values):7.1f}  max {max(values):7.1f}"
            f"  ({med / base:5.2f}x of {variants[0][0]})"
        )


if __name__ == "__main__":
    main()
