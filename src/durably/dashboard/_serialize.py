"""Runs, checkpoints and schedules as the JSON API returns them."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from ..model import Run
from ..schedules import Schedule

__all__ = ["iso", "run_json", "run_summary", "schedule_json"]


def iso(ms: int | None) -> str | None:
    """Epoch ms as ISO-8601 UTC with milliseconds (``None`` stays ``None``)."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def run_summary(run: Run) -> dict[str, Any]:
    """A run's row in a list: no input or output."""
    return {
        "run_id": run.run_id,
        "workflow": run.workflow,
        "version": run.workflow_version,
        "status": str(run.status),
        "namespace": run.namespace,
        "tags": run.tags,
        "parent_id": run.parent_id,
        "created_at": iso(run.created_at),
        "updated_at": iso(run.updated_at),
        "updated_at_ms": run.updated_at,
    }


def run_json(run: Run) -> dict[str, Any]:
    """A run with everything stored on it."""
    data = asdict(run)
    data["status"] = str(run.status)
    for key in ("created_at", "updated_at", "wake_at", "locked_until", "deadline_at"):
        data[key] = iso(data[key])
    return data


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    """A schedule with its times in ISO-8601."""
    data = asdict(schedule)
    data["next_fire_at"] = iso(schedule.next_fire_at)
    data["last_fired_at"] = iso(schedule.last_fired_at)
    return data
