"""The StateStore contract for schedules, proven against every store."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from durably.stores import ScheduleRecord, StateStore

from ._helpers import NESTED, NOW

if TYPE_CHECKING:
    from .. import StoreFactory


def make_schedule(name: str, **fields: Any) -> ScheduleRecord:
    fields.setdefault("spec", {"workflow": "wf", "every_ms": 60_000})
    fields.setdefault("created_at", NOW)
    fields.setdefault("updated_at", fields["created_at"])
    return ScheduleRecord(name=name, **fields)


async def test_create_schedule_stores_every_field(store: StateStore) -> None:
    record = ScheduleRecord(
        name="nightly:é:🎉",
        spec={"workflow": "report", "cron": "0 3 * * *", "tz": "Europe/Paris", "input": NESTED},
        namespace="billing",
        paused=True,
        next_fire_at=NOW + 1,
        last_fired_at=NOW - 2,
        last_run_id="sched:nightly:1",
        firing_run_id="sched:nightly:2",
        revision=4,
        created_at=NOW - 10,
        updated_at=NOW - 5,
    )

    stored, created = await store.create_schedule(record)

    assert created is True
    assert stored == record
    assert await store.get_schedule(record.name) == record
    assert await store.get_schedule("unknown") is None


async def test_create_schedule_keeps_an_existing_one(store: StateStore) -> None:
    first = make_schedule("s", next_fire_at=NOW)
    await store.create_schedule(first)

    stored, created = await store.create_schedule(make_schedule("s", paused=True, spec={}))

    assert created is False
    assert stored == first
    assert await store.get_schedule("s") == first


async def test_racing_creates_of_a_schedule_have_one_winner(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    results = await asyncio.gather(
        *(
            stores[i % 2].create_schedule(make_schedule("race", next_fire_at=NOW + i))
            for i in range(8)
        )
    )

    assert [created for _, created in results].count(True) == 1
    winner = next(record for record, created in results if created)
    assert all(record == winner for record, _ in results)


async def test_update_schedule_applies_changes_and_bumps_the_revision(store: StateStore) -> None:
    await store.create_schedule(make_schedule("s", next_fire_at=NOW))

    updated = await store.update_schedule(
        "s",
        {
            "paused": True,
            "next_fire_at": NOW + 60_000,
            "last_fired_at": NOW,
            "last_run_id": "sched:s:1",
            "firing_run_id": "sched:s:1",
            "spec": {"workflow": "other", "input": NESTED},
            "namespace": "ns2",
        },
        NOW + 7,
    )

    assert updated is not None
    assert updated.revision == 1
    assert updated.updated_at == NOW + 7
    assert updated.created_at == NOW
    assert (updated.paused, updated.next_fire_at, updated.last_fired_at) == (
        True,
        NOW + 60_000,
        NOW,
    )
    assert (updated.last_run_id, updated.firing_run_id) == ("sched:s:1", "sched:s:1")
    assert (updated.spec, updated.namespace) == ({"workflow": "other", "input": NESTED}, "ns2")
    assert await store.get_schedule("s") == updated

    cleared = await store.update_schedule("s", {"firing_run_id": None, "paused": False}, NOW + 8)
    assert cleared is not None
    assert (cleared.firing_run_id, cleared.paused, cleared.revision) == (None, False, 2)
    touched = await store.update_schedule("s", {}, NOW + 9)
    assert touched is not None and touched.revision == 3


async def test_update_schedule_compares_and_sets_on_the_revision(store: StateStore) -> None:
    await store.create_schedule(make_schedule("s", next_fire_at=NOW))

    assert await store.update_schedule("s", {"next_fire_at": 1}, NOW, revision=5) is None
    won = await store.update_schedule("s", {"next_fire_at": 2}, NOW, revision=0)
    assert won is not None and won.next_fire_at == 2
    assert await store.update_schedule("s", {"next_fire_at": 3}, NOW, revision=0) is None
    assert await store.update_schedule("missing", {"paused": True}, NOW) is None
    current = await store.get_schedule("s")
    assert current is not None and (current.next_fire_at, current.revision) == (2, 1)


async def test_update_schedule_rejects_columns_it_may_not_set(store: StateStore) -> None:
    await store.create_schedule(make_schedule("s"))
    for column in ("name", "revision", "created_at", "updated_at", "bogus"):
        with pytest.raises(ValueError, match="cannot update schedule columns"):
            await store.update_schedule("s", {column: 1}, NOW)


async def test_racing_updates_at_one_revision_have_one_winner(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    await stores[0].create_schedule(make_schedule("s", next_fire_at=NOW))

    results = await asyncio.gather(
        *(
            stores[i % 2].update_schedule(
                "s", {"next_fire_at": NOW + i, "last_run_id": f"run-{i}"}, NOW, revision=0
            )
            for i in range(10)
        )
    )

    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert await stores[1].get_schedule("s") == winners[0]


async def test_list_schedules_by_name_and_namespace(store: StateStore) -> None:
    for name, namespace in (("b", "default"), ("a", "default"), ("c", "other")):
        await store.create_schedule(make_schedule(name, namespace=namespace))

    assert [s.name for s in await store.list_schedules()] == ["a", "b", "c"]
    assert [s.name for s in await store.list_schedules("default")] == ["a", "b"]
    assert [s.name for s in await store.list_schedules("other")] == ["c"]
    assert await store.list_schedules("none") == []


async def test_list_due_schedules(store: StateStore) -> None:
    await store.create_schedule(make_schedule("late", next_fire_at=NOW - 100))
    await store.create_schedule(make_schedule("due", next_fire_at=NOW))
    await store.create_schedule(make_schedule("future", next_fire_at=NOW + 1))
    await store.create_schedule(make_schedule("paused", next_fire_at=NOW - 200, paused=True))
    await store.create_schedule(make_schedule("never", next_fire_at=None))
    await store.create_schedule(
        make_schedule("elsewhere", next_fire_at=NOW - 300, namespace="other")
    )
    # a claimed start to confirm is listed whatever its window and pause state
    await store.create_schedule(
        make_schedule("firing", next_fire_at=NOW + 500, paused=True, firing_run_id="x")
    )

    due = await store.list_due_schedules("default", NOW, 10)

    assert [s.name for s in due] == ["late", "due", "firing"]
    assert [s.name for s in await store.list_due_schedules("default", NOW, 2)] == ["late", "due"]
    assert [s.name for s in await store.list_due_schedules("other", NOW, 10)] == ["elsewhere"]
    assert [s.name for s in await store.list_due_schedules("default", NOW - 150, 10)] == ["firing"]


async def test_list_due_schedules_of_some_workflows(store: StateStore) -> None:
    for i, workflow in enumerate(["a", "b", "c", "a"]):
        spec = {"workflow": workflow, "every_ms": 60_000, "input": {"workflow": "b"}}
        await store.create_schedule(make_schedule(f"s{i}", spec=spec, next_fire_at=NOW + i))

    def names(found: list[ScheduleRecord]) -> list[str]:
        return [s.name for s in found]

    assert names(await store.list_due_schedules("default", NOW + 5, 10, ["a"])) == ["s0", "s3"]
    assert names(await store.list_due_schedules("default", NOW + 5, 10, ["b", "c"])) == [
        "s1",
        "s2",
    ]
    assert await store.list_due_schedules("default", NOW + 5, 10, []) == []
    assert len(await store.list_due_schedules("default", NOW + 5, 10, None)) == 4


async def test_delete_schedule(store: StateStore) -> None:
    await store.create_schedule(make_schedule("s"))

    assert await store.delete_schedule("s") is True
    assert await store.delete_schedule("s") is False
    assert await store.get_schedule("s") is None
    _, created = await store.create_schedule(make_schedule("s"))
    assert created is True
