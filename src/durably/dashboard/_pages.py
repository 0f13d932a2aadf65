"""The HTML pages: the runs list, a run, the schedules, the login form, and
the form posts behind their buttons (each answers a redirect back)."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from ..model import RunStatus
from ._actions import ActionError, bulk, run_action, schedule_action
from ._filters import COUNT_CAP, FilterError, RunFilter
from ._live import now_ms
from ._runview import axis, candidates, lineage, pretty, timeline, waits
from ._security import CSRF_COOKIE, SESSION_COOKIE, SESSION_TTL_S
from ._serialize import iso
from ._state import DashboardState
from ._tree import children_tree

__all__ = ["Pages"]

_BARS_SHOWN = 500  # a long history renders its start; the JSON API has all of it


def _environment() -> Environment:
    # autoescape on every template: a stored payload is text, never markup.
    env = Environment(
        loader=PackageLoader("durably.dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["iso"] = lambda ms: (iso(ms) or "").replace("T", " ").replace("+00:00", "Z")
    env.filters["q"] = lambda text: quote(str(text), safe="")
    env.filters["pretty"] = pretty
    env.filters["ms"] = _duration
    env.filters["when"] = _when
    return env


def _when(value: Any) -> str:
    # A log line's time: epoch ms from our workers, ISO text from others.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (iso(int(value)) or "").replace("T", " ").replace("+00:00", "Z")
    return str(value or "")


def _duration(ms: int | None) -> str:
    if ms is None:
        return ""
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    if ms < 3_600_000:
        return f"{ms / 60_000:.1f} min"
    return f"{ms / 3_600_000:.1f} h"


class Pages:
    """The HTML endpoints over one :class:`DashboardState`."""

    def __init__(self, state: DashboardState) -> None:
        self.state = state
        self.env = _environment()

    def render(self, request: Request, template: str, status: int = 200, **values: Any) -> Response:
        """A page, with the CSRF cookie its forms need."""
        csrf = self.state.guard.csrf_token(request)
        html = self.env.get_template(template).render(
            base=request.scope.get("root_path", ""),
            csrf=csrf,
            read_only=self.state.guard.read_only,
            login=self.state.guard.uses_login,
            notice=request.query_params.get("notice"),
            statuses=[s.value for s in RunStatus],
            **values,
        )
        response = HTMLResponse(html, status_code=status)
        if request.cookies.get(CSRF_COOKIE) != csrf:
            response.set_cookie(
                CSRF_COOKIE, csrf, path=self.state.cookie_path(request), samesite="strict"
            )
        return response

    # -- pages --------------------------------------------------------------------------

    async def runs(self, request: Request) -> Response:
        """The runs list."""
        try:
            flt = RunFilter.parse(request.query_params)
        except FilterError as exc:
            return self.render(request, "error.html", 400, message=str(exc))
        store = await self.state.store()
        page, counts = await asyncio.gather(
            store.list_runs(flt.query()), store.count_runs(flt.query(), COUNT_CAP)
        )
        return self.render(
            request,
            "runs.html",
            flt=flt,
            runs=page.runs,
            next_href=flt.href(cursor=page.next_cursor) if page.next_cursor else None,
            first_href=flt.href(cursor=None) if flt.cursor else None,
            counts=counts,
            total=sum(counts.values()),
            cap=COUNT_CAP,
            capped=any(n >= COUNT_CAP for n in counts.values()),
            since_ms=now_ms(),
        )

    async def run(self, request: Request) -> Response:
        """One run: its data, timeline, waits, children, lineage and actions."""
        run_id = request.path_params["run_id"]
        backend = self.state.backend
        await self.state.store()
        run = await backend.get_run(run_id)
        if run is None:
            return self.render(request, "error.html", 404, message=f"no run {run_id!r}")
        history, (children, more_children), linked = await asyncio.gather(
            backend.history(run_id),
            children_tree(backend.store, run_id),
            backend.store.get_runs(candidates(run_id)),
        )
        now = now_ms()
        bars = timeline(run, history, now)
        return self.render(
            request,
            "run.html",
            run=run,
            bars=bars[:_BARS_SHOWN],
            more_bars=max(0, len(bars) - _BARS_SHOWN),
            ticks=axis(run, history, now),
            waits=waits(run, history),
            children=children,
            more_children=more_children,
            lineage=lineage(run, {r.run_id for r in linked}),
            terminal=RunStatus(run.status).is_terminal,
            retryable=run.status in (RunStatus.FAILED, RunStatus.DEAD),
            has_pending_steps=any(
                str(cp.kind) == "step" and str(cp.status) == "pending" for cp in history
            ),
            since_ms=now,
        )

    async def schedules(self, request: Request) -> Response:
        """The schedules with their next fire times."""
        await self.state.store()
        found = await self.state.backend.list_schedules()
        return self.render(request, "schedules.html", schedules=found)

    async def queues(self, request: Request) -> Response:
        """Flow-control queues: slots held, steps waiting."""
        store = await self.state.store()
        return self.render(request, "queues.html", queues=await store.list_queues())

    # -- form posts ---------------------------------------------------------------------

    async def post_run_action(self, request: Request) -> Response:
        """A run's button: do it, then back to the run with a notice."""
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        run_id = fields.get("run_id", "")
        await self.state.store()
        try:
            notice = await run_action(self.state.backend, request.path_params["action"], fields)
        except ActionError as exc:
            notice = f"refused: {exc}"
        target = f"/runs/{quote(run_id, safe='')}" if run_id else "/"
        return self._back(request, target, notice)

    async def post_bulk(self, request: Request) -> Response:
        """Cancel or retry every run of the list's filter (up to the cap)."""
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        try:
            flt = RunFilter.parse(fields)
            await self.state.store()
            result = await bulk(self.state.backend, request.path_params["action"], flt)
            action = request.path_params["action"]
            notice = f"{action}: matched {result.matched}, applied {result.applied}"
            if result.capped:
                notice += " (the first 500 only)"
        except (ActionError, FilterError) as exc:
            flt, notice = RunFilter(), f"refused: {exc}"
        return self._back(request, "/" + flt.href(cursor=None), notice)

    async def post_schedule(self, request: Request) -> Response:
        """A schedule's button."""
        form = await request.form()
        name = form.get("name")
        await self.state.store()
        try:
            notice = await schedule_action(
                self.state.backend,
                request.path_params["action"],
                name if isinstance(name, str) else "",
            )
        except ActionError as exc:
            notice = f"refused: {exc}"
        return self._back(request, "/schedules", notice)

    def _back(self, request: Request, target: str, notice: str) -> Response:
        joiner = "&" if "?" in target else "?"
        url = f"{request.scope.get('root_path', '')}{target}{joiner}{urlencode({'notice': notice})}"
        return RedirectResponse(url, status_code=303)

    # -- login ---------------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        """The login form (GET) and its check (POST): a signed session cookie."""
        guard = self.state.guard
        if not guard.uses_login:
            return RedirectResponse(f"{request.scope.get('root_path', '')}/", 303)
        if request.method == "GET":
            return self.render(request, "login.html", 200, failed=False)
        form = await request.form()
        offered = form.get("token")
        refusal = guard.write_refusal(request, _text(form.get("csrf")), changes_state=False)
        if refusal is not None or not guard.check_login(
            offered if isinstance(offered, str) else ""
        ):
            return self.render(request, "login.html", 401, failed=True)
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/", 303)
        response.set_cookie(
            SESSION_COOKIE,
            guard.new_session(),
            max_age=SESSION_TTL_S,
            path=self.state.cookie_path(request),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        """End the session."""
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/login", 303)
        response.delete_cookie(SESSION_COOKIE, path=self.state.cookie_path(request))
        return response


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
