"""Typed values end to end: what a step, a child or a workflow returns comes back
as its declared type (``output=`` or the return annotation), the same on the
first run and after a crash, on every store."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

import pydantic
import pytest
from typing_extensions import TypedDict

import durably
from durably import CheckpointStatus, RunStatus, _typed

from .conftest import EngineFactory


class Item(pydantic.BaseModel):
    sku: str
    price: Decimal


class Receipt(pydantic.BaseModel):
    order_id: UUID
    total: Decimal
    paid_at: datetime
    items: list[Item]
    signature: bytes


@dataclasses.dataclass
class Parcel:
    weight_kg: Decimal
    ships_on: date
    label: bytes


class Totals(TypedDict):
    net: Decimal
    count: int


ORDER = UUID("6f1c0b7e-2a43-4f7e-9d4b-0c1d2e3f4a5b")
PAID = datetime(2026, 3, 4, 5, 6, 7, 890, tzinfo=UTC)


def make_receipt() -> Receipt:
    return Receipt(
        order_id=ORDER,
        total=Decimal("19.90"),
        paid_at=PAID,
        items=[Item(sku="A-1", price=Decimal("9.95")), Item(sku="B-2", price=Decimal("9.95"))],
        signature=b"sig",
    )


def make_parcel() -> Parcel:
    return Parcel(Decimal("1.250"), date(2026, 3, 5), b"\x00\xff label")


async def test_decimal_and_bytes_results_no_longer_fail_the_step(
    make_engine: EngineFactory,
) -> None:
    # Before typed values: "has a value of type Decimal, which has no JSON form".
    engine = make_engine()

    def amount() -> Decimal:
        return Decimal("10.10")

    def blob() -> bytes:
        return b"\x00\x01\xfe"

    @engine.workflow("raw")
    async def raw(ctx: durably.WorkflowContext) -> list[Any]:
        return [await ctx.local_step("amount", amount), await ctx.local_step("blob", blob)]

    async with engine:
        await engine.start("raw", run_id="r")
        result = await engine.wait_for_run("r", terminal=True, timeout=10)
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output == ["10.10", "AAH+"]


async def test_local_steps_return_their_declared_types_live_and_after_a_crash(
    make_engine: EngineFactory,
) -> None:
    executed: Counter[str] = Counter()
    seen: list[dict[str, Any]] = []

    def define(engine: durably.Engine) -> None:
        def receipt() -> Receipt:
            executed["receipt"] += 1
            return make_receipt()

        async def parcel() -> Parcel:
            executed["parcel"] += 1
            return make_parcel()

        def totals() -> Totals:
            executed["totals"] += 1
            return {"net": Decimal("3.50"), "count": 2}

        def stamps() -> list[datetime]:
            executed["stamps"] += 1
            return [PAID, PAID.replace(year=2027)]

        def when() -> str:  # the data as stored; decoded by output= at the call
            executed["when"] += 1
            return "2026-03-04T05:06:07Z"

        @engine.workflow("typed")
        async def typed(ctx: durably.WorkflowContext) -> str:
            values = {
                "receipt": await ctx.local_step("receipt", receipt),
                "parcel": await ctx.local_step("parcel", parcel),
                "totals": await ctx.local_step("totals", totals),
                "stamps": await ctx.local_step("stamps", stamps),
                "when": await ctx.local_step("when", when, output=datetime),
                "id": await ctx.local_step("id", lambda: str(ORDER), output=UUID),
                "read": await ctx.side_effect(stamps),
            }
            seen.append(values)
            await ctx.wait_for_signal("go")
            return "done"

    first = make_engine()
    define(first)
    async with first:
        await first.start("typed", run_id="t")
        assert (await first.wait_for_run("t", timeout=10)).status is RunStatus.SUSPENDED
    second = make_engine()  # a restarted process: every value comes from a checkpoint
    define(second)
    async with second:
        await second.signal("go", None)
        result = await second.wait_for_run("t", terminal=True, timeout=10)
    assert result.status is RunStatus.COMPLETED, result.error
    assert executed.pop("stamps") == 2  # a step and a side effect
    assert set(executed.values()) == {1}  # the second body replayed, ran nothing
    live, replayed = seen
    assert live == replayed
    for values in (live, replayed):
        assert values["receipt"] == make_receipt()
        assert isinstance(values["receipt"].items[0], Item)
        assert values["parcel"] == make_parcel()
        assert isinstance(values["parcel"].label, bytes)
        assert values["totals"] == {"net": Decimal("3.50"), "count": 2}
        assert values["stamps"] == [PAID, PAID.replace(year=2027)]
        assert values["when"] == PAID.replace(microsecond=0)
        assert values["id"] == ORDER
        assert values["read"] == [PAID, PAID.replace(year=2027)]
    # Stored as plain JSON, readable by any client.
    history = {cp.name: cp for cp in await second.history("t")}
    assert history["receipt"].output["total"] == "19.90"
    assert history["parcel"].output == {
        "weight_kg": "1.250",
        "ships_on": "2026-03-05",
        "label": "AP8gbGFiZWw=",
    }


async def test_a_result_that_does_not_fit_fails_the_step_not_the_engine(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    calls = 0

    def wrong() -> Receipt:
        nonlocal calls
        calls += 1
        return {"order_id": "not-a-uuid"}  # type: ignore[return-value]

    @engine.workflow("misfit")
    async def misfit(ctx: durably.WorkflowContext) -> str:
        try:
            await ctx.local_step("wrong", wrong, retries=3)
        except durably.StepFailed as failure:
            return f"{failure.code}"
        return "fitted?"

    async with engine:
        await engine.start("misfit", run_id="m")
        result = await engine.wait_for_run("m", terminal=True, timeout=10)
        [checkpoint] = await engine.history("m")
        # The engine goes on: another run on it completes.
        await engine.start("misfit", run_id="m2")
        assert (await engine.wait_for_run("m2", terminal=True, timeout=10)).status is (
            RunStatus.COMPLETED
        )
    assert result.output == "schema_validation"
    assert calls == 2  # not retried: the same code returns the same shape
    assert checkpoint.status is CheckpointStatus.FAILED
    assert checkpoint.error is not None
    assert "does not fit the declared type Receipt" in checkpoint.error["message"]
    assert "order_id" in checkpoint.error["message"]
    locations = [e["loc"] for e in checkpoint.error["details"]]
    assert ["order_id"] in locations and ["total"] in locations


async def test_workflow_output_is_checked_against_its_declared_type(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("good", output=Receipt)
    async def good(ctx: durably.WorkflowContext) -> Any:
        return make_receipt().model_dump()  # a dict that fits

    @engine.workflow("bad")
    async def bad(ctx: durably.WorkflowContext) -> Receipt:
        return {"total": "lots"}  # type: ignore[return-value]

    async with engine:
        await engine.start("good", run_id="g")
        await engine.start("bad", run_id="b")
        good_result = await engine.wait_for_run("g", terminal=True, timeout=10)
        bad_result = await engine.wait_for_run("b", terminal=True, timeout=10)
    assert good_result.status is RunStatus.COMPLETED
    # What a client's RunHandle.result() does with the stored output:
    decode = _typed.decoder_for(Receipt, "the output")
    assert decode(good_result.output) == make_receipt()
    assert bad_result.status is RunStatus.FAILED
    assert bad_result.error is not None
    assert bad_result.error["code"] == "schema_validation"
    assert "the declared type Receipt" in bad_result.error["message"]


async def test_children_return_their_workflows_output_type(make_engine: EngineFactory) -> None:
    seen: list[Any] = []

    def define(engine: durably.Engine) -> None:
        @engine.workflow("ship")
        async def ship(ctx: durably.WorkflowContext, n: int) -> Parcel:
            return dataclasses.replace(make_parcel(), weight_kg=Decimal(n))

        @engine.workflow("parent")
        async def parent(ctx: durably.WorkflowContext) -> int:
            one = await ctx.child("ship", 1)
            many = await ctx.all([ctx.child("ship", 2), ctx.child("ship", 3)])
            seen.append([one, *many])
            await ctx.wait_for_signal("go")
            return len(many) + 1

    first = make_engine()
    define(first)
    async with first:
        await first.start("parent", run_id="p")
        assert (await first.wait_for_run("p", timeout=10)).status is RunStatus.SUSPENDED
    second = make_engine()
    define(second)
    async with second:
        await second.signal("go", None)
        assert (await second.wait_for_run("p", terminal=True, timeout=10)).output == 3
    expected = [dataclasses.replace(make_parcel(), weight_kg=Decimal(n)) for n in (1, 2, 3)]
    # Live (children finished in later turns) and replayed after a restart.
    assert seen[-1] == expected and all(isinstance(p, Parcel) for p in seen[-1])
    assert all(value == expected for value in seen if len(value) == 3)


async def test_dispatched_steps_decode_on_the_workflow_side(make_engine: EngineFactory) -> None:
    engine = make_engine(transport="memory://")

    @engine.step("pack")
    def pack(data: Any) -> Parcel:
        return make_parcel()

    @engine.step("stamp")
    def stamp(data: Any) -> str:
        return PAID.isoformat()

    @engine.workflow("dispatch")
    async def dispatch(ctx: durably.WorkflowContext) -> list[Any]:
        parcel = await ctx.step(pack)
        by_name = await ctx.step("pack")
        when = await ctx.step(stamp, output=datetime)
        assert isinstance(parcel, Parcel) and isinstance(by_name, Parcel)
        assert when == PAID
        return [parcel, when]

    async with engine:
        await engine.start("dispatch", run_id="d")
        result = await engine.wait_for_run("d", terminal=True, timeout=15)
    assert result.status is RunStatus.COMPLETED, result.error
    assert result.output[1] == "2026-03-04T05:06:07.000890Z"


def test_plain_annotations_pass_through_untouched() -> None:
    for tp in (Any, str, int, float, bool, None, type(None), list[int], dict[str, Any]):
        assert _typed.decoder_for(tp) is _typed.identity
    assert _typed.decoder_for(int | None) is _typed.identity

    def nothing():  # type: ignore[no-untyped-def]
        return 1

    assert _typed.output_type_of(nothing) is Any
    assert _typed.output_type_of(lambda: 1) is Any
    assert _typed.output_type_of(make_receipt) is Receipt

    async def later() -> Receipt:
        return make_receipt()

    assert _typed.output_type_of(later) is Receipt


def test_without_pydantic_a_declared_type_is_refused_at_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pydantic", None)  # import pydantic -> ImportError
    _typed.clear_caches()
    try:
        engine = durably.Engine("memory://")
        with pytest.raises(_typed.MissingPydantic, match=r"pip install 'durably\[pydantic\]'"):

            @engine.workflow("checkout", output=Parcel)
            async def checkout(ctx: durably.WorkflowContext) -> Any:
                return None

        with pytest.raises(_typed.MissingPydantic, match="step 'pack'"):
            engine.register_step("pack", make_parcel, output=Parcel)

        # Plain JSON types need nothing; an annotation is not enforced.
        @engine.workflow("plain", output=list[int])
        async def plain(ctx: durably.WorkflowContext) -> Parcel:
            return make_parcel()

        assert "plain" in engine.workflows
        assert _typed.output_type_of(make_parcel) is Any
    finally:
        _typed.clear_caches()


def test_an_unusable_output_type_is_refused_at_registration() -> None:
    engine = durably.Engine("memory://")

    class Opaque:
        pass

    with pytest.raises(TypeError, match="workflow 'w': output type"):
        engine.register("w", _noop, output=Opaque)


async def _noop(ctx: durably.WorkflowContext) -> None:
    return None


def test_annotations_are_cached_by_code_and_written_return_type() -> None:
    import functools

    def logged(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            return fn(*args)

        return wrapper

    # Two wrappers share their code; each keeps its own declared type.
    assert _typed.output_type_of(logged(make_receipt)) is Receipt
    assert _typed.output_type_of(logged(make_parcel)) is Parcel

    def closure(n: int) -> Any:
        def inner() -> Parcel:
            return make_parcel()

        return inner

    assert closure(1) is not closure(2)
    assert _typed.output_type_of(closure(1)) is Parcel
    assert _typed.output_type_of(closure(2)) is Parcel


async def test_a_dispatched_result_that_does_not_fit_fails_where_the_handler_runs(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(transport="memory://")
    calls = 0

    @engine.step("pack", retries=3)
    def pack(data: Any) -> Parcel:
        nonlocal calls
        calls += 1
        return {"weight_kg": "heavy"}  # type: ignore[return-value]

    @engine.workflow("dispatch")
    async def dispatch(ctx: durably.WorkflowContext) -> Any:
        try:
            return await ctx.step(pack)
        except durably.StepFailed as failure:
            return [failure.code, failure.message]

    async with engine:
        await engine.start("dispatch", run_id="d")
        result = await engine.wait_for_run("d", terminal=True, timeout=15)
    code, message = result.output
    assert code == "schema_validation"
    assert "does not fit the declared type Parcel" in message and "weight_kg" in message
    assert calls == 1


def test_a_class_from_the_enclosing_function_resolves_through_the_closure() -> None:
    class Local(pydantic.BaseModel):
        n: int

    def make() -> Local:  # a string annotation here: this module defers them
        return Local(n=1)

    assert _typed.output_type_of(make) is Local

    def unrelated() -> None:
        return None

    unrelated.__annotations__["return"] = "Nowhere"  # a name nothing defines
    assert _typed.output_type_of(unrelated) is Any


async def test_a_handle_decodes_the_result_as_the_workflow_declares(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    @engine.workflow("checkout")
    async def checkout(ctx: durably.WorkflowContext, order: str) -> Receipt:
        return Receipt(
            order_id=UUID(int=7),
            total=Decimal("12.50"),
            paid_at=datetime(2026, 12, 1, tzinfo=UTC),
            items=[Item(sku=order, price=Decimal("6.25"))],
            signature=b"sig",
        )

    async with engine:
        handle = await engine.start(checkout, "o-1", run_id="typed-handle")
        receipt = await handle.result(timeout=30)
        assert isinstance(receipt, Receipt)
        assert receipt.total == Decimal("12.50") and receipt.signature == b"sig"
        again = await engine.get_handle("typed-handle")
        assert await again.result(timeout=30) == receipt
        # By name too: the registered version's output type decodes it.
        by_name = await engine.start("checkout", "o-2")
        assert isinstance(await by_name.result(timeout=30), Receipt)
