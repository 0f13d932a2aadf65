"""Declared types (``durably._typed``): a value stored and read back as its declared
type equals the value the first run returned, whatever the value."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

import pydantic
from hypothesis import given, settings
from hypothesis import strategies as st

from durably import _codec, _typed


class Line(pydantic.BaseModel):
    sku: str
    price: Decimal
    at: datetime


@dataclasses.dataclass
class Order:
    id: UUID
    day: date
    blob: bytes
    wait: timedelta
    lines: list[Line]
    note: str | None = None


_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
_decimals = st.decimals(allow_nan=False, allow_infinity=False)
_times = st.datetimes(timezones=st.none() | st.just(UTC))
lines = st.builds(Line, sku=_text, price=_decimals, at=_times)
orders = st.builds(
    Order,
    id=st.uuids(),
    day=st.dates(),
    blob=st.binary(max_size=40),
    wait=st.timedeltas(min_value=timedelta(days=-999), max_value=timedelta(days=999)),
    lines=st.lists(lines, max_size=3),
    note=st.none() | _text,
)


@given(st.lists(orders, max_size=3))
@settings(max_examples=150, deadline=None)
def test_a_stored_value_reads_back_equal_to_the_live_one(value: list[Order]) -> None:
    typed = _typed.typed_for(list[Order], "the result")
    data, live = typed.store(value, "the result")
    assert live == value
    # The stored data is plain JSON: through any store's text, it decodes the same.
    assert typed.decode(_codec.loads(_codec.dumps(data))) == live
    assert json.loads(json.dumps(data)) == data


@given(_decimals, st.binary(max_size=40), st.uuids(), _times)
@settings(max_examples=100, deadline=None)
def test_bare_scalars_read_back_as_their_types(
    amount: Decimal, blob: bytes, ident: UUID, when: datetime
) -> None:
    for tp, value in ((Decimal, amount), (bytes, blob), (UUID, ident), (datetime, when)):
        typed = _typed.typed_for(tp)
        data, live = typed.store(value, "v")
        assert live == value and type(live) is type(value)
        assert typed.decode(data) == value


def test_plain_types_cost_nothing() -> None:
    for tp in (None, Any, int, str, list[dict[str, Any]], dict[str, int] | None):
        assert _typed.typed_for(tp) is _typed.PLAIN
    data, value = _typed.PLAIN.store({"a": (1, 2)}, "v")
    assert data == value == {"a": [1, 2]}
