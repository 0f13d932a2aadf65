"""The StateStore contract for search attributes: written with the run or by
``upsert_attributes`` under the lease, read back typed, filtered in
``list_runs``, deleted with the run.

Same fixtures as every ``stores`` module (see :mod:`durably.testing.conformance`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from durably._attributes import check_filters
from durably.model import CheckpointStatus, RunStatus
from durably.stores import RunQuery, StateStore

from ._helpers import NOW, OWNER, leased, make_cp, make_run

DAY = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)


def _attrs_cp(run_id: str, seq: int = 0) -> Any:
    return make_cp(run_id, seq, CheckpointStatus.COMPLETED, name="attributes", kind="attributes")


async def test_attributes_written_with_the_run_read_back_typed(store: StateStore) -> None:
    given = {"customer": "c-1", "total": 120, "ratio": 0.5, "vip": True, "due": DAY}

    await store.create_run(make_run("r1"), given)

    found = await store.get_attributes("r1")
    assert found == given
    assert [type(v) for v in found.values()] == [type(given[k]) for k in found]
    assert await store.get_attributes("unknown") == {}


async def test_a_datetime_reads_back_in_utc_to_the_millisecond(store: StateStore) -> None:
    local = datetime(2026, 3, 1, 14, 30, 0, 123456, tzinfo=timezone(timedelta(hours=2)))

    await store.create_run(make_run("r1"), {"at": local})

    found = (await store.get_attributes("r1"))["at"]
    assert found == DAY.replace(microsecond=123000)
    assert found.tzinfo is UTC


async def test_a_second_create_leaves_the_first_runs_attributes(store: StateStore) -> None:
    await store.create_run(make_run("r1"), {"customer": "c-1"})

    _, created = await store.create_run(make_run("r1"), {"customer": "c-2", "extra": 1})

    assert created is False
    assert await store.get_attributes("r1") == {"customer": "c-1"}


async def test_upsert_merges_under_the_lease(store: StateStore) -> None:
    await leased(store, "r1")
    await store.upsert_attributes(_attrs_cp("r1", 0), {"a": "x", "b": 1}, OWNER)

    assert await store.upsert_attributes(_attrs_cp("r1", 1), {"b": 2.5, "c": False}, OWNER)

    assert await store.get_attributes("r1") == {"a": "x", "b": 2.5, "c": False}
    history = await store.load_checkpoints("r1")
    assert [cp.kind for cp in history.values()] == ["attributes", "attributes"]


async def test_upsert_without_the_lease_writes_nothing(store: StateStore) -> None:
    await leased(store, "r1")

    held = await store.upsert_attributes(_attrs_cp("r1"), {"a": "x"}, "someone-else")

    assert held is False
    assert await store.get_attributes("r1") == {}
    assert await store.load_checkpoints("r1") == {}


async def test_attributes_are_deleted_with_the_run(store: StateStore) -> None:
    await store.create_run(make_run("r1", RunStatus.COMPLETED), {"customer": "c-1"})

    await store.delete_run("r1")
    await store.create_run(make_run("r1"))

    assert await store.get_attributes("r1") == {}
    assert (
        await store.list_runs(RunQuery(attributes=check_filters({"customer": "c-1"})))
    ).runs == []


async def _fixture(store: StateStore) -> None:
    rows: list[tuple[str, dict[str, Any], RunStatus]] = [
        ("a1", {"customer": "c-1", "total": 50, "vip": True, "due": DAY}, RunStatus.PENDING),
        ("a2", {"customer": "c-1", "total": 150.5, "vip": False}, RunStatus.COMPLETED),
        ("a3", {"customer": "c-2", "total": 100}, RunStatus.FAILED),
        ("a4", {"customer": "c-3", "total": "100"}, RunStatus.PENDING),  # a string "total"
        ("a5", {}, RunStatus.RUNNING),
    ]
    for i, (run_id, attributes, status) in enumerate(rows):
        await store.create_run(make_run(run_id, status, created_at=NOW + i), attributes)


LATER = datetime(2026, 3, 2, tzinfo=UTC)


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        pytest.param([("customer", "eq", "c-1")], ["a2", "a1"], id="eq-str"),
        pytest.param([("customer", "ne", "c-1")], ["a4", "a3"], id="ne-skips-missing"),
        pytest.param([("customer", "gt", "c-1")], ["a4", "a3"], id="gt-str"),
        pytest.param([("total", "gte", 100)], ["a3", "a2"], id="gte-int-and-float"),
        pytest.param([("total", "lt", 100.0)], ["a1"], id="lt-float"),
        pytest.param([("total", "eq", 100)], ["a3"], id="eq-number-not-string"),
        pytest.param([("total", "eq", "100")], ["a4"], id="eq-string-not-number"),
        pytest.param([("total", "ne", 100)], ["a2", "a1"], id="ne-number-only-numbers"),
        pytest.param([("vip", "eq", True)], ["a1"], id="bool"),
        pytest.param([("vip", "ne", True)], ["a2"], id="bool-ne"),
        pytest.param([("due", "lt", LATER)], ["a1"], id="datetime"),
        pytest.param([("due", "gt", LATER)], [], id="datetime-none"),
        pytest.param([("missing", "ne", "x")], [], id="missing-key-never"),
        pytest.param([("customer", "eq", "c-1"), ("total", "gte", 100)], ["a2"], id="anded"),
    ],
)
async def test_list_runs_filters_by_attributes(
    store: StateStore, filters: list[tuple[str, str, Any]], expected: list[str]
) -> None:
    await _fixture(store)

    page = await store.list_runs(RunQuery(attributes=check_filters(filters)))

    assert [r.run_id for r in page.runs] == expected


async def test_attribute_filters_combine_with_statuses_and_pages(store: StateStore) -> None:
    await _fixture(store)
    query = RunQuery(
        statuses=(RunStatus.PENDING, RunStatus.COMPLETED, RunStatus.FAILED),
        attributes=check_filters([("customer", "gte", "c-1")]),
        limit=2,
    )

    first = await store.list_runs(query)
    rest = await store.list_runs(RunQuery(**{**_fields(query), "cursor": first.next_cursor}))

    assert [r.run_id for r in first.runs] == ["a4", "a3"]
    assert [r.run_id for r in rest.runs] == ["a2", "a1"]
    assert rest.next_cursor is None
    counts = await store.count_runs(query, 100)
    assert counts == {"pending": 2, "completed": 1, "failed": 1}


def _fields(query: RunQuery) -> dict[str, Any]:
    return {name: getattr(query, name) for name in query.__dataclass_fields__}


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        pytest.param((RunStatus.PENDING,), ["a4", "a1"], id="one"),
        pytest.param((RunStatus.RUNNING, RunStatus.FAILED), ["a5", "a3"], id="two"),
        pytest.param((), [], id="none"),
    ],
)
async def test_list_runs_filters_by_several_statuses(
    store: StateStore, statuses: tuple[RunStatus, ...], expected: list[str]
) -> None:
    await _fixture(store)

    page = await store.list_runs(RunQuery(statuses=statuses))

    assert [r.run_id for r in page.runs] == expected


HOSTILE = "k'; DROP TABLE durably_run_attributes; --"


async def test_text_compares_by_code_point_and_hostile_keys_are_data(store: StateStore) -> None:
    names = {"t1": "Zoe", "t2": "adam", "t3": "émile", "t4": "😀"}
    for i, (run_id, name) in enumerate(names.items()):
        await store.create_run(make_run(run_id, created_at=NOW + i), {"name": name, HOSTILE: i})

    async def ids(*filters: tuple[str, str, Any]) -> list[str]:
        page = await store.list_runs(RunQuery(attributes=check_filters(list(filters))))
        return [r.run_id for r in page.runs]

    # By code point, as every store compares: "Z" < "a" < "é" < "😀" (never a
    # locale's order, which would put "émile" before "Zoe").
    assert await ids(("name", "lt", "a")) == ["t1"]
    assert await ids(("name", "gt", "z")) == ["t4", "t3"]
    assert await ids(("name", "gte", "😀")) == ["t4"]
    assert await ids((HOSTILE, "gte", 2)) == ["t4", "t3"]
    assert (await store.get_attributes("t2"))[HOSTILE] == 1
