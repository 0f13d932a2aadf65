"""How ``ctx.wait_for_event(name, match=…)`` decides that a payload is for it.

A match is a mapping of top-level keys to values; a payload matches when it is
a JSON object holding every one of those keys with an *equal* value. Equality
is JSON equality on a canonical form: object keys sorted at every depth (so key
order never matters, also inside nested values), and a float that is a whole
number written as the integer (JSON has one number type: ``1 == 1.0``).

Stores index waiters by ``(name, match_keys, match)``: publishing projects the
payload onto each distinct key set waiting on the name and looks the projection
up, instead of testing every waiter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .. import _codec as codec

__all__ = ["canonical", "match_index", "matches", "project"]

_MAX_EXACT_INT = 2**53


def _normalise(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) <= _MAX_EXACT_INT:
            return int(value)
        return value
    if isinstance(value, list):
        return [_normalise(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _normalise(item) for key, item in value.items()}
    return value


def canonical(value: Any) -> str:
    """The canonical JSON text of ``value``: equal JSON values give equal text."""
    return json.dumps(
        _normalise(codec.to_jsonable(value)),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )


def match_index(match: Mapping[str, Any] | None) -> tuple[str, str]:
    """``(match_keys, match)`` as stored with a waiter: the sorted key list and
    the canonical text of the match, both JSON. No match is ``("[]", "{}")``."""
    if not match:
        return "[]", "{}"
    keys = sorted(match)
    return json.dumps(keys, ensure_ascii=False, separators=(",", ":")), canonical(dict(match))


def project(payload: Any, match_keys: str) -> str | None:
    """The canonical text of ``payload`` restricted to ``match_keys`` (a stored
    key list), or ``None`` when the payload cannot match waiters on those keys
    (not an object, or a key is missing)."""
    keys: list[str] = json.loads(match_keys)
    if not keys:
        return "{}"
    if not isinstance(payload, dict) or any(key not in payload for key in keys):
        return None
    return canonical({key: payload[key] for key in keys})


def matches(payload: Any, match: Mapping[str, Any] | None) -> bool:
    """Whether ``payload`` matches ``match`` (see the module docstring)."""
    keys, text = match_index(match)
    return project(payload, keys) == text
