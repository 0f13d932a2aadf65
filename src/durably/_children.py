"""ChildRuns: runs that start runs, and how an ending reaches the runs around it.

A parent creates its children in bulk and suspends on their placeholders; a
child's ending and its report to its parent (settling the placeholder and
stamping the parent's wake) are one write, so the parent hears exactly the
outcome the child's row records, whoever ends it (its own turn, a cancel, a
timeout); a parent's turn reconciles children whose report was lost
otherwise (a chain that continued as new, a run recovered dead).
Cancelling a run cancels its live children, recursively. Every terminal
write outside a turn (a cancel, an execution timeout) goes through
:meth:`ChildRuns.set_terminal`, so the parent always hears of it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from ._batch import BatchCall
from ._lifecycle_events import RUN_OUTCOMES, EventHub
from ._logs import engine_logger
from ._ops.env import ChildStart
from ._replay import CloseReason, error_info
from .errors import DurablyError, SchemaValidationError, WorkflowNotRegistered
from .model import (
    TERMINAL_STATUSES,
    CancelMode,
    CheckpointKind,
    CheckpointStatus,
    ErrorInfo,
    Run,
    RunResult,
    RunStatus,
)
from .stores import ChildEnd, RunChanges, RunQuery
from .stores.base import Resolution

if TYPE_CHECKING:
    from ._registry import Registry
    from ._routing import RunRouter
    from .clock import Clock
    from .model import Checkpoint
    from .stores import StateStore
    from .transports import Transport

__all__ = [
    "LIVE",
    "ChildRuns",
    "ChildStart",
    "RunNotFound",
    "child_error",
    "continued_to",
    "next_link_id",
]

_log = engine_logger("durably")

LIVE = frozenset({RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.BLOCKED})
"""The statuses a run can still leave."""
_RETRYABLE = frozenset({RunStatus.FAILED, RunStatus.DEAD})
_CONTINUATION = re.compile(r"^(.*)~(\d+)$")


class RunNotFound(DurablyError, LookupError):
    """No run has the given id."""

    code = "run_not_found"


class ChildRuns:
    """Spawns children, reports endings to parents, and cascades cancels."""

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        registry: Registry,
        router: RunRouter,
        transport: Transport,
        has_flow_queues: Callable[[], bool],
        events: EventHub,
    ) -> None:
        self._store = store
        self._clock = clock
        self._registry = registry
        self._router = router
        self._transport = transport
        self._has_flow_queues = has_flow_queues
        self._events = events
        # Children ending together tell their parents in shared transactions:
        # on PostgreSQL each report locks the parent's row, and one report at
        # a time queues every child of a large fan behind that lock.
        self._parent_reports: BatchCall[Resolution, int | None] = BatchCall(
            lambda batch: self._store.resolve_checkpoints(batch, self._clock.now_ms())
        )
        # A child's ending and its report share one write (see end_child), and
        # children ending together share one transaction, for the same reason.
        self._child_ends: BatchCall[ChildEnd, tuple[bool, int | None]] = BatchCall(
            lambda batch: self._store.end_child_runs(batch, self._clock.now_ms())
        )

    async def require(self, run_id: str) -> Run:
        """The run, or :class:`RunNotFound`."""
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return run

    async def spawn(self, parent: Run, calls: Sequence[ChildStart]) -> list[ErrorInfo | None]:
        """Create child runs in bulk; return a start error per child (or ``None``)."""
        now = self._clock.now_ms()
        errors: list[ErrorInfo | None] = [None] * len(calls)
        runs: list[Run] = []
        for i, call in enumerate(calls):
            try:
                definition = self._registry.get(call.workflow)
                stored_input = definition.validate_input(call.input)
            except (WorkflowNotRegistered, SchemaValidationError) as exc:
                errors[i] = child_error(call.run_id, "failed", error_info(exc))
                continue
            runs.append(
                Run(
                    run_id=call.run_id,
                    workflow=definition.name,
                    workflow_version=definition.version,
                    status=RunStatus.PENDING,
                    input=stored_input,
                    namespace=parent.namespace,
                    parent_id=parent.run_id,
                    parent_seq=call.seq,
                    priority=parent.priority if call.priority is None else call.priority,
                    deadline_at=definition.deadline_from(now),
                    created_at=now,
                    updated_at=now,
                    # One trace for a parent and its children.
                    trace_context=parent.trace_context,
                )
            )
        # A child that cannot start reaches its parent as a failed child.
        unstartable = [
            Resolution(parent.run_id, calls[i].seq, CheckpointStatus.FAILED, error=error)
            for i, error in enumerate(errors)
            if error is not None
        ]
        if unstartable:
            await self._store.resolve_checkpoints(unstartable, now)
        created = set(await self._store.create_runs(runs)) if runs else set()
        existing = [run.run_id for run in runs if run.run_id not in created]
        for run in runs:
            if run.run_id in created:
                self._router.route(run.run_id, namespace=run.namespace, priority=run.priority)
        if existing:
            # Started by an earlier turn that crashed before suspending: any
            # that already finished settle their placeholder now.
            for child in await self._store.get_runs(existing):
                if continued_to(child) is not None:
                    continue  # a later link of its chain reports (or reconcile follows it)
                if child.status in TERMINAL_STATUSES:
                    await self.report_to_parent(child)
                elif child.status is RunStatus.PENDING:
                    self._router.route(child.run_id, namespace=child.namespace)
        return errors

    async def end_child(
        self,
        child: Run,
        *,
        owner: str | None = None,
        statuses: frozenset[RunStatus] = frozenset(),
    ) -> bool:
        """Write the ending of ``child`` (its terminal status, output and error
        as given) and settle its parent's placeholder with it, in one write:
        the parent hears exactly the outcome the child's row records, and no
        crash falls between the two. Conditional like the store's
        ``end_child_runs`` (``owner``: a turn's settle; else ``statuses``: an
        ending from outside a turn); ``False`` if nothing was written."""
        assert child.parent_id is not None and child.parent_seq is not None
        report = _report(child)
        ended, left = await self._child_ends(
            ChildEnd(
                child.run_id,
                child.status,
                RunChanges(output=child.output, error=child.error),
                report,
                owner=owner,
                statuses=statuses,
            )
        )
        if ended:
            await self._wake_parent(child.parent_id, report, left)
        return ended

    async def report_to_parent(self, child: Run) -> None:
        """Tell a waiting parent that ``child`` ended, however it ended.

        The child's own terminal state is written first; this delivery is
        retried on store errors (0.25 s, 1 s, 4 s). Should it still be lost,
        the parent's next turn reads its children and settles them.
        """
        if child.parent_id is None or child.parent_seq is None:
            return
        report = _report(child)
        for delay in (0.25, 1.0, 4.0, None):
            try:
                left = await self._parent_reports(report)
                break
            except Exception:
                if delay is None:
                    _log.exception(
                        "could not tell run %s that child %s ended", child.parent_id, child.run_id
                    )
                    return
                await asyncio.sleep(delay)
        await self._wake_parent(child.parent_id, report, left)

    async def _wake_parent(self, parent_id: str, report: Resolution, left: int | None) -> None:
        # Wake the parent when its fan-out is complete, or on a failure
        # (fail_fast must hear of it); a fan of thousands costs one parent turn.
        if left is not None and (left == 0 or report.status is CheckpointStatus.FAILED):
            await self._router.wake(parent_id)

    async def reconcile(self, run: Run, checkpoints: dict[int, Checkpoint]) -> set[str]:
        """Settle the children this run waits on that already ended (their
        notification may have been lost to a crash), in batches of 500.
        Returns the ids of waited-on children that do not exist: an earlier
        turn stored their placeholders and died before creating them."""
        waiting = {
            str(cp.input["run_id"]): cp
            for cp in checkpoints.values()
            if cp.kind == CheckpointKind.CHILD
            and cp.status is CheckpointStatus.PENDING
            and isinstance(cp.input, dict)
        }
        if not waiting:
            return set()
        ids = list(waiting)
        missing = set(ids)
        now = self._clock.now_ms()
        while ids:
            page, ids = ids[:500], ids[500:]
            settled: list[Resolution] = []
            for child in await self._store.get_runs(page):
                missing.discard(child.run_id)
                next_link = continued_to(child)
                if next_link is not None:
                    # A child that continued as new: the parent waits for the
                    # last link of its chain, which carries the same placeholder.
                    if next_link not in waiting:
                        waiting[next_link] = waiting[child.run_id]
                        ids.append(next_link)
                    continue
                if child.status not in TERMINAL_STATUSES:
                    continue
                cp = waiting[child.run_id]
                if child.status is RunStatus.COMPLETED:
                    cp.status, cp.output = CheckpointStatus.COMPLETED, child.output
                else:
                    cp.status = CheckpointStatus.FAILED
                    cp.error = child_error(child.run_id, child.status.value, child.error)
                cp.finished_at = now
                settled.append(Resolution(run.run_id, cp.seq, cp.status, cp.output, cp.error))
            if settled:  # one transaction per page, not one per finished child
                await self._store.resolve_checkpoints(settled, now)
        return missing

    async def cancel(self, run_id: str, *, compensate: bool = False) -> RunStatus:
        """Cancel a run and its live children; return its status from before
        (see :meth:`durably.Engine.cancel`)."""
        run = await self.require(run_id)
        if compensate:
            if run.status in TERMINAL_STATUSES:
                return run.status
            if await self._store.update_run_if(
                run_id, LIVE, {"cancel_requested": CancelMode.COMPENSATE}, self._clock.now_ms()
            ):
                turn = self._router.active.get(run_id)
                if turn is not None:
                    turn.close(CloseReason.UNWIND)
                else:
                    await self._router.wake(run_id)
            return run.status
        while run.status not in TERMINAL_STATUSES:
            error = {"message": "cancelled", "code": "cancelled", "type": "RunCancelled"}
            if await self.end_from_outside(run, error):
                return run.status
            run = await self.require(run_id)
        return run.status

    async def retry(self, run_id: str) -> Run:
        """Run a failed or dead run again from where it failed, its failed or
        dead children too (see :meth:`durably.Engine.retry`)."""
        run = await self.require(run_id)
        if run.status not in _RETRYABLE:
            raise DurablyError(f"run {run_id!r} is {run.status}; only failed or dead runs retry")
        history = await self._store.load_checkpoints(run_id)
        stale = [
            cp.seq
            for cp in history.values()
            if cp.status is not CheckpointStatus.COMPLETED or cp.seq < 0
        ]
        for cp in history.values():
            if cp.kind == CheckpointKind.CHILD and cp.status is CheckpointStatus.FAILED:
                child_id = cp.input.get("run_id") if isinstance(cp.input, dict) else None
                child = await self._store.get_run(str(child_id)) if child_id else None
                if child is not None and child.status in _RETRYABLE:
                    await self.retry(child.run_id)
        await self._store.delete_checkpoints(run_id, stale)
        if not await self._store.update_run_if(
            run_id,
            _RETRYABLE,
            {
                "status": RunStatus.PENDING.value,
                "error": None,
                "output": None,
                "wake_at": None,
                "recovery_attempts": 0,
                "cancel_requested": None,
            },
            self._clock.now_ms(),
        ):
            raise DurablyError(f"run {run_id!r} changed while being retried; try again")
        self._router.route(run_id, namespace=run.namespace, priority=run.priority)
        return await self.require(run_id)

    async def cancel_runs(self, run_ids: list[str]) -> None:
        """Cancel each of ``run_ids`` (and its children); a missing run is skipped."""
        for run_id in run_ids:
            try:
                await self.cancel(run_id)
            except RunNotFound:
                continue

    async def cancel_children(self, run_id: str) -> None:
        """Cancel the live children of ``run_id`` but its detached ones, a page
        of 500 at a time."""
        cursor: str | None = None
        detached: set[str] | None = None
        while True:
            page = await self._store.list_runs(RunQuery(parent_id=run_id, limit=500, cursor=cursor))
            live = [r.run_id for r in page.runs if r.status not in TERMINAL_STATUSES]
            if live and detached is None:
                # Read only when there is something to cancel: the parent's
                # placeholders say which children were started detached.
                detached = detached_children(await self._store.load_checkpoints(run_id))
            await self.cancel_runs([child for child in live if child not in (detached or ())])
            cursor = page.next_cursor
            if cursor is None:
                return

    async def cancel_attached(self, run_id: str, child_ids: Collection[str]) -> None:
        """``run_id`` ended: cancel those of ``child_ids`` (its children not
        started detached) still running, so none outlives it unasked."""
        if not child_ids:
            return
        runs = await self._store.get_runs(sorted(child_ids))
        await self.cancel_runs(
            [r.run_id for r in runs if r.parent_id == run_id and r.status in LIVE]
        )

    async def end_from_outside(self, run: Run, error: dict[str, Any]) -> bool:
        """Cancel ``run`` if it is still as read (``False`` if it moved), and do
        everything an ending from outside a turn owes: its live children are
        cancelled, its flow-control slots freed, its step handlers told. A
        cancel and an execution timeout both end a run here, so neither can
        leave a queue slot held by a run that is gone."""
        if not await self.set_terminal(run, RunStatus.CANCELLED, error):
            return False
        # Shielded: a caller cancelled now (a run cancelling itself from its
        # own step has its body cancelled as the ending closes its turn) must
        # not leave the cascade half done.
        await asyncio.shield(self._after_outside_end(run.run_id))
        return True

    async def _after_outside_end(self, run_id: str) -> None:
        await self.cancel_children(run_id)
        await self.after_end(run_id, cancelled=True)

    async def set_terminal(self, run: Run, status: RunStatus, error: dict[str, Any]) -> bool:
        """End ``run`` from outside a turn if it is still as read; ``False`` if it moved.

        A turn of it running here is closed, waiters are woken, and the
        parent hears of the ending.
        """
        expected = frozenset({run.status})
        if run.parent_id is not None and run.parent_seq is not None:
            ended = run.replace(status=status, error=error, output=None)
            changed = await self.end_child(ended, statuses=expected)
        else:
            changed = await self._store.update_run_if(
                run.run_id,
                expected,
                {"status": status.value, "error": error, "wake_at": None},
                self._clock.now_ms(),
            )
        if changed:
            turn = self._router.active.get(run.run_id)
            if turn is not None:
                turn.close(CloseReason.CANCELLED)
            self._router.notify(run.run_id)
            if self._events.active:
                now = self._clock.now_ms()
                self._events.event(
                    RUN_OUTCOMES[status],
                    run.run_id,
                    now,
                    workflow=run.workflow,
                    duration_ms=now - run.created_at,
                    error=error,
                )
        return changed

    async def after_end(self, run_id: str, *, cancelled: bool) -> None:
        """A run ended: free its flow-control slots and stop its step handlers."""
        if self._has_flow_queues():
            try:
                await self._store.release_slots(run_id, self._clock.now_ms())
            except Exception:
                _log.exception("could not release the flow-control slots of run %s", run_id)
        if cancelled:
            try:
                await self._transport.publish_cancel([run_id])
            except Exception:
                _log.warning("could not publish the cancel of run %s", run_id, exc_info=True)

    async def ended_runs(self, run_ids: list[str]) -> dict[str, bool]:
        """Of ``run_ids``, those that ended (``True``) or are being cancelled
        (``False``: a compensating cancel unwinds them), for step handlers."""
        runs = await self._store.get_runs(run_ids)
        return {
            run.run_id: run.status in TERMINAL_STATUSES
            for run in runs
            if run.status in TERMINAL_STATUSES or run.cancel_requested is not None
        }


def detached_children(checkpoints: dict[int, Checkpoint]) -> set[str]:
    """The ids of the children a run started ``detached`` (from its placeholders)."""
    return {
        str(cp.input.get("run_id"))
        for cp in checkpoints.values()
        if cp.kind == CheckpointKind.CHILD
        and isinstance(cp.input, dict)
        and cp.input.get("detached") is True
    }


def _report(child: Run) -> Resolution:
    """How ``child``'s ending settles its parent's placeholder."""
    assert child.parent_id is not None and child.parent_seq is not None
    if child.status is RunStatus.COMPLETED:
        return Resolution(
            child.parent_id, child.parent_seq, CheckpointStatus.COMPLETED, child.output
        )
    error = child_error(child.run_id, child.status.value, child.error)
    return Resolution(child.parent_id, child.parent_seq, CheckpointStatus.FAILED, error=error)


def next_link_id(run_id: str) -> str:
    """The id of the run that ``run_id`` continues as (``<base>~N+1``)."""
    match = _CONTINUATION.match(run_id)
    base, number = (match.group(1), int(match.group(2))) if match else (run_id, 0)
    return f"{base}~{number + 1}"


def continued_to(run: Run | RunResult) -> str | None:
    """The next link of ``run``'s chain if it ended by continuing as new, else
    ``None`` (a run that merely returned a look-alike value names another id)."""
    output = run.output
    if (
        run.status is RunStatus.COMPLETED
        and isinstance(output, dict)
        and len(output) == 1
        and output.get("continued_as") == next_link_id(run.run_id)
    ):
        return next_link_id(run.run_id)
    return None


def child_error(run_id: str, status: str, error: ErrorInfo | None) -> ErrorInfo:
    """How a child's failure is recorded on its parent's checkpoint."""
    message = (error or {}).get("message", status)
    return {
        "message": f"child run {run_id} {status}: {message}",
        "code": (error or {}).get("code") or f"child_{status}",
        "type": "ChildFailed",
        "details": {"run_id": run_id, "status": status},
    }
