"""The JSON codec, measured: stdlib ``json`` against orjson, msgspec and pydantic-core.

What the engine does with a value a step returns: *normalise* it (``to_jsonable``: the value as
plain JSON data, so the first run and every replay see the same thing), *encode* it (the store
writes the checkpoint's text) and, on every replay, *decode* it. Measured per library on typical
checkpoints:

- ``small``: a small dict (an order id, a status, an amount, a flag, a short list);
- ``10k``: a ~10 KB nested payload (a list of 90 line items with nested dicts and text);
- ``models``: a list of 20 pydantic models (each with a nested model and a datetime);
- ``dcs``: a list of 20 dataclasses.

Each library is wrapped to meet durably's rules (see ``src/durably/_codec.py``): NaN and infinity
refused, ``str`` out, non-JSON types through a ``default`` hook. orjson, msgspec and pydantic-core
write NaN as ``null``, so text holding a ``null`` is decoded and compared with the value (plain
data equals its decoding unless a float was not finite), and where they differ the stdlib
encoder decides. The last row is ``durably._codec`` as imported (``dumps``, ``loads``,
``to_jsonable``): put another tree's ``src`` first on ``PYTHONPATH`` to measure it.
Median of 7 repeats of ``timeit`` (auto-ranged), microseconds per operation, one core.

    .venv/bin/python bench/codec.py            # needs orjson, msgspec, pydantic installed
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/codec.py --durably-only
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import sys
import timeit
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
import orjson
import pydantic
import pydantic_core


class Address(pydantic.BaseModel):
    street: str
    city: str
    zip: str


class Customer(pydantic.BaseModel):
    id: int
    name: str
    email: str
    address: Address
    created: datetime
    tags: list[str]


@dataclasses.dataclass
class Line:
    sku: str
    qty: int
    price: float
    note: str | None


SMALL = {"order_id": 42, "status": "paid", "amount": 12.5, "ok": True, "items": [1, 2, 3]}
BIG = {
    "order": {"id": "ord_123", "customer": {"id": 7, "name": "Ada Lovelace", "vip": False}},
    "lines": [
        {
            "sku": f"SKU-{i:05d}",
            "qty": i % 7 + 1,
            "price": round(3.1 * i, 2),
            "attrs": {"colour": "blue", "size": "M", "gift": i % 3 == 0},
            "note": "leave at the door, ring twice" if i % 2 else None,
        }
        for i in range(90)
    ],
    "meta": {"source": "web", "trace": "0123456789abcdef" * 4},
}
MODELS = [
    Customer(
        id=i,
        name=f"Customer {i}",
        email=f"c{i}@example.com",
        address=Address(street=f"{i} Main St", city="Paris", zip="75001"),
        created=datetime(2026, 1, 1, 12, i % 60, tzinfo=UTC),
        tags=["a", "b"],
    )
    for i in range(20)
]
DCS = [Line(f"SKU-{i}", i, 1.5 * i, None if i % 2 else "x") for i in range(20)]
PAYLOADS: dict[str, Any] = {"small": SMALL, "10k": BIG, "models": MODELS, "dcs": DCS}


def _default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


# -- the candidates: (encode: value -> str, decode: str -> value) -----------------------------

_STD = json.JSONEncoder(
    separators=(",", ":"), default=_default, ensure_ascii=False, allow_nan=False
)
_STD_DEC = json.JSONDecoder()


def std_encode(value: Any) -> str:
    return _STD.encode(value)


def guarded(dumps: Callable[[Any], bytes], loads: Callable[[bytes], Any]) -> Callable[[Any], str]:
    """``dumps`` with NaN refused: only text holding a null can hide one."""

    def encode(value: Any) -> str:
        try:
            data = dumps(value)
        except (TypeError, ValueError, OverflowError):
            return std_encode(value)
        if b"null" in data and loads(data) != value:
            return std_encode(value)
        return data.decode()

    return encode


_MS_ENC = msgspec.json.Encoder(enc_hook=_default)
_MS_DEC = msgspec.json.Decoder()
orjson_encode = guarded(lambda v: orjson.dumps(v, default=_default), orjson.loads)
msgspec_encode = guarded(_MS_ENC.encode, _MS_DEC.decode)
pydantic_encode = guarded(pydantic_core.to_json, pydantic_core.from_json)


CANDIDATES: dict[str, tuple[Callable[[Any], str], Callable[[str], Any]]] = {
    "stdlib json": (std_encode, _STD_DEC.decode),
    "orjson": (orjson_encode, orjson.loads),
    "msgspec": (msgspec_encode, _MS_DEC.decode),
    "pydantic-core": (pydantic_encode, pydantic_core.from_json),
}


def _durably_row() -> tuple[str, Callable[[Any], str], Callable[[str], Any], Callable[[Any], Any]]:
    from durably import _codec

    return "durably._codec", _codec.dumps, _codec.loads, _codec.to_jsonable


def per_op_us(fn: Callable[[], Any]) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return statistics.median(t / number * 1e6 for t in timer.repeat(7, number))


def main() -> None:
    only = "--durably-only" in sys.argv
    print(f"Python {platform.python_version()}, orjson {orjson.__version__}, ", end="")
    print(f"msgspec {msgspec.__version__}, pydantic-core {pydantic_core.__version__}")
    texts = {name: std_encode(value) for name, value in PAYLOADS.items()}
    print("sizes: " + ", ".join(f"{n} {len(t)} B" for n, t in texts.items()))
    header = "| library | " + " | ".join(f"{n} enc | {n} dec | {n} to_jsonable" for n in PAYLOADS)
    print(header + " |")
    print("| --- " * (1 + 3 * len(PAYLOADS)) + "|")
    rows = (
        []
        if only
        else [(lib, e, d, lambda v, e=e, d=d: d(e(v))) for lib, (e, d) in CANDIDATES.items()]
    )
    rows.append(_durably_row())
    for lib, encode, decode, normalise in rows:
        cells = []
        for name, value in PAYLOADS.items():
            text = texts[name]
            enc = per_op_us(lambda e=encode, v=value: e(v))  # type: ignore[misc]
            dec = per_op_us(lambda d=decode, t=text: d(t))  # type: ignore[misc]
            both = per_op_us(lambda n=normalise, v=value: n(v))  # type: ignore[misc]
            cells += [f"{enc:.2f}", f"{dec:.2f}", f"{both:.2f}"]
        print(f"| {lib} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
