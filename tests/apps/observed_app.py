"""The worker app of the observability tests: ``durably worker --app observed_app:engine``.

A steps-only worker (``drive=False``) on the ``db://`` transport serving
``observed.work``. With ``OBSERVED_SPANS`` set it traces with
:mod:`durably.otel`, writing every finished span as one JSON line to that file
(the test process reads them: the spans of another process).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import durably


def work(data: Any) -> dict[str, Any]:
    """The dispatched step."""
    return {"done": data, "pid": os.getpid()}


engine = durably.Engine(transport="db://", drive=False, poll_interval=0.1)
engine.step("observed.work")(work)

if os.environ.get("OBSERVED_SPANS"):
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    import durably.otel

    class _LineExporter(SpanExporter):
        def __init__(self, path: str) -> None:
            self._path = path

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with open(self._path, "a") as out:
                for span in spans:
                    context = span.get_span_context()
                    assert context is not None
                    out.write(
                        json.dumps(
                            {
                                "name": span.name,
                                "trace_id": context.trace_id,
                                "span_id": context.span_id,
                                "parent_id": span.parent.span_id if span.parent else None,
                                "attributes": dict(span.attributes or {}),
                            }
                        )
                        + "\n"
                    )
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_LineExporter(os.environ["OBSERVED_SPANS"])))
    engine.use(durably.otel.tracing(provider))
