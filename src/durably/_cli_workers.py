"""``durably workers``: the live remote workers on a transport, what they
serve, the task queues' depths and the queues starving for a worker.

Attached by the ``durably`` command (``cli.add_command(workers)``)::

    durably workers --transport redis://host:6379/0?prefix=durable [--json]

It reads the transport only (liveness keys, descriptors, queue lengths);
no store is opened.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click
from rich import box
from rich.table import Table

from ._cli_common import CliError, describe
from ._cli_render import json_text, make_console, plain
from ._urls import redact_url
from .engine import Engine

__all__ = ["workers", "workers_table"]


async def _health(transport_url: str) -> dict[str, Any]:
    try:
        engine = Engine(store="memory://", transport=transport_url, drive=False)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        return await engine.worker_health()
    except CliError:
        raise
    except Exception as exc:
        raise CliError(
            f"cannot read workers from {redact_url(transport_url)}: {describe(exc)}"
        ) from None
    finally:
        await engine.close()


def workers_table(health: dict[str, Any]) -> Table:
    """The ``durably workers`` table: one row per live worker instance."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("instance", no_wrap=True)
    table.add_column("runtime")
    table.add_column("workflows")
    table.add_column("steps")
    table.add_column("descriptor")
    for worker in health["workers"]:
        sdk = worker.get("sdk") or {}
        runtime = worker.get("runtime") or "?"
        if sdk:
            runtime = f"{runtime} ({sdk.get('name')} {sdk.get('version')})"
        check = {True: "ok", False: "hash mismatch", None: "-"}[worker["descriptor_hash_ok"]]
        table.add_row(
            plain(worker["instance_id"]),
            plain(runtime),
            plain(", ".join(worker["workflows"]) or "-"),
            plain(", ".join(worker["steps"]) or "-"),
            plain(check, style="red" if worker["descriptor_hash_ok"] is False else ""),
        )
    return table


@click.command()
@click.option(
    "--transport",
    "transport_url",
    envvar="DURABLY_TRANSPORT_URL",
    required=True,
    show_envvar=True,
    metavar="URL",
    help="Transport URL the workers serve: redis://host:6379/0?prefix=durable",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def workers(transport_url: str, as_json: bool) -> None:
    """List live remote workers, their workflows and steps, queue depths and starvation."""
    health = asyncio.run(_health(transport_url))
    if as_json:
        click.echo(json_text(health))
        return
    console = make_console()
    if health["workers"]:
        console.print(workers_table(health))
    else:
        console.print("No live workers.")
    if health["queues"]:
        queues = Table(box=box.SIMPLE_HEAD, show_edge=False)
        queues.add_column("queue token", no_wrap=True)
        queues.add_column("waiting", justify="right")
        queues.add_column("state")
        for token, depth in sorted(health["queues"].items()):
            starving = token in health["starving"]
            queues.add_row(
                plain(token),
                str(depth),
                plain("starving: no live worker" if starving else "", style="red"),
            )
        console.print(queues)
