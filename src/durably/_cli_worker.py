"""``durably worker``: serve an application's Engine until SIGTERM/SIGINT, then drain.

``configure_worker`` applies the command's options to an engine and ``serve``
runs its worker loop under the signal handlers; both are usable from a
program that embeds the worker instead of calling the command.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal as signals
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import click

from ._cli_app import AppLoadError, load_engine
from ._cli_common import (
    EXIT_USAGE,
    CliError,
    check_store_url,
    describe,
    json_option,
    one_line,
    remember_url,
    run_sync,
    scrub_urls,
)
from ._cli_render import iso_time, visible
from ._logs import engine_logger
from ._urls import redact_url
from .engine import Engine

__all__ = ["configure_worker", "serve", "worker"]

_log = engine_logger("durably.cli")


class _StoppedEarly(Exception):
    """A second SIGTERM/SIGINT cut the worker's drain short."""


class _JsonLogFormatter(logging.Formatter):
    """``durably worker --json``: one JSON object a log line (``time`` as
    ISO-8601 UTC, ``level``, ``logger``, ``message``, ``exception``), ASCII
    only so no user value can drive the terminal, credentials scrubbed."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": iso_time(int(record.created * 1000)),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub_urls(record.getMessage()),
        }
        if record.exc_info:
            data["exception"] = scrub_urls(self.formatException(record.exc_info))
        return json.dumps(data, ensure_ascii=True, default=str)


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


@click.command("worker", short_help="Run an app's worker until SIGTERM, then drain.")
@click.option(
    "--app",
    "app_spec",
    required=True,
    metavar="MODULE[:ATTR]",
    help="The Engine to serve: an importable module and the attribute (or factory) "
    "holding it; the attribute defaults to 'engine'.",
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
    "--metrics-port",
    "metrics_at",
    default=None,
    metavar="[HOST:]PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to "
    "0.0.0.0; needs durably[prometheus]).",
)
@click.option(
    "--no-gc-freeze",
    is_flag=True,
    help="Leave the garbage collector alone. By default the objects alive once the "
    "engine is open (modules, registries) are moved out of its generations "
    "(gc.freeze()), so its full passes walk only what the runs allocate.",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
)
@json_option
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
    metrics_at: str | None,
    no_gc_freeze: bool,
    log_level: str,
    as_json: bool,
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
    handler.setFormatter(
        _JsonLogFormatter()
        if as_json
        else _LogFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    )
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
    sample = _serve_metrics(engine, metrics_at) if metrics_at is not None else None
    try:
        run_sync(serve(engine, sample, gc_freeze=not no_gc_freeze))
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


def _serve_metrics(engine: Engine, where: str) -> Callable[[], Awaitable[None]]:
    """Serve ``engine``'s Prometheus metrics on ``[HOST:]PORT``; return the
    sampling of its gauges, which the worker runs while it serves."""
    host, _, port_text = where.rpartition(":")
    try:
        port = int(port_text)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise CliError(f"--metrics-port needs [HOST:]PORT, not {where!r}", EXIT_USAGE) from None
    try:
        from . import prometheus
    except ImportError:
        raise CliError(
            "--metrics-port needs prometheus-client: pip install 'durably[prometheus]'",
            EXIT_USAGE,
        ) from None
    metrics = prometheus.metrics()
    engine.use(metrics)
    try:
        metrics.serve(port, host or "0.0.0.0")
    except OSError as exc:
        raise CliError(f"cannot serve metrics on {where}: {describe(exc)}") from None
    _log.info("metrics at http://%s:%d/metrics", host or "0.0.0.0", port)

    return lambda: metrics.sampling(engine, 5.0)


def freeze_start_up_objects() -> int:
    """Collect, then move every object still alive out of the collector's
    generations (``gc.freeze()``); return how many are frozen.

    Meant for a process the worker owns, once its engine is open: the modules,
    registries and driver state alive then live as long as the process, and a
    full collection would otherwise walk them all again each time. Collecting
    first keeps start-up garbage out of the frozen set (never freed after).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(
    engine: Engine,
    background: Callable[[], Awaitable[None]] | None = None,
    *,
    gc_freeze: bool = False,
) -> None:
    """Run ``engine``'s worker loop until SIGTERM/SIGINT, then drain and close it.

    ``background()`` runs while the worker serves (cancelled when it stops).
    ``gc_freeze=True`` (what ``durably worker`` does) freezes the objects alive
    once the engine is open (see ``freeze_start_up_objects``): it changes the
    whole process's collector, so only a program that owns its process should.

    A second signal cancels the drain (the engine is left unclosed: its runs'
    leases expire, or a worker restarted with the same ``instance_id`` reclaims
    them at once).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    received: list[str] = []
    running: asyncio.Future[None] | None = None

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
        if gc_freeze:
            # After the "serving" line: it is the first line a supervisor (and
            # the CLI tests) read as the worker being up.
            _log.info(
                "froze %d start-up objects out of the garbage collector's generations",
                freeze_start_up_objects(),
            )
        if background is not None:
            running = asyncio.ensure_future(background())
        await stop.wait()
        if running is not None:
            running.cancel()  # a sample must not reopen the engine being closed
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
        if running is not None:
            running.cancel()
        for sig in (signals.SIGTERM, signals.SIGINT):
            loop.remove_signal_handler(sig)
