"""Child runs and fan-out: ``ctx.child``, ``ctx.all`` and ``ctx.all_settled``.

Children awaited together are created together: their ``pending``
placeholders are saved in one write *before* any child exists (a child
that finishes fast must find its parent's placeholder), then the runs are
created in bulk, and the parent parks once for all of them. Each child
settles its placeholder and wakes the parent when it ends.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Generator
from dataclasses import dataclass
from typing import Any

from .._typed import Decoder, identity
from ..errors import ChildFailed, GatherFailed, RunCancelled, is_control_flow
from ..model import Checkpoint, CheckpointKind, CheckpointStatus, ErrorInfo
from .env import TurnEnv

__all__ = ["ChildCall", "ChildHandle", "ChildStarts", "Settled", "gather"]


@dataclass(frozen=True, slots=True)
class Settled:
    """One outcome of ``ctx.all_settled``: a value, or the error that ended it."""

    ok: bool
    value: Any = None
    error: BaseException | None = None


class ChildCall:
    """A child run, created by :meth:`WorkflowContext.child`.

    Await it alone, or pass many to :meth:`WorkflowContext.all` so they are
    created together (one bulk insert) and awaited with one suspension.
    """

    __slots__ = (
        "_env",
        "decode",
        "detached",
        "input",
        "priority",
        "ready",
        "recorded",
        "run_id",
        "seq",
        "workflow",
    )

    def __init__(
        self,
        env: TurnEnv,
        seq: int,
        run_id: str,
        workflow: str,
        input: Any,
        recorded: Checkpoint | None,
        decode: Decoder = identity,
        priority: int | None = None,
        detached: bool = False,
    ) -> None:
        self._env = env
        self.detached = detached
        """Whether the child outlives its parent (``ctx.start_child(..., detached=True)``)."""
        self.ready: asyncio.Future[bool] | None = None
        """For a child started by ``ctx.start_child``: its creation, awaited
        before the child is waited on (``None``: nothing to create)."""
        self.priority = priority
        """The child run's priority (``None``: its parent's)."""
        self.decode = decode
        """The child's output (JSON data) as its workflow's output type."""
        self.seq = seq
        self.run_id = run_id
        self.workflow = workflow
        self.input = input
        self.recorded = recorded

    def __await__(self) -> Generator[Any, None, Any]:
        return _await_child(self._env, self).__await__()


async def gather(
    env: TurnEnv, items: list[Awaitable[Any]], *, settled: bool, fail_fast: bool
) -> Any:
    """The body of ``ctx.all`` (``settled=False``) and ``ctx.all_settled``."""
    children = [(i, item) for i, item in enumerate(items) if isinstance(item, ChildCall)]
    others = [(i, item) for i, item in enumerate(items) if not isinstance(item, ChildCall)]
    for _, item in others:
        if not inspect.isawaitable(item):
            raise TypeError(f"ctx.all takes awaitables from ctx calls, got {item!r}")
    calls = [call for _, call in children]
    group = f"all:{calls[0].seq}" if calls else None

    async def run_children() -> list[tuple[bool, Any]]:
        return await _children(env, calls, group, fail_fast) if calls else []

    async def run_others() -> list[Any]:
        return await asyncio.gather(*(item for _, item in others), return_exceptions=True)

    child_outcomes, other_results = await asyncio.gather(run_children(), run_others())
    outcomes: list[tuple[bool, Any]] = [(True, None)] * len(items)
    for (i, _), outcome in zip(children, child_outcomes, strict=True):
        outcomes[i] = outcome
    for (i, _), result in zip(others, other_results, strict=True):
        if isinstance(result, BaseException):
            if is_control_flow(result):
                raise result
            outcomes[i] = (False, result)
        else:
            outcomes[i] = (True, result)
    if settled:
        return [
            Settled(True, value) if ok else Settled(False, error=value) for ok, value in outcomes
        ]
    failures = [(i, value) for i, (ok, value) in enumerate(outcomes) if not ok]
    if failures:
        raise GatherFailed(failures)
    return [value for _, value in outcomes]


async def _await_child(env: TurnEnv, call: ChildCall) -> Any:
    [(ok, value)] = await _children(env, [call], None, False)
    if not ok:
        raise value
    return value


def _children(
    env: TurnEnv, calls: list[ChildCall], group: str | None, fail_fast: bool
) -> Awaitable[list[tuple[bool, Any]]]:
    """:func:`_run_children` again from its start after a kept turn resumes,
    each call's checkpoint read from the new history (as a replay would)."""
    turn = env.turn

    def attempt(again: bool) -> Awaitable[list[tuple[bool, Any]]]:
        if again:
            for call in calls:
                call.recorded = turn.checkpoints.get(call.seq)
        return _run_children(env, calls, group, fail_fast)

    return turn.resumable(tuple(call.seq for call in calls), attempt)


async def _run_children(
    env: TurnEnv, calls: list[ChildCall], group: str | None, fail_fast: bool
) -> list[tuple[bool, Any]]:
    turn, services = env.turn, env.services
    for call in calls:
        if call.ready is not None:
            await call.ready  # created at ``ctx.start_child``: wait for that to finish
    gate = turn.gate([call.seq for call in calls])
    if gate is not None:
        await gate  # held on a replay until the updates handled meanwhile apply again
    outcomes: list[tuple[bool, Any] | None] = [None] * len(calls)
    fresh: list[int] = []
    waiting: list[int] = []
    for i, call in enumerate(calls):
        recorded = call.recorded
        if recorded is None:
            fresh.append(i)
        elif recorded.status is CheckpointStatus.COMPLETED:
            try:
                outcomes[i] = (True, call.decode(recorded.output))
            except Exception as exc:  # Misfit: the child's output no longer fits
                outcomes[i] = (False, exc)
        elif recorded.status is CheckpointStatus.FAILED:
            outcomes[i] = (False, _child_failed(call.run_id, recorded.error))
        else:
            waiting.append(i)
    if fresh and turn.unwinding:
        waiting.extend(fresh)
        fresh = []
    lost = [i for i in waiting if calls[i].run_id in turn.missing_children]
    if lost and not turn.unwinding:
        # An earlier turn stored these placeholders and died before it
        # created the children: create them now.
        with turn.in_flight(), turn.store_calls:
            errors = await services.spawn_children(turn.run, [calls[i] for i in lost])
        for i, error in zip(lost, errors, strict=True):
            turn.missing_children.discard(calls[i].run_id)
            if error is not None:
                waiting.remove(i)
                outcomes[i] = (False, _child_failed(calls[i].run_id, error))
    if fresh:
        now = env.clock.now_ms()
        # The placeholders a child settles exist before any child can finish.
        placeholders = [_placeholder(env, calls[i], now, group) for i in fresh]
        with turn.in_flight(), turn.store_calls:
            await turn.flush()
            if not await env.store.save_checkpoints(placeholders, turn.owner):
                env.fence_lost()
            for placeholder in placeholders:
                turn.wrote(placeholder.seq, placeholder)
            errors = await services.spawn_children(turn.run, [calls[i] for i in fresh])
        for i, error in zip(fresh, errors, strict=True):
            if error is None:
                waiting.append(i)
            else:
                outcomes[i] = (False, _child_failed(calls[i].run_id, error))
    failed = any(o is not None and not o[0] for o in outcomes)
    if waiting and fail_fast and failed:
        with turn.store_calls:
            await services.cancel_runs([calls[i].run_id for i in waiting])
        for i in waiting:
            outcomes[i] = (
                False,
                RunCancelled(f"child {calls[i].run_id} was cancelled: a sibling failed"),
            )
        waiting = []
    if waiting:
        await turn.park(min(calls[i].seq for i in waiting), None, reconcile=True)
    return [o if o is not None else (False, RuntimeError("unsettled")) for o in outcomes]


class ChildHandle:
    """A child started by :meth:`WorkflowContext.start_child`: created already
    (at the call), joined later with :meth:`result`, or never (fire and forget)."""

    __slots__ = ("_call",)

    def __init__(self, call: ChildCall) -> None:
        self._call = call

    @property
    def run_id(self) -> str:
        """The child's run id (``engine.get_run(handle.run_id)`` from outside)."""
        return self._call.run_id

    @property
    def workflow(self) -> str:
        """The child's workflow name."""
        return self._call.workflow

    @property
    def detached(self) -> bool:
        """Whether the child outlives its parent."""
        return self._call.detached

    def result(self) -> ChildCall:
        """Wait for the child and return its output, as ``await ctx.child(...)``
        does (raises :class:`ChildFailed` if it failed, was cancelled, went
        dead or could not start). Pass it to ``ctx.all`` to wait for many."""
        return self._call

    def __repr__(self) -> str:
        return f"ChildHandle(run_id={self.run_id!r}, workflow={self.workflow!r})"


class ChildStarts:
    """The children this turn's ``ctx.start_child`` calls create, created at the call.

    Each call takes its position at once; the creation (placeholder first,
    then the run) is deferred one event-loop step, so starts made together
    (a loop of ``start_child``) are created in one bulk write. The turn does
    not end before they are created: each batch is one of the turn's
    unflushed writes, and marks the turn busy while it runs.
    """

    __slots__ = ("_batch", "_by_id", "_creating", "_env")

    def __init__(self, env: TurnEnv) -> None:
        self._env = env
        self._by_id: dict[str, ChildCall] = {}
        self._batch: list[ChildCall] = []
        self._creating: asyncio.Future[bool] | None = None

    def started(self, run_id: str) -> ChildCall | None:
        """The call that started ``run_id`` earlier in this body, if any (a
        later ``ctx.child`` with that id joins it)."""
        return self._by_id.get(run_id)

    def start(self, call: ChildCall) -> ChildHandle:
        """Create ``call``'s child (unless history shows it was) and hand back its handle."""
        turn = self._env.turn
        self._by_id[call.run_id] = call
        recorded = call.recorded
        fresh = recorded is None
        # A placeholder stored by a turn that died before creating the child.
        lost = (
            recorded is not None
            and recorded.status is CheckpointStatus.PENDING
            and call.run_id in turn.missing_children
        )
        if turn.unwinding or not (fresh or lost):
            return ChildHandle(call)
        if not self._batch or self._creating is None:
            self._creating = turn.write_after_earlier(self._create)
        self._batch.append(call)
        call.ready = self._creating  # every call of a batch waits for the same creation
        return ChildHandle(call)

    async def _create(self) -> bool:
        env, turn, services = self._env, self._env.turn, self._env.services
        await asyncio.sleep(0)  # the starts made in the same stretch of the body join the batch
        batch, self._batch, self._creating = self._batch, [], None
        with turn.in_flight(), turn.store_calls:
            now = env.clock.now_ms()
            fresh = [call for call in batch if call.recorded is None]
            placeholders = {call.run_id: _placeholder(env, call, now, None) for call in fresh}
            # The placeholders a child settles exist before any child can finish.
            if placeholders and not await env.store.save_checkpoints(
                list(placeholders.values()), turn.owner
            ):
                env.fence_lost()
            for placeholder in placeholders.values():
                turn.wrote(placeholder.seq, placeholder)
            errors = await services.spawn_children(turn.run, batch)
        for call, error in zip(batch, errors, strict=True):
            turn.missing_children.discard(call.run_id)
            if error is None:
                if call.run_id in placeholders:
                    call.recorded = placeholders[call.run_id]
                continue
            failed = _placeholder(env, call, now, None)
            failed.status, failed.error, failed.finished_at = CheckpointStatus.FAILED, error, now
            call.recorded = failed
            turn.attached_children.discard(call.run_id)
        return True


def _placeholder(env: TurnEnv, call: ChildCall, now: int, group: str | None) -> Checkpoint:
    """The ``pending`` checkpoint a child settles when it ends."""
    details: dict[str, Any] = {"run_id": call.run_id, "workflow": call.workflow}
    if call.detached:
        details["detached"] = True
    return env.checkpoint(
        call.seq,
        f"child:{call.workflow}",
        CheckpointKind.CHILD,
        CheckpointStatus.PENDING,
        input=details,
        started_at=now,
        group=group,
    )


def _child_failed(run_id: str, error: ErrorInfo | None) -> ChildFailed:
    error = error or {}
    details = error.get("details")
    status = details.get("status", "failed") if isinstance(details, dict) else "failed"
    return ChildFailed(
        run_id,
        str(status),
        str(error.get("message", "failed")),
        code=error.get("code"),
        details=details,
    )
