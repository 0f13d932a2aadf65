"""What the dashboard needs of the object it is given: an ``Engine`` today, a
``durably.Client`` tomorrow (both answer these methods), typed structurally so
the dashboard never imports either."""

from __future__ import annotations

from typing import Any, Protocol

from ..model import Checkpoint, Run, RunStatus
from ..schedules import Schedule
from ..stores.base import QueueState, RunPage, RunQuery

__all__ = ["DashboardBackend", "DashboardStore", "StartedRun"]


class DashboardStore(Protocol):
    """The read-only store queries the runs list needs beyond the client API:
    the richer filters, the counts per status and the live view's polls."""

    async def list_runs(self, query: RunQuery) -> RunPage:
        """Runs matching ``query``, newest first."""

    async def count_runs(self, query: RunQuery, cap: int) -> dict[str, int]:
        """Runs matching ``query`` per status, each count at most ``cap``."""

    async def list_changed(self, after: int, limit: int) -> list[Run]:
        """Runs updated after ``after`` (epoch ms), oldest change first."""

    async def get_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs among ``run_ids`` that exist."""

    async def list_queues(self) -> list[QueueState]:
        """Flow-control queues holding slots or waiters."""


class StartedRun(Protocol):
    """What a start answers (a ``RunHandle``): the new run's id is all the
    dashboard reads of it."""

    @property
    def run_id(self) -> str:
        """The run's id."""


class DashboardBackend(Protocol):
    """The client methods the dashboard calls (``Engine`` satisfies it)."""

    @property
    def store(self) -> DashboardStore:
        """The store the runs live in."""

    async def open(self) -> None:
        """Connect (idempotent)."""

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""

    async def history(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints in seq order."""

    async def cancel(self, run_id: str, *, compensate: bool = False) -> RunStatus:
        """Cancel a run (and its live children)."""

    async def retry(self, run_id: str) -> Run:
        """Run a failed or dead run again from where it failed."""

    async def retry_with_input(
        self, run_id: str, input: Any, *, new_run_id: str | None = None
    ) -> StartedRun:
        """A fresh run of the same workflow with corrected input."""

    async def signal(self, token: str, payload: Any = None) -> str | None:
        """Deliver ``payload`` to the run waiting on ``token``."""

    async def redispatch_pending(self, run_id: str) -> int:
        """Send again the tasks of the run's pending dispatched steps."""

    async def list_schedules(self) -> list[Schedule]:
        """Every schedule with its next fire time."""

    async def pause_schedule(self, name: str) -> Schedule:
        """Pause a schedule."""

    async def resume_schedule(self, name: str) -> Schedule:
        """Resume a paused schedule."""

    async def trigger_schedule(self, name: str) -> str:
        """Start the schedule's workflow now; return the run id."""
