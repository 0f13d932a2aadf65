"""OpenTelemetry: one trace per run across turns, engines and processes.

Spans are collected with the SDK's in-memory exporter; each engine gets its
own TracerProvider, as each process of a fleet would. A real ``durably
worker`` subprocess serving a dispatched step writes its spans to a file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import durably
import durably.otel
from durably.testing import eventually

from .conftest import SpawnWorker

pytestmark = pytest.mark.timeout(180)


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _one(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def _ids(span: ReadableSpan) -> tuple[int, int, int | None]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id, span.parent.span_id if span.parent else None


async def test_a_run_crossing_two_engines_is_one_trace_under_the_apps_span(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
) -> None:
    provider_a, spans_a = _provider()
    provider_b, spans_b = _provider()

    def build(provider: TracerProvider) -> durably.Engine:
        engine = durably.Engine(url, poll_interval=0.05)
        engine.use(durably.otel.tracing(provider))

        @engine.workflow("approve")
        async def approve(ctx: durably.WorkflowContext, n: int) -> int:
            first = await ctx.local_step("before", lambda: n)
            ok = await ctx.wait_for_signal("go")
            return int(await ctx.local_step("after", lambda: first + ok))

        return engine

    async with isolated_postgres() as url:
        first = build(provider_a)
        async with first:
            app_tracer = provider_a.get_tracer("the-app")
            with app_tracer.start_as_current_span("POST /approve"):
                run = await first.start("approve", 1, run_id="r1")
            await eventually(lambda: _status(first, "r1", durably.RunStatus.SUSPENDED))
        second = build(provider_b)
        async with second:
            assert await second.signal("go", 2) == "r1"
            result = await second.wait_for_run(run.run_id, terminal=True, timeout=60)
        assert result.output == 3

    a, b = spans_a.get_finished_spans(), spans_b.get_finished_spans()
    trace_id, app_id, _ = _ids(_one(a, "POST /approve"))
    start = _one(a, "durably.start approve")
    turn_1 = _one(a, "durably.turn approve")
    turn_2 = _one(b, "durably.turn approve")
    before = _one(a, "durably.step before")
    after = _one(b, "durably.step after")
    assert _ids(start)[::2] == (trace_id, app_id)  # the app's span is the run's parent
    start_id = _ids(start)[1]
    assert _ids(turn_1)[::2] == (trace_id, start_id)
    assert _ids(turn_2)[::2] == (trace_id, start_id)  # another engine, the same trace
    assert _ids(before)[::2] == (trace_id, _ids(turn_1)[1])
    assert _ids(after)[::2] == (trace_id, _ids(turn_2)[1])
    assert not [s for s in b if s.name == "durably.step before"]  # replayed: no span
    assert turn_1.attributes is not None and after.attributes is not None
    assert turn_1.attributes["durably.outcome"] == "suspended"
    assert turn_1.attributes["durably.run_id"] == "r1"
    assert dict(after.attributes) | {"durably.attempt": 1} == {
        "durably.run_id": "r1",
        "durably.workflow": "approve",
        "durably.step": "after",
        "durably.seq": 2,
        "durably.attempt": 1,
        "durably.step_kind": "local",
    }


async def _status(engine: durably.Engine, run_id: str, status: durably.RunStatus) -> bool:
    run = await engine.get_run(run_id)
    return run is not None and run.status is status


async def test_a_failed_attempt_records_its_error() -> None:
    provider, spans = _provider()
    engine = durably.Engine("memory://")
    engine.use(durably.otel.tracing(provider))

    def boom() -> None:
        raise ValueError("no")

    @engine.workflow("fails")
    async def fails(ctx: durably.WorkflowContext) -> None:
        await ctx.local_step("boom", boom, retries=1, backoff="fixed", backoff_base=0.01)

    async with engine:
        run = await engine.start("fails")
        assert (await engine.wait_for_run(run.run_id, terminal=True, timeout=30)).status == "failed"
    attempts = [s for s in spans.get_finished_spans() if s.name == "durably.step boom"]
    assert [s.attributes and s.attributes["durably.attempt"] for s in attempts] == [1, 2]
    assert all(s.status.status_code.name == "ERROR" and s.events for s in attempts)
    turn = _one(spans.get_finished_spans(), "durably.turn fails")
    assert turn.attributes is not None and turn.attributes["durably.outcome"] == "failed"


async def test_a_run_started_without_tracing_still_keeps_one_trace() -> None:
    provider, spans = _provider()
    engine = durably.Engine("memory://")

    @engine.workflow("naps")
    async def naps(ctx: durably.WorkflowContext) -> str:
        await ctx.sleep(0.05)
        return "rested"

    run = await engine.start("naps", run_id="untraced")  # no interceptor yet
    engine.use(durably.otel.tracing(provider))
    async with engine:
        await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
    turns = [s for s in spans.get_finished_spans() if s.name == "durably.turn naps"]
    assert len(turns) == 2
    assert {_ids(t)[0] for t in turns} == {durably.otel.run_trace_id("untraced")}


async def test_the_traceparent_rides_the_wire_to_a_durably_worker_process(
    isolated_postgres: Callable[[], AbstractAsyncContextManager[str]],
    tmp_path: Path,
    observed_worker: SpawnWorker,
) -> None:
    provider, spans = _provider()
    worker_spans = tmp_path / "worker-spans.jsonl"
    async with isolated_postgres() as url:
        engine = durably.Engine(url, transport="db://", poll_interval=0.05, serve_steps=[])
        engine.use(durably.otel.tracing(provider))

        @engine.workflow("far")
        async def far(ctx: durably.WorkflowContext, n: int) -> Any:
            return await ctx.step("observed.work", n)

        worker = observed_worker(url, OBSERVED_SPANS=str(worker_spans))
        try:
            async with engine:
                run = await engine.start("far", 7)
                result = await engine.wait_for_run(run.run_id, terminal=True, timeout=60)
            assert result.output is not None and result.output["done"] == 7
            assert result.output["pid"] == worker.pid
            await eventually(worker_spans.exists, what="the worker's spans")
        finally:
            await engine.close()
    [served] = [json.loads(line) for line in worker_spans.read_text().splitlines()]
    turns = [s for s in spans.get_finished_spans() if s.name == "durably.turn far"]
    dispatching = turns[0]
    trace_id, turn_id, _ = _ids(dispatching)
    assert served["name"] == "durably.step observed.work"
    assert (served["trace_id"], served["parent_id"]) == (trace_id, turn_id)
    assert served["attributes"]["durably.run_id"] == run.run_id
    assert served["attributes"]["durably.seq"] == 0
    assert served["attributes"]["durably.step_kind"] == "served"
    assert {_ids(t)[0] for t in turns} == {trace_id}
