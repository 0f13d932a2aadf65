"""The run page's model: the step timeline (a Gantt in percentages of the
run's span), what the run waits for now, and its lineage. Pure functions of
stored rows, so the HTML page and the JSON API show the same thing."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..model import Checkpoint, CheckpointKind, CheckpointStatus, Run, RunStatus

__all__ = ["Bar", "Lineage", "Wait", "axis", "lineage", "pretty", "timeline", "waits"]

# A continue-as-new link is ``<base>~N``; a retry with new input ``<id>~retry~<hex>``.
_LINK = re.compile(r"^(.*)~(\d+)$")
_RETRY = re.compile(r"^(.*)~retry~[0-9a-f]+$")


def pretty(value: Any) -> str:
    """A stored JSON value as indented text (escaped by the template, never here)."""
    return json.dumps(value, indent=2, ensure_ascii=False)


@dataclass(slots=True)
class Bar:
    """One checkpoint on the timeline; positions are percentages of the span."""

    seq: int
    name: str
    kind: str
    status: str
    group: str | None
    attempts: int
    left: float
    width: float
    queued: float
    """The leading part of a dispatched step's bar before its last attempt was
    sent: a flow-control slot, earlier attempts and their backoff."""
    heartbeat: float | None
    started_at: int | None
    finished_at: int | None
    duration_ms: int | None
    queue_ms: int | None
    progress: Any = None
    redispatches: int = 0
    child_id: str | None = None
    """A child run's id (for a link to it)."""
    parallel: bool = False
    """It ran while another operation of the run was running (a gather or a
    fan-out), whether or not they share a ``group``."""
    events: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        """The bar as the JSON API returns it."""
        return asdict(self)


@dataclass(slots=True)
class Wait:
    """One thing a live run waits for."""

    kind: str
    """``timer``, ``signal``, ``event``, ``child``, ``step``, ``admission`` or ``executor``."""
    what: str
    """The token, event name, child run id, step name, or a description."""
    seq: int | None = None
    due_at: int | None = None
    detail: str = ""


@dataclass(slots=True)
class Lineage:
    """Where a run comes from and where it went."""

    parent_id: str | None
    previous_link: str | None
    """The run this one continues (continue-as-new), if that id exists."""
    next_link: str | None
    retry_of: str | None
    """The run this one retries with new input."""


def _span(run: Run, checkpoints: list[Checkpoint], now: int) -> tuple[int, int]:
    start = run.created_at
    end = run.updated_at if RunStatus(run.status).is_terminal else now
    for cp in checkpoints:
        for moment in (cp.started_at, cp.finished_at, cp.last_heartbeat_at):
            if moment is not None:
                start, end = min(start, moment), max(end, moment)
    return start, max(end, start + 1)


def axis(
    run: Run, checkpoints: list[Checkpoint], now: int, ticks: int = 4
) -> list[tuple[float, int]]:
    """The timeline's scale: ``(percent, ms since the run's start)`` pairs."""
    start, end = _span(run, checkpoints, now)
    return [(i * 100 / ticks, (end - start) * i // ticks) for i in range(ticks + 1)]


def timeline(run: Run, checkpoints: list[Checkpoint], now: int) -> list[Bar]:
    """The Gantt bars of ``checkpoints`` across the run's life (up to ``now``
    for a live run): compensations (negative seqs) after the body's steps."""
    start, end = _span(run, checkpoints, now)
    total = end - start
    live_end = run.updated_at if RunStatus(run.status).is_terminal else now

    def pct(moment: int) -> float:
        return round(max(0.0, min(100.0, (moment - start) * 100 / total)), 3)

    bars = []
    ordered = sorted(checkpoints, key=lambda cp: (cp.seq < 0, abs(cp.seq)))
    for cp in ordered:
        begin = cp.started_at if cp.started_at is not None else start
        finish = cp.finished_at if cp.finished_at is not None else max(live_end, begin)
        dispatched = cp.dispatched_at if cp.dispatched_at is not None else begin
        left = pct(begin)
        width = max(pct(finish) - left, 0.4)  # an instant still shows as a sliver
        queued = min(max(pct(dispatched) - left, 0.0), width)
        bars.append(
            Bar(
                seq=cp.seq,
                name=cp.name,
                kind=str(cp.kind),
                status=str(cp.status),
                group=cp.group,
                attempts=cp.attempts,
                left=left,
                width=round(width, 3),
                queued=round(queued, 3),
                heartbeat=pct(cp.last_heartbeat_at) if cp.last_heartbeat_at else None,
                started_at=cp.started_at,
                finished_at=cp.finished_at,
                duration_ms=(cp.finished_at - begin) if cp.finished_at is not None else None,
                queue_ms=(dispatched - begin) if cp.dispatched_at is not None else None,
                progress=cp.progress,
                redispatches=cp.redispatches,
                child_id=_child_of(cp),
                events=list(cp.events or []),
                error=cp.error,
            )
        )
    _mark_parallel(bars)
    return bars


def _mark_parallel(bars: list[Bar]) -> None:
    # Sweep by start: a bar overlapping the furthest end seen so far ran in
    # parallel with the bar that reached it.
    timed = sorted(
        (b for b in bars if b.started_at is not None and b.finished_at is not None),
        key=lambda b: (b.started_at or 0, b.finished_at or 0),
    )
    reach: Bar | None = None
    for bar in timed:
        if reach is not None and (bar.started_at or 0) < (reach.finished_at or 0):
            bar.parallel = reach.parallel = True
        if reach is None or (bar.finished_at or 0) > (reach.finished_at or 0):
            reach = bar


def _child_of(cp: Checkpoint) -> str | None:
    # A child's placeholder checkpoint records the child's id in its input.
    if str(cp.kind) != CheckpointKind.CHILD or not isinstance(cp.input, dict):
        return None
    child = cp.input.get("run_id")
    return str(child) if child else None


def waits(run: Run, checkpoints: list[Checkpoint]) -> list[Wait]:
    """What a live run waits for now (nothing for a terminal run)."""
    status = RunStatus(run.status)
    if status.is_terminal:
        return []
    found: list[Wait] = []
    if status is RunStatus.PENDING:
        found.append(Wait("executor", "an executor to take the run", due_at=run.wake_at))
    if status is RunStatus.BLOCKED:
        found.append(Wait("admission", "a capable worker or a flow-control slot"))
    for cp in checkpoints:
        if cp.status != CheckpointStatus.PENDING:
            continue
        kind = str(cp.kind)
        if kind == CheckpointKind.SLEEP:
            found.append(Wait("timer", cp.name, cp.seq, due_at=cp.wake_at))
        elif kind == CheckpointKind.SIGNAL:
            token = cp.name.removeprefix("signal:")
            found.append(Wait("signal", token, cp.seq, due_at=cp.wake_at, detail="timeout"))
        elif kind == CheckpointKind.EVENT:
            found.append(Wait("event", cp.name.removeprefix("event:"), cp.seq, cp.wake_at))
        elif kind == CheckpointKind.CHILD:
            found.append(Wait("child", _child_of(cp) or cp.name, cp.seq))
        elif kind == CheckpointKind.STEP:
            if cp.dispatched_at is None:
                # The checkpoint names its queue only once it holds a slot.
                detail = "not sent yet: waiting for a flow-control slot or a retry's backoff"
            else:
                detail = "dispatched to any worker serving it"
                if cp.queue:
                    detail += f", holding a slot in queue {cp.queue}"
                if cp.redispatches:
                    detail += f" (sent again {cp.redispatches} times)"
            found.append(Wait("step", cp.name, cp.seq, due_at=cp.dispatched_at, detail=detail))
    if status is RunStatus.SUSPENDED and run.wake_at is not None and not found:
        found.append(Wait("timer", "wake", due_at=run.wake_at))
    return found


def lineage(run: Run, existing: set[str]) -> Lineage:
    """The run's links; ``existing`` holds which of :func:`candidates` exist."""
    previous = _previous_link(run.run_id)
    retry = _RETRY.match(run.run_id)
    output = run.output
    continued = (
        output.get("continued_as") if isinstance(output, dict) and len(output) == 1 else None
    )
    return Lineage(
        parent_id=run.parent_id,
        previous_link=previous if previous in existing else None,
        next_link=str(continued) if continued and run.status == RunStatus.COMPLETED else None,
        retry_of=retry.group(1) if retry and retry.group(1) in existing else None,
    )


def candidates(run_id: str) -> list[str]:
    """The ids :func:`lineage` asks about (to look them up in one read)."""
    found = []
    previous = _previous_link(run_id)
    if previous is not None:
        found.append(previous)
    retry = _RETRY.match(run_id)
    if retry:
        found.append(retry.group(1))
    return found


def _previous_link(run_id: str) -> str | None:
    match = _LINK.match(run_id)
    if match is None:
        return None
    base, number = match.group(1), int(match.group(2))
    return base if number == 1 else f"{base}~{number - 1}"
