"""``durably signal`` and ``durably events publish``: messages for waiting runs.

``signal TOKEN [JSON]`` reaches the one run waiting on ``TOKEN``;
``events publish NAME [JSON]`` reaches every run waiting for event ``NAME``
Either is buffered when nobody waits.
"""

from __future__ import annotations

import click

from ._cli_common import (
    EXIT_USAGE,
    CliError,
    json_option,
    one_line,
    open_client,
    parse_payload,
    run_sync,
    store_option,
)
from ._cli_render import json_text, visible
from .errors import DurablyError

__all__ = ["events", "signal_cmd"]


@click.command("signal")
@store_option
@click.argument("token")
@click.argument("payload", required=False, metavar="[JSON]")
@json_option
def signal_cmd(store_url: str, token: str, payload: str | None, as_json: bool) -> None:
    """Deliver a signal to the run waiting on TOKEN.

    The payload is JSON (default null); pass - to read it from stdin. When no
    run waits on TOKEN yet, the signal is buffered for the first run that does.
    """
    value = parse_payload(payload)

    async def go() -> str | None:
        async with open_client(store_url) as engine:
            try:
                return await engine.signal(token, value)
            except (ValueError, DurablyError) as exc:
                raise CliError(one_line(str(exc)), EXIT_USAGE) from None

    receiver = run_sync(go())
    if as_json:
        click.echo(json_text({"token": token, "delivered_to": receiver}))
    elif receiver is None:
        click.echo(
            f"no run waits on {visible(repr(token))} yet; "
            "the signal is buffered for the first one that does"
        )
    else:
        click.echo(f"delivered {visible(repr(token))} to run {visible(receiver)}")


@click.group()
def events() -> None:
    """Publish events to the runs waiting for them."""


@events.command("publish")
@store_option
@click.argument("name")
@click.argument("payload", required=False, metavar="[JSON]")
@click.option(
    "--id",
    "event_id",
    metavar="ID",
    help="Publish idempotently: publishing the same id again delivers nothing.",
)
@click.option(
    "--no-buffer",
    is_flag=True,
    help="Drop the event when no run waits for it (by default one copy is kept "
    "for the first matching wait).",
)
@json_option
def events_publish(
    store_url: str,
    name: str,
    payload: str | None,
    event_id: str | None,
    no_buffer: bool,
    as_json: bool,
) -> None:
    """Publish event NAME to every run waiting for it (ctx.wait_for_event).

    The payload is JSON (default null); pass - to read it from stdin. The
    workflows an application declares with on_event are not started: they are
    registered in the application, which this command does not load.
    """
    value = parse_payload(payload)

    async def go() -> int:
        async with open_client(store_url) as engine:
            try:
                return await engine.publish_event(name, value, id=event_id, buffer=not no_buffer)
            except (ValueError, DurablyError) as exc:
                raise CliError(one_line(str(exc)), EXIT_USAGE) from None

    received = run_sync(go())
    if as_json:
        click.echo(json_text({"event": name, "id": event_id, "received": received}))
    elif received:
        click.echo(f"published {visible(repr(name))} to {received} run(s)")
    elif no_buffer:
        click.echo(f"published {visible(repr(name))}; no run waits for it (dropped)")
    else:
        click.echo(
            f"published {visible(repr(name))}; no run waits for it yet, "
            "so it is kept for the first one that does"
        )
