"""What every ``durably`` command shares: the error type and exit codes, the
``--store`` option and the client engine the store commands open.

``durably.cli`` and the command groups in the other ``_cli_*`` modules import
this module; it imports none of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from ._logs import engine_logger
from ._urls import redact_url, scrub
from .client import Client
from .durations import Duration
from .engine import Engine, RunNotFound
from .model import Run, RunStatus
from .stores.sqlite import sqlite_path_from_url

__all__ = [
    "DEFAULT_STORE",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "CliError",
    "check_store_url",
    "describe",
    "json_option",
    "one_line",
    "open_client",
    "parse_payload",
    "remember_url",
    "resume_run",
    "run_sync",
    "scrub_urls",
    "sqlite_file",
    "start_by_name",
    "store_option",
]

DEFAULT_STORE = "sqlite:///durably.db"
"""The store used when neither ``--store`` nor ``DURABLY_DATABASE_URL`` is given."""

EXIT_FAILURE = 1
"""The exit code of a command that failed (an unknown run, a store that cannot be opened…)."""
EXIT_USAGE = 2
"""The exit code of a command given bad input (an option, a JSON payload, a store URL…)."""

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_log = engine_logger("durably.cli")

# The store URLs this process was given: scrub_urls hides their credentials in
# any message, including ones a database driver built from the raw URL.
_urls: list[str] = []


class CliError(click.ClickException):
    """A failure reported as one line on stderr with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.status = exit_code
        """The process exit code (``exit_code`` is a class attribute in click)."""


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    message = one_line(str(exc))
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def remember_url(url: str) -> None:
    """Have :func:`scrub_urls` hide ``url``'s credentials from now on."""
    if url and url not in _urls:
        _urls.append(url)


def scrub_urls(text: str) -> str:
    """``text`` with the credentials of every store URL this process was given
    (``--store``, ``DURABLY_DATABASE_URL``, the app's engine) replaced by ``***``."""
    return scrub(text, [*_urls, os.environ.get("DURABLY_DATABASE_URL", "")])


def check_store_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The ``--store`` callback: an empty URL is a usage error (it would quietly
    mean ``./durably.db``), and a given URL's credentials are scrubbed from output."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter(
            "is empty; pass a store URL such as sqlite:///durably.db or postgresql://…",
            ctx=ctx,
            param=param,
        )
    remember_url(value)
    return value


def store_option(fn: F) -> F:
    """The ``--store URL`` option (``DURABLY_DATABASE_URL``, default ``sqlite:///durably.db``)."""
    option = click.option(
        "--store",
        "store_url",
        envvar="DURABLY_DATABASE_URL",
        default=DEFAULT_STORE,
        show_default=True,
        show_envvar=True,
        metavar="URL",
        callback=check_store_url,
        help="Store URL: sqlite:///path.db, postgresql://…, memory://, or a SQLite file path.",
    )
    return option(fn)


def json_option(fn: F) -> F:
    """The ``--json`` flag: machine-readable output (times as ISO-8601 UTC strings)."""
    option = click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print JSON instead of text (times as ISO-8601 UTC strings).",
    )
    return option(fn)


def parse_payload(payload: str | None, what: str = "payload") -> Any:
    """A JSON argument (``None`` when absent; ``-`` reads it from stdin); bad
    JSON is a usage error naming ``what``."""
    if payload is None:
        return None
    if payload == "-":
        payload = sys.stdin.read()
    try:
        return json.loads(payload)
    except json.JSONDecodeError as exc:
        raise CliError(f"the {what} is not valid JSON: {exc}", EXIT_USAGE) from None


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


def sqlite_file(url: str) -> str | None:
    """The file of a SQLite store URL (``None`` for other stores and ``:memory:``)."""
    if "://" in url and not url.startswith("sqlite:"):
        return None
    try:
        path = sqlite_path_from_url(url)
    except ValueError as exc:
        raise CliError(f"invalid store URL {redact_url(url)!r}: {exc}", EXIT_USAGE) from None
    return None if path == ":memory:" else path


@asynccontextmanager
async def open_client(store_url: str) -> AsyncIterator[Client]:
    """An opened :class:`~durably.Client` on ``store_url`` for client commands.

    It never executes runs. A SQLite file that does not exist is an error here
    (rather than silently creating an empty database from a mistyped path).
    """
    path = sqlite_file(store_url)
    if path is not None and not Path(path).exists():  # noqa: ASYNC240 - one stat, before any I/O
        raise CliError(
            f"no SQLite database at {path!r} (pass --store URL or set DURABLY_DATABASE_URL)"
        )
    try:
        client = Client(store_url)
    except ValueError as exc:
        raise CliError(one_line(str(exc)), EXIT_USAGE) from None
    try:
        await client.open()
    except Exception as exc:
        raise CliError(f"cannot open the store {redact_url(store_url)}: {describe(exc)}") from None
    try:
        yield client
    finally:
        try:
            await client.close()
        except Exception as exc:  # closing must not mask the command's own outcome
            _log.debug("closing the store failed: %s", exc)


async def start_by_name(
    client: Client | Engine,
    workflow: str,
    input: Any,
    *,
    run_id: str | None = None,
    version: str | None = None,
    tags: list[str] | None = None,
    priority: int = 0,
    start_at: datetime | Duration | None = None,
) -> tuple[Run, bool]:
    """Create a run of ``workflow`` by name; return it and whether it is new.

    An engine that registers ``workflow`` (``--app``) starts it itself, which
    validates the input and stamps the execution deadline. Otherwise a
    :class:`~durably.Client` creates it for whichever worker registers it;
    without ``version`` the first engine that executes it pins it to its
    current version. An id that exists returns that run, unchanged.
    """
    before = await client.get_run(run_id) if run_id is not None else None
    handle = await client.start(
        workflow,
        input,
        run_id=run_id,
        version=version,
        tags=tags,
        priority=priority,
        start_at=start_at,
    )
    return handle.run, before is None


async def resume_run(engine: Client, run_id: str) -> tuple[Run, str]:
    """Give the live run ``run_id`` a turn now (after a lost wake-up, say);
    return it as it was and what was done: ``"woken"``, ``"unblocked"``,
    ``"queued"`` (pending already) or ``"finished"`` (terminal: left alone).

    Its waits are not skipped: a run sleeping or waiting for a signal replays
    and waits again. A ``blocked`` run goes back to ``pending`` so that the
    workers look at it again (one that registers its workflow takes it).
    """
    run = await engine.get_run(run_id)
    if run is None:
        raise RunNotFound(run_id)
    now = engine.clock.now_ms()
    if run.status.is_terminal:
        return run, "finished"
    if run.status is RunStatus.PENDING:
        return run, "queued"
    if run.status is RunStatus.BLOCKED:
        changes = {"status": RunStatus.PENDING, "error": None}
        if await engine.store.update_run_if(run_id, frozenset({RunStatus.BLOCKED}), changes, now):
            return run, "unblocked"
        return await resume_run(engine, run_id)  # it moved on meanwhile: judge it again
    # Releases a ctx.breakpoint too, and wakes the run.
    if await engine.resume(run_id):
        return run, "woken"
    return run, "finished"
