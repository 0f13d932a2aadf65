"""The web dashboard: ``durably.dashboard.app(engine_or_client)`` is a
Starlette app to mount at any prefix, or to serve with ``durably dashboard``.

Server-rendered HTML (Jinja2, plain forms, a few lines of script for live
updates over server-sent events), and a JSON API under ``/api`` described by
``/api/openapi.json``. Needs the ``dashboard`` extra.

    import durably.dashboard
    app.mount("/durably", durably.dashboard.app(engine, token=os.environ["TOKEN"]))
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from functools import wraps

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ._api import Api
from ._backend import DashboardBackend, DashboardStore
from ._live import ChangeSource, PollingChanges
from ._pages import Pages
from ._security import AuthHook, Guard, SecurityHeaders
from ._state import DashboardState

__all__ = ["TOKEN_ENV", "AuthHook", "ChangeSource", "DashboardBackend", "DashboardStore", "app"]

TOKEN_ENV = "DURABLY_DASHBOARD_TOKEN"
"""The environment variable ``app()`` reads its token from when given none."""

Endpoint = Callable[[Request], Awaitable[Response]]


def app(
    backend: DashboardBackend,
    *,
    token: str | None = None,
    auth: AuthHook | None = None,
    read_only: bool = False,
    live: ChangeSource | None = None,
    poll_interval: float = 1.0,
) -> Starlette:
    """The dashboard of ``backend`` (an ``Engine`` or a ``Client``) as an ASGI app.

    ``auth`` (``request -> bool``, sync or async) decides who gets in;
    otherwise ``token`` (default: ``$DURABLY_DASHBOARD_TOKEN``) is required as
    a bearer header or through the login form; with neither the dashboard is
    open, for a host app that guards the mount itself; a blank token raises
    ``ValueError`` here, never an open dashboard. ``read_only`` hides
    and refuses every action. ``live`` replaces the store polling (every
    ``poll_interval`` seconds) that feeds the live view.
    """
    if token is None:
        # Set but blank is a misconfiguration: Guard refuses it at boot
        # rather than serving an open dashboard.
        token = os.environ.get(TOKEN_ENV)
    guard = Guard(token=token, auth=auth, read_only=read_only)
    state = DashboardState(backend, guard)
    pages = Pages(state)
    api = Api(state, live or PollingChanges(backend, poll_interval))

    def page(endpoint: Endpoint, *, write: bool = False) -> Endpoint:
        @wraps(endpoint)
        async def guarded(request: Request) -> Response:
            if not await guard.allowed(request):
                if guard.uses_login:
                    root = request.scope.get("root_path", "")
                    return RedirectResponse(f"{root}/login", 303)
                return pages.render(request, "error.html", 403, message="not allowed")
            if write:
                form = await request.form()
                offered = form.get("csrf")
                refusal = guard.write_refusal(
                    request, offered if isinstance(offered, str) else None
                )
                if refusal is not None:
                    return pages.render(request, "error.html", 403, message=refusal)
            return await endpoint(request)

        return guarded

    def api_route(endpoint: Endpoint, *, write: bool = False) -> Endpoint:
        @wraps(endpoint)
        async def guarded(request: Request) -> Response:
            if not await guard.allowed(request):
                modes = ["bearer", "session"] if guard.uses_login else ["hook"]
                return JSONResponse({"error": "unauthorized", "auth": modes}, status_code=401)
            if write:
                refusal = guard.write_refusal(request, None)
                if refusal is not None:
                    return JSONResponse({"error": refusal}, status_code=403)
            return await endpoint(request)

        return guarded

    routes = [
        Route("/", page(pages.runs), name="runs"),
        Route("/runs/{run_id:path}", page(pages.run), name="run"),
        Route("/schedules", page(pages.schedules), name="schedules"),
        Route("/queues", page(pages.queues), name="queues"),
        Route("/actions/{action}", page(pages.post_run_action, write=True), methods=["POST"]),
        Route("/bulk/{action}", page(pages.post_bulk, write=True), methods=["POST"]),
        Route("/schedules/{action}", page(pages.post_schedule, write=True), methods=["POST"]),
        Route("/login", pages.login, methods=["GET", "POST"]),
        Route("/logout", pages.logout, methods=["POST"]),
        Route("/api/openapi.json", api_route(api.openapi)),
        Route("/api/runs", api_route(api.runs)),
        Route("/api/runs/{run_id:path}", api_route(api.run)),
        Route("/api/actions/{action}", api_route(api.action, write=True), methods=["POST"]),
        Route("/api/bulk/{action}", api_route(api.bulk, write=True), methods=["POST"]),
        Route("/api/schedules", api_route(api.schedules)),
        Route("/api/queues", api_route(api.queues)),
        Route(
            "/api/schedules/{action}", api_route(api.schedule_action, write=True), methods=["POST"]
        ),
        Route("/api/stream", api_route(api.stream)),
        Mount("/static", StaticFiles(packages=[("durably.dashboard", "static")]), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)])
