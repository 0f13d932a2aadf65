"""``durably start WORKFLOW [JSON]``: start a run by workflow name.

The run is written to the store for the application's workers, without the
workflow registered here (see :func:`durably._cli_common.start_by_name`);
``--app`` starts it through the application's engine instead, which checks
the input first.
"""

from __future__ import annotations

import os
from datetime import datetime

import click
from click.core import ParameterSource

from ._cli_app import AppLoadError, load_engine
from ._cli_common import (
    EXIT_USAGE,
    CliError,
    json_option,
    one_line,
    open_client,
    parse_payload,
    run_sync,
    start_by_name,
    store_option,
)
from ._cli_render import json_text, run_to_dict, visible
from ._cli_worker import configure_worker
from .client import Client
from .durations import Duration, to_ms
from .engine import Engine
from .errors import DurablyError
from .model import Run

__all__ = ["parse_start_at", "start"]


def parse_start_at(text: str) -> datetime | Duration:
    """``--start-at``: a delay (``30s``, ``2h``) or an ISO-8601 time with a zone."""
    try:
        to_ms(text, name="--start-at")
        return text
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(
            f"--start-at must be a delay such as 30s or 2h, or an ISO-8601 time such as "
            f"2030-01-01T09:00:00Z; got {text!r}",
            EXIT_USAGE,
        ) from None
    if moment.tzinfo is None:
        raise CliError(
            f"--start-at {text!r} has no time zone; add one (2030-01-01T09:00:00Z, +02:00)",
            EXIT_USAGE,
        )
    return moment


@click.command("start", short_help="Start a run of a workflow by name.")
@store_option
@click.argument("workflow")
@click.argument("payload", required=False, metavar="[JSON]")
@click.option("--run-id", metavar="ID", help="The run's id (idempotent: an existing id is kept).")
@click.option(
    "--version",
    "version",
    metavar="VERSION",
    help="The workflow version (default: that of the workflow's newest run, else 1).",
)
@click.option("--tag", "tags", multiple=True, metavar="TAG", help="Tag the run (repeatable).")
@click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
@click.option(
    "--start-at",
    metavar="WHEN",
    help="Start later: a delay (30s, 2h) or an ISO-8601 time with a zone.",
)
@click.option(
    "--app",
    "app_spec",
    metavar="MODULE[:ATTR]",
    help="Start through this application's Engine: it checks the name and input and "
    "applies the workflow's execution_timeout (a run started by name alone has "
    "none); its store is used. The attribute defaults to 'engine'.",
)
@json_option
def start(
    store_url: str,
    workflow: str,
    payload: str | None,
    run_id: str | None,
    version: str | None,
    tags: tuple[str, ...],
    priority: int,
    start_at: str | None,
    app_spec: str | None,
    as_json: bool,
) -> None:
    """Start a run of WORKFLOW with JSON input (default null; - reads stdin).

    The run is queued in the store; a worker of the application (durably
    worker) executes it. A --run-id that exists already is left as it is.
    """
    value = parse_payload(payload, "input")
    when = parse_start_at(start_at) if start_at is not None else None

    if app_spec is not None:
        source = click.get_current_context().get_parameter_source("store_url")
        if source is not ParameterSource.DEFAULT:
            # Like `durably worker`: an Engine() built with the default store uses it.
            os.environ["DURABLY_DATABASE_URL"] = store_url

    async def go() -> tuple[Run, bool]:
        if app_spec is None:
            async with open_client(store_url) as client:
                return await _start(client)
        try:
            engine = load_engine(app_spec)
        except AppLoadError as exc:
            raise CliError(one_line(str(exc)), EXIT_USAGE) from None
        configure_worker(engine, drive=False)  # start it; never execute it in this process
        if workflow not in engine.workflows:
            # The app knows its workflows: a name it lacks is a typo, not a remote one.
            known = ", ".join(engine.workflows) or "none"
            raise CliError(
                f"{app_spec} registers no workflow {workflow!r} (it registers: {known})",
                EXIT_USAGE,
            )
        try:
            return await _start(engine)
        finally:
            await engine.close()

    async def _start(engine: Client | Engine) -> tuple[Run, bool]:
        try:
            return await start_by_name(
                engine,
                workflow,
                value,
                run_id=run_id,
                version=version,
                tags=list(tags),
                priority=priority,
                start_at=when,
            )
        except (ValueError, TypeError, DurablyError) as exc:
            raise CliError(one_line(str(exc)), EXIT_USAGE) from None

    run, created = run_sync(go())
    if as_json:
        click.echo(json_text({"run": run_to_dict(run), "created": created}))
        return
    what = (
        f"run {visible(run.run_id)} of {visible(run.workflow)} "
        f"(version {visible(run.workflow_version)})"
    )
    if not created:
        click.echo(f"{what} exists already ({run.status.value}); left as it is")
    elif run.wake_at is not None:
        click.echo(f"started {what}; it waits until {run_to_dict(run)['wake_at']}")
    else:
        click.echo(f"started {what}; a worker executes it")
