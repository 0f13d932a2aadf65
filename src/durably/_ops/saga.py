"""Sagas: the undos registered by ``compensate=`` and their unwinding.

A saga step's undo is remembered only once the step completed in this turn
(replayed or executed), so the stack is rebuilt on every replay and never
persisted itself. When the run fails, or is cancelled with
``compensate=True``, the engine unwinds it last in, first out. Each undo is
checkpointed at its own reserved negative position (``-2 - index``), so an
unwind interrupted by a crash resumes without undoing anything twice.

An undo is a local function (called here with the step's output) or a
dispatched step (sent like ``ctx.step``, with ``{"input", "output"}`` of the
step it undoes). A dispatched undo may take a while, so the unwind runs as a
turn of its own (:meth:`Turn.unwind_phase`): an undo still out parks it, the
run suspends mid-unwind, and the result wakes it; its next turn replays the
body to the same failure (or the same compensating cancel), skips the undos
whose checkpoints completed, and goes on with the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from .._replay import Turn, TurnEnd, TurnOutcome, error_info
from .._typed import Decoder, identity
from ..errors import StepFailed, _TurnClosed
from ..model import CheckpointKind, CheckpointStatus, ErrorInfo
from ..retry import RetryPolicy
from ..steps import StepRef
from .env import Services, TurnEnv
from .step import StepCall, StepRunner, resolve_step

__all__ = ["Saga", "Undo", "UndoPlan", "check_compensation_retries"]

Undo: TypeAlias = "Callable[..., Any] | StepRef[Any] | str"
"""What ``compensate=`` takes: a local function, or a step (reference or name)."""

_UNDO_BACKOFF_MS = 500
"""The first delay between an undo's attempts (exponential after it)."""
_MAX_COMPENSATION_RETRIES = 100


def check_compensation_retries(value: object, where: str) -> int:
    """``value`` as a count of retries (an int from 0 to 100), or a clear error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: compensation_retries must be an int, got {value!r}")
    if not 0 <= value <= _MAX_COMPENSATION_RETRIES:
        raise ValueError(
            f"{where}: compensation_retries must be between 0 and "
            f"{_MAX_COMPENSATION_RETRIES}, got {value}"
        )
    return value


@dataclass(frozen=True, slots=True)
class UndoPlan:
    """How one saga step is undone: a local function, or a dispatched step."""

    retries: int
    fn: Callable[..., Any] | None = None
    step: StepCall | None = None
    """A dispatched undo's call, its ``input`` filled in at unwind time."""


@dataclass(slots=True)
class _Compensation:
    seq: int
    name: str
    plan: UndoPlan
    input: Any
    output: Any


class Saga:
    """The undos of one turn's completed saga steps, in completion order."""

    __slots__ = ("_undos",)

    def __init__(self) -> None:
        self._undos: list[_Compensation] = []

    def __bool__(self) -> bool:
        """Whether any undo is registered (the engine unwinds only then)."""
        return bool(self._undos)

    # -- registering ---------------------------------------------------------------------

    @staticmethod
    def local_undo(
        services: Services, name: str, undo: Callable[..., Any] | None, retries: int | None
    ) -> UndoPlan | None:
        """The plan of ``local_step(..., compensate=undo)`` (checked)."""
        where = f"local step {name!r}"
        count = _retries(services, retries, where)
        if undo is None:
            return None
        return UndoPlan(count, fn=undo)

    @staticmethod
    def undo_for(
        services: Services, call: StepCall, undo: Undo | None, retries: int | None
    ) -> UndoPlan | None:
        """The plan of ``ctx.step(..., compensate=undo)`` (checked: a bad undo
        fails the call, before anything is dispatched)."""
        where = f"ctx.step {call.name!r}"
        count = _retries(services, retries, where)
        if undo is None:
            return None
        if isinstance(undo, StepRef | str):
            if isinstance(undo, str) and not undo:
                raise ValueError(f"{where}: compensate needs a non-empty step name")
            # Resolved now, so a bad name or an unknown queue fails the call.
            template, _ = resolve_step(services, undo, None, None, None, {"retries": count})
            return UndoPlan(count, step=template)
        if callable(undo):
            return UndoPlan(count, fn=undo)
        raise TypeError(f"{where}: compensate must be a function, a step reference or a name")

    def with_undo(
        self,
        seq: int,
        name: str,
        plan: UndoPlan,
        step: Awaitable[Any],
        decode: Decoder = identity,
        input: Any = None,
    ) -> Awaitable[Any]:
        """``step``'s value (decoded), registering ``plan`` once it completed.

        A dispatched undo receives the step's output as JSON data (what the
        step returned, before ``decode``), a local one the decoded value.
        """
        return self._register(seq, name, plan, step, decode, input)

    async def _register(
        self,
        seq: int,
        name: str,
        plan: UndoPlan,
        step: Awaitable[Any],
        decode: Decoder,
        input: Any,
    ) -> Any:
        raw = await step
        value = decode(raw)
        self._undos.append(
            _Compensation(seq, name, plan, input, raw if plan.step is not None else value)
        )
        return value

    # -- unwinding -----------------------------------------------------------------------

    async def compensate(self, turn: Turn, services: Services) -> list[ErrorInfo] | TurnOutcome:
        """Run the registered undos last in, first out; called by the engine
        after the body ended. Returns the failures of undos that were skipped,
        or, while a dispatched undo is out, the outcome that suspends the run
        mid-unwind. Raises :class:`_TurnClosed` if the turn was closed."""
        phase = turn.unwind_phase()
        failures: list[ErrorInfo] = []
        outcome = await phase.execute(lambda: self._unwind(phase, services, failures))
        try:
            if outcome.end is not TurnEnd.CLOSED:
                with phase.store_calls:
                    await phase.flush()  # the unwind's writes are durable before the outcome
        finally:
            turn.fenced = turn.fenced or phase.fenced
        if outcome.end is TurnEnd.COMPLETED:
            return failures
        if outcome.end in (TurnEnd.SUSPENDED, TurnEnd.BLOCKED):
            return outcome
        if outcome.end is TurnEnd.FAILED and outcome.error is not None:
            # Not an undo's failure (those are caught): the unwind itself broke.
            return [*failures, outcome.error]
        raise _TurnClosed(phase.close_reason)

    async def _unwind(self, turn: Turn, services: Services, failures: list[ErrorInfo]) -> None:
        env = TurnEnv(turn, services)
        for index in reversed(range(len(self._undos))):
            entry = self._undos[index]
            seq = -2 - index
            recorded = turn.checkpoints.get(seq)
            if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
                continue
            if entry.plan.step is not None:
                error = await _dispatched_undo(env, seq, entry, entry.plan.step, recorded)
            elif recorded is not None and recorded.status is CheckpointStatus.FAILED:
                error = recorded.error or {"message": "compensation failed"}
            else:
                assert entry.plan.fn is not None
                with turn.in_flight():
                    error = await _local_undo(env, seq, entry, entry.plan.fn)
            if error is not None:
                env.log.error(
                    "compensation of step %s failed; skipped: %s", entry.name, error.get("message")
                )
                failures.append(error)


def _retries(services: Services, retries: int | None, where: str) -> int:
    if retries is None:
        return services.compensation_retries
    return check_compensation_retries(retries, where)


async def _dispatched_undo(
    env: TurnEnv, seq: int, entry: _Compensation, template: StepCall, recorded: Any
) -> ErrorInfo | None:
    """Dispatch the undo step (or wait for it, parking this unwind) at ``seq``;
    its failure once its attempts ran out, or ``None``."""
    call = dataclasses.replace(template, input={"input": entry.input, "output": entry.output})
    try:
        await StepRunner(env).run(seq, call, recorded)
    except StepFailed as exc:
        return error_info(exc)
    return None


async def _local_undo(
    env: TurnEnv, seq: int, entry: _Compensation, fn: Callable[..., Any]
) -> ErrorInfo | None:
    """Run ``fn(output)`` with its retries, checkpointed ``running`` then settled."""
    turn, store, clock = env.turn, env.store, env.clock
    policy = RetryPolicy(retries=entry.plan.retries, base_ms=_UNDO_BACKOFF_MS)
    started = clock.now_ms()
    name = f"compensate:{entry.name}"
    running = env.checkpoint(
        seq,
        name,
        CheckpointKind.COMPENSATION,
        CheckpointStatus.RUNNING,
        started_at=started,
        attempts=1,
    )
    with turn.store_calls:
        held = await store.save_checkpoint(running, turn.owner)
    if not held:
        env.fence_lost()
    error: ErrorInfo | None = None
    attempts = 0
    for attempt in range(policy.retries + 1):
        attempts = attempt + 1
        try:
            await env.call(fn, (entry.output,))
            error = None
            break
        except Exception as exc:
            error = error_info(exc)
            if attempt < policy.retries:
                await clock.sleep(policy.delay_ms(attempt + 1) / 1000)
    status = CheckpointStatus.COMPLETED if error is None else CheckpointStatus.FAILED
    settled = env.checkpoint(
        seq,
        name,
        CheckpointKind.COMPENSATION,
        status,
        error=error,
        started_at=started,
        finished_at=clock.now_ms(),
        attempts=attempts,
    )
    with turn.store_calls:
        held = await store.save_checkpoint(settled, turn.owner)
    if not held:
        env.fence_lost()
    return error
