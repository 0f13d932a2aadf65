"""Entities (virtual objects): the run serving a key, and the caller's side
(``engine.call_entity``, ``signal_entity`` and ``get_entity_state``).

An entity key lives in one durable run, ``entity:<name>:<key>``, whose body
keeps the state in memory and registers one update handler per operation
(:mod:`durably._ops.updates`). Each operation is one update: serialized (a
run handles one update at a time), exactly once (deduplicated by update id),
and recorded as ``update:<op>`` whose output holds the new state and the
reply together — so a crash never separates them, and a replay rebuilds the
state. A handler that raises leaves the state as it was and answers
``failed``; the caller gets the error. After ``ops_per_run`` operations the
run continues as new with the state, so its history stays bounded; updates
not yet taken move to the next link.

A call creates the key's run on first use (idempotent by run id, so two
processes racing to create it converge on one), sends the operation as an
update to the chain's live link and waits for the answer
(:class:`~durably._update_calls.UpdateCalls`). The link last seen answering
is remembered per key, so a call does not walk the continue-as-new chain from
its first run each time; a call given its own ``update_id`` (a retry) does
walk it, so it finds the link that took the first attempt and is applied once.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from . import _codec as codec
from ._children import continued_to
from ._ops.entities import (
    EntityDef,
    EntityHandler,
    check_entity_key,
    check_entity_name,
    check_op,
    entity_run_id,
    entity_workflow,
)
from ._ops.updates import Handler
from ._update_calls import UpdateCalls
from .context import WorkflowContext
from .errors import EntityError
from .model import Checkpoint, CheckpointKind, CheckpointStatus, Run

__all__ = ["Entities", "entity_body"]

_LINKS_REMEMBERED = 10_000


class _Store(Protocol):
    async def get_run(self, run_id: str) -> Run | None: ...

    async def load_checkpoints(self, run_id: str) -> dict[int, Checkpoint]: ...


Start = Callable[..., Awaitable[Any]]
"""``start(workflow, input, run_id=...)``: the engine's idempotent start."""


class Entities:
    """Entity definitions registered here, and calls to any entity by name."""

    def __init__(self, store: _Store, updates: UpdateCalls, start: Start) -> None:
        self._store = store
        self._updates = updates
        self._start = start
        self.defined: dict[str, EntityDef] = {}
        self._links: dict[str, str] = {}
        self._creating: dict[str, asyncio.Future[None]] = {}

    def use_start(self, start: Start) -> None:
        """Create entity runs with ``start`` (a client's, which needs no registration)."""
        self._start = start

    def define(self, definition: EntityDef) -> None:
        """Remember ``definition`` (its workflow is registered by the engine)."""
        self.defined[definition.name] = definition

    async def call(
        self,
        name: str,
        key: str,
        op: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Apply ``op`` to the entity and return its reply (raises :class:`EntityError`)."""
        base, link = await self._link(name, key, op, fresh=update_id is not None)
        result = await self._updates.update(link, op, payload, update_id=update_id, timeout=timeout)
        self._remember(base, result.run_id)
        if result.accepted:
            answer = result.result if isinstance(result.result, dict) else {}
            return answer.get("reply")
        raise EntityError(name, key, op, result.outcome, result.reason or "", result.error)

    async def signal(
        self, name: str, key: str, op: str, payload: Any = None, *, update_id: str | None = None
    ) -> str:
        """Send ``op`` without waiting for its reply; return its update id.
        Applied exactly once however often it is sent with that id."""
        _, link = await self._link(name, key, op, fresh=update_id is not None)
        _, uid = await self._updates.send(link, op, payload, update_id)
        return uid

    async def state(self, name: str, key: str) -> Any:
        """The entity's state after the last operation applied (its initial
        state if none was, or ``None`` when it is not defined here)."""
        check_entity_name(name)
        check_entity_key(name, key)
        base = entity_run_id(name, key)
        definition = self.defined.get(name)
        initial = None if definition is None else definition.initial_state
        run_id = self._links.get(base, base)
        run = await self._store.get_run(run_id)
        if run is None and run_id != base:
            run_id, run = base, await self._store.get_run(base)
        if run is None:
            return copy.deepcopy(initial)
        while (follow := continued_to(run)) is not None:
            nxt = await self._store.get_run(follow)
            if nxt is None:
                break
            run_id, run = follow, nxt
        self._remember(base, run_id)
        history = await self._store.load_checkpoints(run_id)
        for _, checkpoint in sorted(history.items(), reverse=True):
            if (
                checkpoint.kind == CheckpointKind.UPDATE
                and checkpoint.status == CheckpointStatus.COMPLETED
                and isinstance(checkpoint.output, dict)
                and "state" in checkpoint.output
            ):
                return checkpoint.output["state"]
        if isinstance(run.input, dict) and "state" in run.input:
            return run.input["state"]
        return copy.deepcopy(initial)

    async def _link(self, name: str, key: str, op: str, *, fresh: bool) -> tuple[str, str]:
        """The key's first run (created if need be) and the link to send to."""
        check_entity_name(name)
        check_entity_key(name, key)
        check_op(name, op)
        definition = self.defined.get(name)
        if definition is not None and op not in definition.handlers:
            ops = ", ".join(sorted(definition.handlers))
            raise ValueError(f"entity {name!r} has no operation {op!r} (it has: {ops})")
        base = entity_run_id(name, key)
        if base not in self._links:
            await self._create(name, base, definition)
        # A retry (its own update id) walks the chain from the start, to the
        # link holding the first attempt: ``send`` stops where the id is.
        return base, base if fresh else self._links.get(base, base)

    async def _create(self, name: str, base: str, definition: EntityDef | None) -> None:
        creating = self._creating.get(base)
        if creating is not None:
            await asyncio.shield(creating)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._creating[base] = future
        try:
            if await self._store.get_run(base) is None:
                state = None if definition is None else {"state": definition.initial_state}
                await self._start(entity_workflow(name), state, run_id=base)
            self._remember(base, base)
            future.set_result(None)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: the concurrent callers re-raise it
            raise
        finally:
            del self._creating[base]

    def _remember(self, base: str, link: str) -> None:
        if base not in self._links and len(self._links) >= _LINKS_REMEMBERED:
            self._links.pop(next(iter(self._links)))
        known = self._links.get(base)
        if known is None or _link_number(link) >= _link_number(known):
            self._links[base] = link


def _link_number(run_id: str) -> int:
    _, sep, tail = run_id.rpartition("~")
    return int(tail) if sep and tail.isdigit() else 0


def entity_body(definition: EntityDef) -> Callable[[WorkflowContext, Any], Awaitable[None]]:
    """The workflow body serving one key's operations."""

    async def serve(ctx: WorkflowContext, input: Any = None) -> None:
        start = input.get("state") if isinstance(input, dict) else definition.initial_state
        box: dict[str, Any] = {"state": copy.deepcopy(start), "done": 0}
        for op, fn in definition.handlers.items():
            ctx.on_update(op, _operation(definition.name, op, fn, box))
        ctx._updates.fallback = Handler(_nothing, _unknown(definition))
        await ctx.wait_condition(lambda: box["done"] >= definition.ops_per_run)
        # History stays bounded: the state goes on in a fresh run.
        ctx.continue_as_new({"state": box["state"]})

    serve.__name__ = f"entity_{definition.name}"
    return serve


def _operation(
    entity: str, op: str, fn: EntityHandler, box: dict[str, Any]
) -> Callable[[Any], Awaitable[dict[str, Any]]]:
    async def apply(payload: Any) -> dict[str, Any]:
        try:
            # A copy: a handler that changes the state and then raises leaves
            # the entity's state as it was.
            outcome = fn(copy.deepcopy(box["state"]), payload)
            if inspect.isawaitable(outcome):
                outcome = await outcome
            if not isinstance(outcome, tuple) or len(outcome) != 2:
                raise TypeError(
                    f"entity {entity!r} op {op!r} must return (new_state, reply), "
                    f"not {type(outcome).__name__}"
                )
            state = codec.to_jsonable(outcome[0], f"the state of entity {entity!r}")
            reply = codec.to_jsonable(outcome[1], f"the reply of entity {entity!r} op {op!r}")
        finally:
            box["done"] += 1
        box["state"] = state
        # State and reply recorded together, in the update's history entry.
        return {"state": state, "reply": reply}

    return apply


def _nothing(_payload: Any) -> None:
    return None


def _unknown(definition: EntityDef) -> Callable[[Any], str]:
    ops = ", ".join(sorted(definition.handlers))

    def refuse(_payload: Any) -> str:
        return f"entity {definition.name!r} has no such operation (it has: {ops})"

    return refuse
