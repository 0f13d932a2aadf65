"""JSON in every column and on every wire: encoding of user values, never pickle.

Values a workflow passes around (inputs, step outputs, signal payloads) are
stored as JSON text. Pydantic models, dataclasses, datetimes, sets and tuples
are converted on the way in; what comes back out is plain JSON data, which the
engine re-validates into the workflow's ``input=`` model where one is declared.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import date, datetime
from enum import Enum
from typing import Any
from uuid import UUID

__all__ = ["EncodeError", "dumps", "loads", "to_jsonable"]


class EncodeError(TypeError):
    """A value cannot be stored as JSON."""


def _default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic v2 models
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise EncodeError(
        f"cannot store a value of type {type(value).__name__} as JSON; "
        "return plain data, a dataclass or a pydantic model"
    )


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_default, ensure_ascii=False)
_DECODER = json.JSONDecoder()


def dumps(value: Any) -> str:
    """Encode ``value`` as compact JSON text (raises :class:`EncodeError`)."""
    try:
        return _ENCODER.encode(value)
    except ValueError as exc:  # circular references, NaN handling
        raise EncodeError(str(exc)) from exc


def loads(text: str | None) -> Any:
    """Decode JSON text; ``None`` stays ``None``."""
    if text is None:
        return None
    return _DECODER.decode(text)


def to_jsonable(value: Any) -> Any:
    """Round-trip ``value`` through JSON, so what a step returns on its first
    execution is exactly what replay returns later."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return loads(dumps(value))


def parse_as(kind: Any, value: Any) -> Any:
    """``value`` (JSON data) converted to ``kind``: a pydantic model (validated),
    a dataclass (built from an object), or any callable type. Raises whatever
    the type raises for data it rejects."""
    validate = getattr(kind, "model_validate", None)
    if callable(validate):
        return validate(value)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        if isinstance(value, kind):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"expected an object for {kind.__name__}")
        return kind(**value)
    return kind(value)
