"""JSON in every column and on every wire: encoding of user values, never pickle.

Values a workflow passes around (inputs, step outputs, signal payloads) are
stored as JSON text. Values users naturally return are converted on the way in:

- pydantic models (``model_dump(mode="json")``) and dataclasses: objects;
- ``datetime`` / ``date`` / ``time``: ISO 8601 text (UTC as ``Z``), ``timedelta``:
  an ISO 8601 duration (``PT5S``), the forms pydantic reads back;
- ``UUID`` and ``Decimal``: text (a ``Decimal`` keeps its digits: ``"1.10"``);
- ``bytes``: standard base64 text; an ``Enum``: its value;
- tuples, sets and frozensets: arrays (a set in iteration order).

What comes back out is plain JSON data; :mod:`durably._typed` turns it into a
declared type. NaN and infinity are refused (JSON has no form for them and
PostgreSQL's ``jsonb`` rejects them), as are strings that are not valid Unicode.

The encoder and decoder are msgspec's (several times faster than ``json`` on
typical checkpoints, see ``bench/RESULTS.md``), with the standard library as
the reference: any value
msgspec refuses, and any text holding a ``null`` that might stand for a NaN
msgspec wrote as ``null``, goes through ``json``, whose C encoder refuses NaN.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

import msgspec

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


def _datetime_text(value: datetime | time) -> str:
    text = value.isoformat()
    # RFC 3339's Z, as msgspec and pydantic write UTC: one value, one text.
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _duration_text(value: timedelta) -> str:
    sign = "-" if value < timedelta(0) else ""
    value = abs(value)
    days, seconds, micros = value.days, value.seconds, value.microseconds
    if not (seconds or micros):
        return f"{sign}P{days}D"
    secs = f"{seconds}.{micros:06d}".rstrip("0") if micros else str(seconds)
    return f"{sign}P{days}DT{secs}S" if days else f"{sign}PT{secs}S"


def _hook(value: Any) -> Any:
    """The JSON form of a value msgspec does not know (pydantic models, and
    anything else the ``json`` path needs)."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic v2 models
        return dump(mode="json")
    raise TypeError(
        f"has a value of type {type(value).__name__}, which has no JSON form; "
        "return plain data, a dataclass or a pydantic model"
    )


def _default(value: Any) -> Any:
    """The ``json`` path's conversions: the same forms msgspec writes natively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Shallow: the encoder recurses (asdict deep-copies, ~10x slower).
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, datetime | time):
        return _datetime_text(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return _duration_text(value)
    if isinstance(value, UUID | Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return _hook(value)


# allow_nan=False: Python's NaN/Infinity tokens are not JSON, and what one
# store would keep another's JSON tooling (jsonb, other languages) refuses.
_ENCODER = json.JSONEncoder(
    separators=(",", ":"), default=_default, ensure_ascii=False, allow_nan=False
)
_DECODER = json.JSONDecoder()
_FAST_ENCODE = msgspec.json.Encoder(enc_hook=_hook).encode
_FAST_DECODE = msgspec.json.Decoder().decode
_FAST_ERRORS = (TypeError, ValueError, OverflowError, RecursionError)


_UNDECODED: Any = object()


def _fast(value: Any) -> tuple[bytes, Any] | None:
    """``(text, decoded or _UNDECODED)`` from msgspec, or ``None`` where the
    ``json`` path must decide: a value msgspec refuses, or text with a
    ``null`` that is not a ``None`` of the value's (msgspec writes NaN and
    infinity as ``null``). Only text holding a null is decoded here."""
    try:
        data = _FAST_ENCODE(value)
    except _FAST_ERRORS:
        return None
    if b"null" not in data:
        return data, _UNDECODED
    # Plain data equals its decoding unless a float was not finite (NaN !=
    # anything; inf became None); anything else with a null takes the json path.
    decoded = _FAST_DECODE(data)
    if decoded != value:
        return None
    return data, decoded


def _reference_dumps(value: Any, field: str) -> str:
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


def dumps(value: Any, field: str = "value") -> str:
    """Encode ``value`` as compact JSON text; :class:`EncodeError` (naming
    ``field``) for a value no store can keep."""
    fast = _fast(value)
    return fast[0].decode() if fast is not None else _reference_dumps(value, field)


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
    try:
        return _FAST_DECODE(text)
    except Exception:  # msgspec.DecodeError, or deeper than it goes
        pass  # json decides: it also reads NaN tokens and lone surrogate escapes
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
    fast = _fast(value)
    if fast is not None:
        data, decoded = fast
        return _FAST_DECODE(data) if decoded is _UNDECODED else decoded
    text = _reference_dumps(value, field)
    try:
        return _DECODER.decode(text)
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
