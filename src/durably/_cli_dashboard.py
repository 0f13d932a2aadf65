"""``durably dashboard``: serve the web dashboard of a store.

Listens on 127.0.0.1 unless told otherwise, and refuses to listen anywhere
else without ``DURABLY_DASHBOARD_TOKEN``: a dashboard cancels and retries
runs, so it never opens to a network by accident.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os

import click

from ._cli_common import EXIT_USAGE, CliError, json_option, open_client, store_option

__all__ = ["dashboard", "is_loopback"]

DEFAULT_PORT = 8765


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


@click.command("dashboard")
@store_option
@click.option("--host", default="127.0.0.1", show_default=True, help="The interface to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--read-only", is_flag=True, help="Show everything, change nothing.")
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between the live view's polls of the store.",
)
@json_option
def dashboard(
    store_url: str, host: str, port: int, read_only: bool, poll_interval: float, as_json: bool
) -> None:
    """Serve the web dashboard (runs, a run's timeline, actions, schedules, a JSON API).

    Off the loopback interface it needs DURABLY_DASHBOARD_TOKEN: browsers log
    in with it, API clients send it as a bearer token.
    """
    token = os.environ.get("DURABLY_DASHBOARD_TOKEN")
    if token is not None and not token.strip():
        raise CliError("DURABLY_DASHBOARD_TOKEN is set but empty", EXIT_USAGE)
    if not is_loopback(host) and not token:
        raise CliError(
            f"refusing to serve the dashboard on {host} without authentication: "
            "set DURABLY_DASHBOARD_TOKEN (or bind 127.0.0.1)",
            EXIT_USAGE,
        )
    try:
        import uvicorn

        from . import dashboard as web
    except ImportError as exc:
        raise CliError(
            f"the dashboard needs its extra: pip install 'durably[dashboard]' ({exc})"
        ) from None

    async def serve() -> None:
        async with open_client(store_url) as engine:
            app = web.app(engine, token=token, read_only=read_only, poll_interval=poll_interval)
            config = uvicorn.Config(app, host=host, port=port, log_level="warning")
            server = uvicorn.Server(config)
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{port}/"
            if as_json:
                click.echo(json.dumps({"url": url, "read_only": read_only, "auth": bool(token)}))
            else:
                click.echo(f"durably dashboard on {url}", err=True)
            await server.serve()

    asyncio.run(serve())
