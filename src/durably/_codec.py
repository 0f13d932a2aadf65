"""JSON in every column and on every wire: encoding of user values, never pickle.

Values a workflow passes around (inputs, step outputs, signal payloads) are
stored as JSON text. Pydantic models, dataclasses, datetimes, sets and tuples
are converted on the way in; what comes back out is plain JSON data, which the
engine re-validates into the workflow's ``input=`` model where one is declared.
"""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import date, datetime
from enum import Enum
from typing import Any
from uuid import UUID

from .errors import UnstorableValue

__all__ = ["EncodeError", "check_text", "dumps", "loads", "storable_text", "to_jsonable"]

_NOT_UNICODE = (
    "contains a string that is not valid Unicode (a lone surrogate, such as "
    "os.listdir() returns for a file name in another encoding); decode it with "
    "errors='replace' or pass the raw bytes as base64"
)
_NOT_FINITE = "NaN and infinity have no JSON form; store them as strings or None"
_TOO_DEEP = "is nested too deeply to encode"


class EncodeError(UnstorableValue, TypeError):
    """A value cannot be stored as JSON: a type with no JSON form, NaN or
    infinity, a string that is not valid Unicode, or nesting too deep.

    ``field`` names what was being stored ("the result of step 'x'", "input",
    "signal payload", ...). It is an :class:`~durably.errors.UnstorableValue`
    (so a ``ValueError``) and, for older callers, a ``TypeError``.
    """


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
    raise TypeError(
        f"has a value of type {type(value).__name__}, which has no JSON form; "
        "return plain data, a dataclass or a pydantic model"
    )


# allow_nan=False: Python's NaN/Infinity tokens are not JSON, and what one
# store would keep another's JSON tooling (jsonb, other languages) refuses.
_ENCODER = json.JSONEncoder(
    separators=(",", ":"), default=_default, ensure_ascii=False, allow_nan=False
)
_DECODER = json.JSONDecoder()


def dumps(value: Any, field: str = "value") -> str:
    """Encode ``value`` as compact JSON text; :class:`EncodeError` (naming
    ``field``) for a value no store can keep."""
    try:
        text = _ENCODER.encode(value)
    except RecursionError:
        # Raised afresh, outside the exhausted stack, without its frames.
        raise EncodeError(field, _TOO_DEEP) from None
    except ValueError as exc:  # circular reference, NaN or infinity
        problem = _NOT_FINITE if "Out of range float" in str(exc) else str(exc)
        raise EncodeError(field, problem) from exc
    except TypeError as exc:  # no JSON form; non-str keys
        raise EncodeError(field, str(exc)) from exc
    # isascii() is O(1) on CPython; only non-ASCII text pays for the check
    # that it encodes as UTF-8, which every store and driver needs.
    if not text.isascii():
        check_text(text, field)
    return text


def check_text(text: str, field: str) -> None:
    """Raise :class:`EncodeError` unless ``text`` encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise EncodeError(field, _NOT_UNICODE) from None


def storable_text(text: str) -> str:
    """``text`` with anything UTF-8 cannot carry escaped (for messages and
    tracebacks, which must be stored whatever they contain)."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def loads(text: str | None) -> Any:
    """Decode JSON text; ``None`` stays ``None``."""
    if text is None:
        return None
    return _DECODER.decode(text)


def to_jsonable(value: Any, field: str = "value") -> Any:
    """Round-trip ``value`` through JSON, so what a step returns on its first
    execution is exactly what replay returns later. Raises :class:`EncodeError`
    naming ``field`` for a value no store can keep, whatever the store."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, str):
        if not value.isascii():
            check_text(value, field)
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise EncodeError(field, _NOT_FINITE)
        return value
    text = dumps(value, field)
    try:
        return loads(text)
    except RecursionError:  # as deep as the encoder could go, deeper than the decoder
        raise EncodeError(field, _TOO_DEEP) from None


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
