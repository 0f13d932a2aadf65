"""``durably schedules …``: list, pause, resume, trigger and remove schedules.

A click group for the ``durably`` command to attach (``cli.add_command(schedules)``)::

    durably schedules list [--json]       every schedule with its state and next window
    durably schedules pause NAME          stop firing NAME (all instances, across restarts)
    durably schedules resume NAME         fire again from the next window after now
    durably schedules trigger NAME        start a run now (queued for the next worker pass)
    durably schedules remove NAME         delete NAME (one declared in code returns on restart)

The commands talk to the store only (``--store URL``, ``DURABLY_DATABASE_URL``),
like the other client commands. A worker of the application starts a triggered
run at its next firing pass, since only it has the workflow registered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import click
from rich import box
from rich.table import Table
from rich.text import Text

from ._cli_common import CliError, json_option, open_client, store_option
from ._cli_render import (
    abbreviate,
    format_time,
    iso_times,
    json_text,
    make_console,
    plain,
    visible,
)
from .client import Client
from .errors import DurablyError
from .schedules import Schedule, ScheduleNotFound

__all__ = ["schedules", "schedules_table"]

T = TypeVar("T")


def _with_client(store_url: str, action: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``action`` on a client opened on ``store_url``; an unknown
    schedule becomes a one-line CLI error."""

    async def go() -> T:
        async with open_client(store_url) as client:
            try:
                return await action(client)
            except ScheduleNotFound as exc:
                raise CliError(str(exc)) from None

    coro: Coroutine[Any, Any, T] = go()
    return asyncio.run(coro)


def _when(schedule: Schedule) -> str:
    if schedule.cron is not None:
        return schedule.cron if schedule.tz == "UTC" else f"{schedule.cron} ({schedule.tz})"
    return f"every {_interval(schedule.every_ms or 0)}"


def _interval(ms: int) -> str:
    """``900000`` → ``15m``; ``5400000`` → ``1h30m`` (the ``every=`` spelling)."""
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        count, ms = divmod(ms, size)
        if count:
            parts.append(f"{count}{unit}")
    if ms:
        parts.append(f"{ms}ms")
    return "".join(parts) or "0s"


def schedules_table(found: list[Schedule]) -> Table:
    """The ``durably schedules list`` table."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("workflow")
    table.add_column("when")
    table.add_column("state")
    table.add_column("next window")
    table.add_column("last window")
    table.add_column("last run", no_wrap=True)
    table.add_column("input")
    namespaces = {s.namespace for s in found}
    for s in found:
        state = "paused" if s.paused else "active"
        if s.overlap != "skip":
            state += f", overlap={s.overlap}"
        if s.catchup:
            state += ", catch-up"
        name = s.name if namespaces == {"default"} else f"{s.namespace}/{s.name}"
        table.add_row(
            plain(name),
            plain(s.workflow),
            plain(_when(s)),
            plain(state, style="yellow" if s.paused else ""),
            "-" if s.paused else format_time(s.next_fire_at),
            format_time(s.last_fired_at),
            plain(s.last_run_id or "-"),
            Text(abbreviate(s.input, 40)) if s.input is not None else "",
        )
    return table


@click.group()
def schedules() -> None:
    """List, pause, resume, trigger and remove schedules."""


@schedules.command("list")
@store_option
@json_option
def schedules_list(store_url: str, as_json: bool) -> None:
    """List every schedule (all namespaces) with its state and next window."""

    async def load(client: Client) -> list[Schedule]:
        return [Schedule.from_record(r) for r in await client.store.list_schedules()]

    found = _with_client(store_url, load)
    if as_json:
        click.echo(json_text([iso_times(s.to_dict()) for s in found]))
        return
    console = make_console()
    if not found:
        console.print("No schedules.")
        return
    console.print(schedules_table(found))


@schedules.command("pause")
@store_option
@click.argument("name")
@json_option
def schedules_pause(store_url: str, name: str, as_json: bool) -> None:
    """Stop firing NAME until it is resumed (for every instance, across restarts)."""
    paused = _with_client(store_url, lambda client: client.pause_schedule(name))
    if as_json:
        click.echo(json_text(iso_times(paused.to_dict())))
    else:
        click.echo(f"paused schedule {visible(name)}")


@schedules.command("resume")
@store_option
@click.argument("name")
@json_option
def schedules_resume(store_url: str, name: str, as_json: bool) -> None:
    """Fire NAME again from its next window (windows missed while paused are skipped)."""
    resumed = _with_client(store_url, lambda client: client.resume_schedule(name))
    if as_json:
        click.echo(json_text(iso_times(resumed.to_dict())))
        return
    click.echo(f"resumed schedule {visible(name)}; next window {format_time(resumed.next_fire_at)}")


@schedules.command("trigger")
@store_option
@click.argument("name")
@json_option
def schedules_trigger(store_url: str, name: str, as_json: bool) -> None:
    """Start a run of NAME now, outside its windows (even while paused).

    The run is queued on the schedule; the next worker pass of the
    application (which has the workflow registered) starts it.
    """

    async def trigger(client: Client) -> str:
        try:
            return await client.trigger_schedule(name)
        except ScheduleNotFound:
            raise
        except DurablyError as exc:
            raise CliError(str(exc)) from None

    run_id = _with_client(store_url, trigger)
    if as_json:
        click.echo(json_text({"schedule": name, "run_id": run_id}))
        return
    click.echo(
        f"queued run {visible(run_id)} of schedule {visible(name)}; "
        "a worker starts it on its next pass"
    )


@schedules.command("remove")
@store_option
@click.argument("name")
@json_option
def schedules_remove(store_url: str, name: str, as_json: bool) -> None:
    """Delete schedule NAME (runs it started are kept). A schedule declared in
    the application's code comes back when the application starts again."""
    if not _with_client(store_url, lambda client: client.remove_schedule(name)):
        raise CliError(f"no schedule named {name!r}")
    if as_json:
        click.echo(json_text({"schedule": name, "removed": True}))
    else:
        click.echo(f"removed schedule {visible(name)}")
