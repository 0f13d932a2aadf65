"""Prometheus metrics: fed by lifecycle events, scraped over HTTP, and served
by a real ``durably worker --metrics-port`` subprocess."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import durably
import durably.prometheus
from durably.testing import eventually

from .conftest import SpawnWorker

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_runs_steps_and_gauges_are_counted(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = durably.prometheus.metrics(registry)
    assert durably.prometheus.metrics(registry) is metrics  # one set per registry
    engine = durably.Engine(f"sqlite:///{tmp_path / 'm.db'}", poll_interval=0.05)
    engine.use(metrics)
    engine.register_queue("narrow", concurrency=1)

    def boom() -> None:
        raise ValueError("no")

    @engine.workflow("ok")
    async def ok(ctx: durably.WorkflowContext) -> int:
        await ctx.sleep(0.05)
        return int(await ctx.local_step("one", lambda: 1))

    @engine.workflow("bad")
    async def bad(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("boom", boom, retries=1, backoff="fixed", backoff_base=0.01)

    async with engine:
        runs = [await engine.start("ok") for _ in range(3)] + [await engine.start("bad")]
        for run in runs:
            await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
        await engine.start("ok", start_at=3600)  # suspended: not pending
        await metrics.sample(engine)
        port = _free_port()
        metrics.serve(port, "127.0.0.1")
        scraped = await asyncio.to_thread(_scrape, port)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("durably_runs_started_total", workflow="ok") == 3
    assert value("durably_turns_total", workflow="ok") == 6  # each run slept once
    assert value("durably_runs_ended_total", workflow="ok", status="completed") == 3
    assert value("durably_runs_ended_total", workflow="bad", status="failed") == 1
    labels = {"step": "boom", "kind": "local", "status": "failed"}
    assert value("durably_step_duration_seconds_count", **labels) == 2  # per attempt
    labels = {"step": "one", "kind": "local", "status": "completed"}
    assert value("durably_step_duration_seconds_count", **labels) == 3
    assert value("durably_timer_lag_seconds_count") == 3
    assert value("durably_pending_runs") == 0
    assert scraped[("durably_runs_started_total", (("workflow", "ok"),))] == 3


async def test_a_durably_worker_serves_metrics_on_its_port(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
    observed_worker: SpawnWorker,
) -> None:
    port = _free_port()
    async with isolated_postgres() as url:
        engine = durably.Engine(url, transport="db://", poll_interval=0.05, serve_steps=[])

        @engine.workflow("far")
        async def far(ctx: durably.WorkflowContext, n: int) -> Any:
            return await ctx.step("observed.work", n)

        worker = observed_worker(url, "--metrics-port", f"127.0.0.1:{port}")
        async with engine:
            runs = [await engine.start("far", n) for n in range(3)]
            for run in runs:
                result = await engine.wait_for_run(run.run_id, terminal=True, timeout=60)
                assert result.output is not None and result.output["pid"] == worker.pid

    served = (("kind", "served"), ("status", "completed"), ("step", "observed.work"))

    def scraped_all() -> dict[Any, float] | None:
        try:
            found = _scrape(port)
        except OSError:
            return None
        done = found.get(("durably_step_duration_seconds_count", served))
        return found if done == 3 else None

    scraped = await eventually(lambda: asyncio.to_thread(scraped_all), what="the scrape")
    assert scraped[("durably_step_queue_seconds_count", (("step", "observed.work"),))] == 3


@pytest.mark.parametrize("where", ["nope", "127.0.0.1:0", "99999"])
def test_a_bad_metrics_port_is_one_line_of_error(where: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("DURABLY_DATABASE_URL", None)
    command = [sys.executable, "-m", "durably", "worker", "--app", "observed_app:engine"]
    done = subprocess.run(
        [*command, "--store", f"sqlite:///{tmp_path / 'w.db'}", "--metrics-port", where],
        cwd=ROOT / "tests" / "apps",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"durably: error: --metrics-port needs [HOST:]PORT, not {where!r}"
    )
    assert "Traceback" not in done.stderr
