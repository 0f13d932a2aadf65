"""What every ``durably`` command shares: the error type and exit codes, the
``--store`` option and the client engine the store commands open.

``durably.cli`` and the command groups in the other ``_cli_*`` modules import
this module; it imports none of them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from ._urls import redact_url, scrub
from .client import Client
from .stores.sqlite import sqlite_path_from_url

__all__ = [
    "DEFAULT_STORE",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "CliError",
    "check_store_url",
    "describe",
    "one_line",
    "open_client",
    "remember_url",
    "scrub_urls",
    "sqlite_file",
    "store_option",
]

DEFAULT_STORE = "sqlite:///durably.db"
"""The store used when neither ``--store`` nor ``DURABLY_DATABASE_URL`` is given."""

EXIT_FAILURE = 1
"""The exit code of a command that failed (an unknown run, a store that cannot be opened…)."""
EXIT_USAGE = 2
"""The exit code of a command given bad input (an option, a JSON payload, a store URL…)."""

F = TypeVar("F", bound=Callable[..., Any])

_log = logging.getLogger("durably.cli")

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
