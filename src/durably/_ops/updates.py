"""Updates inside a run: ``ctx.on_update`` handlers, ``ctx.wait_condition``,
and when an update is handled.

**When.** An update is handled only while the body is *quiescent*: every
branch is parked on a durable wait, a condition, or (in a replay) a held
position; no body code runs. Then, before the turn would suspend, the run's
inbox is read (oldest first) and each update whose name has a handler is
validated (a validator that raises or returns a string rejects it: answered,
nothing recorded) and applied: the handler runs at the next position ``N``,
and the checkpoint ``update:<name>`` at ``N`` — holding the update id, the
payload, the handler's result or error, and the positions parked at that
moment — is written in one store transaction with the caller's answer, under
the lease. An update named by no handler stays in the inbox.

**Why it replays.** Every turn re-runs the body from the top. A recorded
update at ``N`` is re-applied when the replaying body is quiescent with its
next position at ``N``, which is where the body stood when the update was
first handled. The operations that were parked then (listed in the
checkpoint) completed *after* the update, so on replay they are held before
resolving until every recorded update that lists them has been re-applied,
and released only at the next quiescent point — after whatever the update
let the body do (a condition met). So the body sees the same sequence as the
first time: the code before the update, the handler's changes to its state,
then the continuations. A replay that reaches quiescence at another position
than the next recorded update's is a :class:`NondeterminismError`. Handlers
must be deterministic and may not call ``ctx`` (refused).

A condition (``ctx.wait_condition``) is checked when called and after each
update is applied (handlers are what change state while the body waits),
never at an arbitrary point, for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .. import _codec as codec
from .._names import check_name as check_key
from .._replay import error_info
from ..errors import NondeterminismError
from ..model import Checkpoint, CheckpointKind, CheckpointStatus
from ..stores.base import UpdateRecord
from .env import TurnEnv

__all__ = ["UPDATE_PREFIX", "Handler", "TurnUpdates", "check_update_name"]

UPDATE_PREFIX = "update:"
"""How a handled update is named in history: ``update:<name>``."""

_BATCH = 64


def check_update_name(name: Any) -> str:
    """``name`` if it is a usable update name (``ValueError`` otherwise)."""
    if not isinstance(name, str) or not name:
        raise ValueError("an update name must be a non-empty string")
    check_key(f"{UPDATE_PREFIX}{name}", "update name")
    return name


@dataclass(frozen=True, slots=True)
class Handler:
    """A registered ``ctx.on_update`` handler and its validator."""

    handler: Callable[[Any], Any]
    validator: Callable[[Any], Any] | None = None


class TurnUpdates:
    """The updates of one turn: handlers, recorded updates to re-apply, the inbox."""

    def __init__(self, env: TurnEnv) -> None:
        self._env = env
        turn = env.turn
        self.handlers: dict[str, Handler] = {}
        self.fallback: Handler | None = None
        """Takes the updates no handler is registered for (an entity refuses
        an unknown operation at once instead of leaving it in the inbox)."""
        self._recorded: deque[Checkpoint] = deque(
            cp for _, cp in sorted(turn.checkpoints.items()) if cp.kind == CheckpointKind.UPDATE
        )
        self._handled = {_update_id(cp) for cp in self._recorded}
        # How many recorded, not yet re-applied updates list each parked position
        # (a run's first turn has none: skip Counter's generic iterable path).
        self._holding: Counter[int] = (
            Counter(seq for cp in self._recorded for seq in _parked(cp))
            if self._recorded
            else Counter()
        )
        self._gates: dict[int, asyncio.Future[None]] = {}
        self._conditions: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        if self._recorded:
            turn.gate = self.gate
        turn.on_quiescent = self.on_quiescent

    @property
    def idle(self) -> bool:
        """Whether updates play no part in this body: no handler, no recorded
        update, no condition or gate (a kept turn resumes only then)."""
        return not (
            self.handlers or self.fallback or self._recorded or self._conditions or self._gates
        )

    # -- the body's side ---------------------------------------------------------------

    def register(self, name: str, handler: Handler) -> None:
        """``ctx.on_update``: handle updates called ``name`` from now on."""
        self.handlers[name] = handler

    async def wait_condition(self, predicate: Callable[[], bool]) -> None:
        """``ctx.wait_condition``: return once ``predicate()`` holds."""
        if predicate():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._conditions.append((predicate, future))
        await self._env.turn.hold(future)

    def gate(self, seqs: Iterable[int]) -> Awaitable[None] | None:
        """What an operation at ``seqs`` awaits before it resolves: ``None``
        unless a recorded update not yet re-applied was handled while it was
        parked (see the module docstring)."""
        held = [seq for seq in seqs if self._holding[seq] > 0]
        if not held:
            return None
        futures = []
        loop = asyncio.get_running_loop()
        for seq in held:
            if seq not in self._gates:
                self._gates[seq] = loop.create_future()
            futures.append(self._gates[seq])
        return self._env.turn.hold(asyncio.gather(*futures))

    # -- the turn's side ---------------------------------------------------------------

    async def on_quiescent(self) -> bool:
        """The body is quiescent: release, re-apply or handle; ``True`` if it moved on."""
        turn = self._env.turn
        released = [
            seq for seq, gate in self._gates.items() if self._holding[seq] == 0 and not gate.done()
        ]
        for seq in released:
            self._gates[seq].set_result(None)
        if released:
            return True
        if self._recorded:
            recorded = self._recorded[0]
            if recorded.seq != turn.next_seq:
                raise turn.halt(
                    NondeterminismError(
                        f"run {turn.run.run_id!r}: update {recorded.name!r} was handled at "
                        f"position {recorded.seq}, but the replayed workflow waits at "
                        f"position {turn.next_seq}",
                        seq=recorded.seq,
                        history=(str(recorded.kind), recorded.name),
                        found=("wait", f"position {turn.next_seq}"),
                    )
                )
            self._recorded.popleft()
            turn.skip(recorded.seq)
            await self._reapply(recorded)
            for seq in _parked(recorded):
                self._holding[seq] -= 1
            self._conditions_met()
            return True
        if turn.unwinding or turn.closed or not (self.handlers or self.fallback):
            return False
        if turn.replaying:
            # Positions recorded ahead of the body: a new update's entry
            # belongs after them, not among them. Taken on a later turn.
            return False
        with turn.store_calls:
            inbox = await self._env.store.pending_updates(turn.run.run_id, _BATCH)
        moved = False
        for record in inbox:
            handler = self.handlers.get(record.name) or self.fallback
            if handler is None or record.update_id in self._handled:
                continue  # no handler (yet): it stays in the inbox
            moved = True
            if await self._handle(record, handler) and self._conditions_met():
                break  # the body goes on first; the rest at its next quiescence
        return moved

    async def _reapply(self, recorded: Checkpoint) -> None:
        """Run a recorded update's handler again, so the state it changed is rebuilt."""
        name = recorded.name[len(UPDATE_PREFIX) :]
        handler = self.handlers.get(name)
        if handler is None:
            raise self._env.turn.halt(
                NondeterminismError(
                    f"run {self._env.run_id!r}: update {name!r} at position {recorded.seq} "
                    "has no handler in the replayed workflow",
                    seq=recorded.seq,
                    history=(str(recorded.kind), recorded.name),
                    found=("no handler", name),
                )
            )
        payload = recorded.input.get("payload") if isinstance(recorded.input, dict) else None
        # A handler that raised the first time raises again: its error is recorded.
        with contextlib.suppress(Exception):
            await self._call(handler.handler, payload)

    async def _handle(self, record: UpdateRecord, handler: Handler) -> bool:
        """Validate and apply one update; ``True`` if it was applied (recorded)."""
        env, turn = self._env, self._env.turn
        if handler.validator is not None:
            reason = await self._validate(handler.validator, record.payload)
            if reason is not None:
                await self._answer(record, {"outcome": "rejected", "reason": reason}, None)
                return False
        seq, _ = turn.allocate(f"{UPDATE_PREFIX}{record.name}", CheckpointKind.UPDATE)
        parked = turn.parked_seqs
        now = env.clock.now_ms()
        status, output, error = CheckpointStatus.COMPLETED, None, None
        try:
            output = codec.to_jsonable(
                await self._call(handler.handler, record.payload),
                f"the result of update {record.name!r}",
            )
            answer: dict[str, Any] = {"outcome": "accepted", "result": output}
        except Exception as exc:
            status, error = CheckpointStatus.FAILED, error_info(exc)
            answer = {"outcome": "failed", "reason": error["message"], "error": error}
        checkpoint = env.checkpoint(
            seq,
            f"{UPDATE_PREFIX}{record.name}",
            CheckpointKind.UPDATE,
            status,
            input={"update_id": record.update_id, "payload": record.payload, "parked": parked},
            output=output,
            error=error,
            attempts=1,
            started_at=now,
            finished_at=env.clock.now_ms(),
        )
        await self._answer(record, answer, checkpoint)
        self._handled.add(record.update_id)
        return True

    async def _validate(self, validator: Callable[[Any], Any], payload: Any) -> str | None:
        try:
            verdict = await self._call(validator, payload)
        except Exception as exc:
            return str(exc) or type(exc).__name__
        return verdict if isinstance(verdict, str) else None

    async def _call(self, fn: Callable[[Any], Any], payload: Any) -> Any:
        # On the event loop, not in a thread: a handler changes the body's own
        # state, which only the body's thread may touch.
        turn = self._env.turn
        turn.in_handler = True
        try:
            result = fn(payload)
            if inspect.isawaitable(result):
                result = await result
            return result
        finally:
            turn.in_handler = False

    async def _answer(
        self, record: UpdateRecord, answer: dict[str, Any], checkpoint: Checkpoint | None
    ) -> None:
        env, turn = self._env, self._env.turn
        with turn.store_calls:
            # Every earlier result is durable before the update's entry lands
            # after it in history.
            await turn.flush()
            held = await env.store.answer_update(
                env.run_id,
                record.update_id,
                answer,
                env.clock.now_ms(),
                checkpoint=checkpoint,
                owner=turn.owner,
            )
        if not held:
            env.fence_lost()
        env.services.update_answered(env.run_id, record.update_id)

    def _conditions_met(self) -> bool:
        met = False
        for predicate, future in list(self._conditions):
            if future.done():
                self._conditions.remove((predicate, future))
                continue
            try:
                ready = bool(predicate())
            except Exception as exc:
                self._conditions.remove((predicate, future))
                future.set_exception(exc)
                met = True
                continue
            if ready:
                self._conditions.remove((predicate, future))
                future.set_result(None)
                met = True
        return met


def _update_id(checkpoint: Checkpoint) -> str:
    data = checkpoint.input if isinstance(checkpoint.input, dict) else {}
    return str(data.get("update_id"))


def _parked(checkpoint: Checkpoint) -> list[int]:
    data = checkpoint.input if isinstance(checkpoint.input, dict) else {}
    return [int(seq) for seq in data.get("parked") or []]
