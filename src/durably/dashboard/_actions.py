"""The dashboard's state changes, shared by the HTML forms and the JSON API:
each answers a short sentence, or raises :class:`ActionError` with one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import DurablyError
from ..model import TERMINAL_STATUSES, RunStatus
from ._backend import DashboardBackend
from ._filters import BULK_CAP, COUNT_CAP, RunFilter

__all__ = ["RUN_ACTIONS", "SCHEDULE_ACTIONS", "ActionError", "BulkResult", "bulk", "run_action"]

RUN_ACTIONS = ("cancel", "cancel-compensate", "retry", "retry-with-input", "signal", "redispatch")
SCHEDULE_ACTIONS = ("pause", "resume", "trigger")
_RETRYABLE = frozenset({RunStatus.FAILED, RunStatus.DEAD})


class ActionError(Exception):
    """An action that cannot be done: ``status`` is the HTTP answer (400 bad
    input, 404 unknown run, 409 not in a state that allows it)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class BulkResult:
    """What a bulk action did: runs ``matched`` by the filter (exact up to
    :data:`COUNT_CAP` per status), and on how many of the first
    :data:`BULK_CAP` it was ``applied``."""

    matched: int
    applied: int
    capped: bool


def parse_json(text: str | None, what: str) -> Any:
    """A JSON value typed into a form (empty text is ``null``)."""
    if text is None or not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ActionError(f"{what} is not valid JSON: {exc}") from None


async def run_action(backend: DashboardBackend, action: str, fields: dict[str, Any]) -> str:
    """Do ``action`` on the run ``fields["run_id"]``; the sentence to show."""
    run_id = str(fields.get("run_id") or "")
    if action not in RUN_ACTIONS:
        raise ActionError(f"unknown action {action!r}", 404)
    if action == "signal":
        token = str(fields.get("token") or "").strip()
        if not token:
            raise ActionError("a signal needs a token")
        payload = fields.get("payload")
        value = parse_json(payload, "the payload") if isinstance(payload, str) else payload
        receiver = await _call(backend.signal(token, value))
        return f"signal {token} delivered to {receiver}" if receiver else f"signal {token} buffered"
    run = await backend.get_run(run_id) if run_id else None
    if run is None:
        raise ActionError(f"no run {run_id!r}", 404)
    if action in ("cancel", "cancel-compensate"):
        if run.status in TERMINAL_STATUSES:
            raise ActionError(f"run is {run.status}; nothing to cancel", 409)
        await _call(backend.cancel(run_id, compensate=action == "cancel-compensate"))
        return "cancel requested" + (" with compensation" if action != "cancel" else "")
    if action == "retry":
        if run.status not in _RETRYABLE:
            raise ActionError(f"run is {run.status}; only failed or dead runs retry", 409)
        await _call(backend.retry(run_id))
        return "retrying"
    if action == "retry-with-input":
        raw = fields.get("input")
        value = parse_json(raw, "the input") if isinstance(raw, str) else raw
        new = await _call(backend.retry_with_input(run_id, value))
        return f"started {new.run_id}"
    count = await _call(backend.redispatch_pending(run_id))
    return f"sent {count} pending step(s) again"


async def bulk(backend: DashboardBackend, action: str, flt: RunFilter) -> BulkResult:
    """Cancel or retry the runs matching ``flt`` (at most :data:`BULK_CAP`)."""
    if action not in ("cancel", "retry"):
        raise ActionError(f"unknown bulk action {action!r}", 404)
    wanted = _RETRYABLE if action == "retry" else None
    counts = await backend.store.count_runs(flt.query(), COUNT_CAP)
    matched = (
        sum(counts.get(s.value, 0) for s in ([flt.status] if flt.status else RunStatus))
        if counts
        else 0
    )
    page = await backend.store.list_runs(flt.query(limit=BULK_CAP, cursor=None))
    applied = 0
    for run in page.runs:
        if (wanted is not None and run.status not in wanted) or (
            wanted is None and run.status in TERMINAL_STATUSES
        ):
            continue
        try:
            if action == "retry":
                await backend.retry(run.run_id)
            else:
                await backend.cancel(run.run_id)
        except DurablyError:
            continue  # it moved on meanwhile (finished, retried elsewhere): not applied
        applied += 1
    return BulkResult(matched, applied, matched > BULK_CAP)


async def schedule_action(backend: DashboardBackend, action: str, name: str) -> str:
    """Pause, resume or trigger the schedule ``name``."""
    if action not in SCHEDULE_ACTIONS:
        raise ActionError(f"unknown action {action!r}", 404)
    if not name:
        raise ActionError("which schedule?")
    if action == "pause":
        await _call(backend.pause_schedule(name))
        return f"paused {name}"
    if action == "resume":
        await _call(backend.resume_schedule(name))
        return f"resumed {name}"
    run_id = await _call(backend.trigger_schedule(name))
    return f"started {run_id}"


async def _call(awaitable: Any) -> Any:
    # The engine's refusals (a run that moved on, an unknown schedule, bad
    # input) become a sentence for the operator instead of a 500.
    try:
        return await awaitable
    except LookupError as exc:
        raise ActionError(str(exc).strip("'\""), 404) from None
    except (DurablyError, ValueError) as exc:
        raise ActionError(str(exc), 409) from None
