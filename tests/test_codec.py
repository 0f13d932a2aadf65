"""The JSON codec (``durably._codec``): what values become, what is refused, and
that msgspec (the fast path) and the standard library (the reference) agree."""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import math
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durably import _codec as codec
from durably.stores._match import canonical

# Plain JSON data as Python holds it: what every store keeps and gives back.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # beyond 64 bits too
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=("Cs",)))
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(st.characters(exclude_categories=("Cs",))), inner, max_size=5)
    ),
    max_leaves=30,
)


def _stdlib(value: Any) -> Any:
    return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False))


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_plain_json_round_trips_exactly_as_the_standard_library(value: Any) -> None:
    text = codec.dumps(value)
    assert codec.loads(text) == value == _stdlib(value)
    assert json.loads(text) == value  # any JSON reader reads it back
    assert codec.to_jsonable(value) == value


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_decoding_agrees_with_the_standard_library(value: Any) -> None:
    # Text written by another writer (json here): floats round the same way.
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
        assert codec.loads(text) == json.loads(text)


def _reference_canonical(value: Any) -> str:
    def normalise(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer() and abs(v) <= 2**53:
            return int(v)
        if isinstance(v, list):
            return [normalise(i) for i in v]
        if isinstance(v, dict):
            return {k: normalise(i) for k, i in v.items()}
        return v

    return json.dumps(
        normalise(_stdlib(value)), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_canonical_match_text_is_byte_identical_to_the_stdlib_rules(value: Any) -> None:
    # Waiters stored by an earlier release compare this text byte for byte.
    assert canonical(value) == _reference_canonical(value)


_non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


@dataclasses.dataclass
class Point:
    x: float
    label: str | None = None


class Reading(pydantic.BaseModel):
    value: float
    note: str | None = None


@given(json_values, _non_finite, st.integers(0, 4))
@settings(max_examples=200, deadline=None)
def test_nan_and_infinity_are_refused_wherever_they_hide(value: Any, bad: float, wrap: int) -> None:
    # A None beside the NaN: the text holds a null either way, so the fast
    # path cannot tell them apart by looking for one.
    hidden: Any = [value, None, bad]
    if wrap == 1:
        hidden = {"data": value, "none": None, "bad": bad}
    elif wrap == 2:
        hidden = Point(bad, None)
    elif wrap == 3:
        hidden = [Reading(value=bad), value]
    elif wrap == 4:
        hidden = (bad, value)
    with pytest.raises(codec.EncodeError, match="NaN and infinity"):
        codec.dumps(hidden, "the result")
    with pytest.raises(codec.EncodeError, match="NaN and infinity"):
        codec.to_jsonable(hidden, "the result")


class Colour(enum.Enum):
    RED = "red"


class Size(enum.IntEnum):
    BIG = 3


@dataclasses.dataclass
class Line:
    sku: str
    at: datetime
    price: Decimal
    tags: tuple[str, ...] = ()


FORMS: list[tuple[Any, Any]] = [
    (datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "2026-01-02T03:04:05Z"),
    (datetime(2026, 1, 2, 3, 4, 5, 600, tzinfo=UTC), "2026-01-02T03:04:05.000600Z"),
    (datetime(2026, 1, 2, 3, 4, 5), "2026-01-02T03:04:05"),
    (
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        "2026-01-02T03:04:05+05:30",
    ),
    (date(2026, 1, 2), "2026-01-02"),
    (time(3, 4, 5), "03:04:05"),
    (timedelta(seconds=5), "PT5S"),
    (timedelta(days=1, seconds=3700, microseconds=5), "P1DT3700.000005S"),
    (timedelta(seconds=-1), "-PT1S"),
    (timedelta(0), "P0D"),
    (UUID(int=1), "00000000-0000-0000-0000-000000000001"),
    (Decimal("1.10"), "1.10"),
    (Decimal("-1E+3"), "-1E+3"),
    (b"\x00\xffbytes", base64.b64encode(b"\x00\xffbytes").decode()),
    (bytearray(b"ab"), "YWI="),
    (Colour.RED, "red"),
    (Size.BIG, 3),
    ((1, "a"), [1, "a"]),
    (frozenset({7}), [7]),
    (
        Line("A-1", datetime(2026, 1, 2, tzinfo=UTC), Decimal("9.99"), ("x",)),
        {"sku": "A-1", "at": "2026-01-02T00:00:00Z", "price": "9.99", "tags": ["x"]},
    ),
    (Reading(value=1.5), {"value": 1.5, "note": None}),
    ({1: "int keys become text"}, {"1": "int keys become text"}),
]


@pytest.mark.parametrize(("value", "form"), FORMS, ids=[repr(v)[:40] for v, _ in FORMS])
def test_values_users_return_have_one_json_form(value: Any, form: Any) -> None:
    assert codec.to_jsonable(value) == form
    assert codec.loads(codec.dumps(value)) == form
    # The reference path (json) writes the same forms as the fast one (msgspec).
    assert json.loads(codec._reference_dumps(value, "v")) == form
    # ... also when a None beside it sends the value down the reference path.
    assert codec.to_jsonable([value, None]) == [form, None]


def test_a_set_becomes_an_array_of_its_items() -> None:
    assert sorted(codec.to_jsonable({3, 1, 2})) == [1, 2, 3]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (object(), "type object, which has no JSON form"),
        ({("a", "b"): 1}, "keys must be str"),
        (["caf\udce9"], "not valid Unicode"),
    ],
)
def test_what_has_no_json_form_is_refused_naming_the_field(value: Any, problem: str) -> None:
    with pytest.raises(codec.EncodeError, match=problem) as caught:
        codec.dumps(value, "the result of step 'x'")
    assert caught.value.field == "the result of step 'x'"


def test_a_cycle_is_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(codec.EncodeError):
        codec.to_jsonable(loop)


def test_text_from_other_writers_still_decodes() -> None:
    # The stdlib decoder is the fallback: NaN tokens, lone surrogate escapes.
    assert math.isnan(codec.loads("NaN"))
    assert codec.loads('"\\ud800"') == "\ud800"
    assert codec.loads(None) is None
    assert codec.loads(" [1, 2.5e3 ] ") == [1, 2500.0]
