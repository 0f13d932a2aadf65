"""Where a run meets the outside world by name: values it publishes, webhooks,
external tasks and breakpoints.

Each is built on a recorded position plus, where something is awaited, an
ordinary signal wait, so delivery, buffering, timeouts and crashes behave
exactly as for ``wait_for_signal``. What is new is the *token*: the handle an
outsider uses to reach one position of one run.

A token names its run and position (``kind:secret:seq:run_id``), so the engine
can check it against the recorded position before delivering anything: a token
that is malformed, forged or stale is refused instead of being buffered as a
signal nobody will ever take. Webhook and task tokens carry a random secret
compared in constant time; a breakpoint token needs none (only
``engine.resume`` builds it).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .. import _codec as codec
from .._attributes import to_jsonable as attribute_json
from .._names import MAX_NAME_LENGTH
from .._replay import error_info
from ..errors import FatalError, StepFailed
from ..model import Checkpoint, CheckpointKind, CheckpointStatus
from .env import TurnEnv

__all__ = [
    "BREAKPOINT_PREFIX",
    "TASK_FAILED",
    "TASK_RESULT",
    "Token",
    "breakpoint_token",
    "make_token",
    "parse_token",
    "record_attributes",
    "record_value",
    "task",
    "task_outcome",
    "webhook_token",
]

WEBHOOK, TASK, BREAKPOINT = "wh", "task", "bp"

BREAKPOINT_PREFIX = "breakpoint:"
"""How the pending wait of ``ctx.breakpoint(label)`` is named in history."""

TASK_RESULT = "$durably.task.result"
"""The key of a completed task's result in the payload ``complete_task`` sends."""
TASK_FAILED = "$durably.task.failed"
"""The key of a failed task's error in the payload ``fail_task`` sends."""


@dataclass(frozen=True, slots=True)
class Token:
    """A parsed token: which run, which position, and the secret it must match."""

    kind: str
    secret: str
    seq: int
    run_id: str
    text: str


def make_token(kind: str, seq: int, run_id: str, secret: str = "") -> str:
    """The token of position ``seq`` of ``run_id`` (``ValueError`` if no store could key it)."""
    text = f"{kind}:{secret}:{seq}:{run_id}"
    if len(text) > MAX_NAME_LENGTH:
        # The token is a signal token, bounded like every stored key; the run id
        # is in it so a forged token can be refused by reading one checkpoint.
        raise ValueError(
            f"run id {run_id[:40]!r}… is too long for a {kind} token "
            f"(a token is at most {MAX_NAME_LENGTH} characters; keep run ids under 200)"
        )
    return text


def parse_token(text: Any, kind: str) -> Token | None:
    """``text`` as a token of ``kind``, or ``None`` if it cannot be one."""
    if not isinstance(text, str) or len(text) > MAX_NAME_LENGTH:
        return None
    parts = text.split(":", 3)
    if len(parts) != 4 or parts[0] != kind or not parts[2].isdigit() or not parts[3]:
        return None
    return Token(kind, parts[1], int(parts[2]), parts[3], text)


def webhook_token(seq: int, run_id: str) -> str:
    """A fresh webhook token for position ``seq`` (its secret: 128 random bits)."""
    return make_token(WEBHOOK, seq, run_id, secrets.token_urlsafe(16))


def breakpoint_token(seq: int, run_id: str) -> str:
    """The signal token a breakpoint at ``seq`` waits on."""
    return make_token(BREAKPOINT, seq, run_id)


def record_value(env: TurnEnv, seq: int, key: str, value: Any, recorded: Checkpoint | None) -> None:
    """Record ``value`` under ``key`` at ``seq`` (written with the turn's next flush)."""
    if recorded is not None or env.turn.unwinding:
        # Replayed: the value is already there. Unwinding records nothing new.
        return
    now = env.clock.now_ms()
    env.save_later(
        env.checkpoint(
            seq,
            key,
            CheckpointKind.VALUE,
            CheckpointStatus.COMPLETED,
            output=value,
            attempts=1,
            started_at=now,
            finished_at=now,
        )
    )


def record_attributes(
    env: TurnEnv, seq: int, attributes: dict[str, Any], recorded: Checkpoint | None
) -> None:
    """Merge checked search ``attributes`` into the run's, recorded at ``seq``.

    The checkpoint and the index rows are one store transaction (written with
    the turn's next flush): a crash leaves both or neither, and a replay,
    finding the checkpoint, writes nothing again.
    """
    if recorded is not None or env.turn.unwinding:
        return
    now = env.clock.now_ms()
    checkpoint = env.checkpoint(
        seq,
        "attributes",
        CheckpointKind.ATTRIBUTES,
        CheckpointStatus.COMPLETED,
        output=attribute_json(attributes),
        attempts=1,
        started_at=now,
        finished_at=now,
    )
    env.turn.write_later(
        env.store.upsert_attributes(checkpoint, attributes, env.turn.owner), ordered=False
    )
    env.turn.wrote(seq, checkpoint)


async def new_webhook(env: TurnEnv, seq: int, name: str, recorded: Checkpoint | None) -> str:
    """The webhook token recorded at ``seq``, made once.

    Its write is awaited: the body may hand the URL out at once, and a post
    that arrives before the token is stored would be refused as unknown.
    """
    if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
        return str(recorded.output)
    turn = env.turn
    if turn.unwinding:
        return await turn.park(seq, None, reconcile=False)  # type: ignore[no-any-return]
    token = webhook_token(seq, env.run_id)
    now = env.clock.now_ms()
    with turn.in_flight():
        await env.save(
            env.checkpoint(
                seq,
                name,
                CheckpointKind.WEBHOOK,
                CheckpointStatus.COMPLETED,
                output=token,
                attempts=1,
                started_at=now,
                finished_at=now,
            )
        )
    return token


async def task(
    env: TurnEnv,
    seq: int,
    name: str,
    dispatch: Callable[..., Any],
    args: tuple[Any, ...],
    recorded: Checkpoint | None,
    wait: Callable[[str], Awaitable[Any]],
) -> Any:
    """Dispatch an external task once, then wait for its completion by token.

    The token is written (as a ``running`` checkpoint, awaited) *before*
    ``dispatch`` runs, so a crash between the dispatch and its record re-runs
    the dispatch with the same token: the outside system sees one task, maybe
    announced twice, never two tasks of which one can no longer complete.
    """
    turn = env.turn
    if recorded is not None and recorded.status is CheckpointStatus.FAILED:
        raise StepFailed.from_error(name, recorded.error, recorded.attempts)
    if recorded is not None and recorded.status is CheckpointStatus.COMPLETED:
        token = str(recorded.input["token"])
    elif turn.unwinding:
        return await turn.park(seq, None, reconcile=False)
    else:
        if recorded is not None and isinstance(recorded.input, dict):
            token = str(recorded.input["token"])
        else:
            token = make_token(TASK, seq, env.run_id, secrets.token_urlsafe(16))
        now = env.clock.now_ms()
        stored = {"token": token}
        with turn.in_flight():
            if recorded is None:
                await env.save(
                    env.checkpoint(
                        seq,
                        name,
                        CheckpointKind.TASK,
                        CheckpointStatus.RUNNING,
                        input=stored,
                        attempts=1,
                        started_at=now,
                    )
                )
            try:
                dispatched = await env.call(dispatch, (token, *args))
                value = codec.to_jsonable(dispatched, f"the dispatch result of task {name!r}")
            except Exception as exc:
                # Recorded, so a replay raises the same failure instead of
                # dispatching again behind the body's back.
                error = error_info(exc)
                env.save_later(
                    env.checkpoint(
                        seq,
                        name,
                        CheckpointKind.TASK,
                        CheckpointStatus.FAILED,
                        input=stored,
                        error=error,
                        attempts=1,
                        started_at=recorded.started_at if recorded else now,
                        finished_at=env.clock.now_ms(),
                    )
                )
                raise StepFailed.from_error(name, error, 1) from exc
            env.save_later(
                env.checkpoint(
                    seq,
                    name,
                    CheckpointKind.TASK,
                    CheckpointStatus.COMPLETED,
                    input=stored,
                    output=value,
                    attempts=1,
                    started_at=recorded.started_at if recorded else now,
                    finished_at=env.clock.now_ms(),
                )
            )
    return task_outcome(name, await wait(token))


def task_outcome(name: str, payload: Any) -> Any:
    """What ``ctx.task`` returns for the payload its token received (or raises)."""
    if isinstance(payload, dict):
        if TASK_FAILED in payload:
            error = payload[TASK_FAILED] if isinstance(payload[TASK_FAILED], dict) else {}
            raise FatalError(
                str(error.get("message") or f"task {name!r} failed"),
                code=error.get("code"),
                details=error.get("details"),
            )
        if TASK_RESULT in payload:
            return payload[TASK_RESULT]
    # A plain ``engine.signal`` to the token: its payload is the result.
    return payload
