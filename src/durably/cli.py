"""The ``durably`` command line.

Commands::

    durably worker --app myapp.main            run the worker loop; drain on SIGTERM/SIGINT
    durably start WORKFLOW [JSON]              start a run by workflow name
    durably runs list [--status …] [--stale]   runs, newest first (or the stale ones)
    durably runs show|retry|resume|delete|cancel RUN_ID
    durably signal TOKEN [JSON]                deliver a signal (buffered if nobody waits)
    durably events publish NAME [JSON]         publish an event to the runs waiting for it
    durably cancel RUN_ID                      cancel a run
    durably schedules list|pause|resume|trigger|remove
    durably runs export RUN_ID                 a run and its checkpoints as JSON
    durably replay-check --app mod:engine H.json  does the current code replay it?
    durably demo                               crash a worker mid-run and watch it recover

Each command lives in a ``_cli_*`` module and is attached below with one
line: ``cli.add_command(cmd)``, or ``runs.add_command(cmd)`` for a
``durably runs …`` subcommand. A command takes ``@store_option`` and
``@json_option`` (``_cli_common``) and opens the store with ``open_client``;
it raises :class:`CliError` for a one-line failure. The store comes from ``--store URL``, else
``DURABLY_DATABASE_URL``, else ``sqlite:///durably.db`` — the same default as
``durably.Engine()``. Every command takes ``--json``.

Every failure is reported as one line on stderr, never a traceback: exit code
2 for bad input (a bad option, JSON payload, store URL or ``--app`` path) and
1 for everything else (an unknown run, a store that cannot be opened…). Set
``DURABLY_TRACEBACK=1`` to see the traceback of an unexpected error.

Shell completion is click's: ``eval "$(_DURABLY_COMPLETE=bash_source durably)"``
(``zsh_source``, ``fish_source`` for the other shells).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from ._cli_common import (
    DEFAULT_STORE,
    EXIT_FAILURE,
    CliError,
    describe,
    json_option,
    one_line,
    scrub_urls,
)
from ._cli_dashboard import dashboard
from ._cli_export import add_commands
from ._cli_messages import events, signal_cmd
from ._cli_render import json_text, make_console, visible
from ._cli_runs import cancel, runs
from ._cli_schedules import schedules
from ._cli_start import start
from ._cli_worker import configure_worker, serve, worker
from ._cli_workers import workers

__all__ = ["DEFAULT_STORE", "CliError", "cli", "configure_worker", "main", "serve"]


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Every command takes --json. Shell completion (bash; zsh_source, fish_source "
    'for the others): eval "$(_DURABLY_COMPLETE=bash_source durably)"',
)
@click.version_option(package_name="durably", prog_name="durably")
def cli() -> None:
    """durably: durable execution for Python.

    Inspect and operate runs in a store, run a worker, or watch the demo.
    The store is --store URL, else $DURABLY_DATABASE_URL, else sqlite:///durably.db.
    """


@cli.command("demo")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the demo's database, effects ledger and worker logs here "
    "(default: a temporary directory, removed afterwards).",
)
@json_option
def demo(directory: Path | None, as_json: bool) -> None:
    """Kill a worker mid-run and watch the run finish anyway.

    An order workflow (reserve stock, wait for approval, charge the card,
    sleep durably, ship) runs in a child worker process on SQLite. The worker
    is killed with SIGKILL mid-run, a new one takes over, and the run
    finishes; the effects ledger proves each step's side effect ran once.
    """
    from ._demo import run_demo

    # With --json the show goes to stderr and stdout holds only the verdict.
    code = run_demo(directory, make_console(stderr=True) if as_json else None)
    if as_json:
        click.echo(json_text({"ok": code == 0, "exit_code": code}))
    if code:
        raise click.exceptions.Exit(code)


# One line a command (a ``durably runs …`` subcommand: ``runs.add_command(cmd)``).
cli.add_command(worker)
cli.add_command(start)
cli.add_command(runs)
cli.add_command(cancel)
cli.add_command(signal_cmd)
cli.add_command(events)
cli.add_command(schedules)
cli.add_command(workers)
cli.add_command(dashboard)
add_commands(cli, runs)


# -- entry point --------------------------------------------------------------------------


# click >= 8.2 raises this for a group invoked without a command; older versions print
# the help themselves.
_NO_ARGS_IS_HELP: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_NeverRaised", (click.UsageError,), {})
)


def _report(message: str, code: int, as_json: bool) -> NoReturn:
    text = scrub_urls(one_line(message))
    if as_json:
        # Still one line on stderr, but one a program parses (ASCII: no escape
        # sequence from a user value reaches the terminal).
        error = {"error": {"message": text, "exit_code": code}}
        click.echo(json.dumps(error, ensure_ascii=True), err=True)
    else:
        click.echo(f"durably: error: {visible(text)}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the ``durably`` command (the console-script entry point).

    With ``--json`` among the arguments an error is reported as one line of
    JSON on stderr, ``{"error": {"message": …, "exit_code": …}}``.
    """
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)

    def _fail(message: str, code: int) -> NoReturn:
        _report(message, code, as_json)

    try:
        result = cli.main(args=argv, prog_name="durably", standalone_mode=False)
    except CliError as exc:
        _fail(exc.format_message(), exc.status)
    except _NO_ARGS_IS_HELP as exc:  # ``durably`` or ``durably runs`` alone: show the help
        click.echo(exc.format_message())
        sys.exit(0)
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _fail(exc.format_message() + hint, exc.exit_code)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _fail("interrupted", 130)
    except Exception as exc:
        if os.environ.get("DURABLY_TRACEBACK"):
            raise
        _fail(f"unexpected {describe(exc)} (set DURABLY_TRACEBACK=1 for details)", EXIT_FAILURE)
    sys.exit(result if isinstance(result, int) else 0)
