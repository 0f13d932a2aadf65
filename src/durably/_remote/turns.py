"""RemoteTurns: the engine side of a remote workflow, one turn at a time.

A turn (:meth:`RemoteTurns.turn`, under the run's lease): settle due timers,
build the history from the run's settled checkpoints, mint a task id, record
it as the awaited turn, and end the turn *suspended* with the re-drive time
``now + remote_advance_silence`` as its wake. Only once that is written is the
WorkflowTask sent, so a fast decision always finds its turn recorded.

A decision (:meth:`RemoteTurns.on_decision`, on whichever instance takes it)
is applied by one conditional write (:meth:`~durably.stores.base.DecisionStore.take_decision`):
the run must still be suspended awaiting that task id; the write leases the
run, clears the id and inserts the commands' checkpoints (a seq that has one
keeps it, so a re-emitted ``call`` is a no-op). Under that lease the new calls
are dispatched as step tasks, signal waits registered and children started;
then the outcome is settled like any turn's. A duplicate, late or stale
decision finds no awaited id to match and changes nothing.

A lost turn (a worker that died holding it) is re-driven by the run's wake:
past the silence window the timer sweep gives the run a turn, under a fresh
task id. A run-scoped heartbeat pushes that wake back while the turn is alive.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._faults import FailureLog
from .._ops.env import SpawnChildren
from .._registry import RemoteSpec
from .._replay import TurnEnd, TurnOutcome
from ..model import Checkpoint, CheckpointKind, CheckpointStatus, ErrorInfo, Run, RunStatus
from ..transports.base import TransportError, TurnCarrier
from ..wire import StepTask, WireError, routing_token
from .wire import (
    Call,
    Decision,
    RecordStep,
    Sleep,
    StartChild,
    WaitSignal,
    WorkflowTask,
    history,
    parse_decision,
    parse_run_beat,
)

if TYPE_CHECKING:
    from .._options import EngineOptions
    from .._registry import WorkflowDef
    from ..clock import Clock
    from ..stores import StateStore

__all__ = ["RemoteTurns"]

_log = logging.getLogger("durably.remote")
_EXTENDED_MEMORY = 10_000

Conclude = Callable[[Run, TurnOutcome], Awaitable[None]]
Guard = Callable[[Run, "WorkflowDef"], Awaitable[ErrorInfo | None]]


@dataclass(frozen=True, slots=True)
class _Child:
    run_id: str
    workflow: str
    input: Any
    seq: int
    priority: int | None = None
    """A remote child runs at its parent's priority."""


class RemoteTurns:
    """Sends remote turns and applies their decisions; see the module docstring."""

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        carrier: Callable[[], TurnCarrier | None],
        dispatch: Callable[[list[StepTask]], Awaitable[None]],
        spawn_children: SpawnChildren,
        conclude: Conclude,
        options: Callable[[], EngineOptions],
        owner: Callable[[], str],
        has_remote: Callable[[], bool],
    ) -> None:
        """``conclude(run, outcome)`` settles a run leased here as a turn's
        outcome would be (parents, waiters, hooks) and drives any turn that
        follows; ``carrier()`` is the transport, if it carries turns."""
        self._store = store
        self._clock = clock
        self._carrier = carrier
        self._dispatch = dispatch
        self._spawn = spawn_children
        self._conclude = conclude
        self._options = options
        self._owner = owner
        self._has_remote = has_remote
        self.guard: Guard | None = None
        """Checked before each turn goes out: an error parks the run ``blocked``
        (no live capable worker). Set by the capability router."""
        self._failures = FailureLog(_log)
        self._extended: OrderedDict[str, int] = OrderedDict()

    async def start(self) -> None:
        """Consume decisions, step events and run beats, if this engine
        registers remote workflows and its transport carries turns."""
        carrier = self._carrier()
        if carrier is not None and self._has_remote():
            await carrier.consume_turns(self.on_decision, self.on_step_event, self.on_run_beat)

    # -- turns out ---------------------------------------------------------------------

    async def turn(
        self,
        run: Run,
        checkpoints: dict[int, Checkpoint],
        definition: WorkflowDef,
        missing_children: set[str],
    ) -> TurnOutcome:
        """One turn of a remote run leased here (see the module docstring)."""
        carrier = self._carrier()
        if carrier is None:
            return TurnOutcome(
                TurnEnd.FAILED,
                error={
                    "message": f"workflow {run.workflow!r} is remote, and the engine's "
                    "transport carries no remote turns (use transport='redis://…')",
                    "code": "remote_transport",
                    "type": "ConfigurationError",
                },
            )
        owner, now = self._owner(), self._clock.now_ms()
        if self.guard is not None:
            blocked = await self.guard(run, definition)
            if blocked is not None:
                await self._store.mark_awaiting(run.run_id, owner, None)
                poll = self._options().remote_silence_ms
                return TurnOutcome(TurnEnd.BLOCKED, error=blocked, wake_at=now + poll)
        due = [
            cp
            for cp in checkpoints.values()
            if cp.kind == CheckpointKind.SLEEP
            and cp.status is CheckpointStatus.PENDING
            and cp.wake_at is not None
            and cp.wake_at <= now
        ]
        for cp in due:
            cp.status, cp.finished_at = CheckpointStatus.COMPLETED, now
        if due and not await self._store.save_checkpoints(due, owner):
            return TurnOutcome(TurnEnd.CLOSED)
        if missing_children:
            # An earlier decision stored their placeholders and died before
            # creating them: create them now (idempotent by id).
            lost = [
                _Child(
                    str(cp.input["run_id"]),
                    str(cp.input["workflow"]),
                    cp.input.get("input"),
                    cp.seq,
                )
                for cp in checkpoints.values()
                if cp.kind == CheckpointKind.CHILD
                and isinstance(cp.input, dict)
                and cp.input.get("run_id") in missing_children
            ]
            await self._spawn(run, lost)
        unsent = [
            cp
            for cp in checkpoints.values()
            if cp.kind == CheckpointKind.STEP
            and cp.status is CheckpointStatus.PENDING
            and cp.dispatched_at is None
        ]
        await self._send_calls(run, unsent, now)
        task_id = f"{run.run_id}:wf:{uuid.uuid4().hex[:8]}"
        if not await self._store.mark_awaiting(run.run_id, owner, task_id):
            return TurnOutcome(TurnEnd.CLOSED)
        token = (definition.remote or RemoteSpec()).token(run.workflow, run.namespace)
        task = WorkflowTask(
            task_id=task_id,
            run_id=run.run_id,
            workflow=run.workflow,
            workflow_version=run.workflow_version,
            input=run.input,
            history=history(checkpoints),
            group=token,
            priority=run.priority or None,
        )

        async def send() -> None:
            try:
                await carrier.send_turn(token, task.to_wire(), task.priority)
            except TransportError as exc:
                # The run's wake (the silence window) re-drives it.
                self._failures.failed("sending a remote turn", exc)
                return
            self._failures.succeeded("sending a remote turn")

        wake_at = now + self._options().remote_silence_ms
        return TurnOutcome(TurnEnd.SUSPENDED, wake_at=wake_at, after_settle=send)

    # -- what comes back ----------------------------------------------------------------

    async def on_decision(self, body: Any) -> None:
        """Apply a decision if its run still awaits it; drop anything else."""
        try:
            decision = parse_decision(body)
        except WireError as exc:
            _log.warning("dropping a malformed workflow decision: %s", exc)
            return
        run = await self._store.get_run(decision.run_id)
        if run is None:
            _log.warning(
                "dropping a workflow decision for unknown run %r (task %r)",
                decision.run_id,
                decision.task_id,
            )
            return
        if run.status is not RunStatus.SUSPENDED:
            _log.info(
                "dropping a workflow decision for run %s (%s): it awaits no decision",
                run.run_id,
                run.status.value,
            )
            return
        before = await self._store.load_checkpoints(run.run_id)
        now, owner = self._clock.now_ms(), self._owner()
        fresh = [c for c in decision.commands if c.seq not in before]
        taken = await self._store.take_decision(
            run.run_id,
            decision.task_id,
            owner,
            now + self._options().lease_ms,
            now,
            [cp for c in fresh if (cp := _checkpoint(run.run_id, c, now)) is not None],
        )
        if taken is None:
            _log.info(
                "dropping a stale or duplicate decision %r of run %s",
                decision.task_id,
                run.run_id,
            )
            return
        await self._conclude(taken, await self._carry_out(taken, decision, fresh, now))

    async def _carry_out(
        self, run: Run, decision: Decision, fresh: list[Any], now: int
    ) -> TurnOutcome:
        """Dispatch, wait and spawn what the decision's new commands ask for,
        under the lease ``take_decision`` gave; return the run's outcome."""
        owner = self._owner()
        again = False  # something settled already: the run takes another turn at once
        sent = True
        calls = {c.seq: c for c in fresh if isinstance(c, Call)}
        if calls:
            unsent = [
                cp
                for seq, cp in (await self._store.load_checkpoints(run.run_id)).items()
                if seq in calls
            ]
            sent = await self._send_calls(run, unsent, now)
        for c in fresh:
            if isinstance(c, WaitSignal):
                cp = Checkpoint(
                    run.run_id,
                    c.seq,
                    f"signal:{c.signal}",
                    CheckpointKind.SIGNAL,
                    CheckpointStatus.PENDING,
                    started_at=now,
                )
                found = await self._store.wait_signal(cp, c.signal, owner, now)
                if found is None:
                    return TurnOutcome(TurnEnd.CLOSED)
                again = again or found.delivered
            elif isinstance(c, Sleep) and c.ms == 0:
                again = True
        children = [
            _Child(f"{run.run_id}.child.{c.seq}", c.workflow, c.input, c.seq)
            for c in fresh
            if isinstance(c, StartChild)
        ]
        if children:
            errors = await self._spawn(run, children)
            again = again or any(error is not None for error in errors)
        if decision.status == "completed":
            return TurnOutcome(TurnEnd.COMPLETED, output=decision.output)
        if decision.status == "failed":
            return TurnOutcome(TurnEnd.FAILED, error=decision.error)
        if decision.status == "cancelled":
            error = {"message": "cancelled by its worker", "code": "cancelled"}
            return TurnOutcome(TurnEnd.CANCELLED, error=error)
        if again:
            await self._store.request_wake(run.run_id, now)
        wakes = [
            cp.wake_at
            for cp in (await self._store.load_checkpoints(run.run_id)).values()
            if cp.kind == CheckpointKind.SLEEP
            and cp.status is CheckpointStatus.PENDING
            and cp.wake_at is not None
        ]
        if not sent:
            # Calls the transport refused go out with the run's next turn.
            wakes.append(now + self._options().remote_silence_ms)
        return TurnOutcome(TurnEnd.SUSPENDED, wake_at=min(wakes) if wakes else None)

    async def _send_calls(self, run: Run, calls: list[Checkpoint], now: int) -> bool:
        """Send the tasks of ``calls`` (pending, not out yet), then stamp them
        sent (only those no result settled meanwhile). A transport that
        refuses them leaves them unstamped for the run's next turn (``False``)."""
        if not calls:
            return True
        tasks = [
            StepTask(
                run_id=run.run_id,
                seq=cp.seq,
                name=cp.name,
                group=routing_token(cp.name, run.namespace),
                input=cp.input,
                attempt=max(1, cp.attempts),
                priority=run.priority or None,
            )
            for cp in calls
        ]
        try:
            await self._dispatch(tasks)
        except TransportError as exc:
            _log.warning("could not dispatch the calls of run %s: %s", run.run_id, exc)
            return False
        await self._store.mark_dispatched(run.run_id, [cp.seq for cp in calls], now)
        return True

    async def on_run_beat(self, body: Any) -> None:
        """A worker is executing a turn of the run: push its re-drive back."""
        beat = parse_run_beat(body)
        if beat is None:
            return
        now, silence = self._clock.now_ms(), self._options().remote_silence_ms
        # Every instance hears every beat: one write per run per quarter
        # window here is plenty to keep a live turn from being re-driven.
        last = self._extended.get(beat.run_id)
        if last is not None and now - last < silence // 4:
            return
        self._extended[beat.run_id] = now
        self._extended.move_to_end(beat.run_id)
        while len(self._extended) > _EXTENDED_MEMORY:
            self._extended.popitem(last=False)
        await self._store.extend_decision_wait(beat.run_id, now + silence, now)

    async def on_step_event(self, body: Any) -> None:
        """A local step's live progress. The decision's ``recordStep`` is what
        counts (events may trail it), so nothing is written: it is only logged."""
        if isinstance(body, dict):
            _log.debug(
                "step event of run %s seq %s: %s",
                body.get("runId"),
                body.get("seq"),
                body.get("phase"),
            )


def _checkpoint(run_id: str, command: Any, now: int) -> Checkpoint | None:
    """The checkpoint a new command writes with the decision (``None``: a
    signal wait, registered by the store's own atomic wait afterwards)."""
    if isinstance(command, RecordStep):
        failed = command.error is not None
        return Checkpoint(
            run_id,
            command.seq,
            command.name,
            CheckpointKind.LOCAL,
            CheckpointStatus.FAILED if failed else CheckpointStatus.COMPLETED,
            output=None if failed else command.output,
            error=command.error,
            attempts=1,
            started_at=command.started_at or now,
            finished_at=command.finished_at or now,
            group=command.parallel_group,
        )
    if isinstance(command, Call):
        return Checkpoint(
            run_id,
            command.seq,
            command.name,
            CheckpointKind.STEP,
            CheckpointStatus.PENDING,
            input=command.input,
            attempts=1,
            started_at=now,
            # Stamped once its task is sent: a crash before that leaves it
            # unstamped, and the run's next turn sends it (a re-emitted call
            # is a no-op, so nothing else would).
            dispatched_at=None,
            group=command.parallel_group,
        )
    if isinstance(command, Sleep):
        done = command.ms == 0
        return Checkpoint(
            run_id,
            command.seq,
            "sleep",
            CheckpointKind.SLEEP,
            CheckpointStatus.COMPLETED if done else CheckpointStatus.PENDING,
            wake_at=now + command.ms,
            started_at=now,
            finished_at=now if done else None,
        )
    if isinstance(command, StartChild):
        child_id = f"{run_id}.child.{command.seq}"
        return Checkpoint(
            run_id,
            command.seq,
            f"child:{command.workflow}",
            CheckpointKind.CHILD,
            CheckpointStatus.PENDING,
            input={"run_id": child_id, "workflow": command.workflow, "input": command.input},
            started_at=now,
            group=command.parallel_group,
        )
    return None


def _input(placeholder: Checkpoint) -> Any:
    """The input a child placeholder recorded for its child."""
    return placeholder.input.get("input") if isinstance(placeholder.input, dict) else None
