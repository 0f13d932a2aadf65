"""``TurnEnv``: what every ``ctx`` operation works against during one turn.

The operations in :mod:`durably._ops` receive it explicitly rather than
reaching into ``WorkflowContext``: the turn (positions, parking, deferred
writes), the engine's services, and the few routines they all need — build a
checkpoint, save it now or with the next flush, and leave the turn when the
store's lease fence refuses a write.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from .._intercept import Interceptors
from .._lifecycle_events import EventHub
from .._replay import CloseReason, Turn
from .._step_faults import StepFaults
from .._threads import StepThreads
from .._typed import Decoder, identity
from ..clock import Clock
from ..errors import _TurnClosed
from ..model import Checkpoint, CheckpointKind, CheckpointStatus, ErrorInfo, Run
from ..retry import RetryPolicy
from ..steps._dispatcher import StepDispatcher
from ..stores.base import StateStore
from ..wire import StepTask

__all__ = ["ChildStart", "Services", "SpawnChildren", "StepGuard", "TurnEnv"]

StepGuard = Callable[[str, frozenset[str]], Awaitable[ErrorInfo | None]]
"""``(routing token, required capabilities)``: why no live worker can take a
step sent to that token (the run is then parked ``blocked``), or ``None``."""


class ChildStart(Protocol):
    """What creating a child run needs from the call that asks for it (a
    ``ctx.child`` / ``ctx.start_child`` call, or a remote turn's decision).

    Typed by shape, not by those classes, so this module stays below them,
    and a caller that forgets a field (``priority``...) fails the type check.
    """

    @property
    def run_id(self) -> str:
        """The child's run id."""
        ...

    @property
    def workflow(self) -> str:
        """The child's workflow name."""
        ...

    @property
    def input(self) -> Any:
        """The child's input (validated by its workflow's input type)."""
        ...

    @property
    def seq(self) -> int:
        """The parent's position whose placeholder the child settles."""
        ...

    @property
    def priority(self) -> int | None:
        """The child's priority (``None``: its parent's)."""
        ...


SpawnChildren = Callable[[Run, Sequence[ChildStart]], Awaitable[list[ErrorInfo | None]]]
"""Create child runs for a parent; return a start error per child (or ``None``)."""


@dataclass(frozen=True, slots=True)
class Services:
    """What the operations need from the engine, passed in explicitly (one per engine)."""

    store: StateStore
    clock: Clock
    threads: StepThreads
    track_start: bool
    default_retry: RetryPolicy
    logger: logging.Logger
    spawn_children: SpawnChildren
    cancel_runs: Callable[[list[str]], Awaitable[None]]
    steps: StepDispatcher
    redispatch_ms: int | None
    redispatch_max: int
    faults: StepFaults
    intercept: Interceptors
    events: EventHub
    webhook_base_url: str | None = None
    child_output: Callable[[str], Decoder] = lambda _workflow: identity
    """The decoder of a child workflow's output, by workflow name (its
    registered default version's output type; plain data when unknown here)."""
    step_guard: StepGuard | None = None
    """``(token, requires)``: why no live worker can take a step, or ``None``."""
    compensation_retries: int = 2
    """Retries of a failing saga undo before it is skipped (the engine's default)."""
    update_answered: Callable[[str, str], None] = lambda _run_id, _update_id: None
    """Told ``(run_id, update_id)`` of each update a turn here answered, so a
    caller waiting in this process hears at once (others poll the store)."""
    entity_call: Callable[..., Awaitable[Any]] | None = None
    """``ctx.call_entity``'s way to an entity (:mod:`durably._entities`)."""
    entity_signal: Callable[..., Awaitable[Any]] | None = None
    """``ctx.signal_entity``'s way to an entity."""


class WorkflowLogger(logging.LoggerAdapter[logging.Logger]):
    """``ctx.log``: a standard logger adapter whose records carry ``run_id``,
    ``workflow`` and ``step``, that keeps the caller's ``extra=`` (which
    Python 3.11's adapter drops), and that is silent while the body replays
    code an earlier turn ran (so each line is logged once, not once per turn)."""

    def __init__(self, logger: logging.Logger, turn: Turn) -> None:
        super().__init__(logger, {"run_id": turn.run.run_id, "workflow": turn.run.workflow})
        self._turn = turn

    def isEnabledFor(self, level: int) -> bool:
        """``False`` while replaying; else as the logger says."""
        return not self._turn.replaying and self.logger.isEnabledFor(level)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        """Merge the caller's ``extra`` under the run's (the run's keys win)."""
        kwargs["extra"] = {**(kwargs.get("extra") or {}), **(self.extra or {})}
        return msg, kwargs


class TurnEnv:
    """One turn of one run as the operations see it: the turn plus the engine's services."""

    __slots__ = ("clock", "log", "run_id", "services", "store", "turn")

    def __init__(self, turn: Turn, services: Services) -> None:
        self.turn = turn
        self.services = services
        # Copied out of ``services``: they are read on every operation.
        self.store = services.store
        self.clock = services.clock
        self.run_id = turn.run.run_id
        self.log = WorkflowLogger(services.logger, turn)
        """A logger that tags every record with the run id and workflow."""

    def checkpoint(
        self,
        seq: int,
        name: str,
        kind: CheckpointKind,
        status: CheckpointStatus,
        *,
        input: Any = None,
        output: Any = None,
        error: ErrorInfo | None = None,
        attempts: int = 0,
        wake_at: int | None = None,
        started_at: int | None = None,
        finished_at: int | None = None,
        group: str | None = None,
        dispatched_at: int | None = None,
        redispatches: int = 0,
        queue: str | None = None,
    ) -> Checkpoint:
        """A checkpoint of this run at ``seq`` (the fields a ``ctx`` operation writes)."""
        return Checkpoint(
            self.run_id,
            seq,
            name,
            kind,
            status,
            input,
            output,
            error,
            attempts,
            wake_at,
            started_at,
            finished_at,
            group,
            dispatched_at,
            redispatches,
            queue,
        )

    async def save(self, checkpoint: Checkpoint, *, send: list[StepTask] | None = None) -> None:
        """Write ``checkpoint`` after every deferred write, fenced by the lease;
        with ``send``, send those tasks in the same transaction (the
        transport must allow it: ``StepDispatcher.send_with_checkpoint``)."""
        turn, store = self.turn, self.store
        turn.ensure_open()

        def write() -> Awaitable[bool]:
            if send is None:
                return store.save_checkpoint(checkpoint, turn.owner)
            return self.services.steps.save_and_send(checkpoint, turn.owner, send)

        with turn.store_calls:
            if store.ordered_writes:
                # Queued behind every earlier write: once this one is done they
                # are too, and the flush only collects their results.
                held = await write()
                await turn.flush()
            else:
                await turn.flush()
                held = await write()
        if not held:
            self.fence_lost()
        turn.wrote(checkpoint.seq, checkpoint)

    def save_later(self, checkpoint: Checkpoint, *, send: list[StepTask] | None = None) -> None:
        """Start writing ``checkpoint``; the turn's next flush waits for it.
        With ``send``, those tasks go out in its transaction (as :meth:`save`)."""
        turn = self.turn
        if send is None:
            turn.write_later(self.store.save_checkpoint(checkpoint, turn.owner))
        else:
            turn.write_later(self.services.steps.save_and_send(checkpoint, turn.owner, send))
        turn.wrote(checkpoint.seq, checkpoint)

    def fence_lost(self) -> NoReturn:
        """Leave the turn: the store refused a write, so another instance holds the lease.

        Marked ``fenced`` so the engine writes no outcome over the new owner's.
        """
        self.turn.fenced = True
        self.turn.close(CloseReason.FENCED)
        raise _TurnClosed(CloseReason.FENCED)

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run user code: a coroutine function on the loop, anything else in a step thread
        (so a blocking function cannot stall every other run)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        result = await self.services.threads.call(fn, args)
        if inspect.isawaitable(result):
            return await result
        return result
