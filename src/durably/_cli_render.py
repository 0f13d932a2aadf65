"""Rich renderings shared by the ``durably`` CLI and ``durably demo``.

Everything here is pure: it turns runs and checkpoints into rich renderables
(or JSON-ready dicts) and never touches a store.

Every value an application wrote (ids, names, tags, inputs, outputs, errors)
goes into a renderable as :class:`rich.text.Text`, which rich never parses
for markup, after :func:`visible` has turned its control characters into
escapes: a run id holding ``[link=…]`` or an ANSI sequence is shown, not obeyed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from .model import Checkpoint, CheckpointStatus, Run, RunStatus

__all__ = [
    "abbreviate",
    "checkpoint_to_dict",
    "format_duration",
    "format_time",
    "iso_time",
    "iso_times",
    "json_text",
    "make_console",
    "plain",
    "render_run",
    "run_details",
    "run_to_dict",
    "runs_table",
    "status_text",
    "timeline_table",
    "visible",
]

# C0 and C1 controls and DEL (ANSI/OSC sequences start with ESC or the 8-bit
# CSI/OSC), the bidirectional overrides and isolates (they reorder what the
# operator reads) and the Unicode line separators.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
# The same, less C0: json.dumps already escapes those.
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")

_RUN_STYLES: dict[str, str] = {
    RunStatus.PENDING: "white",
    RunStatus.RUNNING: "cyan",
    RunStatus.SUSPENDED: "blue",
    RunStatus.BLOCKED: "yellow",
    RunStatus.COMPLETED: "green",
    RunStatus.FAILED: "red",
    RunStatus.CANCELLED: "magenta",
    RunStatus.DEAD: "bold red",
}
_CHECKPOINT_STYLES: dict[str, str] = {
    CheckpointStatus.PENDING: "blue",
    CheckpointStatus.RUNNING: "cyan",
    CheckpointStatus.COMPLETED: "green",
    CheckpointStatus.FAILED: "red",
}


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, *, keep: str = "") -> str:
    """``text`` with every control character shown as an escape (ESC as ``\\x1b``).

    Characters in ``keep`` (e.g. ``"\\n"`` for a traceback) are left as they are.
    """
    if not keep:
        return _CONTROLS.sub(_escape, text)
    return _CONTROLS.sub(lambda m: m.group() if m.group() in keep else _escape(m), text)


def plain(value: object, style: str = "") -> Text:
    """A user value as text that is displayed literally: no markup, no control codes."""
    return Text(visible(str(value)), style=style)


def json_text(data: Any) -> str:
    """``data`` as indented JSON that is safe to print on a terminal.

    ``json.dumps`` escapes C0 controls itself; C1 controls, DEL and the
    bidirectional overrides are escaped here too (``\\u009b``), so the
    JSON still parses to the same data.
    """
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def make_console(*, stderr: bool = False) -> Console:
    """A console for CLI output.

    On a terminal it is rich's usual console. When piped (and ``COLUMNS`` is
    not set) it is wide, so tables are not squeezed into 80 columns and run
    ids are never folded; rich already drops colours when not on a terminal.
    """
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=240)
    return console


def status_text(status: str) -> Text:
    """A run or checkpoint status, coloured."""
    style = _RUN_STYLES.get(status) or _CHECKPOINT_STYLES.get(status, "")
    return Text(str(status), style=style)


def format_time(ms: int | None, *, with_date: bool = True) -> str:
    """Epoch milliseconds as local time (``2024-05-01 12:00:00.123``); ``-`` for none."""
    if ms is None:
        return "-"
    try:
        moment = datetime.fromtimestamp(ms / 1000)
    except (ValueError, OverflowError, OSError):
        return str(ms)
    text = moment.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S")
    return f"{text}.{moment.microsecond // 1000:03d}"


def format_duration(ms: int | float | None) -> str:
    """A compact duration: ``12ms``, ``1.25s``, ``3m 2s``, ``2h 5m``, ``3d 4h``."""
    if ms is None:
        return "-"
    if ms < 0:
        return "-" + format_duration(-ms)
    if ms < 1000:
        return f"{ms:.0f}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


def abbreviate(value: Any, limit: int = 60) -> str:
    """``value`` as one line of compact JSON, cut to ``limit`` characters."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    text = visible(" ".join(text.split()))
    return text if len(text) <= limit else text[: max(limit - 1, 1)] + "…"


def _error_line(error: dict[str, Any] | None, limit: int) -> str:
    if not error:
        return ""
    message = str(error.get("message", "failed"))
    kind = error.get("type") or error.get("code")
    text = f"{kind}: {message}" if kind else message
    text = visible(" ".join(text.split()))
    return text if len(text) <= limit else text[: max(limit - 1, 1)] + "…"


def runs_table(runs: Iterable[Run], *, title: str | None = None) -> Table:
    """The ``durably runs list`` table: one row per run, newest first."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False)
    table.add_column("RUN ID", no_wrap=True)
    table.add_column("WORKFLOW", no_wrap=True)
    table.add_column("VER", no_wrap=True)
    table.add_column("STATUS", no_wrap=True)
    table.add_column("TAGS")
    table.add_column("CREATED", no_wrap=True)
    table.add_column("UPDATED", no_wrap=True)
    for run in runs:
        table.add_row(
            plain(run.run_id),
            plain(run.workflow),
            plain(run.workflow_version or "-"),
            status_text(run.status),
            plain(", ".join(run.tags)),
            format_time(run.created_at),
            format_time(run.updated_at),
        )
    return table


def run_details(run: Run, *, now_ms: int | None = None) -> Table:
    """A key/value grid describing one run."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("Run", plain(run.run_id))
    # An empty version: a client started the run and no engine executed it yet.
    version = f"version {run.workflow_version}" if run.workflow_version else "no version yet"
    grid.add_row("Workflow", plain(f"{run.workflow} ({version})"))
    grid.add_row("Status", status_text(run.status))
    if run.namespace != "default":
        grid.add_row("Namespace", plain(run.namespace))
    if run.parent_id:
        grid.add_row("Parent", plain(run.parent_id))
    if run.tags:
        grid.add_row("Tags", plain(", ".join(run.tags)))
    if run.priority:
        grid.add_row("Priority", str(run.priority))
    grid.add_row("Created", format_time(run.created_at))
    grid.add_row("Updated", format_time(run.updated_at))
    if run.status.is_terminal:
        grid.add_row("Took", format_duration(run.updated_at - run.created_at))
    if run.wake_at is not None and not run.status.is_terminal:
        grid.add_row("Wakes at", f"{format_time(run.wake_at)} ({_relative(run.wake_at, now)})")
    if run.locked_by:
        grid.add_row(
            "Lease",
            plain(f"{run.locked_by} until {format_time(run.locked_until, with_date=False)}"),
        )
    if run.recovery_attempts:
        grid.add_row("Recoveries", str(run.recovery_attempts))
    if run.deadline_at is not None:
        grid.add_row("Deadline", format_time(run.deadline_at))
    grid.add_row("Input", Text(abbreviate(run.input, 200)))
    if run.status is RunStatus.COMPLETED:
        grid.add_row("Output", Text(abbreviate(run.output, 200), style="green"))
    if run.error and run.status is RunStatus.BLOCKED:
        # Not a failure: why no instance takes the run (it waits for one that can).
        grid.add_row("Blocked", Text(visible(str(run.error.get("message", ""))), style="yellow"))
    elif run.error:
        grid.add_row("Error", Text(_error_line(run.error, 200), style="red"))
    return grid


def _relative(ms: int, now: int) -> str:
    delta = ms - now
    return f"in {format_duration(delta)}" if delta >= 0 else f"{format_duration(-delta)} ago"


def _checkpoint_detail(cp: Checkpoint, now: int, limit: int) -> Text:
    if cp.status is CheckpointStatus.COMPLETED:
        return Text(abbreviate(cp.output, limit))
    if cp.status is CheckpointStatus.FAILED:
        return Text(_error_line(cp.error, limit), style="red")
    if cp.status is CheckpointStatus.RUNNING:
        return Text(f"running (attempt {max(cp.attempts, 1)})", style="cyan")
    if cp.kind == "sleep" and cp.wake_at is not None:
        return Text(f"sleeping until {format_time(cp.wake_at, with_date=False)}", style="blue")
    if cp.kind == "signal":
        text = "waiting for the signal"
        if cp.wake_at is not None:
            text += f", times out {format_time(cp.wake_at, with_date=False)}"
        return Text(text, style="blue")
    if cp.wake_at is not None:
        return Text(f"waiting until {format_time(cp.wake_at, with_date=False)}", style="blue")
    return Text("waiting", style="blue")


def timeline_table(
    checkpoints: Iterable[Checkpoint],
    *,
    now_ms: int | None = None,
    detail_limit: int = 60,
    title: str | None = "Timeline",
) -> Table:
    """The step timeline of a run: one row per checkpoint, in seq order.

    Times are shown without their date when every one falls on the same day.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    rows = sorted(checkpoints, key=lambda cp: (cp.seq < 0, abs(cp.seq)))
    days = {format_time(ms)[:10] for cp in rows for ms in (cp.started_at, cp.finished_at) if ms}
    with_date = len(days) > 1
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False)
    table.add_column("SEQ", justify="right", no_wrap=True)
    table.add_column("NAME", no_wrap=True)
    table.add_column("KIND", no_wrap=True)
    table.add_column("STATUS", no_wrap=True)
    table.add_column("ATT", justify="right", no_wrap=True)
    table.add_column("STARTED", no_wrap=True)
    table.add_column("FINISHED", no_wrap=True)
    table.add_column("DURATION", justify="right", no_wrap=True)
    table.add_column("OUTPUT / ERROR")
    for cp in rows:
        duration = (
            cp.finished_at - cp.started_at
            if cp.finished_at is not None and cp.started_at is not None
            else None
        )
        table.add_row(
            str(cp.seq),
            plain(cp.name),
            plain(cp.kind),
            status_text(cp.status),
            str(cp.attempts) if cp.attempts else "",
            format_time(cp.started_at, with_date=with_date),
            format_time(cp.finished_at, with_date=with_date),
            format_duration(duration) if duration is not None else "…",
            _checkpoint_detail(cp, now, detail_limit),
        )
    return table


def render_run(
    run: Run,
    checkpoints: list[Checkpoint],
    *,
    now_ms: int | None = None,
    attributes: dict[str, Any] | None = None,
) -> Group:
    """``durably runs show``: the run's details (with its search attributes),
    then its step timeline."""
    details = run_details(run, now_ms=now_ms)
    if attributes:
        shown = ", ".join(f"{k}={v}" for k, v in attributes_to_json(attributes).items())
        details.add_row("Attributes", plain(shown))
    parts: list[RenderableType] = [details, Text("")]
    if checkpoints:
        parts.append(timeline_table(checkpoints, now_ms=now_ms))
    else:
        parts.append(Text("No steps recorded yet.", style="dim"))
    return Group(*parts)


def attributes_to_json(attributes: dict[str, Any]) -> dict[str, Any]:
    """Search attributes as JSON values (a datetime as ISO-8601 UTC)."""
    return {
        key: value.astimezone(UTC).isoformat().replace("+00:00", "Z")
        if isinstance(value, datetime)
        else value
        for key, value in attributes.items()
    }


def iso_time(ms: int | None) -> str | None:
    """Epoch milliseconds as an ISO-8601 UTC string (``2024-05-01T12:00:00.123Z``)."""
    if ms is None:
        return None
    try:
        moment = datetime.fromtimestamp(ms / 1000, UTC)
    except (ValueError, OverflowError, OSError):
        return None
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


# Epoch-ms columns that are not named ``*_at``.
_TIME_KEYS = frozenset({"locked_until"})


def iso_times(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its epoch-ms times (``*_at`` keys, ``locked_until``) as ISO-8601 UTC."""
    return {
        key: iso_time(value)
        if (key.endswith("_at") or key in _TIME_KEYS)
        and isinstance(value, int)
        and not isinstance(value, bool)
        else value
        for key, value in data.items()
    }


def run_to_dict(run: Run) -> dict[str, Any]:
    """A run as JSON-ready data (for ``--json``; times as ISO-8601 UTC)."""
    data = dataclasses.asdict(run)
    data["status"] = run.status.value
    return iso_times(data)


def checkpoint_to_dict(checkpoint: Checkpoint) -> dict[str, Any]:
    """A checkpoint as JSON-ready data (for ``--json``; times as ISO-8601 UTC)."""
    data = dataclasses.asdict(checkpoint)
    data["status"] = checkpoint.status.value
    data["step_id"] = checkpoint.step_id
    return iso_times(data)
