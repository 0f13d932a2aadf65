"""Search attributes: typed values a run is found by in ``list_runs``.

Each store keeps them in an index table, one row per ``(run, key)``: the
value's type, and the value in a text column (``str``) or a number column
(``int``, ``float``, ``bool`` as 0/1, ``datetime`` as epoch ms). A filter
compares one column through an index on ``(key, value)``, never by scanning
JSON. A filter only matches a value of its own type family (numbers compare
with numbers, whether int or float), and a run without the key never matches,
not even ``ne``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from ._names import check_name
from .errors import UnstorableValue

__all__ = [
    "NUMBER_TYPES",
    "OPS",
    "AttributeFilter",
    "check_attributes",
    "check_filters",
    "decode",
    "encode",
    "matches",
    "to_jsonable",
]

AttributeType = Literal["str", "int", "float", "bool", "datetime"]

OPS = {"eq": "=", "ne": "<>", "lt": "<", "lte": "<=", "gt": ">", "gte": ">="}
"""The filter operators and the SQL comparison each one is."""

NUMBER_TYPES = ("int", "float")

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MILLISECOND = timedelta(milliseconds=1)

MAX_EXACT_INT = 2**53
"""Numbers are stored as 64-bit floats (one indexed column for every numeric
type): an int beyond this would be stored as a different int."""


def _type_of(value: object, where: str) -> AttributeType:
    # bool before int: True is an int to Python, but a distinct type here.
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        if not -MAX_EXACT_INT <= value <= MAX_EXACT_INT:
            raise UnstorableValue(where, f"{value} is out of range (at most ±2**53)")
        return "int"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise UnstorableValue(where, f"{value} is not a finite number")
        return "float"
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise UnstorableValue(where, "a datetime must be timezone-aware")
        return "datetime"
    if isinstance(value, str):
        check_name(value, where)
        return "str"
    raise TypeError(
        f"{where}: a search attribute is a str, int, float, bool or datetime, "
        f"not {type(value).__name__}"
    )


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a search attribute key must be a non-empty string, not {key!r}")
    check_name(key, "search attribute key")
    return key


def check_attributes(attributes: object) -> dict[str, Any]:
    """A copy of ``attributes`` once every key and value can be stored and
    searched; raises :class:`TypeError` for a value of another type and
    :class:`ValueError` (or :class:`~durably.errors.UnstorableValue`) for a
    bad key or an unstorable value."""
    if attributes is None:
        return {}
    if not isinstance(attributes, Mapping):
        raise TypeError(
            f"search attributes are a dict of key → value, not {type(attributes).__name__}"
        )
    clean: dict[str, Any] = {}
    for key, value in cast(Mapping[object, object], attributes).items():
        name = _check_key(key)
        _type_of(value, f"search attribute {name!r}")
        clean[name] = value
    return clean


def encode(value: Any) -> tuple[AttributeType, str | None, float | None]:
    """``(type, str_value, num_value)``: the index row of a checked value."""
    kind = _type_of(value, "search attribute")
    if kind == "str":
        return kind, value, None
    if kind == "datetime":
        # Integer arithmetic: timestamp() * 1000 is a float product that can
        # land a millisecond low.
        return kind, None, float((value - EPOCH) // MILLISECOND)
    return kind, None, float(value)


def decode(kind: str, str_value: str | None, num_value: float | None) -> Any:
    """The value an index row holds, as the type it was set as (a datetime in UTC)."""
    if kind == "str":
        return str_value
    assert num_value is not None
    if kind == "int":
        return int(num_value)
    if kind == "bool":
        return bool(num_value)
    if kind == "datetime":
        return EPOCH + int(num_value) * MILLISECOND
    return float(num_value)


def to_jsonable(attributes: dict[str, Any]) -> dict[str, Any]:
    """``attributes`` as JSON for a checkpoint: ``{key: [type, value]}``
    (a datetime as epoch ms), so history keeps the types."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        kind, text, number = encode(value)
        if kind == "str":
            out[key] = [kind, text]
        elif kind in ("int", "datetime"):
            out[key] = [kind, int(cast(float, number))]
        else:
            out[key] = [kind, value]
    return out


@dataclass(frozen=True, slots=True)
class AttributeFilter:
    """One condition of ``list_runs(attributes=...)``: ``key op value``."""

    key: str
    op: str
    """One of :data:`OPS`' keys."""
    types: tuple[str, ...]
    """The stored types it compares with (``int`` and ``float`` together)."""
    str_value: str | None
    num_value: float | None

    @property
    def column(self) -> str:
        """The index table's column it compares."""
        return "str_value" if self.str_value is not None else "num_value"

    @property
    def value(self) -> str | float:
        """The value compared, as stored."""
        return self.str_value if self.str_value is not None else cast(float, self.num_value)


def check_filters(filters: object) -> tuple[AttributeFilter, ...]:
    """The checked filters of ``list_runs(attributes=[(key, op, value), ...])``."""
    if filters is None:
        return ()
    if isinstance(filters, dict):
        # The common case of equalities, written as a dict.
        filters = [(k, "eq", v) for k, v in filters.items()]
    if not isinstance(filters, list | tuple):
        raise TypeError("attribute filters are a list of (key, op, value) tuples")
    checked: list[AttributeFilter] = []
    for item in cast(list[object], filters):
        if not isinstance(item, tuple | list) or len(cast(tuple[Any, ...], item)) != 3:
            raise TypeError(f"an attribute filter is a (key, op, value) tuple, not {item!r}")
        key, op, value = cast(tuple[Any, Any, Any], item)
        name = _check_key(key)
        if op not in OPS:
            raise ValueError(f"attribute filter on {name!r}: op must be one of {', '.join(OPS)}")
        kind, text, number = encode(value)
        if kind == "bool" and op not in ("eq", "ne"):
            raise ValueError(f"attribute filter on {name!r}: a bool compares only with eq or ne")
        types = NUMBER_TYPES if kind in NUMBER_TYPES else (kind,)
        checked.append(AttributeFilter(name, op, types, text, number))
    return tuple(checked)


def matches(stored: dict[str, Any], filters: tuple[AttributeFilter, ...]) -> bool:
    """Whether attributes ``stored`` satisfy every filter (the memory store's
    version of the SQL stores' ``EXISTS`` on the index table)."""
    for flt in filters:
        if flt.key not in stored:
            return False
        kind, text, number = encode(stored[flt.key])
        if kind not in flt.types:
            return False
        have: Any = text if flt.str_value is not None else number
        want: Any = flt.value
        ok = {
            "eq": have == want,
            "ne": have != want,
            "lt": have < want,
            "lte": have <= want,
            "gt": have > want,
            "gte": have >= want,
        }[flt.op]
        if not ok:
            return False
    return True
