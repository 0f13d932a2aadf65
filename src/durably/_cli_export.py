"""``durably runs export`` and ``durably replay-check``: record a run's history,
and check that the current code still replays it.

    durably runs export RUN_ID > history.json     the run and its checkpoints as JSON
    durably replay-check --app mod:engine history.json [more.json …]

``replay-check`` exits 0 when every history replays, 1 naming the first
diverging position of the first that does not (see
:func:`durably.testing.assert_replayable`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from ._cli_app import AppLoadError, load_engine
from ._cli_common import EXIT_USAGE, CliError, json_option, open_client, store_option
from ._cli_render import json_text
from ._history import history_to_json
from ._urls import redact_url
from .testing.replay import ReplayMismatch, check_replay

__all__ = ["add_commands"]


@click.command("export")
@store_option
@json_option
@click.argument("run_id")
def runs_export(store_url: str, as_json: bool, run_id: str) -> None:
    """Print a run and its checkpoints as JSON (for replay-check and assert_replayable).

    The output is JSON with or without ``--json``: the export format keeps the
    stored epoch-millisecond times, exactly as replay reads them back."""

    async def go() -> str:
        async with open_client(store_url) as engine:
            run = await engine.get_run(run_id)
            if run is None:
                raise CliError(f"no run with id {run_id!r} in {redact_url(store_url)}")
            return json_text(history_to_json(run, await engine.history(run_id)))

    click.echo(asyncio.run(go()))


@click.command("replay-check")
@click.option(
    "--app",
    "app_spec",
    required=True,
    metavar="MODULE:ENGINE",
    help="The application's engine, with the workflows as they are now.",
)
@json_option
@click.argument("histories", nargs=-1, required=True, type=click.Path(path_type=Path))
def replay_check(app_spec: str, as_json: bool, histories: tuple[Path, ...]) -> None:
    """Check that the current code replays each exported history (exit 1 if not)."""
    try:
        engine = load_engine(app_spec)
    except AppLoadError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None

    async def go() -> None:
        for path in histories:
            try:
                report = await check_replay(engine, path)
            except ReplayMismatch as exc:
                raise CliError(str(exc)) from None
            except ValueError as exc:
                raise CliError(str(exc), EXIT_USAGE) from None
            if as_json:
                click.echo(
                    json_text(
                        {
                            "path": str(path),
                            "ok": True,
                            "run_id": report.run_id,
                            "workflow": report.workflow,
                            "version": report.version,
                            "positions": report.positions,
                            "parked": report.parked,
                        }
                    )
                )
                continue
            more = ", then parks on new code" if report.parked else ""
            click.echo(
                f"ok {path}: run {report.run_id} ({report.workflow} v{report.version}) "
                f"replays its {report.positions} positions{more}"
            )

    asyncio.run(go())


def add_commands(cli: click.Group, runs: click.Group) -> None:
    """Attach ``runs export`` and ``replay-check`` to the ``durably`` command."""
    runs.add_command(runs_export)
    cli.add_command(replay_check)
