"""Pieces the stores share for the schedules table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SCHEDULE_COLUMNS", "UPDATABLE_SCHEDULE_COLUMNS", "check_schedule_changes"]

SCHEDULE_COLUMNS = (
    "name, namespace, spec, paused, next_fire_at, last_fired_at, last_run_id, "
    "firing_run_id, revision, created_at, updated_at"
)
"""The columns of ``durably_schedules`` in the order the stores read them."""

UPDATABLE_SCHEDULE_COLUMNS = frozenset(
    {
        "spec",
        "namespace",
        "paused",
        "next_fire_at",
        "last_fired_at",
        "last_run_id",
        "firing_run_id",
    }
)
"""The columns ``update_schedule`` may set (``revision`` and ``updated_at`` move on their own)."""


def check_schedule_changes(changes: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if ``changes`` names a column ``update_schedule`` may not set."""
    unknown = set(changes) - UPDATABLE_SCHEDULE_COLUMNS
    if unknown:
        raise ValueError(f"cannot update schedule columns {sorted(unknown)}")
