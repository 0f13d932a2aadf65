"""``durably runs …``: list, inspect and operate the runs in a store.

A click group for the ``durably`` command to attach (``cli.add_command(runs)``);
other modules add their own subcommands with ``runs.add_command(...)``::

    durably runs list [--status …] [--workflow …] [--tag …] [--stale [AGE]] [--limit N]
    durably runs show RUN_ID           a run and its step timeline
    durably runs cancel RUN_ID         cancel a run (also ``durably cancel``)

The commands talk to the store only (``--store URL``, ``DURABLY_DATABASE_URL``).
"""

from __future__ import annotations

from typing import Any

import click
from rich.text import Text

from ._cli_common import (
    EXIT_USAGE,
    CliError,
    json_option,
    one_line,
    open_client,
    run_sync,
    store_option,
)
from ._cli_render import (
    checkpoint_to_dict,
    json_text,
    make_console,
    render_run,
    run_to_dict,
    runs_table,
    visible,
)
from ._urls import redact_url
from .engine import RunNotFound
from .model import RunStatus

__all__ = ["cancel", "no_such_run", "runs"]


def no_such_run(run_id: str, store_url: str) -> CliError:
    """The one-line error for a run id the store does not hold."""
    return CliError(f"no run with id {run_id!r} in {redact_url(store_url)}")


@click.group()
def runs() -> None:
    """List, inspect and operate runs."""


@runs.command("list")
@store_option
@click.option(
    "--status", type=click.Choice([s.value for s in RunStatus]), help="Only runs in this status."
)
@click.option("--workflow", metavar="NAME", help="Only runs of this workflow.")
@click.option("--tag", metavar="TAG", help="Only runs carrying this tag.")
@click.option(
    "--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="Page size."
)
@click.option(
    "--cursor", metavar="CURSOR", help="Continue from the cursor a previous page printed."
)
@json_option
def runs_list(
    store_url: str,
    status: str | None,
    workflow: str | None,
    tag: str | None,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first, one page at a time."""

    async def go() -> tuple[list[Any], str | None]:
        async with open_client(store_url) as engine:
            try:
                page = await engine.list_runs(
                    status=status, workflow=workflow, tag=tag, limit=limit, cursor=cursor
                )
            except ValueError as exc:
                raise CliError(one_line(str(exc)), EXIT_USAGE) from None
            return page.runs, page.next_cursor

    found, next_cursor = run_sync(go())
    if as_json:
        click.echo(json_text({"runs": [run_to_dict(r) for r in found], "next_cursor": next_cursor}))
        return
    console = make_console()
    if not found:
        console.print("No runs match." if cursor is None else "No more runs.")
        return
    console.print(runs_table(found))
    if next_cursor:
        cursor_text = visible(next_cursor)
        console.print(Text(f"next cursor: {cursor_text}"))
        console.print(Text(f"(more runs: add --cursor {cursor_text})", style="dim"))
    else:
        console.print(f"[dim]{len(found)} run(s); end of list[/dim]")


@runs.command("show")
@store_option
@click.argument("run_id")
@json_option
def runs_show(store_url: str, run_id: str, as_json: bool) -> None:
    """Show a run and its step timeline."""

    async def go() -> tuple[Any, list[Any]]:
        async with open_client(store_url) as engine:
            run = await engine.get_run(run_id)
            if run is None:
                raise no_such_run(run_id, store_url)
            return run, await engine.history(run_id)

    run, checkpoints = run_sync(go())
    if as_json:
        click.echo(
            json_text(
                {
                    "run": run_to_dict(run),
                    "checkpoints": [checkpoint_to_dict(c) for c in checkpoints],
                }
            )
        )
        return
    make_console().print(render_run(run, checkpoints))


def _cancel(store_url: str, run_id: str, as_json: bool) -> None:
    async def go() -> RunStatus:
        async with open_client(store_url) as engine:
            try:
                return await engine.cancel(run_id)
            except RunNotFound:
                raise no_such_run(run_id, store_url) from None

    before = run_sync(go())
    if as_json:
        click.echo(
            json_text({"run_id": run_id, "cancelled": not before.is_terminal, "was": before.value})
        )
    elif before.is_terminal:
        click.echo(f"run {visible(run_id)} was already {before.value}; left unchanged")
    else:
        click.echo(f"cancelled run {visible(run_id)} (it was {before.value})")


@runs.command("cancel")
@store_option
@click.argument("run_id")
@json_option
def runs_cancel(store_url: str, run_id: str, as_json: bool) -> None:
    """Cancel a run (same as 'durably cancel')."""
    _cancel(store_url, run_id, as_json)


@click.command("cancel")
@store_option
@click.argument("run_id")
@json_option
def cancel(store_url: str, run_id: str, as_json: bool) -> None:
    """Cancel a run. A finished run is left as it is."""
    _cancel(store_url, run_id, as_json)
