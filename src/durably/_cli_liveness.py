"""``durably runs list --stale``: the live runs nothing has moved for a while,
each with what it waits for and a hint of what to do.

A run is stale when, for at least the given age, it has been:

- ``pending`` and no worker took it (is a worker running?);
- ``running`` with a lease that expired (its worker died; a worker recovers it);
- ``suspended`` with a timer (or wake-up) due and no worker woke it;
- stranded (the store's :meth:`list_stalled`): waiting for a signal or an
  event nobody sent, or on a dispatched step no step worker answered;
- ``blocked``: no worker registers its workflow version.

Each comes from an indexed query of the worker loop, so the command stays
cheap on a store holding many runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from ._cli_render import format_duration, iso_time, plain, run_to_dict, status_text, visible
from .client import Client
from .model import Checkpoint, CheckpointStatus, Run, RunStatus

__all__ = ["Liveness", "find_stale", "liveness_table"]

# Ids each query returns at most: filters (--status, --workflow, --tag) and
# the page size apply to the runs found, so a query reads more than a page.
_SCAN = 1000

_WAITING = frozenset({CheckpointStatus.PENDING, CheckpointStatus.RUNNING})


@dataclasses.dataclass(slots=True)
class Liveness:
    """A stale run, how long since anything moved it, and what it waits for."""

    run: Run
    idle_ms: int
    """Since the run was last updated."""
    oldest_step: Checkpoint | None
    """Its oldest checkpoint still waiting (pending or running), if any."""
    step_since: int | None
    """When that checkpoint started waiting (epoch ms)."""
    hint: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (times as ISO-8601 UTC)."""
        step = self.oldest_step
        return {
            "run": run_to_dict(self.run),
            "idle_seconds": round(self.idle_ms / 1000, 3),
            "recovery_attempts": self.run.recovery_attempts,
            "oldest_pending_step": None
            if step is None
            else {
                "seq": step.seq,
                "name": step.name,
                "kind": str(step.kind),
                "status": str(step.status),
                "since": iso_time(self.step_since),
            },
            "hint": self.hint,
        }


async def find_stale(
    engine: Client,
    age_ms: int,
    limit: int,
    *,
    keep: Callable[[Run], bool] = lambda run: True,
) -> list[Liveness]:
    """The live runs (every namespace) stale for at least ``age_ms`` that
    ``keep`` accepts, least recently updated first, at most ``limit``."""
    store = engine.store
    now = engine.clock.now_ms()
    before = now - age_ms
    ids: dict[str, None] = {}
    # Outside no workflow = every run: pending and untaken, or suspended and due,
    # since ``before`` (what a worker would mark blocked if it lacked the workflow).
    for run_id in await store.list_unclaimed(before, _SCAN, workflows=frozenset()):
        ids[run_id] = None
    for run_id in await store.list_orphans(before, _SCAN):
        ids[run_id] = None
    for run_id in await store.list_stalled(before, _SCAN):
        ids[run_id] = None
    blocked = await engine.list_runs(status=RunStatus.BLOCKED, limit=_SCAN)
    for run in blocked.runs:
        ids[run.run_id] = None
    stale = sorted(
        (
            run
            for run in await store.get_runs(list(ids))
            if not run.status.is_terminal and run.updated_at <= before and keep(run)
        ),
        key=lambda run: (run.updated_at, run.run_id),
    )[:limit]
    found: list[Liveness] = []
    for run in stale:  # the history of the runs shown only
        checkpoints = (await store.load_checkpoints(run.run_id)).values()
        step, since = _oldest_waiting(checkpoints)
        found.append(Liveness(run, now - run.updated_at, step, since, _hint(run, step, since, now)))
    return found


def _oldest_waiting(checkpoints: Iterable[Checkpoint]) -> tuple[Checkpoint | None, int | None]:
    oldest: tuple[Checkpoint | None, int | None] = (None, None)
    for cp in checkpoints:
        if cp.status not in _WAITING or cp.seq < 0:
            continue
        since = cp.dispatched_at or cp.started_at
        if oldest[0] is None or (since or 0) < (oldest[1] or 0):
            oldest = (cp, since)
    return oldest


def _ago(ms: int | None, now: int) -> str:
    return "a while" if ms is None else format_duration(max(now - ms, 0))


def _hint(run: Run, step: Checkpoint | None, since: int | None, now: int) -> str:
    hint = _what_to_do(run, step, since, now)
    if run.recovery_attempts:
        # Each recovery is a worker that died holding the run: its turns may be
        # what kills them (memory, a native crash), not bad luck.
        hint += (
            f" (recovered {run.recovery_attempts} time(s) after its worker died: "
            "check the worker logs for what killed them)"
        )
    return hint


def _what_to_do(run: Run, step: Checkpoint | None, since: int | None, now: int) -> str:
    idle = format_duration(now - run.updated_at)
    name = visible(run.workflow)
    if run.status is RunStatus.BLOCKED:
        return (
            f"no worker registers workflow {name} version {visible(run.workflow_version)}: "
            "deploy a worker that does (the run waits for it)"
        )
    if run.status is RunStatus.PENDING:
        return (
            f"no worker has taken this run for {idle}: is a worker running "
            f"(durably worker --app …) with workflow {name} registered?"
        )
    if run.status is RunStatus.RUNNING:
        return (
            f"its worker {visible(run.locked_by or '?')} stopped renewing the lease "
            f"(crashed?); no worker has recovered it for {idle}: is one running?"
        )
    if step is not None and step.kind in ("signal", "event"):
        what, _, key = step.name.partition(":")
        send = "durably signal" if what == "signal" else "durably events publish"
        return (
            f"waits for {what} {visible(repr(key))} for {_ago(since, now)}: "
            f"send it ({send} {visible(key)} JSON) or cancel the run"
        )
    if step is not None and step.kind == "step" and step.dispatched_at is not None:
        return (
            f"step {visible(step.name)} was sent {_ago(step.dispatched_at, now)} ago and no step "
            "worker answered: is one serving it? (durably runs resume re-drives the run)"
        )
    if run.wake_at is not None and run.wake_at <= now:
        return (
            f"its timer was due {_ago(run.wake_at, now)} ago and no worker woke it: "
            "is a worker running?"
        )
    return f"no worker has touched this run for {idle}: is a worker running?"


def liveness_table(found: list[Liveness]) -> Table:
    """The ``durably runs list --stale`` table."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("RUN ID", no_wrap=True)
    table.add_column("WORKFLOW", no_wrap=True)
    table.add_column("STATUS", no_wrap=True)
    table.add_column("IDLE", justify="right", no_wrap=True)
    table.add_column("RECOVERIES", justify="right", no_wrap=True)
    table.add_column("OLDEST PENDING STEP")
    table.add_column("HINT")
    for live in found:
        step = live.oldest_step
        table.add_row(
            plain(live.run.run_id),
            plain(live.run.workflow),
            status_text(live.run.status),
            format_duration(live.idle_ms),
            str(live.run.recovery_attempts),
            plain(f"{step.name} ({step.kind})") if step is not None else Text("-"),
            Text(live.hint, style="yellow"),
        )
    return table
