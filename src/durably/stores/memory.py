"""An in-memory store for tests and throwaway scripts. Nothing survives the process.

Each method runs without awaiting in between its reads and writes, so every
method is atomic with respect to every other on the one event loop.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Any

from .. import _attributes as attrcodec
from ..model import (
    TERMINAL_STATUSES,
    Checkpoint,
    CheckpointStatus,
    Run,
    RunStatus,
)
from ._memory_waits import MemoryWaits
from ._rows import (
    check_run_changes,
    check_schedule_changes,
    dead_error,
    decode_cursor,
    encode_cursor,
)
from .base import (
    Admission,
    BeatRecord,
    ChildEnd,
    Executable,
    QueueState,
    ReadFrom,
    Resolution,
    RunChanges,
    RunPage,
    RunQuery,
    ScheduleRecord,
    SettleResult,
    TurnLease,
    UpdateRecord,
    read_tail,
)

__all__ = ["MemoryStore"]


class MemoryStore(MemoryWaits):
    """A :class:`~durably.stores.base.StateStore` kept in dictionaries."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self.ordered_writes = False
        self._runs: dict[str, Run] = {}
        self._checkpoints: dict[str, dict[int, Checkpoint]] = defaultdict(dict)
        # Search attributes by run (values are immutable: str, numbers, datetimes).
        self._attributes: dict[str, dict[str, Any]] = {}
        self._awaiting: dict[str, str] = {}
        # token -> its waits (run, seq) in the order they registered
        self._waiters: dict[str, dict[tuple[str, int], None]] = {}
        # buffered signals and events: (created_at, payload), oldest first
        self._buffered: dict[str, deque[tuple[int, Any]]] = defaultdict(deque)
        # events: name -> {(run_id, seq): (match_keys, match)}; buffered payloads; published ids
        self._event_waiters: dict[str, dict[tuple[str, int], tuple[str, str]]] = {}
        self._buffered_events: dict[str, deque[tuple[int, Any]]] = {}
        self._published: dict[str, int] = {}
        self._schedules: dict[str, ScheduleRecord] = {}
        # flow control: queue -> step_id -> slot (released ones kept for the rate window)
        self._slots: dict[str, dict[str, _Slot]] = {}
        self._flow_waiters: dict[str, dict[str, _FlowWaiter]] = {}
        # updates: run -> update id -> record, in the order they arrived
        self._updates: dict[str, dict[str, UpdateRecord]] = {}

    async def open(self) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        """Nothing to release."""

    async def subscribe(self, on_event: Callable[[str, str], None]) -> bool:
        """No cross-process channel: the engine polls."""
        return False

    # -- runs --------------------------------------------------------------------

    async def create_run(
        self, run: Run, attributes: dict[str, Any] | None = None
    ) -> tuple[Run, bool]:
        """Insert unless the id exists (with its search attributes)."""
        existing = self._runs.get(run.run_id)
        if existing is not None:
            return copy.deepcopy(existing), False
        self._runs[run.run_id] = copy.deepcopy(run)
        if attributes:
            self._attributes[run.run_id] = _as_stored(attributes)
        return copy.deepcopy(run), True

    async def create_runs(self, runs: list[Run]) -> list[str]:
        """Insert the runs whose ids are new."""
        created: list[str] = []
        for run in runs:
            if run.run_id not in self._runs:
                self._runs[run.run_id] = copy.deepcopy(run)
                created.append(run.run_id)
        return created

    async def get_run(self, run_id: str) -> Run | None:
        """The run, or ``None``."""
        run = self._runs.get(run_id)
        return copy.deepcopy(run) if run is not None else None

    async def get_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs that exist among ``run_ids``."""
        return [copy.deepcopy(self._runs[i]) for i in dict.fromkeys(run_ids) if i in self._runs]

    async def get_run_statuses(self, run_ids: list[str]) -> dict[str, RunStatus]:
        """The status of each run that exists among ``run_ids`` (``RunStatusStore``)."""
        return {i: self._runs[i].status for i in run_ids if i in self._runs}

    async def watch_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs, as :meth:`get_runs` (this store's notices stay in-process)."""
        return await self.get_runs(run_ids)

    async def list_runs(self, query: RunQuery) -> RunPage:
        """Runs matching ``query``, newest first."""
        after = decode_cursor(query.cursor)
        matches = sorted(
            (r for r in self._runs.values() if self._matches(r, query)),
            key=lambda r: (r.created_at, r.run_id),
            reverse=True,
        )
        if after is not None:
            matches = [r for r in matches if (r.created_at, r.run_id) < after]
        page = matches[: query.limit]
        more = len(matches) > query.limit
        cursor = encode_cursor(page[-1].created_at, page[-1].run_id) if more and page else None
        return RunPage([copy.deepcopy(r) for r in page], cursor)

    async def count_runs(self, query: RunQuery, cap: int) -> dict[str, int]:
        """Runs matching ``query`` per status, each count at most ``cap``."""
        any_status = dataclasses.replace(query, status=None, statuses=None)
        counts: dict[str, int] = {}
        for run in self._runs.values():
            if self._matches(run, any_status):
                counts[run.status.value] = min(cap, counts.get(run.status.value, 0) + 1)
        return counts

    async def list_queues(self) -> list[QueueState]:
        """Flow-control queues holding slots or waiters, by name."""
        states = []
        for queue in sorted(set(self._slots) | set(self._flow_waiters)):
            held = sum(1 for s in self._slots.get(queue, {}).values() if s.released_at is None)
            waiters = self._flow_waiters.get(queue, {})
            if held or waiters:
                oldest = min((w.enqueued_at for w in waiters.values()), default=None)
                states.append(QueueState(queue, held, len(waiters), oldest))
        return states

    async def list_changed(self, after: int, limit: int) -> list[Run]:
        """Runs updated after ``after``, oldest change first."""
        changed = sorted(
            (r for r in self._runs.values() if r.updated_at > after),
            key=lambda r: (r.updated_at, r.run_id),
        )
        return [copy.deepcopy(r) for r in changed[:limit]]

    async def delete_run(self, run_id: str) -> bool:
        """Delete a run with its history."""
        if self._runs.pop(run_id, None) is None:
            return False
        self._checkpoints.pop(run_id, None)
        self._attributes.pop(run_id, None)
        self._updates.pop(run_id, None)
        self._drop_waiters(run_id)
        for slots in self._slots.values():
            for step_id in [k for k, slot in slots.items() if slot.run_id == run_id]:
                if slots[step_id].released_at is None:
                    del slots[step_id]
        for waiters in self._flow_waiters.values():
            for step_id in [k for k, w in waiters.items() if w.run_id == run_id]:
                del waiters[step_id]
        return True

    # -- leases and turns ------------------------------------------------------------

    async def _acquire_run(
        self, run_id: str, owner: str, now: int, lease_until: int, statuses: frozenset[RunStatus]
    ) -> Run | None:
        # One run's lease for start_turns: leased if its status allows and
        # nobody else holds it.
        run = self._runs.get(run_id)
        if run is None or run.status not in statuses or _leased(run, now):
            return None
        run.status = RunStatus.RUNNING
        run.locked_by, run.locked_until = owner, lease_until
        run.wake_requested_at = None
        run.wake_at = None
        run.updated_at = now
        return copy.deepcopy(run)

    async def start_turns(
        self,
        run_ids: list[str],
        owner: str,
        now: int,
        lease_until: int,
        statuses: frozenset[RunStatus],
        *,
        workflows: Executable | None = None,
        read_from: ReadFrom | None = None,
    ) -> dict[str, tuple[Run, dict[int, Checkpoint]]]:
        """Lease each run that is free and load its history (no await yields)."""
        leased: dict[str, tuple[Run, dict[int, Checkpoint]]] = {}
        for run_id in run_ids:
            found = self._runs.get(run_id)
            if found is None or not _of(found, workflows):
                continue
            run = await self._acquire_run(run_id, owner, now, lease_until, statuses)
            if run is not None:
                since = 0 if read_from is None else read_from(run_id)
                leased[run_id] = run, await self.load_checkpoints(run_id, since)
        return leased

    async def continue_turn(self, run_id: str, owner: str, lease_until: int) -> Run | None:
        """Keep the lease for one more turn."""
        run = self._runs.get(run_id)
        if run is None or run.status is not RunStatus.RUNNING or run.locked_by != owner:
            return None
        run.wake_requested_at = None
        run.locked_until = lease_until
        return copy.deepcopy(run)

    async def renew_lease(self, run_id: str, owner: str, lease_until: int) -> bool:
        """Extend our lease."""
        run = self._runs.get(run_id)
        if run is None or run.status is not RunStatus.RUNNING or run.locked_by != owner:
            return False
        run.locked_until = lease_until
        return True

    async def settle_run(
        self, run_id: str, owner: str, status: RunStatus, changes: RunChanges, now: int
    ) -> SettleResult:
        """End a turn by compare-and-set."""
        run = self._runs.get(run_id)
        if run is None or run.status is not RunStatus.RUNNING or run.locked_by != owner:
            return SettleResult.LOST
        if status not in TERMINAL_STATUSES and run.wake_requested_at is not None:
            return SettleResult.WAKE_REQUESTED
        run.status = status
        run.output, run.error, run.wake_at = changes.output, changes.error, changes.wake_at
        run.locked_by = run.locked_until = None
        run.updated_at = now
        if status in TERMINAL_STATUSES:
            self._drop_waiters(run_id)
        return SettleResult.SETTLED

    async def end_child_runs(self, ends: list[ChildEnd], now: int) -> list[tuple[bool, int | None]]:
        """End each child still as expected and settle its parent's
        placeholder; nothing awaits in between, so the batch is atomic."""
        answers: list[tuple[bool, int | None]] = []
        for end in ends:
            run = self._runs.get(end.run_id)
            if run is None or (
                run.status is not RunStatus.RUNNING or run.locked_by != end.owner
                if end.owner is not None
                else run.status not in end.statuses
            ):
                answers.append((False, None))
                continue
            run.status = end.status
            run.output = copy.deepcopy(end.changes.output)
            run.error = copy.deepcopy(end.changes.error)
            run.wake_at = end.changes.wake_at
            run.locked_by = run.locked_until = None
            run.updated_at = now
            self._drop_waiters(end.run_id)
            answers.append((True, self._resolve(end.report, now)))
        return answers

    async def release_run(self, run_id: str, owner: str, now: int) -> bool:
        """Hand the run back as pending."""
        run = self._runs.get(run_id)
        if run is None or run.status is not RunStatus.RUNNING or run.locked_by != owner:
            return False
        run.status = RunStatus.PENDING
        run.locked_by = run.locked_until = None
        run.updated_at = now
        return True

    async def request_wake(self, run_id: str, now: int) -> bool:
        """Stamp a wake request on a live run."""
        run = self._runs.get(run_id)
        if run is None or run.status in TERMINAL_STATUSES:
            return False
        run.wake_requested_at = now
        return True

    # -- remote workflow turns --------------------------------------------------------

    async def mark_awaiting(self, run_id: str, owner: str, task_id: str | None) -> bool:
        """Record (or clear) the turn a run leased by ``owner`` awaits."""
        run = self._runs.get(run_id)
        if run is None or run.status is not RunStatus.RUNNING or run.locked_by != owner:
            return False
        if task_id is None:
            self._awaiting.pop(run_id, None)
        else:
            self._awaiting[run_id] = task_id
        return True

    async def take_decision(
        self,
        run_id: str,
        task_id: str,
        owner: str,
        lease_until: int,
        now: int,
        checkpoints: list[Checkpoint],
    ) -> Run | None:
        """Lease a run awaiting ``task_id`` and insert the decision's
        checkpoints (no await yields: atomic)."""
        run = self._runs.get(run_id)
        if (
            run is None
            or run.status is not RunStatus.SUSPENDED
            or self._awaiting.get(run_id) != task_id
        ):
            return None
        del self._awaiting[run_id]
        run.status = RunStatus.RUNNING
        run.locked_by, run.locked_until = owner, lease_until
        run.wake_at = run.wake_requested_at = None
        run.updated_at = now
        held = self._checkpoints[run_id]
        for checkpoint in checkpoints:
            held.setdefault(checkpoint.seq, copy.deepcopy(checkpoint))
        return copy.deepcopy(run)

    async def mark_dispatched(self, run_id: str, seqs: list[int], at: int) -> None:
        """Stamp the pending, unstamped checkpoints at ``seqs`` as sent."""
        held = self._checkpoints.get(run_id, {})
        for seq in seqs:
            cp = held.get(seq)
            if (
                cp is not None
                and cp.status is CheckpointStatus.PENDING
                and cp.dispatched_at is None
            ):
                cp.dispatched_at = at

    async def extend_decision_wait(self, run_id: str, wake_at: int, now: int) -> bool:
        """Push back the re-drive time of a run awaiting a decision."""
        run = self._runs.get(run_id)
        if run is None or run.status is not RunStatus.SUSPENDED or run_id not in self._awaiting:
            return False
        if run.wake_at is None or run.wake_at < wake_at:
            run.wake_at = wake_at
            run.updated_at = now
        return True

    async def update_run_if(
        self, run_id: str, statuses: frozenset[RunStatus], changes: dict[str, Any], now: int
    ) -> bool:
        """Apply ``changes`` while the status is one of ``statuses``."""
        check_run_changes(changes)
        run = self._runs.get(run_id)
        if run is None or run.status not in statuses:
            return False
        for column, value in changes.items():
            setattr(run, column, RunStatus(value) if column == "status" else copy.deepcopy(value))
        run.updated_at = now
        if run.status in TERMINAL_STATUSES:
            run.locked_by = run.locked_until = None
            self._drop_waiters(run_id)
        return True

    # -- the worker loop ---------------------------------------------------------------

    async def list_pending(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Pending runs, most urgent first, then oldest."""
        pending = [
            r
            for r in self._runs.values()
            if r.status is RunStatus.PENDING and _in(r, namespace) and _of(r, workflows)
        ]
        pending.sort(key=lambda r: (-r.priority, r.created_at, r.run_id))
        return [r.run_id for r in pending[:limit]]

    async def list_orphans(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Running runs whose lease expired."""
        orphans = [
            r
            for r in self._runs.values()
            if r.status is RunStatus.RUNNING
            and (r.locked_until or 0) < now
            and _in(r, namespace)
            and _of(r, workflows)
        ]
        orphans.sort(key=lambda r: (r.locked_until or 0, r.run_id))
        return [r.run_id for r in orphans[:limit]]

    async def recover_orphans(
        self, run_ids: list[str], now: int, max_attempts: int
    ) -> dict[str, RunStatus]:
        """Count a recovery of each run still orphaned; pending again, or dead
        past ``max_attempts``. No await inside, so the batch is atomic."""
        recovered: dict[str, RunStatus] = {}
        for run_id in run_ids:
            run = self._runs.get(run_id)
            if run is None or run.status is not RunStatus.RUNNING or (run.locked_until or 0) >= now:
                continue  # a duplicate id lands here too: it is pending already
            run.recovery_attempts += 1
            run.locked_by = run.locked_until = None
            run.updated_at = now
            if run.recovery_attempts > max_attempts:
                run.status = RunStatus.DEAD
                run.error = dead_error(run.recovery_attempts)
                self._drop_waiters(run_id)
            else:
                run.status = RunStatus.PENDING
            recovered[run_id] = run.status
        return recovered

    async def list_due(
        self,
        now: int,
        limit: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> list[str]:
        """Suspended runs whose timer is due or whose wake was requested."""
        due = [
            r
            for r in self._runs.values()
            if _due(r, now) and _in(r, namespace) and _of(r, workflows)
        ]
        due.sort(key=lambda r: (_due_key(r, now), r.run_id))
        return [r.run_id for r in due[:limit]]

    async def next_wake_at(
        self,
        after: int,
        *,
        namespace: str | None = None,
        workflows: Executable | None = None,
    ) -> int | None:
        """The earliest timer of a suspended run later than ``after``."""
        return min(
            (
                r.wake_at
                for r in self._runs.values()
                if r.status is RunStatus.SUSPENDED
                and r.wake_at is not None
                and r.wake_at > after
                and _in(r, namespace)
                and _of(r, workflows)
            ),
            default=None,
        )

    async def list_unclaimed(
        self,
        before: int,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Runs outside ``workflows`` nobody took since ``before``, oldest first."""
        found: list[tuple[int, str]] = []
        for r in self._runs.values():
            if _of(r, workflows) or not _in(r, namespace):
                continue
            if r.status is RunStatus.PENDING and r.updated_at < before:
                found.append((r.updated_at, r.run_id))
            elif r.status is RunStatus.SUSPENDED:
                due = [t for t in (r.wake_at, r.wake_requested_at) if t is not None and t < before]
                if due:
                    found.append((min(due), r.run_id))
        found.sort()
        return [run_id for _, run_id in found[:limit]]

    async def list_blocked(
        self,
        limit: int,
        *,
        workflows: Executable,
        namespace: str | None = None,
    ) -> list[str]:
        """Blocked runs of ``workflows``, most urgent first, then oldest."""
        blocked = [
            r
            for r in self._runs.values()
            if r.status is RunStatus.BLOCKED and _in(r, namespace) and _of(r, workflows)
        ]
        blocked.sort(key=lambda r: (-r.priority, r.created_at, r.run_id))
        return [r.run_id for r in blocked[:limit]]

    async def claim_due_batch(self, run_ids: list[str], now: int, next_wake_at: int) -> list[str]:
        """Move each due run's wake time ahead so no other poll takes it."""
        claimed: list[str] = []
        for run_id in run_ids:
            run = self._runs.get(run_id)
            if run is None or not _due(run, now) or _leased(run, now):
                continue  # a duplicate id lands here too: its wake_at moved ahead
            run.wake_at = next_wake_at
            run.wake_requested_at = None
            claimed.append(run_id)
        return claimed

    async def list_finished_before(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Terminal runs last updated before ``before``, oldest first."""
        old = [
            r
            for r in self._runs.values()
            if r.status in TERMINAL_STATUSES and r.updated_at < before and _in(r, namespace)
        ]
        old.sort(key=lambda r: (r.updated_at, r.run_id))
        return [r.run_id for r in old[:limit]]

    async def list_stalled(
        self, before: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Live runs with no progress since ``before``."""
        stalled = [
            r
            for r in self._runs.values()
            if _in(r, namespace) and _stalled(r, self._checkpoints.get(r.run_id, {}), before)
        ]
        stalled.sort(key=lambda r: (r.updated_at, r.run_id))
        return [r.run_id for r in stalled[:limit]]

    async def list_expired(
        self, now: int, limit: int, *, namespace: str | None = None
    ) -> list[str]:
        """Live runs past their execution deadline."""
        expired = [
            r
            for r in self._runs.values()
            if r.status not in TERMINAL_STATUSES
            and _in(r, namespace)
            and r.deadline_at is not None
            and r.deadline_at <= now
        ]
        expired.sort(key=lambda r: (r.deadline_at or 0, r.run_id))
        return [r.run_id for r in expired[:limit]]

    # -- checkpoints -------------------------------------------------------------------

    async def load_checkpoints(self, run_id: str, since: int = 0) -> dict[int, Checkpoint]:
        """Every checkpoint of the run (from ``since``, and the negative ones)."""
        history = sorted(self._checkpoints.get(run_id, {}).items())
        return read_tail(
            since, [(seq, copy.deepcopy(cp)) for seq, cp in history if seq < 0 or seq >= since]
        )

    async def save_checkpoint(self, checkpoint: Checkpoint, owner: str) -> bool:
        """Upsert under the lease; never replace a completed checkpoint."""
        if not self._holds(checkpoint.run_id, owner):
            return False
        self._put(checkpoint)
        return True

    async def save_checkpoints(self, checkpoints: list[Checkpoint], owner: str) -> bool:
        """Upsert many checkpoints under the lease."""
        if any(not self._holds(cp.run_id, owner) for cp in checkpoints):
            return False
        for checkpoint in checkpoints:
            self._put(checkpoint)
        return True

    async def get_attributes(self, run_id: str) -> dict[str, Any]:
        """The run's search attributes."""
        return dict(sorted(self._attributes.get(run_id, {}).items()))

    async def upsert_attributes(
        self, checkpoint: Checkpoint, attributes: dict[str, Any], owner: str
    ) -> bool:
        """Write the checkpoint and merge the attributes, under the lease."""
        if not self._holds(checkpoint.run_id, owner):
            return False
        self._put(checkpoint)
        self._attributes.setdefault(checkpoint.run_id, {}).update(_as_stored(attributes))
        return True

    # -- updates -------------------------------------------------------------------------

    async def put_update(self, record: UpdateRecord) -> UpdateRecord:
        """Add the update unless its id is there; return the stored one."""
        inbox = self._updates.setdefault(record.run_id, {})
        if record.update_id not in inbox:
            inbox[record.update_id] = copy.deepcopy(record)
        return copy.deepcopy(inbox[record.update_id])

    async def get_update(self, run_id: str, update_id: str) -> UpdateRecord | None:
        """The update, or ``None``."""
        found = self._updates.get(run_id, {}).get(update_id)
        return copy.deepcopy(found)

    async def pending_updates(self, run_id: str, limit: int) -> list[UpdateRecord]:
        """Unanswered updates, oldest first."""
        waiting = [r for r in self._updates.get(run_id, {}).values() if r.answer is None]
        return copy.deepcopy(waiting[:limit])

    async def answer_update(
        self,
        run_id: str,
        update_id: str,
        answer: dict[str, Any],
        now: int,
        *,
        checkpoint: Checkpoint | None = None,
        owner: str | None = None,
    ) -> bool:
        """Answer an unanswered update (with ``owner``: under the lease, with
        ``checkpoint``)."""
        if owner is not None and not self._holds(run_id, owner):
            return False
        record = self._updates.get(run_id, {}).get(update_id)
        pending = record is not None and record.answer is None
        if record is not None and pending:
            record.answer, record.answered_at = copy.deepcopy(answer), now
        if owner is None:
            return pending
        if checkpoint is not None:
            self._put(checkpoint)
        return True

    async def move_updates(self, from_run: str, to_run: str, now: int) -> int:
        """Hand the unanswered updates to ``to_run``."""
        moved = 0
        for record in list(self._updates.get(from_run, {}).values()):
            if record.answer is not None:
                continue
            await self.put_update(dataclasses.replace(record, run_id=to_run))
            record.answer, record.answered_at = {"outcome": "moved", "run_id": to_run}, now
            moved += 1
        return moved

    def _matches(self, run: Run, query: RunQuery) -> bool:
        return _matches(run, query) and (
            not query.attributes
            or attrcodec.matches(self._attributes.get(run.run_id, {}), query.attributes)
        )

    async def delete_checkpoints(self, run_id: str, seqs: list[int]) -> None:
        """Forget the given checkpoints."""
        history = self._checkpoints.get(run_id, {})
        for seq in seqs:
            history.pop(seq, None)

    async def resolve_checkpoints(
        self, resolutions: list[Resolution], now: int
    ) -> list[int | None]:
        """Settle each outcome in order (nothing awaits in between, so the
        batch is one atomic step)."""
        return [self._resolve(r, now) for r in resolutions]

    async def resolve_and_lease(
        self, resolutions: list[Resolution], now: int, lease: TurnLease
    ) -> tuple[list[int | None], dict[str, tuple[Run, dict[int, Checkpoint]]]]:
        """Resolve, then lease the woken runs (nothing awaits in between)."""
        answers = [self._resolve(r, now) for r in resolutions]
        woken = sorted(
            {
                r.run_id
                for r, left in zip(resolutions, answers, strict=True)
                if left is not None and (left == 0 or r.status is CheckpointStatus.FAILED)
            }
        )
        leased = await self.start_turns(
            woken[: max(0, lease.limit)],
            lease.owner,
            now,
            lease.lease_until,
            lease.statuses,
            workflows=lease.workflows,
            read_from=lease.read_from,
        )
        return answers, leased

    def _resolve(self, resolution: Resolution, now: int) -> int | None:
        run_id, seq, status = resolution.run_id, resolution.seq, resolution.status
        history = self._checkpoints.get(run_id, {})
        current = history.get(seq)
        if current is None or current.status in (
            CheckpointStatus.COMPLETED,
            CheckpointStatus.FAILED,
        ):
            return None
        current.status = status
        current.output = copy.deepcopy(resolution.output)
        current.error = copy.deepcopy(resolution.error)
        current.events = copy.deepcopy(resolution.events)
        current.finished_at = now
        left = 0
        if current.group is not None:
            left = sum(
                1
                for cp in history.values()
                if cp.group == current.group and cp.status is CheckpointStatus.PENDING
            )
        run = self._runs.get(run_id)
        wake = left == 0 or status is CheckpointStatus.FAILED
        held = (
            run is not None
            and resolution.held_by is not None
            and run.locked_by == resolution.held_by
            and (run.locked_until or 0) > now
        )
        if wake and run is not None and run.status not in TERMINAL_STATUSES and not held:
            run.wake_requested_at = now
        if current.queue is not None:
            slot = self._slots.get(current.queue, {}).get(current.step_id)
            if slot is not None and slot.released_at is None:
                slot.released_at = now
                self._wake_first_waiter(current.queue, now)
        return left

    # -- dispatched steps ----------------------------------------------------------------

    async def get_checkpoint(self, run_id: str, seq: int) -> Checkpoint | None:
        """One checkpoint, or ``None``."""
        found = self._checkpoints.get(run_id, {}).get(seq)
        return copy.deepcopy(found) if found is not None else None

    async def record_heartbeat(self, run_id: str, seq: int, at: int, progress: Any) -> bool:
        """Keep the later heartbeat (and its progress) on a pending checkpoint."""
        current = self._checkpoints.get(run_id, {}).get(seq)
        if current is None or current.status is not CheckpointStatus.PENDING:
            return False
        current.last_heartbeat_at = max(current.last_heartbeat_at or at, at)
        if progress is not None:
            current.progress = copy.deepcopy(progress)
        return True

    async def record_heartbeats(self, beats: list[BeatRecord]) -> list[bool]:
        """Each beat as :meth:`record_heartbeat`, in order."""
        return [await self.record_heartbeat(b.run_id, b.seq, b.at, b.progress) for b in beats]

    async def try_admit(self, request: Admission, now: int) -> int | None:
        """A slot for the step, or when to ask again."""
        queue, step_id = request.queue, request.step_id
        slots = self._slots.setdefault(queue, {})
        held = slots.get(step_id)
        if held is not None and held.released_at is None:
            return None
        for slot in slots.values():
            run = self._runs.get(slot.run_id)
            if slot.released_at is None and run is not None and run.status in TERMINAL_STATUSES:
                # Its run ended without freeing it (the process died in between).
                slot.released_at = now
        waiters = self._flow_waiters.setdefault(queue, {})
        for stale in [k for k, w in waiters.items() if w.seen_at < now - 3 * request.retry_ms]:
            del waiters[stale]
        window = now - request.rate_period_ms
        for old in [
            k for k, s in slots.items() if s.released_at is not None and s.acquired_at <= window
        ]:
            del slots[old]
        free: int | None = None
        if request.concurrency is not None:
            free = request.concurrency - sum(1 for s in slots.values() if s.released_at is None)
        if request.rate_limit is not None:
            by_rate = request.rate_limit - sum(1 for s in slots.values() if s.acquired_at > window)
            free = by_rate if free is None else min(free, by_rate)
        key = request.fairness_key if request.fairness_key is not None else request.run_id
        waiter = waiters.get(step_id)
        waiters[step_id] = _FlowWaiter(
            request.run_id,
            request.priority,
            key,
            waiter.enqueued_at
            if waiter is not None
            else (now if request.enqueued_at is None else request.enqueued_at),
            now,
        )
        admitted = free is None
        if free is not None and free > 0:
            first = self._waiters_in_order(queue)[:free]
            admitted = step_id in first
            if not admitted:
                # Room, but for waiters ahead of this one: wake them, in case the
                # release that made the room woke nobody (it found its slot freed).
                for ahead in first:
                    run = self._runs.get(waiters[ahead].run_id)
                    if run is not None and run.status not in TERMINAL_STATUSES:
                        run.wake_requested_at = now
        if not admitted:
            return now + request.retry_ms
        del waiters[step_id]
        slots[step_id] = _Slot(request.run_id, key, now, None)
        return None

    async def count_pending(self, namespace: str | None = None) -> int:
        """Pending runs (in ``namespace``)."""
        return sum(
            1 for r in self._runs.values() if r.status is RunStatus.PENDING and _in(r, namespace)
        )

    async def count_flow_waiters(self) -> dict[str, int]:
        """Steps waiting for admission, by queue."""
        return {queue: len(waiters) for queue, waiters in self._flow_waiters.items() if waiters}

    async def release_slots(self, run_id: str, now: int) -> int:
        """Free the run's slots, drop its waiters, wake each queue's next waiter."""
        freed = 0
        touched: set[str] = set()
        for queue, slots in self._slots.items():
            for slot in slots.values():
                if slot.run_id == run_id and slot.released_at is None:
                    slot.released_at = now
                    freed += 1
                    touched.add(queue)
        for queue, waiters in self._flow_waiters.items():
            for step_id in [k for k, w in waiters.items() if w.run_id == run_id]:
                del waiters[step_id]
                touched.add(queue)
        for queue in sorted(touched):
            self._wake_first_waiter(queue, now)
        return freed

    # -- schedules -----------------------------------------------------------------------

    async def create_schedule(self, record: ScheduleRecord) -> tuple[ScheduleRecord, bool]:
        """Insert unless the name exists."""
        existing = self._schedules.get(record.name)
        if existing is not None:
            return copy.deepcopy(existing), False
        self._schedules[record.name] = copy.deepcopy(record)
        return copy.deepcopy(record), True

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        """The schedule, or ``None``."""
        found = self._schedules.get(name)
        return copy.deepcopy(found) if found is not None else None

    async def list_schedules(self, namespace: str | None = None) -> list[ScheduleRecord]:
        """Schedules by name."""
        return [
            copy.deepcopy(s)
            for _, s in sorted(self._schedules.items())
            if namespace is None or s.namespace == namespace
        ]

    async def list_due_schedules(
        self, namespace: str, now: int, limit: int, workflows: list[str] | None = None
    ) -> list[ScheduleRecord]:
        """Schedules with a window due or a start to confirm."""
        due = [
            s
            for s in self._schedules.values()
            if s.namespace == namespace
            and (workflows is None or s.spec.get("workflow") in workflows)
            and (
                s.firing_run_id is not None
                or (not s.paused and s.next_fire_at is not None and s.next_fire_at <= now)
            )
        ]
        due.sort(key=lambda s: (s.next_fire_at if s.next_fire_at is not None else -1, s.name))
        return [copy.deepcopy(s) for s in due[:limit]]

    async def update_schedule(
        self, name: str, changes: dict[str, Any], now: int, *, revision: int | None = None
    ) -> ScheduleRecord | None:
        """Apply ``changes`` (compare-and-set on ``revision`` when given)."""
        check_schedule_changes(changes)
        record = self._schedules.get(name)
        if record is None or (revision is not None and record.revision != revision):
            return None
        for column, value in changes.items():
            setattr(record, column, copy.deepcopy(value))
        record.revision += 1
        record.updated_at = now
        return copy.deepcopy(record)

    async def delete_schedule(self, name: str) -> bool:
        """Delete a schedule."""
        return self._schedules.pop(name, None) is not None

    # -- helpers ---------------------------------------------------------------------------

    def _holds(self, run_id: str, owner: str) -> bool:
        run = self._runs.get(run_id)
        return run is not None and run.locked_by == owner

    def _put(self, checkpoint: Checkpoint) -> None:
        existing = self._checkpoints[checkpoint.run_id].get(checkpoint.seq)
        if existing is not None and existing.status is CheckpointStatus.COMPLETED:
            return
        stored = copy.deepcopy(checkpoint)
        # only a resolve writes events: a save keeps the stored ones
        stored.events = existing.events if existing is not None else None
        if existing is not None:
            # a heartbeat recorded meanwhile (by any instance) is never lost
            if existing.last_heartbeat_at is not None and (
                stored.last_heartbeat_at is None
                or stored.last_heartbeat_at < existing.last_heartbeat_at
            ):
                stored.last_heartbeat_at = existing.last_heartbeat_at
            if stored.progress is None:
                stored.progress = existing.progress
        self._checkpoints[checkpoint.run_id][checkpoint.seq] = stored

    def _waiters_in_order(self, queue: str) -> list[str]:
        """A queue's waiting step ids in admission order: priority, then the
        fairness key holding the fewest slots, then the oldest."""
        held: dict[str, int] = defaultdict(int)
        for slot in self._slots.get(queue, {}).values():
            if slot.released_at is None:
                held[slot.fairness_key] += 1
        waiters = self._flow_waiters.get(queue, {})
        return sorted(
            waiters,
            key=lambda k: (
                -waiters[k].priority,
                held[waiters[k].fairness_key],
                waiters[k].enqueued_at,
                k,
            ),
        )

    def _wake_first_waiter(self, queue: str, now: int) -> None:
        order = self._waiters_in_order(queue)
        if order:
            run = self._runs.get(self._flow_waiters[queue][order[0]].run_id)
            if run is not None and run.status not in TERMINAL_STATUSES:
                run.wake_requested_at = now

    def _drop_waiters(self, run_id: str) -> None:
        for token, waits in list(self._waiters.items()):
            for wait in [w for w in waits if w[0] == run_id]:
                self._forget_wait(token, *wait)
        for name, waiters in list(self._event_waiters.items()):
            for key in [k for k in waiters if k[0] == run_id]:
                del waiters[key]
            if not waiters:
                del self._event_waiters[name]


@dataclasses.dataclass(slots=True)
class _Slot:
    run_id: str
    fairness_key: str
    acquired_at: int
    released_at: int | None


@dataclasses.dataclass(slots=True)
class _FlowWaiter:
    run_id: str
    priority: int
    fairness_key: str
    enqueued_at: int
    seen_at: int


_WAIT_KINDS = ("signal", "event")


def _stalled(run: Run, checkpoints: Mapping[int, Checkpoint], before: int) -> bool:
    """The stranded signature (``StateStore.list_stalled``), as the SQL stores test it."""
    if run.status not in (RunStatus.SUSPENDED, RunStatus.RUNNING):
        return False
    pending = [cp for cp in checkpoints.values() if cp.status is CheckpointStatus.PENDING]
    if any(
        cp.dispatched_at is not None
        and cp.dispatched_at < before
        and (cp.last_heartbeat_at or 0) < before
        for cp in pending
    ):
        return True  # parked on a dispatched step whose worker went silent
    if run.status is not RunStatus.SUSPENDED:
        return False
    if any(cp.kind not in _WAIT_KINDS or cp.wake_at is not None for cp in pending):
        return False  # a timer, a child or a step of its own can wake it
    if any(
        (cp.started_at or 0) >= before or (cp.finished_at or 0) >= before
        for cp in checkpoints.values()
    ):
        return False  # it progressed since
    return bool(pending) or (run.wake_at is None and run.updated_at < before)


def _in(run: Run, namespace: str | None) -> bool:
    return namespace is None or run.namespace == namespace


def _of(run: Run, workflows: Executable | None) -> bool:
    return workflows is None or (run.workflow, run.workflow_version) in workflows


def _leased(run: Run, now: int) -> bool:
    return run.locked_by is not None and (run.locked_until or 0) >= now


def _due(run: Run, now: int) -> bool:
    if run.status is not RunStatus.SUSPENDED:
        return False
    return run.wake_requested_at is not None or (run.wake_at is not None and run.wake_at <= now)


def _due_key(run: Run, now: int) -> int:
    """When the run became due: the earliest of its reasons to wake that holds at ``now``."""
    times = [run.wake_requested_at] if run.wake_requested_at is not None else []
    if run.wake_at is not None and run.wake_at <= now:
        times.append(run.wake_at)
    return min(times) if times else 0


def _as_stored(attributes: dict[str, Any]) -> dict[str, Any]:
    # What a SQL store reads back (a datetime in UTC, to the millisecond), so
    # all three stores answer alike.
    return {key: attrcodec.decode(*attrcodec.encode(value)) for key, value in attributes.items()}


def _matches(run: Run, q: RunQuery) -> bool:
    return (
        (q.status is None or run.status == q.status)
        and (q.statuses is None or run.status in q.statuses)
        and (q.workflow is None or run.workflow == q.workflow)
        and (q.tag is None or q.tag in run.tags)
        and (q.namespace is None or run.namespace == q.namespace)
        and (q.parent_id is None or run.parent_id == q.parent_id)
        and (q.run_id_prefix is None or run.run_id.startswith(q.run_id_prefix))
        and (q.created_after is None or run.created_at >= q.created_after)
        and (q.created_before is None or run.created_at < q.created_before)
    )
