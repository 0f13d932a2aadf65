"""How ``ctx.step`` executes: dispatch, durable waiting, liveness, retries, nets.

The context only resolves a call's options and takes its position; this
module does the rest, because a dispatched step is a small state machine
over its checkpoint:

- no checkpoint, or one not out (``dispatched_at`` unset): ask for admission
  if the call names a queue, then save ``pending`` *before* sending the task,
  so a fast result always finds it;
- out, no ``timeout``: hold the turn in memory up to ``step_hold``, unless
  the step is known slower (:mod:`durably.steps._holds`), then park durably (the reconcile wake, and
  the redispatch deadline when set, bound the wait); whoever receives the
  result settles the checkpoint and hands it to the holder or wakes the run;
- out, with ``timeout``: await in memory with a heartbeat-rearmed window;
  when it runs out, re-read the checkpoint before failing the attempt;
- ``failed`` with attempts left and retryable: save ``pending`` with a backoff
  timer, so the retry survives crashes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import _codec as codec
from .._names import check_name as check_key
from .._names import check_priority
from .._typed import Decoder, identity
from ..durations import to_ms
from ..errors import StepFailed
from ..model import Checkpoint, CheckpointKind, CheckpointStatus, ErrorInfo
from ..retry import RetryPolicy
from ..steps import StepDefinition, StepRef
from ..steps._dispatcher import LiveStep
from ..steps._holds import loop_time_ms
from ..stores.base import Admission
from ..transports.base import TransportError
from ..wire import StepTask, routing_token
from .env import Services, TurnEnv

__all__ = ["StepCall", "StepRunner", "resolve_step"]

_SEND_RETRY_MS = 1000
"""When a step whose task the transport refused is sent again."""


_BLOCKED_POLL_MS = 5_000


@dataclass(slots=True)
class StepCall:
    """One ``ctx.step`` call's resolved options."""

    name: str
    input: Any
    policy: RetryPolicy
    timeout_ms: int | None
    pickup_ms: int | None
    queue: str | None
    priority: int | None
    fairness_key: str | None
    context: Any
    requires: frozenset[str] = frozenset()


class StepRunner:
    """Executes ``ctx.step`` calls for one turn."""

    __slots__ = ("_env",)

    def __init__(self, env: TurnEnv) -> None:
        self._env = env

    async def run(self, seq: int, call: StepCall, recorded: Checkpoint | None) -> Any:
        """Drive the step at ``seq`` from its ``recorded`` checkpoint to a result or a park."""
        turn, services = self._env.turn, self._env.services
        cp = recorded
        while True:
            if cp is not None and cp.status is CheckpointStatus.COMPLETED:
                return cp.output
            if cp is not None and cp.status is CheckpointStatus.FAILED:
                error = cp.error or {}
                if (
                    error.get("retryable") is False
                    or cp.attempts > call.policy.retries
                    or turn.unwinding
                ):
                    raise StepFailed.from_error(call.name, cp.error, cp.attempts)
                # Retry after a durable backoff timer, not an in-memory sleep.
                now = services.clock.now_ms()
                cp = self._step_checkpoint(
                    seq,
                    call,
                    attempts=cp.attempts,
                    wake_at=now + call.policy.delay_ms(cp.attempts),
                    error=cp.error,
                    started_at=cp.started_at,
                )
                with turn.in_flight():
                    await self._env.save(cp)
            if turn.unwinding:
                return await turn.park(seq, None, reconcile=False)
            now = services.clock.now_ms()
            if cp is None or cp.dispatched_at is None:
                if cp is not None and cp.wake_at is not None and cp.wake_at > now:
                    return await turn.park(seq, cp.wake_at, reconcile=False)
                attempts = cp.attempts if cp is not None else 0
                started = cp.started_at if cp is not None and cp.started_at else now
                if call.requires and services.step_guard is not None:
                    token = routing_token(call.name, turn.run.namespace)
                    with turn.in_flight(), turn.store_calls:
                        blocked = await services.step_guard(token, call.requires)
                    if blocked is not None:
                        # Not sent into a queue nobody able drains: the run
                        # parks blocked (no checkpoint) and polls again.
                        return await turn.block(seq, blocked, now + _BLOCKED_POLL_MS)
                if call.queue is not None:
                    retry_at = await self._admit(seq, call)
                    if retry_at is not None:
                        cp = self._step_checkpoint(
                            seq, call, attempts=attempts, wake_at=retry_at, started_at=started
                        )
                        with turn.in_flight():
                            await self._env.save(cp)
                        return await turn.park(seq, retry_at, reconcile=False)
                cp = self._step_checkpoint(
                    seq,
                    call,
                    attempts=attempts + 1,
                    dispatched_at=now,
                    wake_at=self._redispatch_at(now),
                    started_at=started,
                    queue=call.queue,
                )
            elif cp.wake_at is not None and cp.wake_at <= now and services.redispatch_ms:
                if cp.redispatches >= services.redispatch_max:
                    lost = self._step_checkpoint(
                        seq,
                        call,
                        attempts=cp.attempts,
                        status=CheckpointStatus.FAILED,
                        error={
                            "message": f"no result after {cp.redispatches} re-dispatches",
                            "code": "remote_step_lost",
                            "retryable": False,
                        },
                        started_at=cp.started_at,
                        queue=cp.queue,
                    )
                    with turn.in_flight():
                        await self._env.save(lost)
                    raise StepFailed.from_error(call.name, lost.error, lost.attempts)
                cp = self._step_checkpoint(
                    seq,
                    call,
                    attempts=cp.attempts,
                    dispatched_at=now,
                    wake_at=self._redispatch_at(now),
                    started_at=cp.started_at,
                    queue=cp.queue,
                    redispatches=cp.redispatches + 1,
                )
            else:
                # Out already (an earlier turn sent it): wait for its result.
                if call.timeout_ms is None:
                    return await turn.park(seq, cp.wake_at, reconcile=True)
                cp = await self._await_live(seq, call, cp, send=False)
                continue
            if call.timeout_ms is None:
                window = services.steps.holds.window_ms(call.name)
                if window > 0:
                    held = await self._send_and_hold(seq, call, cp, window)
                    if held is not None:
                        cp = held
                        continue
                elif services.steps.send_with_checkpoint is not None:
                    # Not awaited: the checkpoint and its task are queued
                    # before the turn's settle and commit with it (ordered
                    # writes), so the run is parked when its result can first
                    # arrive, and a crash leaves all three or none.
                    self._env.save_later(cp, send=[self._task(seq, call, cp)])
                else:
                    await self._send(seq, call, cp)
                return await turn.park(seq, cp.wake_at, reconcile=True)
            cp = await self._await_live(seq, call, cp, send=True)

    def _redispatch_at(self, now: int) -> int | None:
        ms = self._env.services.redispatch_ms
        return None if not ms else now + ms

    def _step_checkpoint(
        self,
        seq: int,
        call: StepCall,
        *,
        attempts: int,
        status: CheckpointStatus = CheckpointStatus.PENDING,
        wake_at: int | None = None,
        dispatched_at: int | None = None,
        output: Any = None,
        error: ErrorInfo | None = None,
        started_at: int | None = None,
        queue: str | None = None,
        redispatches: int = 0,
    ) -> Checkpoint:
        now = self._env.clock.now_ms()
        return self._env.checkpoint(
            seq,
            call.name,
            CheckpointKind.STEP,
            status,
            input=call.input,
            output=output,
            error=error,
            attempts=attempts,
            wake_at=wake_at,
            started_at=started_at or now,
            finished_at=None if status is CheckpointStatus.PENDING else now,
            dispatched_at=dispatched_at,
            redispatches=redispatches,
            queue=queue,
        )

    async def _admit(self, seq: int, call: StepCall) -> int | None:
        assert call.queue is not None
        flow = self._env.services.steps.queue(call.queue)
        assert flow is not None  # ctx.step refused an undeclared queue
        request = Admission(
            queue=call.queue,
            step_id=f"{self._env.run_id}:{seq}",
            run_id=self._env.run_id,
            concurrency=flow.concurrency,
            rate_limit=flow.rate_limit,
            rate_period_ms=flow.rate_period_ms,
            priority=call.priority or 0,
            fairness_key=call.fairness_key,
            retry_ms=flow.retry_ms,
        )
        with self._env.turn.in_flight(), self._env.turn.store_calls:
            await self._env.turn.flush()
            return await self._env.store.try_admit(request, self._env.clock.now_ms())

    def _task(self, seq: int, call: StepCall, cp: Checkpoint) -> StepTask:
        return StepTask(
            run_id=self._env.run_id,
            seq=seq,
            name=call.name,
            group=routing_token(call.name, self._env.turn.run.namespace),
            input=call.input,
            attempt=cp.attempts,
            priority=call.priority,
            context=call.context,
            sent_at=cp.dispatched_at,
        )

    async def _send(self, seq: int, call: StepCall, cp: Checkpoint) -> bool:
        """Make ``cp`` durable, then send its task (a fast result must find it).

        If the transport refuses it, ``cp`` is saved as not out, due again in a
        second, so a later turn sends the same attempt again (with or without
        the redispatch net); returns whether it was sent.
        """
        turn = self._env.turn
        with turn.in_flight(), turn.store_calls:
            if self._env.services.steps.send_with_checkpoint is not None:
                # One transaction: the task is out exactly when its checkpoint
                # is durable (a store error leaves neither, and the turn runs again).
                await self._env.save(cp, send=[self._task(seq, call, cp)])
                return True
            await self._env.save(cp)
            try:
                await self._env.services.steps.dispatch([self._task(seq, call, cp)])
            except TransportError as exc:
                await self._unsent(call, cp, exc)
                return False
        return True

    async def _unsent(self, call: StepCall, cp: Checkpoint, exc: TransportError) -> None:
        """The transport refused ``cp``'s task: save it as not out, due again
        in a second (a later turn sends the same attempt again)."""
        self._env.log.warning("step %s could not be dispatched: %s", call.name, exc)
        cp.dispatched_at = None
        cp.attempts -= 1
        cp.wake_at = self._env.clock.now_ms() + _SEND_RETRY_MS
        await self._env.save(cp)

    async def _send_and_hold(
        self, seq: int, call: StepCall, cp: Checkpoint, window_ms: float
    ) -> Checkpoint | None:
        """Send a step without ``timeout``, then hold the turn up to
        ``window_ms`` for its result (:mod:`durably.steps._holds`): its
        settled checkpoint, or ``None`` when the caller must park as usual
        (no result in time, released, or not sent)."""
        turn, services = self._env.turn, self._env.services
        steps = services.steps
        settled: Checkpoint | None = None
        with turn.in_flight():
            # Registered before the task can go out: an inline result cannot slip past.
            with steps.live(f"{self._env.run_id}:{seq}") as waiter:
                # Results for it are settled with no wake stamp from now on (the
                # hand-over delivers them; an inline one may come during the
                # send), so it lets go only through StepDispatcher.let_go.
                waiter.owner = turn.owner
                if steps.send_with_checkpoint is not None:
                    # Queued, not awaited (as a park does): the task goes out in the
                    # transaction that makes its checkpoint durable, so no result
                    # can come before it, and the hold overlaps the commit.
                    self._env.save_later(cp, send=[self._task(seq, call, cp)])
                else:
                    # As _send does, inline: a coroutine and an in-flight mark
                    # less per held step (the hold marks the turn already).
                    with turn.store_calls:
                        await self._env.save(cp)
                        try:
                            await steps.dispatch([self._task(seq, call, cp)])
                        except TransportError as exc:
                            await self._unsent(call, cp, exc)
                            if steps.let_go(waiter):
                                return None  # not out: the caller parks until it is due again
                    if not steps.holds.may_hold() and steps.let_go(waiter):
                        # Holds started during the send filled their bound (or a
                        # drain began): park, as a window of 0 would have.
                        return None
                began = now = loop_time_ms()
                deadline = began + window_ms
                with steps.holds.hold(waiter, self._env.run_id):
                    while True:
                        if waiter.result is not None:
                            steps.holds.heard(call.name, now - began)
                            turn.wrote(seq)  # the receiver settled it in the store
                            settled = self._settled(seq, call, cp, waiter)
                            break
                        if waiter.recheck:
                            fresh = await self._recheck(seq, waiter)
                            now = loop_time_ms()
                            if fresh is not None:
                                steps.holds.heard(call.name, now - began)
                                settled = fresh
                                break
                        left = deadline - now
                        if waiter.released or left <= 0:
                            if steps.let_go(waiter):
                                if not waiter.released:
                                    steps.holds.missed(call.name, window_ms)
                                # Let go and unregistered with no await in
                                # between: a result heard from now on finds no
                                # waiter and wakes the run (its stamp makes the
                                # park's settle see it).
                                break
                            # A result is being settled for it without a stamp:
                            # parking now could lose it; its settle is a moment.
                            left = float("inf")
                        # The holds' shared alarm sets the event, not wait_for:
                        # no task, nor timer, per wait.
                        waiter.changed.clear()
                        if left != float("inf"):
                            steps.holds.alarm(waiter, deadline)
                        await waiter.changed.wait()
                        turn.ensure_open()
                        # One clock read per wake (and after each await): the
                        # checks above use it.
                        now = loop_time_ms()
            # The hold lent its turn slot: take one back before the body goes
            # on (or parks), so at most max_concurrent_runs turns work. Only
            # now: a hold that let go must be unregistered with no await in
            # between (above), and it still counts as in flight meanwhile.
            claim = steps.holds.reclaim(self._env.run_id)
            if claim is not None:
                await claim
        return settled

    async def _recheck(self, seq: int, waiter: LiveStep) -> Checkpoint | None:
        """The step's checkpoint as the store holds it, if settled there (a
        result this process heard settled nothing: someone settled it first)."""
        waiter.recheck = False
        turn = self._env.turn
        with turn.store_calls:
            fresh = await self._env.services.store.get_checkpoint(self._env.run_id, seq)
        turn.ensure_open()
        if fresh is not None and fresh.status in (
            CheckpointStatus.COMPLETED,
            CheckpointStatus.FAILED,
        ):
            turn.wrote(seq)
            return fresh
        return None

    async def _await_live(
        self, seq: int, call: StepCall, cp: Checkpoint, *, send: bool
    ) -> Checkpoint:
        """Await a step with a ``timeout`` in memory; return its settled checkpoint."""
        turn, services = self._env.turn, self._env.services
        assert call.timeout_ms is not None
        step_id = f"{self._env.run_id}:{seq}"
        with services.steps.live(step_id) as waiter:
            if send and not await self._send(seq, call, cp):
                return cp  # not out: the caller parks until it is due again
            sent_at = cp.dispatched_at or services.clock.now_ms()
            first_window = call.pickup_ms if call.pickup_ms is not None else call.timeout_ms
            with turn.in_flight():
                seen = 0  # the newest beat persisted by someone else that we saw
                while True:
                    if waiter.result is not None:
                        turn.wrote(seq)  # the receiver settled it in the store
                        return self._settled(seq, call, cp, waiter)
                    if waiter.recheck:
                        fresh = await self._recheck(seq, waiter)
                        if fresh is not None:
                            return fresh
                    heard = waiter.heard_at or 0
                    if seen > heard:
                        # A beat we did not hear: allow one persist-throttle of
                        # extra silence, since the newest beat may be that much
                        # newer than the persisted one.
                        deadline = seen + call.timeout_ms + services.steps.heartbeat_throttle_ms
                    elif heard:
                        deadline = heard + call.timeout_ms
                    else:
                        deadline = sent_at + first_window
                    now = services.clock.now_ms()
                    if deadline > now:
                        await self._wait_change(waiter, (deadline - now) / 1000)
                        turn.ensure_open()
                        continue
                    # The window ran out here: the store may know better (a
                    # result or beat another instance consumed).
                    with turn.store_calls:
                        fresh = await services.store.get_checkpoint(self._env.run_id, seq)
                    turn.ensure_open()
                    if fresh is not None and fresh.status in (
                        CheckpointStatus.COMPLETED,
                        CheckpointStatus.FAILED,
                    ):
                        turn.wrote(seq)  # settled by whoever received the result
                        return fresh
                    persisted = fresh.last_heartbeat_at if fresh is not None else None
                    if persisted is not None and persisted > max(seen, heard):
                        seen = persisted
                        continue
                    if heard or seen:
                        what = f"sent no heartbeat for {call.timeout_ms} ms"
                    else:
                        # No beat ever: the task waited in the queue, and an
                        # operator must look for a missing worker, not a hung one.
                        what = f"was not picked up within {first_window} ms"
                    silent = {
                        "message": f"step {call.name!r} {what} (attempt {cp.attempts})",
                        "code": "remote_step_timeout",
                        "retryable": True,
                    }
                    failed = self._step_checkpoint(
                        seq,
                        call,
                        attempts=cp.attempts,
                        status=CheckpointStatus.FAILED,
                        error=silent,
                        started_at=cp.started_at,
                        queue=cp.queue,
                    )
                    await self._env.save(failed)
                    return failed

    async def _wait_change(self, waiter: LiveStep, seconds: float) -> None:
        waiter.changed.clear()
        changed = asyncio.ensure_future(waiter.changed.wait())
        timer = asyncio.ensure_future(self._env.clock.sleep(seconds))
        try:
            await asyncio.wait({changed, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            timer.cancel()

    def _settled(self, seq: int, call: StepCall, cp: Checkpoint, waiter: LiveStep) -> Checkpoint:
        result = waiter.result
        assert result is not None
        # The receiver already wrote this to the store; mirror it for replay.
        return self._step_checkpoint(
            seq,
            call,
            attempts=cp.attempts,
            status=CheckpointStatus.COMPLETED if result.ok else CheckpointStatus.FAILED,
            output=result.output if result.ok else None,
            error=None if result.ok else (result.error or {"message": "step failed"}),
            started_at=cp.started_at,
        )


def resolve_step(
    services: Services,
    step: StepRef[Any] | str,
    input: Any,
    fairness_key: str | None,
    context: Any,
    policy: Mapping[str, Any],
) -> tuple[StepCall, Decoder]:
    """A ``ctx.step`` call's options resolved against the step's registration
    and the engine's defaults, checked: the call, and the decoder of its result
    (the registered step's output type; JSON data for a step served elsewhere).
    Raises ``TypeError`` / ``ValueError`` for bad input, before anything runs."""
    definition: StepDefinition | None
    if isinstance(step, StepRef):
        name, definition = step.name, step.definition
    elif isinstance(step, str) and step:
        # A registered step's name was checked when it was registered.
        check_key(step, "step name")
        name, definition = step, services.steps.definition(step)
    else:
        raise TypeError("ctx.step takes a step reference or a non-empty step name")
    if fairness_key is not None:
        check_key(fairness_key, "fairness_key")
    priority: int | None
    if not policy:
        # The usual call: no option of its own, the registration's as they
        # are (nine lookups and conversions of nothing were a cost per step).
        priority = None
        if definition is not None:
            retry, timeout_ms = definition.retry, definition.timeout_ms
            pickup_ms, queue_name = definition.pickup_timeout_ms, definition.queue
        else:
            retry, timeout_ms, pickup_ms, queue_name = services.default_retry, None, None, None
    else:
        timeout, pickup_timeout = policy.get("timeout"), policy.get("pickup_timeout")
        queue, priority = policy.get("queue"), policy.get("priority")
        check_priority(priority, "step priority")
        base = definition.retry if definition is not None else services.default_retry
        retry = RetryPolicy.build(
            policy.get("retries"),
            policy.get("backoff"),
            policy.get("backoff_base"),
            policy.get("backoff_max"),
            policy.get("jitter"),
            default=base,
        )
        timeout_ms = (
            to_ms(timeout, name="step timeout")
            if timeout is not None
            else (definition.timeout_ms if definition else None)
        )
        pickup_ms = (
            to_ms(pickup_timeout, name="pickup timeout")
            if pickup_timeout is not None
            else (definition.pickup_timeout_ms if definition else None)
        )
        queue_name = queue if queue is not None else (definition.queue if definition else None)
    if queue_name is not None and services.steps.queue(queue_name) is None:
        raise ValueError(f"ctx.step: queue {queue_name!r} is not registered on this engine")
    try:
        payload = codec.to_jsonable(input, f"the input of step {name!r}")
    except (TypeError, ValueError) as exc:
        raise TypeError(f"step {name!r}: input cannot be sent as JSON: {exc}") from exc
    call = StepCall(
        name=name,
        input=payload,
        policy=retry,
        timeout_ms=timeout_ms,
        pickup_ms=pickup_ms,
        queue=queue_name,
        priority=priority
        if priority is not None
        else ((definition and definition.priority) or None),
        fairness_key=fairness_key,
        context=context,
        requires=definition.requires if definition is not None else frozenset(),
    )
    decode = definition.typed_output.decode if definition is not None else identity
    return call, decode
