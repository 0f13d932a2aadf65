"""The JSON API under ``<prefix>/api`` (described by :data:`._openapi.OPENAPI`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ._actions import ActionError, bulk, run_action, schedule_action
from ._filters import BULK_CAP, COUNT_CAP, FilterError, RunFilter
from ._live import ChangeSource, now_ms
from ._openapi import OPENAPI
from ._runview import candidates, lineage, timeline, waits
from ._serialize import iso, run_json, run_summary, schedule_json
from ._state import DashboardState
from ._tree import Node, children_tree

__all__ = ["Api"]


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class Api:
    """The JSON endpoints over one :class:`DashboardState`."""

    def __init__(self, state: DashboardState, live: ChangeSource) -> None:
        self.state = state
        self.live = live

    async def runs(self, request: Request) -> Response:
        """``GET /api/runs``: a page of runs, the next cursor and the counts."""
        try:
            flt = RunFilter.parse(request.query_params)
        except FilterError as exc:
            return _error(str(exc), 400)
        store = await self.state.store()
        page, counts = await asyncio.gather(
            store.list_runs(flt.query()), store.count_runs(flt.query(), COUNT_CAP)
        )
        return JSONResponse(
            {
                "runs": [run_summary(r) for r in page.runs],
                "next_cursor": page.next_cursor,
                "counts": counts,
                "count_cap": COUNT_CAP,
                "filter": flt.as_json(),
            }
        )

    async def run(self, request: Request) -> Response:
        """``GET /api/runs/{run_id}``: the run, its timeline, waits, children, lineage."""
        run_id = request.path_params["run_id"]
        store = await self.state.store()
        backend = self.state.backend
        run = await backend.get_run(run_id)
        if run is None:
            return _error(f"no run {run_id!r}", 404)
        history, (children, more_children), linked = await asyncio.gather(
            backend.history(run_id),
            children_tree(store, run_id),
            store.get_runs(candidates(run_id)),
        )
        links = lineage(run, {r.run_id for r in linked})
        return JSONResponse(
            {
                "run": run_json(run),
                "timeline": [bar.as_json() for bar in timeline(run, history, now_ms())],
                "waiting": [vars_of(w) for w in waits(run, history)],
                "children": [_node_json(node) for node in children],
                "more_children": more_children,
                "lineage": vars_of(links),
            }
        )

    async def action(self, request: Request) -> Response:
        """``POST /api/actions/{action}`` with a JSON object holding ``run_id``."""
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        await self.state.store()
        try:
            message = await run_action(self.state.backend, request.path_params["action"], body)
        except ActionError as exc:
            return _error(str(exc), exc.status)
        return JSONResponse({"ok": True, "message": message})

    async def bulk(self, request: Request) -> Response:
        """``POST /api/bulk/{cancel|retry}`` with the list's filter as the query string."""
        try:
            flt = RunFilter.parse(request.query_params)
            await self.state.store()
            result = await bulk(self.state.backend, request.path_params["action"], flt)
        except FilterError as exc:
            return _error(str(exc), 400)
        except ActionError as exc:
            return _error(str(exc), exc.status)
        return JSONResponse({"matched": result.matched, "applied": result.applied, "cap": BULK_CAP})

    async def schedules(self, request: Request) -> Response:
        """``GET /api/schedules``."""
        await self.state.store()
        found = await self.state.backend.list_schedules()
        return JSONResponse({"schedules": [schedule_json(s) for s in found]})

    async def queues(self, request: Request) -> Response:
        """``GET /api/queues``."""
        store = await self.state.store()
        found = await store.list_queues()
        return JSONResponse(
            {
                "queues": [
                    {
                        "queue": q.queue,
                        "held": q.held,
                        "waiting": q.waiting,
                        "oldest_wait_at": iso(q.oldest_wait_at),
                    }
                    for q in found
                ]
            }
        )

    async def schedule_action(self, request: Request) -> Response:
        """``POST /api/schedules/{action}`` with ``{"name": …}``."""
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        await self.state.store()
        try:
            message = await schedule_action(
                self.state.backend, request.path_params["action"], str(body.get("name") or "")
            )
        except ActionError as exc:
            return _error(str(exc), exc.status)
        return JSONResponse({"ok": True, "message": message})

    async def stream(self, request: Request) -> Response:
        """``GET /api/stream``: server-sent ``runs`` events, one per batch of
        changed runs (``?run=ID`` narrows to that run and its children; with
        ``since`` too, the run's stream sends one event at once, after its
        first reading: the page was rendered before it began)."""
        await self.state.store()
        only = request.query_params.get("run")
        since_text = request.query_params.get("since", "")
        since = int(since_text) if since_text.isdigit() else now_ms()

        async def events() -> AsyncIterator[dict[str, str]]:
            if only is not None:
                async for _ in self.live.run_changes(only, resync=bool(since_text)):
                    yield {"event": "runs", "data": json.dumps([{"run_id": only}])}
            async for batch in self.live.changes(since):
                data = json.dumps([run_summary(r) for r in batch])
                yield {"event": "runs", "data": data}

        return EventSourceResponse(events(), ping=15)

    async def openapi(self, request: Request) -> Response:
        """``GET /api/openapi.json``."""
        document = dict(OPENAPI)
        document["servers"] = [{"url": request.scope.get("root_path", "") or "/"}]
        return JSONResponse(document)


def _node_json(node: Node) -> dict[str, Any]:
    return {
        **run_summary(node.run),
        "children": [_node_json(child) for child in node.children],
        "more_children": node.more,
    }


def vars_of(value: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict."""
    return {name: getattr(value, name) for name in value.__slots__}


async def _json_body(request: Request) -> dict[str, Any] | Response:
    try:
        body = await request.json()
    except ValueError:
        return _error("the body must be a JSON object", 400)
    if not isinstance(body, dict):
        return _error("the body must be a JSON object", 400)
    return body
