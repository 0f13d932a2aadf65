"""``durably runs …``: list, inspect and operate the runs in a store.

A click group for the ``durably`` command to attach (``cli.add_command(runs)``);
other modules add their own subcommands with ``runs.add_command(...)``::

    durably runs list [--status …] [--workflow …] [--tag …] [--attr K=V …] [--limit N]
    durably runs list --stale [AGE]    live runs nothing moved for AGE (15m), with hints
    durably runs show RUN_ID           a run and its step timeline
    durably runs retry RUN_ID          run a failed or dead run again from where it failed
    durably runs resume RUN_ID         give a live run a turn now (after a lost wake-up)
    durably runs delete RUN_ID         delete a finished run and its history
    durably runs cancel RUN_ID         cancel a run (also ``durably cancel``)

The commands talk to the store only (``--store URL``, ``DURABLY_DATABASE_URL``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import click
from click.shell_completion import CompletionItem
from rich.text import Text

from ._cli_common import (
    DEFAULT_STORE,
    EXIT_USAGE,
    CliError,
    json_option,
    one_line,
    open_client,
    resume_run,
    run_sync,
    store_option,
)
from ._cli_liveness import Liveness, find_stale, liveness_table
from ._cli_render import (
    attributes_to_json,
    checkpoint_to_dict,
    json_text,
    make_console,
    render_run,
    run_to_dict,
    runs_table,
    visible,
)
from ._urls import redact_url
from .client import Client
from .durations import to_ms
from .engine import RunNotFound
from .errors import DurablyError
from .model import Run, RunStatus

__all__ = ["cancel", "no_such_run", "run_id_argument", "runs"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# How many of the newest runs shell completion offers (one query, no scan).
_COMPLETIONS = 200


def _complete_run_id(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Shell completion of a RUN_ID: the newest runs of the store whose id
    starts with what was typed. Completion must never print an error, so any
    failure (no store, a store that cannot be opened) completes nothing."""
    store_url = ctx.params.get("store_url") or os.environ.get("DURABLY_DATABASE_URL")

    async def newest() -> list[str]:
        async with open_client(store_url or DEFAULT_STORE) as engine:
            page = await engine.list_runs(limit=_COMPLETIONS)
            return [run.run_id for run in page.runs]

    try:
        ids = run_sync(newest())
    except Exception:
        return []
    # An id with control characters is never offered: the shell would put
    # them on the command line (and a newline splits the completions).
    return [
        CompletionItem(run_id)
        for run_id in ids
        if run_id.startswith(incomplete) and visible(run_id) == run_id
    ]


def run_id_argument(fn: F) -> F:
    """The ``RUN_ID`` argument, completed from the store's newest runs."""
    return click.argument("run_id", shell_complete=_complete_run_id)(fn)


def no_such_run(run_id: str, store_url: str) -> CliError:
    """The one-line error for a run id the store does not hold."""
    return CliError(f"no run with id {run_id!r} in {redact_url(store_url)}")


@click.group()
def runs() -> None:
    """List, inspect and operate runs."""


@runs.command("list", short_help="List runs, or the stale ones (--stale).")
@store_option
@click.option(
    "--status", type=click.Choice([s.value for s in RunStatus]), help="Only runs in this status."
)
@click.option("--workflow", metavar="NAME", help="Only runs of this workflow.")
@click.option("--tag", metavar="TAG", help="Only runs carrying this tag.")
@click.option(
    "--attr",
    "attrs",
    metavar="KEY<OP>VALUE",
    multiple=True,
    help="Only runs whose search attribute matches (repeatable, ANDed): OP is =, !=, <, <=, "
    ">, >=; VALUE is read as a number, true/false, an ISO datetime with a zone, or else "
    "text (quote it, '\"42\"', to force text).",
)
@click.option(
    "--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="Page size."
)
@click.option(
    "--cursor", metavar="CURSOR", help="Continue from the cursor a previous page printed."
)
@click.option(
    "--stale",
    metavar="AGE",
    is_flag=False,
    flag_value="15m",
    default=None,
    help="List instead the live runs nothing moved for AGE (default 15m), "
    "least recently updated first, with liveness columns and a hint for each.",
)
@json_option
def runs_list(
    store_url: str,
    status: str | None,
    workflow: str | None,
    tag: str | None,
    limit: int,
    cursor: str | None,
    stale: str | None,
    as_json: bool,
    attrs: tuple[str, ...] = (),
) -> None:
    """List runs, newest first, one page at a time (or the stale ones: --stale)."""
    if stale is not None:
        if attrs:
            raise CliError("--attr does not combine with --stale", EXIT_USAGE)
        _list_stale(store_url, stale, status, workflow, tag, limit, as_json)
        return
    filters = [parse_attribute_filter(text) for text in attrs]

    async def go() -> tuple[list[Any], str | None]:
        async with open_client(store_url) as engine:
            try:
                page = await engine.list_runs(
                    status=status,
                    workflow=workflow,
                    tag=tag,
                    attributes=filters,
                    limit=limit,
                    cursor=cursor,
                )
            except (TypeError, ValueError) as exc:
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


_FILTER = re.compile(r"^(?P<key>[^=!<>]+)(?P<op>!=|<=|>=|=|<|>)(?P<value>.*)$", re.DOTALL)
_OPS = {"=": "eq", "!=": "ne", "<": "lt", "<=": "lte", ">": "gt", ">=": "gte"}


def parse_attribute_filter(text: str) -> tuple[str, str, Any]:
    """``--attr total>=100`` → ``("total", "gte", 100)``, the value typed as
    it reads: an int, a float, true/false, an aware ISO datetime, else text
    (``"..."`` in double quotes is always text)."""
    found = _FILTER.match(text)
    if found is None:
        raise CliError(
            f"--attr {visible(text)}: expected KEY<OP>VALUE with OP one of = != < <= > >=",
            EXIT_USAGE,
        )
    key, value = found["key"].strip(), found["value"]
    return key, _OPS[found["op"]], _typed(value)


def _typed(value: str) -> Any:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    if value in ("true", "false"):
        return value == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    return moment if moment.tzinfo is not None else value


def _list_stale(
    store_url: str,
    age: str,
    status: str | None,
    workflow: str | None,
    tag: str | None,
    limit: int,
    as_json: bool,
) -> None:
    try:
        age_ms = to_ms(age, name="--stale")
    except ValueError as exc:
        raise CliError(one_line(str(exc)), EXIT_USAGE) from None

    def keep(run: Run) -> bool:
        return (
            (status is None or run.status == status)
            and (workflow is None or run.workflow == workflow)
            and (tag is None or tag in run.tags)
        )

    async def go() -> list[Liveness]:
        async with open_client(store_url) as engine:
            return await find_stale(engine, age_ms, limit, keep=keep)

    found = run_sync(go())
    if as_json:
        click.echo(json_text({"stale": [live.to_dict() for live in found]}))
        return
    console = make_console()
    if not found:
        console.print(f"No live run has been idle for {visible(age)} or more.")
        return
    console.print(liveness_table(found))
    console.print(f"[dim]{len(found)} run(s) idle for {visible(age)} or more[/dim]")


@runs.command("show")
@store_option
@run_id_argument
@json_option
def runs_show(store_url: str, run_id: str, as_json: bool) -> None:
    """Show a run and its step timeline."""

    async def go() -> tuple[Any, list[Any], dict[str, Any]]:
        async with open_client(store_url) as engine:
            run = await engine.get_run(run_id)
            if run is None:
                raise no_such_run(run_id, store_url)
            return run, await engine.history(run_id), await engine.get_attributes(run_id)

    run, checkpoints, attributes = run_sync(go())
    if as_json:
        click.echo(
            json_text(
                {
                    "run": run_to_dict(run),
                    "attributes": attributes_to_json(attributes),
                    "checkpoints": [checkpoint_to_dict(c) for c in checkpoints],
                }
            )
        )
        return
    make_console().print(render_run(run, checkpoints, attributes=attributes))


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
@run_id_argument
@json_option
def runs_cancel(store_url: str, run_id: str, as_json: bool) -> None:
    """Cancel a run (same as 'durably cancel')."""
    _cancel(store_url, run_id, as_json)


@click.command("cancel")
@store_option
@run_id_argument
@json_option
def cancel(store_url: str, run_id: str, as_json: bool) -> None:
    """Cancel a run. A finished run is left as it is."""
    _cancel(store_url, run_id, as_json)


def _operate(store_url: str, run_id: str, action: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``action`` on a client engine; an unknown run and a refused
    operation (a run in the wrong status) become one-line errors."""

    async def go() -> T:
        async with open_client(store_url) as engine:
            try:
                return await action(engine)
            except RunNotFound:
                raise no_such_run(run_id, store_url) from None
            except DurablyError as exc:
                raise CliError(one_line(str(exc))) from None

    return run_sync(go())


@runs.command("retry")
@store_option
@run_id_argument
@json_option
def runs_retry(store_url: str, run_id: str, as_json: bool) -> None:
    """Run a failed or dead run again from where it failed.

    Its failed steps (and failed children) run again; completed steps are
    not re-executed. A worker of the application executes it.
    """
    run = _operate(store_url, run_id, lambda engine: engine.retry(run_id))
    if as_json:
        click.echo(json_text({"run": run_to_dict(run)}))
    else:
        click.echo(f"retrying run {visible(run_id)}: {run.status.value}; a worker executes it")


@runs.command("resume")
@store_option
@run_id_argument
@json_option
def runs_resume(store_url: str, run_id: str, as_json: bool) -> None:
    """Give a live run a turn now (after a lost wake-up, say).

    Its waits are not skipped: a run sleeping or waiting for a signal checks
    and waits again. A blocked run goes back to pending for the workers to
    look at again. A finished run is left as it is (retry a failed one).
    """

    async def resume(engine: Client) -> tuple[Run, str]:
        return await resume_run(engine, run_id)

    run, action = _operate(store_url, run_id, resume)
    if as_json:
        click.echo(json_text({"run_id": run_id, "was": run.status.value, "action": action}))
        return
    shown = visible(run_id)
    if action == "finished":
        retry = " (durably runs retry runs it again)" * (
            run.status in (RunStatus.FAILED, RunStatus.DEAD)
        )
        click.echo(f"run {shown} is {run.status.value}; left unchanged{retry}")
    elif action == "queued":
        click.echo(f"run {shown} is pending already; the next worker poll takes it")
    elif action == "unblocked":
        click.echo(f"run {shown} was blocked; pending again for a worker that registers it")
    else:
        click.echo(f"woke run {shown} (it was {run.status.value}); a worker gives it a turn")


@runs.command("delete")
@store_option
@run_id_argument
@json_option
def runs_delete(store_url: str, run_id: str, as_json: bool) -> None:
    """Delete a finished run and its history (cancel a live run first)."""

    async def delete(engine: Client) -> bool:
        if not await engine.delete_run(run_id):
            raise RunNotFound(run_id)
        return True

    _operate(store_url, run_id, delete)
    if as_json:
        click.echo(json_text({"run_id": run_id, "deleted": True}))
    else:
        click.echo(f"deleted run {visible(run_id)}")
