"""``WorkflowContext``: the operations a workflow body uses for everything
that is not pure computation.

Each public method is a plain (non-async) function that checks its
arguments, takes the operation's position at call time and returns an
awaitable; see :mod:`durably._replay` for why. An operation whose checkpoint
is completed returns the recorded value without executing anything. The
operations themselves live in :mod:`durably._ops`, one module per family.
"""

from __future__ import annotations

import inspect
import random as _random
import uuid as _uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar, Unpack, overload
from urllib.parse import quote

from . import _codec as codec
from ._attributes import check_attributes
from ._names import check_name as check_key
from ._names import check_priority, check_token
from ._ops.boundaries import (
    BREAKPOINT_PREFIX,
    breakpoint_token,
    new_webhook,
    record_attributes,
    record_value,
    task,
)
from ._ops.entities import (
    ENTITY_PREFIX,
    call_update_id,
    check_entity_key,
    check_entity_name,
    check_op,
)
from ._ops.env import Services, TurnEnv
from ._ops.fan import ChildCall, ChildHandle, ChildStarts, Settled, gather
from ._ops.local_step import local_step, recorded_value
from ._ops.saga import Saga, Undo
from ._ops.step import StepRunner, resolve_step
from ._ops.transaction import transaction
from ._ops.updates import Handler, TurnUpdates, check_update_name
from ._ops.waits import (
    EventBatch,
    check_batch,
    check_match,
    check_name,
    timer,
    wait_for_event,
    wait_for_events,
    wait_for_signal,
)
from ._replay import Turn
from ._typed import Decoder, check_declared, identity, output_type_of, typed_for
from .durations import Duration, to_ms
from .errors import NondeterminismError, _ContinueAsNew
from .model import Checkpoint, CheckpointKind, CheckpointStatus
from .retry import RetryPolicy
from .steps import StepPolicy, StepRef
from .steps.definition import check_policy
from .stores.base import TransactionStore

__all__ = ["ChildCall", "ChildHandle", "Settled", "Webhook", "WorkflowContext"]

T = TypeVar("T")


class Webhook:
    """A webhook made by :meth:`WorkflowContext.webhook`: its token, its URL, and the wait."""

    __slots__ = ("_wait", "token", "url")

    def __init__(
        self, token: str, url: str | None, wait: Callable[[str, Duration | None], Awaitable[Any]]
    ) -> None:
        self.token = token
        """The secret that addresses this webhook (``engine.deliver_webhook(token, body)``)."""
        self.url = url
        """``webhook_base_url`` + ``/`` + the token, when the engine has a base URL."""
        self._wait = wait

    def wait(self, *, timeout: Duration | None = None) -> Awaitable[Any]:
        """Wait for a body posted to this webhook and return it.

        Each posted body is received by one wait; a body posted while nobody
        waits is buffered for the next. With ``timeout`` the await raises
        :class:`SignalTimeout` once it passes.
        """
        return self._wait(self.token, timeout)

    def __repr__(self) -> str:
        # The token is a secret: keep it out of logs and tracebacks.
        return f"Webhook(url={'…' if self.url else None})"


class WorkflowContext:
    """The handle a workflow body receives as its first argument.

    All I/O, time and randomness in a body must go through it; everything it
    returns is recorded, so a replay after a crash sees the same values.
    """

    def __init__(self, turn: Turn, services: Services, saga: Saga | None = None) -> None:
        self._turn = turn
        self._env = TurnEnv(turn, services)
        self._saga = Saga() if saga is None else saga
        self._starts = ChildStarts(self._env)
        self._updates = TurnUpdates(self._env)
        self.log = self._env.log
        """A logger that tags every record with the run id and workflow."""

    @property
    def _updates_idle(self) -> bool:
        """Whether this body uses no updates (internal: a kept turn resumes only then)."""
        return self._updates.idle

    # -- identity ------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """This run's id."""
        return self._turn.run.run_id

    @property
    def workflow(self) -> str:
        """The workflow's registered name."""
        return self._turn.run.workflow

    @property
    def version(self) -> str:
        """The workflow version this run is pinned to."""
        return self._turn.run.workflow_version

    @property
    def attempt(self) -> int:
        """1 on the first execution; +1 for every crash recovery of this run."""
        return self._turn.run.recovery_attempts + 1

    # -- steps ---------------------------------------------------------------------------

    def local_step(
        self,
        name: str,
        fn: Callable[..., T | Awaitable[T]],
        *args: Any,
        retries: int | None = None,
        backoff: str | None = None,
        backoff_base: Duration | None = None,
        backoff_max: Duration | None = None,
        jitter: bool | None = None,
        track_start: bool | None = None,
        compensate: Callable[..., Any] | None = None,
        compensation_retries: int | None = None,
        output: Any = None,
    ) -> Awaitable[T]:
        """Run ``fn(*args)`` in this process and checkpoint its result.

        ``fn`` may be a coroutine function or a plain function (run in a worker
        thread so it cannot block the event loop). Its return value is stored
        as JSON (see docs/workflows.md, "Typed values") and handed back decoded
        into ``output`` or else ``fn``'s return annotation (a pydantic model,
        dataclass, ``datetime``, ``Decimal``...), the same on the first run
        and on replay; a result that does not fit fails the step (not retried).

        On failure it is retried ``retries`` more times (default 0) with
        ``backoff`` ``"exp"`` (default), ``"linear"`` or ``"fixed"`` from
        ``backoff_base`` (default 1 s) capped at ``backoff_max`` (default 60 s),
        with ``jitter``. A :class:`FatalError` is never retried. When attempts
        run out the await raises :class:`StepFailed`.

        With ``track_start`` (the engine default) each attempt records a
        ``running`` checkpoint, so history shows a step that is running or was
        interrupted by a crash (it is re-run on replay). When the turn must
        first make earlier results durable or prove a lease taken more than
        half a lease ago, that write is awaited before ``fn`` runs; otherwise
        it goes out while ``fn`` runs, and a quick step's result supersedes it
        in the same commit.

        ``compensate(output)`` registers an undo (a saga step): if the run
        later fails, or is cancelled with ``compensate=True``, the undos of the
        completed steps run in reverse order, each exactly once even across
        crashes; a failing undo is retried ``compensation_retries`` times
        (default: the engine's, 2), then skipped and logged.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("a local step needs a non-empty name")
        check_key(name, "step name")
        if not callable(fn):
            raise TypeError(f"local step {name!r}: {fn!r} is not callable")
        policy = RetryPolicy.build(
            retries,
            backoff,
            backoff_base,
            backoff_max,
            jitter,
            default=self._env.services.default_retry,
        )
        if compensate is not None and not callable(compensate):
            raise TypeError(f"local step {name!r}: compensate must be callable")
        undo = self._saga.local_undo(self._env.services, name, compensate, compensation_retries)
        track = self._env.services.track_start if track_start is None else track_start
        if output is not None:
            check_declared(output, f"local step {name!r}")
        typed = typed_for(output_type_of(fn, output), f"the result of step {name!r}")
        seq, recorded = self._turn.allocate(name, CheckpointKind.LOCAL)
        step = self._gated(
            local_step(self._env, seq, name, fn, args, policy, track, recorded, typed), seq
        )
        if undo is None:
            return step
        return self._saga.with_undo(seq, name, undo, step)

    def transaction(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retries: int | None = None,
        backoff: str | None = None,
        backoff_base: Duration | None = None,
        backoff_max: Duration | None = None,
        jitter: bool | None = None,
    ) -> Awaitable[Any]:
        """Run ``fn(connection, *args)`` inside the store's own database transaction,
        the one that records this step's result: exactly once for writes to your
        own tables in the same database.

        On PostgreSQL ``fn`` is an ``async`` function given an asyncpg
        connection; on SQLite a plain function given a ``sqlite3.Connection``
        (it runs on the store's writer thread: keep it short). Do not commit or
        roll back yourself. If ``fn`` raises, its writes are rolled back with
        the checkpoint and the step is retried like a local step (``retries``,
        ``backoff``…); a :class:`FatalError` is never retried. A crash at any
        point leaves both the writes and the checkpoint, or neither. Refused on
        ``memory://``, which has no database to share.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("a transaction needs a non-empty name")
        check_key(name, "transaction name")
        if not callable(fn):
            raise TypeError(f"transaction {name!r}: {fn!r} is not callable")
        store = self._env.store
        if not isinstance(store, TransactionStore):
            raise TypeError(
                f"transaction {name!r}: ctx.transaction needs a SQL store (sqlite:// or "
                f"postgresql://) whose database your writes share; {type(store).__name__} has none"
            )
        if store.async_transactions != inspect.iscoroutinefunction(fn):
            wanted = (
                "an async function taking an asyncpg connection"
                if store.async_transactions
                else "a plain (sync) function taking a sqlite3.Connection"
            )
            raise TypeError(f"transaction {name!r}: on {type(store).__name__} fn must be {wanted}")
        policy = RetryPolicy.build(
            retries,
            backoff,
            backoff_base,
            backoff_max,
            jitter,
            default=self._env.services.default_retry,
        )
        seq, recorded = self._turn.allocate(name, CheckpointKind.TRANSACTION)
        return self._gated(
            transaction(self._env, store, seq, name, fn, args, policy, recorded), seq
        )

    def side_effect(self, fn: Callable[..., T | Awaitable[T]], *args: Any) -> Awaitable[T]:
        """Run ``fn(*args)`` once and record its value (no retries, no running checkpoint).

        For cheap non-deterministic reads (a feature flag, a config value) whose
        value the rest of the run must see consistently. The value comes back
        as ``fn``'s return annotation, as :meth:`local_step`'s does.
        """
        if not callable(fn):
            raise TypeError(f"side_effect: {fn!r} is not callable")
        typed = typed_for(output_type_of(fn), "the value of side_effect")
        seq, recorded = self._turn.allocate("side_effect", CheckpointKind.SIDE_EFFECT)

        env = self._env

        async def compute() -> Any:
            await env.turn.flush()  # earlier results are durable before the effect
            return await env.call(fn, args)

        return recorded_value(
            env, seq, "side_effect", CheckpointKind.SIDE_EFFECT, recorded, compute, typed
        )

    @overload
    def step(
        self,
        step: StepRef[T],
        input: Any = None,
        *,
        fairness_key: str | None = None,
        context: Any = None,
        output: None = None,
        compensate: Undo | None = None,
        compensation_retries: int | None = None,
        **policy: Unpack[StepPolicy],
    ) -> Awaitable[T]: ...
    @overload
    def step(
        self,
        step: StepRef[Any] | str,
        input: Any = None,
        *,
        fairness_key: str | None = None,
        context: Any = None,
        output: Any = None,
        compensate: Undo | None = None,
        compensation_retries: int | None = None,
        **policy: Unpack[StepPolicy],
    ) -> Awaitable[Any]: ...
    def step(
        self,
        step: StepRef[Any] | str,
        input: Any = None,
        *,
        fairness_key: str | None = None,
        context: Any = None,
        output: Any = None,
        compensate: Undo | None = None,
        compensation_retries: int | None = None,
        **policy: Unpack[StepPolicy],
    ) -> Awaitable[Any]:
        """Dispatch a step by name to whichever worker serves it and return its result.

        ``step`` is what ``@engine.step`` returned, or a step name served by
        another process or language. Options override the step's registered
        policy for this call (the policy keywords are those of
        :class:`~durably.steps.StepPolicy`, each ``None`` by default: not set).

        Without ``timeout`` the run suspends durably while the task is out:
        nothing is held in memory, and whichever instance receives the result
        resumes the run. With ``timeout`` this process awaits the result and
        fails the attempt after ``timeout`` of silence (no heartbeat);
        ``pickup_timeout`` bounds the wait for the worker's first beat.

        A failed attempt is retried ``retries`` more times after a durable
        backoff timer, unless the worker raised :class:`FatalError`. When
        attempts run out the await raises :class:`StepFailed` with the
        worker's code and details.

        With ``queue`` (a name given to ``engine.register_queue``) the step
        first needs a slot there: a step not admitted suspends and asks again,
        ``priority`` first, round-robin across ``fairness_key`` (default: the
        run id).

        The result comes back decoded into ``output``, else the registered
        step's output type (its ``output=`` or its handler's return
        annotation); a step served elsewhere, with neither, returns JSON data.

        ``compensate`` registers an undo (a saga step) run if the run later
        fails or is cancelled with ``compensate=True``: a function called
        with the step's output, or a step (reference or name) dispatched
        like this one with ``{"input": <this input>, "output": <its output>}``
        and checkpointed, so an unwind interrupted by a crash never runs a
        finished undo again. An undo that fails is retried
        ``compensation_retries`` times (default: the engine's, 2), then
        skipped and logged; the run's own error stays its error.
        """
        check_policy("WorkflowContext.step", policy)
        call, decode = resolve_step(self._env.services, step, input, fairness_key, context, policy)
        if output is not None:
            check_declared(output, f"ctx.step {call.name!r}")
            decode = typed_for(output, f"the result of step {call.name!r}").decode
        undo = self._saga.undo_for(self._env.services, call, compensate, compensation_retries)
        seq, recorded = self._turn.allocate(call.name, CheckpointKind.STEP)
        runner = StepRunner(self._env)
        result = self._gated(
            self._turn.resumable_at(seq, recorded, lambda cp: runner.run(seq, call, cp)), seq
        )
        if undo is not None:
            return self._saga.with_undo(seq, call.name, undo, result, decode, call.input)
        return result if decode is identity else _decoded(result, decode)

    # -- deterministic sources -----------------------------------------------------------

    def now(self) -> Awaitable[datetime]:
        """The current time (UTC), recorded on first execution and replayed verbatim."""
        seq, recorded = self._turn.allocate("now", CheckpointKind.NOW)

        env = self._env

        async def read() -> int:
            return env.clock.now_ms()

        async def as_datetime() -> datetime:
            ms = await recorded_value(env, seq, "now", CheckpointKind.NOW, recorded, read)
            return datetime.fromtimestamp(ms / 1000, tz=UTC)

        return as_datetime()

    def uuid(self) -> Awaitable[_uuid.UUID]:
        """A random UUID4, recorded so replay returns the same one."""
        seq, recorded = self._turn.allocate("uuid", CheckpointKind.UUID)
        env = self._env

        async def make() -> str:
            return str(_uuid.uuid4())

        async def as_uuid() -> _uuid.UUID:
            return _uuid.UUID(
                await recorded_value(env, seq, "uuid", CheckpointKind.UUID, recorded, make)
            )

        return as_uuid()

    def random(self) -> Awaitable[float]:
        """A random float in [0, 1), recorded so replay returns the same one."""
        seq, recorded = self._turn.allocate("random", CheckpointKind.RANDOM)

        async def make() -> float:
            return _random.random()

        return recorded_value(self._env, seq, "random", CheckpointKind.RANDOM, recorded, make)

    # -- waiting -------------------------------------------------------------------------

    def sleep(self, duration: Duration) -> Awaitable[None]:
        """Wait durably: the run suspends and any instance wakes it when due.

        The wake time is fixed when the sleep first executes, so a replay does
        not restart the countdown.
        """
        ms = to_ms(duration, name="sleep duration")
        seq, recorded = self._turn.allocate("sleep", CheckpointKind.SLEEP)
        return self._gated(self._timer(seq, recorded, lambda now: now + ms), seq)

    def sleep_until(self, when: datetime | int | float) -> Awaitable[None]:
        """Wait durably until ``when`` (an aware ``datetime`` or epoch seconds)."""
        if isinstance(when, datetime):
            if when.tzinfo is None:
                raise ValueError("sleep_until needs a timezone-aware datetime")
            target = int(when.timestamp() * 1000)
        elif isinstance(when, int | float) and not isinstance(when, bool):
            target = int(when * 1000)
        else:
            raise TypeError("sleep_until takes an aware datetime or epoch seconds")
        seq, recorded = self._turn.allocate("sleep", CheckpointKind.SLEEP)
        return self._gated(self._timer(seq, recorded, lambda _now: target), seq)

    def _timer(
        self, seq: int, recorded: Checkpoint | None, wake_time: Callable[[int], int]
    ) -> Awaitable[None]:
        env = self._env
        return self._turn.resumable_at(seq, recorded, lambda cp: timer(env, seq, cp, wake_time))

    def wait_for_signal(self, token: str, *, timeout: Duration | None = None) -> Awaitable[Any]:
        """Wait for ``engine.signal(token, payload)`` and return the payload.

        A signal sent before the wait begins is buffered (for the engine's
        ``buffer_ttl``) and consumed here. A token names one wait: build it
        from the run id (``f"approve:{ctx.run_id}"``), never reuse it across runs.
        With ``timeout`` the await raises :class:`SignalTimeout` once it passes.
        Several waits may share a token: each signal is delivered to exactly
        one of them, the one registered first (oldest first), and a signal
        sent while nobody waits is buffered for the next wait. A wait that
        times out, or whose run ends, leaves the line without disturbing the
        others.
        """
        check_token(token)
        timeout_ms = None if timeout is None else to_ms(timeout, name="signal timeout")
        name = f"signal:{token}"
        seq, recorded = self._turn.allocate(name, CheckpointKind.SIGNAL)
        return self._gated(wait_for_signal(self._env, seq, name, token, timeout_ms, recorded), seq)

    def wait_for_event(
        self,
        name: str,
        *,
        match: Mapping[str, Any] | None = None,
        timeout: Duration | None = None,
    ) -> Awaitable[Any]:
        """Wait for ``engine.publish_event(name, payload)`` and return the payload.

        With ``match`` only a payload holding each of its top-level keys with
        an equal JSON value is taken (``match={"order_id": 42}``). Every run
        waiting on a matching event receives it; an event published while
        nobody waited is buffered and taken by the first matching wait. With
        ``timeout`` the await raises :class:`EventTimeout` once it passes.
        """
        check_name(name)
        clean = check_match(match)
        timeout_ms = None if timeout is None else to_ms(timeout, name="event timeout")
        label = f"event:{name}"
        seq, recorded = self._turn.allocate(label, CheckpointKind.EVENT)
        return self._gated(
            wait_for_event(self._env, seq, label, name, clean, timeout_ms, recorded), seq
        )

    def wait_for_events(
        self,
        name: str,
        *,
        max_items: int,
        window: Duration,
        match: Mapping[str, Any] | None = None,
        timeout: Duration | None = None,
    ) -> Awaitable[list[Any]]:
        """Collect a batch of ``name`` events and return their payloads, in arrival order.

        Waits for a first event (as :meth:`wait_for_event`, with ``match``;
        with ``timeout`` raises :class:`EventTimeout` if none comes), then
        keeps taking events until ``max_items`` (1 to 1000) were taken or
        ``window`` passed since the first was taken, whichever comes first:
        the window is fixed from the first event, not restarted by each
        (``window=0``: only those already buffered). Every event taken is
        recorded, so a replay returns the same list.
        """
        check_name(name)
        clean = check_match(match)
        window_ms = to_ms(window, name="event window")
        count = check_batch(max_items, window_ms)
        timeout_ms = None if timeout is None else to_ms(timeout, name="event timeout")
        label = f"events:{name}"
        turn = self._turn
        first = turn.allocate(label, CheckpointKind.EVENT)
        opened = turn.allocate(f"{label}:window", CheckpointKind.NOW)
        rest = [turn.allocate(label, CheckpointKind.EVENT) for _ in range(count - 1)]
        batch = EventBatch(label, first, opened, rest)
        return self._gated(
            wait_for_events(self._env, batch, name, clean, window_ms, timeout_ms),
            first[0],
            opened[0],
            *(seq for seq, _ in rest),
        )

    # -- the outside world ---------------------------------------------------------------

    def set_value(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key`` for ``engine.get_value(run_id, key)``.

        Recorded in history (the last write wins) and readable while the run
        waits and after it ended; reading it has no effect on the run. Not
        awaited: it is written with the run's next checkpoint write, at the
        latest when the turn ends.
        """
        if not isinstance(key, str) or not key:
            raise ValueError("ctx.set_value needs a non-empty key")
        name = f"value:{key}"
        check_key(name, "value key")
        stored = codec.to_jsonable(value, f"the value of {key!r}")
        seq, recorded = self._turn.allocate(name, CheckpointKind.VALUE)
        record_value(self._env, seq, name, stored, recorded)

    def upsert_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Merge ``attributes`` into the run's search attributes (key by key:
        a key given replaces its value, the others stay) for
        ``engine.list_runs(attributes=...)``.

        Values are str, int, float, bool or aware datetime; anything else
        raises :class:`TypeError` here. Recorded in history, so a replay does
        not write them again. Not awaited: written with the run's next
        checkpoint write, at the latest when the turn ends.
        """
        clean = check_attributes(
            dict(attributes) if isinstance(attributes, Mapping) else attributes
        )
        if not clean:
            return
        seq, recorded = self._turn.allocate("attributes", CheckpointKind.ATTRIBUTES)
        record_attributes(self._env, seq, clean, recorded)

    def webhook(self) -> Awaitable[Webhook]:
        """Make a webhook: an unguessable token (and a URL when the engine has a
        ``webhook_base_url``) that outsiders POST a JSON body to.

        ``body = await hook.wait(timeout="1d")`` returns a posted body; a body
        posted before the wait is buffered for it. Serve the posts with
        :func:`durably.webhooks.app`, or pass them to ``engine.deliver_webhook``
        from your own route. Treat the token as a secret.
        """
        seq, recorded = self._turn.allocate("webhook", CheckpointKind.WEBHOOK)
        token = new_webhook(self._env, seq, "webhook", recorded)
        base = self._env.services.webhook_base_url

        def wait(text: str, timeout: Duration | None) -> Awaitable[Any]:
            # Named without the token: it is a secret, and history is shown to operators.
            timeout_ms = None if timeout is None else to_ms(timeout, name="webhook timeout")
            wait_seq, wait_recorded = self._turn.allocate("webhook:wait", CheckpointKind.SIGNAL)
            return self._gated(
                wait_for_signal(
                    self._env, wait_seq, "webhook:wait", text, timeout_ms, wait_recorded
                ),
                wait_seq,
            )

        async def made() -> Webhook:
            text = await token
            url = None if base is None else f"{base.rstrip('/')}/{quote(text, safe='')}"
            return Webhook(text, url, wait)

        return made()

    def task(
        self,
        name: str,
        dispatch: Callable[..., Any],
        *args: Any,
        timeout: Duration | None = None,
    ) -> Awaitable[Any]:
        """Hand work to an outside system and wait until it reports back.

        ``dispatch(token, *args)`` (sync or async) runs once, with a secret
        completion token, and its return value is recorded; then the run
        waits, durably, until ``engine.complete_task(token, result)`` (the
        await returns ``result``) or ``engine.fail_task(token, message)`` (the
        await raises :class:`FatalError`). A duplicate completion is a no-op.
        After a crash during ``dispatch`` it runs again with the same token.
        With ``timeout`` the await raises :class:`SignalTimeout` once it passes.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("ctx.task needs a non-empty name")
        label = f"task:{name}"
        check_key(label, "task name")
        if not callable(dispatch):
            raise TypeError(f"task {name!r}: {dispatch!r} is not callable")
        timeout_ms = None if timeout is None else to_ms(timeout, name="task timeout")
        seq, recorded = self._turn.allocate(label, CheckpointKind.TASK)
        wait_seq, wait_recorded = self._turn.allocate(label, CheckpointKind.SIGNAL)
        env = self._env

        def wait(token: str) -> Awaitable[Any]:
            return wait_for_signal(env, wait_seq, label, token, timeout_ms, wait_recorded)

        return self._gated(task(env, seq, label, dispatch, args, recorded, wait), seq, wait_seq)

    def breakpoint(self, label: str = "breakpoint") -> Awaitable[None]:
        """Pause the run here until ``engine.resume(run_id)`` (``durably runs resume``).

        The run suspends durably, holding nothing; the pause shows in history
        as a pending ``breakpoint:<label>`` wait.
        """
        if not isinstance(label, str) or not label:
            raise ValueError("ctx.breakpoint needs a non-empty label")
        name = f"{BREAKPOINT_PREFIX}{label}"
        check_key(name, "breakpoint label")
        seq, recorded = self._turn.allocate(name, CheckpointKind.SIGNAL)
        token = breakpoint_token(seq, self.run_id)

        async def paused() -> None:
            await wait_for_signal(self._env, seq, name, token, None, recorded)

        return self._gated(paused(), seq)

    # -- composition ---------------------------------------------------------------------

    def child(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        priority: int | None = None,
    ) -> ChildCall:
        """Start ``workflow`` as a child run and wait for its output.

        The child's id is ``run_id`` or ``<this run>.child.<seq>``, the same on
        every replay, so it is started once. It runs in this run's namespace,
        at ``priority`` (default: this run's).
        Its output comes back decoded into the child workflow's output type
        when that workflow is registered here.
        The await raises :class:`ChildFailed` if the child fails, is
        cancelled, goes dead or cannot be started. With the ``run_id`` of a
        child this body started with :meth:`start_child`, it waits for that
        child instead of starting one.
        """
        if run_id is not None and (joined := self._starts.started(run_id)) is not None:
            # Started earlier by start_child: wait for that child, creating nothing.
            if joined.workflow != workflow:
                raise ValueError(
                    f"ctx.child: child {run_id!r} was started as {joined.workflow!r}, "
                    f"not {workflow!r}"
                )
            return joined
        return self._child_call("ctx.child", workflow, input, run_id, priority, False)

    def start_child(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        priority: int | None = None,
        detached: bool = False,
    ) -> ChildHandle:
        """Start ``workflow`` as a child run now and return a handle to join later.

        The child is created at this call (recorded at this position, so a
        replay never creates it twice), whether or not it is ever waited for.
        ``await handle.result()`` waits for its output as :meth:`child` does;
        a later ``ctx.child(..., run_id=handle.run_id)`` joins it too.
        When this run ends (completes, fails, is cancelled, continues as new)
        a child still running is cancelled, unless started ``detached=True``:
        a detached child outlives its parent, even its cancel.
        """
        if not isinstance(detached, bool):
            raise TypeError("ctx.start_child: detached must be True or False")
        if run_id is not None and self._starts.started(run_id) is not None:
            raise ValueError(f"ctx.start_child: child {run_id!r} was already started by this run")
        call = self._child_call("ctx.start_child", workflow, input, run_id, priority, detached)
        return self._starts.start(call)

    def _child_call(
        self,
        what: str,
        workflow: str,
        input: Any,
        run_id: str | None,
        priority: int | None,
        detached: bool,
    ) -> ChildCall:
        if not isinstance(workflow, str) or not workflow:
            raise ValueError(f"{what} needs a workflow name")
        check_key(workflow, "child workflow name")
        if run_id is not None:
            if not isinstance(run_id, str) or not run_id:
                raise ValueError(f"{what}: run_id must be a non-empty string")
            check_key(run_id, "child run_id")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ValueError(f"{what}: priority must be an int")
        check_priority(priority, "child priority")
        seq, recorded = self._turn.allocate(f"child:{workflow}", CheckpointKind.CHILD)
        if recorded is not None and isinstance(recorded.input, dict):
            child_id = str(recorded.input.get("run_id"))
        else:
            child_id = run_id or f"{self.run_id}.child.{seq}"
        if not detached and (recorded is None or recorded.status is CheckpointStatus.PENDING):
            self._turn.attached_children.add(child_id)
        decode = self._env.services.child_output(workflow)
        return ChildCall(
            self._env, seq, child_id, workflow, input, recorded, decode, priority, detached
        )

    def all(
        self, items: Iterable[Awaitable[Any]], *, fail_fast: bool = False
    ) -> Awaitable[list[Any]]:
        """Await many children and steps; return their values in input order.

        Children (:meth:`child`) are started together and cost one suspension,
        however many. If any item fails, :class:`GatherFailed` is raised once
        every item has finished (``fail_fast=True``: at the first failure,
        cancelling the children still running); it lists every failure.
        """
        return gather(self._env, list(items), settled=False, fail_fast=fail_fast)

    def all_settled(self, items: Iterable[Awaitable[Any]]) -> Awaitable[list[Settled]]:
        """Like :meth:`all`, but never raises for a failed item: returns one
        :class:`Settled` per item, in input order."""
        return gather(self._env, list(items), settled=True, fail_fast=False)

    def patched(self, patch_id: str) -> Awaitable[bool]:
        """Guard an in-place change to a workflow body.

        New runs record a marker here and get ``True`` (take the new code
        path). A run that already recorded another operation at this position
        started before the change: it gets ``False`` and its positions are
        left as they were.
        """
        if not isinstance(patch_id, str) or not patch_id:
            raise ValueError("ctx.patched needs a non-empty id")
        turn = self._turn
        turn.ensure_open()
        name = f"patch:{patch_id}"
        recorded = turn.checkpoints.get(turn.next_seq)
        if recorded is not None and recorded.kind != CheckpointKind.PATCH:
            return _resolved(False)
        if recorded is not None and recorded.name != name:
            raise turn.halt(
                NondeterminismError(
                    f"run {self.run_id!r}: position {turn.next_seq} holds {recorded.name!r}, "
                    f"but the workflow now asks for {name!r}",
                    seq=turn.next_seq,
                    history=(str(recorded.kind), recorded.name),
                    found=(str(CheckpointKind.PATCH), name),
                )
            )
        seq, recorded = turn.allocate(name, CheckpointKind.PATCH)
        if recorded is None:
            env = self._env
            now = env.clock.now_ms()
            env.save_later(
                env.checkpoint(
                    seq,
                    name,
                    CheckpointKind.PATCH,
                    CheckpointStatus.COMPLETED,
                    output=True,
                    started_at=now,
                    finished_at=now,
                )
            )
        return _resolved(True)

    # -- updates -------------------------------------------------------------------------

    def on_update(
        self,
        name: str,
        handler: Callable[[Any], Any],
        *,
        validator: Callable[[Any], Any] | None = None,
    ) -> None:
        """Handle ``engine.update(run_id, name, payload)`` with ``handler(payload)``.

        ``handler`` (sync or async) may change the workflow's own state and
        returns the update's result (JSON data). It runs while the body waits
        (every branch parked on a durable wait or :meth:`wait_condition`),
        never in the middle of body code, and is recorded in history so a
        replay applies it again at the same point: keep it deterministic and
        free of ``ctx`` calls (they are refused) and side effects. An update
        sent before this call waits in the run's inbox until it is made; one
        whose name is never registered waits until the run ends (then it is
        answered ``ended``). ``validator(payload)`` (sync or async) runs first
        and must not change state: raising or returning a string rejects the
        update with that reason, and nothing is recorded. A handler that raises
        answers ``failed``; the workflow goes on. Registering a name again
        replaces its handler.
        """
        check_update_name(name)
        if not callable(handler):
            raise TypeError(f"update {name!r}: handler {handler!r} is not callable")
        if validator is not None and not callable(validator):
            raise TypeError(f"update {name!r}: validator {validator!r} is not callable")
        self._turn.ensure_open()
        self._updates.register(name, Handler(handler, validator))

    def wait_condition(self, predicate: Callable[[], bool]) -> Awaitable[None]:
        """Wait until ``predicate()`` is true: checked now and again after every
        update handled (handlers are what change state while the body waits).

        Records nothing; the run suspends meanwhile, and an update wakes it.
        """
        if not callable(predicate):
            raise TypeError(f"wait_condition: {predicate!r} is not callable")
        self._turn.ensure_open()
        return self._updates.wait_condition(predicate)

    def call_entity(self, name: str, key: str, op: str, payload: Any = None) -> Awaitable[Any]:
        """Apply ``op`` to entity ``name``'s key ``key`` and return its reply
        (see ``Engine.call_entity``).

        Recorded like a local step: a replay returns the recorded reply, and a
        re-execution after a crash sends the same operation id, so it is
        applied once. A failed operation raises :class:`StepFailed` carrying
        the entity's error (never retried).
        """
        check_entity_name(name)
        check_entity_key(name, key)
        check_op(name, op)
        label = f"{ENTITY_PREFIX}{name}:{op}"
        check_key(label, "entity step name")
        call = self._env.services.entity_call
        if call is None:
            raise RuntimeError("ctx.call_entity needs an engine (entity_call is not wired)")
        update_id = call_update_id(self.run_id, self._turn.next_seq)

        async def apply() -> Any:
            return await call(name, key, op, payload, update_id=update_id)

        return self.local_step(label, apply, retries=0)

    def signal_entity(self, name: str, key: str, op: str, payload: Any = None) -> Awaitable[str]:
        """Send ``op`` to entity ``name``'s key ``key`` without waiting for its
        reply (see ``Engine.signal_entity``); recorded, and applied once even
        if a crash makes this step run again. Returns the operation's id."""
        check_entity_name(name)
        check_entity_key(name, key)
        check_op(name, op)
        label = f"{ENTITY_PREFIX}{name}:{op}:signal"
        check_key(label, "entity step name")
        send = self._env.services.entity_signal
        if send is None:
            raise RuntimeError("ctx.signal_entity needs an engine (entity_signal is not wired)")
        update_id = call_update_id(self.run_id, self._turn.next_seq)

        async def sent() -> str:
            return str(await send(name, key, op, payload, update_id=update_id))

        return self.local_step(label, sent, retries=0)

    def _gated(self, operation: Awaitable[T], *seqs: int) -> Awaitable[T]:
        """``operation``, held on a replay until the recorded updates handled
        while it was parked are applied again (see :mod:`durably._ops.updates`)."""
        gate = self._turn.gate(seqs)
        return operation if gate is None else _after(gate, operation)

    # -- control -------------------------------------------------------------------------

    def continue_as_new(self, input: Any) -> None:
        """End this run and continue as a fresh run (``<id>~N``) with ``input``.

        Raises a control-flow signal; code after it does not run.
        """
        raise _ContinueAsNew(codec.to_jsonable(input, "continue_as_new input"))


async def _after(gate: Awaitable[None], operation: Awaitable[T]) -> T:
    try:
        await gate
    except BaseException:
        if inspect.iscoroutine(operation):
            operation.close()  # never started: no "never awaited" warning
        raise
    return await operation


async def _resolved(value: bool) -> bool:
    return value


async def _decoded(result: Awaitable[Any], decode: Decoder) -> Any:
    return decode(await result)
