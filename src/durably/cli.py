"""The ``durably`` command line.

Commands::

    durably worker --app myapp.main:engine     run the worker loop; drain on SIGTERM/SIGINT
    durably runs list [--status …] [--workflow …] [--tag …] [--limit N] [--cursor C]
    durably runs show RUN_ID                   a run and its step timeline
    durably signal TOKEN [JSON]                deliver a signal (buffered if nobody waits)
    durably cancel RUN_ID                      cancel a run
    durably demo                               crash a worker mid-run and watch it recover

The store comes from ``--store URL``, else ``DURABLY_DATABASE_URL``, else
``sqlite:///durably.db`` — the same default as ``durably.Engine()``.

Every failure is reported as one line on stderr, never a traceback: exit code
2 for bad input (a bad option, JSON payload, store URL or ``--app`` path) and
1 for everything else (an unknown run, a store that cannot be opened…). Set
``DURABLY_TRACEBACK=1`` to see the traceback of an unexpected error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal as signals
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
from rich.text import Text

from ._cli_app import AppLoadError, load_engine
from ._cli_common import (
    DEFAULT_STORE,
    EXIT_FAILURE,
    EXIT_USAGE,
    CliError,
    check_store_url,
    describe,
    one_line,
    open_client,
    remember_url,
    scrub_urls,
    store_option,
)
from ._cli_dashboard import dashboard
from ._cli_render import (
    checkpoint_to_dict,
    json_text,
    make_console,
    render_run,
    run_to_dict,
    runs_table,
    visible,
)
from ._cli_schedules import schedules
from ._urls import redact_url
from .engine import Engine, RunNotFound
from .errors import DurablyError
from .model import RunStatus

__all__ = ["DEFAULT_STORE", "CliError", "cli", "main"]

T = TypeVar("T")

_log = logging.getLogger("durably.cli")


class _StoppedEarly(Exception):
    """A second SIGTERM/SIGINT cut the worker's drain short."""


# -- helpers ------------------------------------------------------------------------------


class _LogFormatter(logging.Formatter):
    """Worker log lines whose user values (run ids, names, error messages) cannot
    drive the terminal: control characters are shown as escapes, and a message
    cannot start a forged log line (only a traceback keeps its newlines). The
    credentials of the store URLs are hidden too, even in a driver's message."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub_urls(super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:
        return visible(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return visible(super().formatException(ei), keep="\n")

    def formatStack(self, stack_info: str) -> str:
        return visible(super().formatStack(stack_info), keep="\n")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _print_json(data: Any) -> None:
    click.echo(json_text(data))


# -- the command group --------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="durably", prog_name="durably")
def cli() -> None:
    """durably: durable execution for Python.

    Inspect and operate runs in a store, run a worker, or watch the demo.
    The store is --store URL, else $DURABLY_DATABASE_URL, else sqlite:///durably.db.
    """


# -- runs ---------------------------------------------------------------------------------


@cli.group()
def runs() -> None:
    """List, inspect and cancel runs."""


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
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
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

    found, next_cursor = _run(go())
    if as_json:
        _print_json({"runs": [run_to_dict(r) for r in found], "next_cursor": next_cursor})
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
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def runs_show(store_url: str, run_id: str, as_json: bool) -> None:
    """Show a run and its step timeline."""

    async def go() -> tuple[Any, list[Any]]:
        async with open_client(store_url) as engine:
            run = await engine.get_run(run_id)
            if run is None:
                raise CliError(f"no run with id {run_id!r} in {redact_url(store_url)}")
            return run, await engine.history(run_id)

    run, checkpoints = _run(go())
    if as_json:
        _print_json(
            {"run": run_to_dict(run), "checkpoints": [checkpoint_to_dict(c) for c in checkpoints]}
        )
        return
    make_console().print(render_run(run, checkpoints))


def _cancel(store_url: str, run_id: str) -> None:
    async def go() -> RunStatus:
        async with open_client(store_url) as engine:
            try:
                return await engine.cancel(run_id)
            except RunNotFound:
                raise CliError(f"no run with id {run_id!r} in {redact_url(store_url)}") from None

    before = _run(go())
    if before.is_terminal:
        click.echo(f"run {visible(run_id)} was already {before.value}; left unchanged")
    else:
        click.echo(f"cancelled run {visible(run_id)} (it was {before.value})")


@runs.command("cancel")
@store_option
@click.argument("run_id")
def runs_cancel(store_url: str, run_id: str) -> None:
    """Cancel a run (same as 'durably cancel')."""
    _cancel(store_url, run_id)


@cli.command("cancel")
@store_option
@click.argument("run_id")
def cancel(store_url: str, run_id: str) -> None:
    """Cancel a run. A finished run is left as it is."""
    _cancel(store_url, run_id)


# -- signal -------------------------------------------------------------------------------


@cli.command("signal")
@store_option
@click.argument("token")
@click.argument("payload", required=False, metavar="[JSON]")
def signal_cmd(store_url: str, token: str, payload: str | None) -> None:
    """Deliver a signal to the run waiting on TOKEN.

    The payload is JSON (default null); pass - to read it from stdin. When no
    run waits on TOKEN yet, the signal is buffered for the first run that does.
    """
    if payload == "-":
        payload = sys.stdin.read()
    value: Any = None
    if payload is not None:
        try:
            value = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise CliError(f"the payload is not valid JSON: {exc}", EXIT_USAGE) from None

    async def go() -> str | None:
        async with open_client(store_url) as engine:
            try:
                return await engine.signal(token, value)
            except (ValueError, DurablyError) as exc:
                raise CliError(one_line(str(exc)), EXIT_USAGE) from None

    receiver = _run(go())
    if receiver is None:
        click.echo(
            f"no run waits on {visible(repr(token))} yet; "
            "the signal is buffered for the first one that does"
        )
    else:
        click.echo(f"delivered {visible(repr(token))} to run {visible(receiver)}")


# -- worker -------------------------------------------------------------------------------


@cli.command("worker")
@click.option(
    "--app",
    "app_spec",
    required=True,
    metavar="MODULE:ATTR",
    help="The Engine to serve: an importable module and the attribute (or factory) holding it.",
)
@click.option(
    "--store",
    "store_url",
    envvar="DURABLY_DATABASE_URL",
    default=None,
    metavar="URL",
    callback=check_store_url,
    help="Exported as DURABLY_DATABASE_URL before the app is imported, so an "
    "Engine() built with the default store uses it.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.01),
    default=None,
    help="Seconds between worker-loop ticks (default: the engine's poll_interval).",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="On SIGTERM/SIGINT, seconds to let running turns finish before handing "
    "them back (default: the engine's drain_timeout).",
)
@click.option(
    "--instance-id",
    default=None,
    help="A stable lease-owner id (e.g. the pod name): a restarted worker "
    "reclaims its previous incarnation's runs at once.",
)
@click.option(
    "--group",
    "groups",
    multiple=True,
    metavar="NAME",
    help="Serve only the step handlers of this group (repeatable).",
)
@click.option(
    "--steps",
    "step_names",
    default=None,
    metavar="A,B,...",
    help="Serve only these step handlers (comma-separated names).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Step handlers executing at once (default: the engine's step_concurrency).",
)
@click.option(
    "--no-drive",
    is_flag=True,
    help="Serve step handlers only and execute no run, as an engine built with "
    "drive=False does (a step-worker pool beside the processes that drive runs).",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
)
def worker(
    app_spec: str,
    store_url: str | None,
    interval: float | None,
    drain_timeout: float | None,
    instance_id: str | None,
    groups: tuple[str, ...],
    step_names: str | None,
    concurrency: int | None,
    no_drive: bool,
    log_level: str,
) -> None:
    """Run the worker loop of an app's Engine until SIGTERM or SIGINT, and
    serve its step handlers (all of them, or those picked by --group/--steps).

    An engine built with drive=False (or any engine, with --no-drive) only
    serves its step handlers: it executes no run.

    On the first signal it drains: stops taking tasks and work, lets running turns
    finish for up to --drain-timeout seconds, hands the rest back as pending,
    closes the store and exits 0. A second signal stops without waiting.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, log_level.upper()), handlers=[handler])
    if store_url:
        os.environ["DURABLY_DATABASE_URL"] = store_url
    try:
        engine = load_engine(app_spec)
    except AppLoadError as exc:
        raise CliError(one_line(str(exc)), EXIT_USAGE) from None
    remember_url(engine.store.url)
    if store_url and engine.store.url != store_url:
        _log.warning(
            "the app's engine uses its own store %s; --store/DURABLY_DATABASE_URL is ignored",
            redact_url(engine.store.url),
        )
    configure_worker(
        engine,
        interval=interval,
        drain_timeout=drain_timeout,
        instance_id=instance_id,
        drive=False if no_drive else None,
    )
    if groups:
        engine.serve_groups = frozenset(groups)
    if step_names is not None:
        names = frozenset(n.strip() for n in step_names.split(",") if n.strip())
        unknown = sorted(names - set(engine.steps))
        if unknown:
            raise CliError(
                f"--steps names steps {app_spec} does not register: {', '.join(unknown)}",
                EXIT_USAGE,
            )
        engine.serve_steps = names
    if concurrency is not None:
        engine.step_concurrency = concurrency
    if not engine.drive and not engine.served_steps:
        why = "--no-drive" if no_drive else "drive=False"
        raise CliError(
            f"{app_spec} has nothing to serve: it executes no run ({why}) and serves "
            "no step handler (none registered, consumers='never', or none left by "
            "--group/--steps)",
            EXIT_USAGE,
        )
    try:
        _run(serve(engine))
    except _StoppedEarly:
        message = "stopped by a second signal before the drain finished"
        _exit_now_if_steps_linger(130, message)
        raise CliError(message, 130) from None
    _exit_now_if_steps_linger(0)


def _exit_now_if_steps_linger(code: int, error: str | None = None) -> None:
    """Exit at once if step threads outlived the drain.

    A synchronous step runs in a thread that cannot be interrupted; the drain
    already handed its run back (fencing the thread's result), but the
    interpreter would still wait for the thread at exit, stretching the drain
    past its bound. A step cut short here is re-run by the next owner of the
    run, exactly as after a crash.
    """
    lingering = [
        t
        for t in threading.enumerate()
        if t.is_alive() and not t.daemon and t.name.startswith("durably-step")
    ]
    if not lingering:
        return
    _log.warning(
        "%d synchronous step(s) still running; exiting without them "
        "(their runs are handed back, or recovered once their lease expires, and re-run them)",
        len(lingering),
    )
    logging.shutdown()
    if error is not None:
        click.echo(f"durably: error: {visible(scrub_urls(error))}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def configure_worker(
    engine: Engine,
    *,
    interval: float | None = None,
    drain_timeout: float | None = None,
    instance_id: str | None = None,
    drive: bool | None = None,
) -> None:
    """Apply the ``durably worker`` options to an engine that is not open yet.

    ``drive=False`` makes it a step worker: it serves its step handlers and
    executes no run (what ``Engine(drive=False)`` does from the start).
    """
    if interval is not None:
        engine.poll_interval = interval
    if drain_timeout is not None:
        engine.drain_timeout = drain_timeout
    if instance_id is not None:
        if engine.is_open:
            raise CliError("--instance-id needs an engine that is not open yet", EXIT_USAGE)
        # Counts as stable, like an id given to Engine(): opening reclaims its leases.
        engine.instance_id = instance_id
    if drive is not None:
        # Read when the worker starts (whether to run the worker loop and claim
        # queued runs) and on each store event, so it must be set before then.
        if engine.is_open and drive != engine.drive:
            raise CliError("--no-drive needs an engine that is not open yet", EXIT_USAGE)
        engine.drive = drive


async def serve(engine: Engine) -> None:
    """Run ``engine``'s worker loop until SIGTERM/SIGINT, then drain and close it.

    A second signal cancels the drain (the engine is left unclosed: its runs'
    leases expire, or a worker restarted with the same ``instance_id`` reclaims
    them at once).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    received: list[str] = []

    def on_signal(sig: signals.Signals) -> None:
        received.append(sig.name)
        if len(received) == 1:
            _log.info(
                "%s received: draining (up to %.1fs); send it again to stop at once",
                sig.name,
                engine.drain_timeout,
            )
            stop.set()
        elif main_task is not None:
            _log.warning("%s received again: stopping without waiting", sig.name)
            main_task.cancel()

    for sig in (signals.SIGTERM, signals.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        try:
            await engine.start_worker()
        except Exception as exc:
            raise CliError(
                f"cannot open the store {redact_url(engine.store.url)}: {describe(exc)}"
            ) from None
        _log.info(
            "worker %s serving %s and steps %s on %s (tick every %gs)",
            engine.instance_id,
            (", ".join(engine.workflows) or "no workflows")
            if engine.drive
            else "no runs (steps only)",
            ", ".join(engine.served_steps) or "none",
            redact_url(engine.store.url),
            engine.poll_interval,
        )
        await stop.wait()
        started = time.monotonic()
        await engine.drain(engine.drain_timeout)
        await engine.close()
        _log.info(
            "drained in %.2fs; worker %s stopped", time.monotonic() - started, engine.instance_id
        )
    except asyncio.CancelledError:
        if received:
            raise _StoppedEarly from None
        raise
    finally:
        for sig in (signals.SIGTERM, signals.SIGINT):
            loop.remove_signal_handler(sig)


# -- demo ---------------------------------------------------------------------------------


@cli.command("demo")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the demo's database, effects ledger and worker logs here "
    "(default: a temporary directory, removed afterwards).",
)
def demo(directory: Path | None) -> None:
    """Kill a worker mid-run and watch the run finish anyway.

    An order workflow (reserve stock, wait for approval, charge the card,
    sleep durably, ship) runs in a child worker process on SQLite. The worker
    is killed with SIGKILL mid-run, a new one takes over, and the run
    finishes; the effects ledger proves each step's side effect ran once.
    """
    from ._demo import run_demo

    code = run_demo(directory)
    if code:
        raise click.exceptions.Exit(code)


# -- entry point --------------------------------------------------------------------------


# click >= 8.2 raises this for a group invoked without a command; older versions print
# the help themselves.
_NO_ARGS_IS_HELP: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_NeverRaised", (click.UsageError,), {})
)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"durably: error: {visible(scrub_urls(one_line(message)))}", err=True)
    sys.exit(code)


cli.add_command(schedules)
cli.add_command(dashboard)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the ``durably`` command (the console-script entry point)."""
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
