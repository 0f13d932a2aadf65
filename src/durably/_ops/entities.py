"""Entities: their names, the checks on them, and their definitions.

The body itself is in :mod:`durably._entities`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import _codec as codec
from .._names import check_name as check_key
from .updates import check_update_name

__all__ = [
    "ENTITY_PREFIX",
    "EntityDef",
    "EntityHandler",
    "call_update_id",
    "check_entity_key",
    "check_entity_name",
    "check_op",
    "entity_run_id",
    "entity_workflow",
]

ENTITY_PREFIX = "entity:"
"""Entity ``name``'s workflow is ``entity:<name>``; key ``k``'s run is ``entity:<name>:<k>``."""

EntityHandler = Callable[[Any, Any], "tuple[Any, Any] | Awaitable[tuple[Any, Any]]"]
"""``handler(state, payload) -> (new_state, reply)``, sync or async."""

_LINK_SUFFIX = re.compile(r"~\d+$")


def check_entity_name(name: Any) -> str:
    """``name`` if it is a usable entity name (``ValueError`` otherwise)."""
    if not isinstance(name, str) or not name:
        raise ValueError("an entity name must be a non-empty string")
    if ":" in name or "~" in name:
        raise ValueError(f"entity name {name!r} may not contain ':' or '~'")
    check_key(entity_workflow(name), "entity name")
    return name


def check_entity_key(name: str, key: Any) -> str:
    """``key`` if it is a usable key of entity ``name`` (``ValueError`` otherwise)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"entity {name!r}: a key must be a non-empty string")
    if _LINK_SUFFIX.search(key):
        # ``<run>~N`` names the N-th continuation of a run: such a key would
        # collide with another key's later run.
        raise ValueError(f"entity {name!r}: key {key!r} may not end with '~' and digits")
    check_key(entity_run_id(name, key), "entity key")
    return key


def check_op(name: str, op: Any) -> str:
    """``op`` if it is a usable operation name (``ValueError`` otherwise)."""
    if not isinstance(op, str) or not op:
        raise ValueError(f"entity {name!r}: an operation name must be a non-empty string")
    return check_update_name(op)


def entity_workflow(name: str) -> str:
    """The workflow name of entity ``name``."""
    return f"{ENTITY_PREFIX}{name}"


def entity_run_id(name: str, key: str) -> str:
    """The id of key ``key``'s first run."""
    return f"{ENTITY_PREFIX}{name}:{key}"


def call_update_id(run_id: str, seq: int) -> str:
    """The update id of ``ctx.call_entity`` at ``seq`` of ``run_id``: the same on
    every re-execution, so an operation is applied once however often it is sent."""
    return hashlib.sha256(f"{run_id}:{seq}".encode("utf-8", "surrogatepass")).hexdigest()[:40]


@dataclass(frozen=True, slots=True)
class EntityDef:
    """An entity registered with ``engine.entity``: its state's start and its operations."""

    name: str
    initial_state: Any
    handlers: Mapping[str, EntityHandler]
    ops_per_run: int

    @staticmethod
    def build(
        name: str, initial_state: Any, handlers: Mapping[str, EntityHandler], ops_per_run: int
    ) -> EntityDef:
        """Check everything up front; ``ValueError`` / ``TypeError`` name what is wrong."""
        check_entity_name(name)
        if not isinstance(handlers, Mapping) or not handlers:
            raise ValueError(f"entity {name!r}: handlers must be a non-empty mapping op -> fn")
        for op, fn in handlers.items():
            check_op(name, op)
            if not callable(fn):
                raise TypeError(f"entity {name!r}: the handler of {op!r} is not callable")
        if isinstance(ops_per_run, bool) or not isinstance(ops_per_run, int) or ops_per_run < 1:
            raise ValueError(f"entity {name!r}: ops_per_run must be a positive int")
        state = codec.to_jsonable(initial_state, f"the initial state of entity {name!r}")
        return EntityDef(name, state, dict(handlers), ops_per_run)
