"""The StateStore contract for updates (``engine.update``): each run's inbox,
deduplicated by update id, answered once, atomically with the history entry
under the lease, handed on to the next link of a continue-as-new chain, and
deleted with the run.

Same fixtures as every ``stores`` module (see :mod:`durably.testing.conformance`).
"""

from __future__ import annotations

import asyncio

from durably.model import CheckpointStatus
from durably.stores import StateStore
from durably.stores.base import UpdateRecord

from ._helpers import NOW, OWNER, checkpoint, leased, make_cp, make_run

__all__ = [
    "test_a_moved_update_waits_in_the_next_link",
    "test_an_answer_is_written_once",
    "test_an_update_is_added_once_per_id",
    "test_concurrent_puts_of_one_id_keep_one",
    "test_deleting_the_run_deletes_its_updates",
    "test_pending_updates_come_oldest_first",
    "test_the_answer_and_its_history_entry_are_one_write_under_the_lease",
]


def _update(run_id: str, update_id: str, payload: object = None, at: int = NOW) -> UpdateRecord:
    return UpdateRecord(run_id, update_id, "add", payload, at)


async def test_an_update_is_added_once_per_id(store: StateStore) -> None:
    first = await store.put_update(_update("r1", "u1", {"n": 1}))
    again = await store.put_update(_update("r1", "u1", {"n": 2}))

    assert first.payload == {"n": 1} and first.answer is None
    assert again.payload == {"n": 1}
    assert await store.get_update("r1", "u1") == first
    assert await store.get_update("r1", "unknown") is None
    assert await store.get_update("r2", "u1") is None


async def test_concurrent_puts_of_one_id_keep_one(store: StateStore) -> None:
    stored = await asyncio.gather(*(store.put_update(_update("r1", "u1", i)) for i in range(8)))

    assert len({r.payload for r in stored}) == 1
    assert len(await store.pending_updates("r1", 100)) == 1


async def test_pending_updates_come_oldest_first(store: StateStore) -> None:
    for i in range(5):
        await store.put_update(_update("r1", f"u{i}", i))
    await store.put_update(_update("r2", "other", None))
    await store.answer_update("r1", "u1", {"outcome": "rejected", "reason": "no"}, NOW)

    pending = await store.pending_updates("r1", 100)

    assert [r.update_id for r in pending] == ["u0", "u2", "u3", "u4"]
    assert [r.update_id for r in await store.pending_updates("r1", 2)] == ["u0", "u2"]


async def test_an_answer_is_written_once(store: StateStore) -> None:
    await store.put_update(_update("r1", "u1"))

    assert await store.answer_update("r1", "u1", {"outcome": "ended"}, NOW + 1) is True
    assert await store.answer_update("r1", "u1", {"outcome": "rejected"}, NOW + 2) is False
    assert await store.answer_update("r1", "unknown", {"outcome": "ended"}, NOW) is False

    found = await store.get_update("r1", "u1")
    assert found is not None and found.answer == {"outcome": "ended"}
    assert found.answered_at == NOW + 1
    assert await store.pending_updates("r1", 10) == []


async def test_the_answer_and_its_history_entry_are_one_write_under_the_lease(
    store: StateStore,
) -> None:
    await leased(store, "r1")
    await store.put_update(_update("r1", "u1", {"n": 1}))
    await store.put_update(_update("r1", "u2", {"n": 2}))
    entry = make_cp("r1", 0, CheckpointStatus.COMPLETED, name="update:add", kind="update")
    answer = {"outcome": "accepted", "result": 3}

    assert await store.answer_update("r1", "u1", answer, NOW, checkpoint=entry, owner=OWNER)
    fenced = make_cp("r1", 1, CheckpointStatus.COMPLETED, name="update:add", kind="update")
    assert not await store.answer_update(
        "r1", "u2", answer, NOW, checkpoint=fenced, owner="someone-else"
    )

    assert (await checkpoint(store, "r1", 0)).kind == "update"
    assert 1 not in await store.load_checkpoints("r1")
    first, second = await store.get_update("r1", "u1"), await store.get_update("r1", "u2")
    assert first is not None and first.answer == answer
    assert second is not None and second.answer is None


async def test_a_moved_update_waits_in_the_next_link(store: StateStore) -> None:
    await store.put_update(_update("r1", "u1", 1))
    await store.put_update(_update("r1", "u2", 2))
    await store.put_update(_update("r1", "u3", 3))
    await store.answer_update("r1", "u1", {"outcome": "accepted", "result": None}, NOW)
    await store.put_update(_update("r1~1", "u3", "already there"))

    assert await store.move_updates("r1", "r1~1", NOW + 5) == 2

    moved = await store.get_update("r1", "u2")
    assert moved is not None and moved.answer == {"outcome": "moved", "run_id": "r1~1"}
    pending = await store.pending_updates("r1~1", 10)
    assert [(r.update_id, r.payload) for r in pending] == [("u3", "already there"), ("u2", 2)]
    assert await store.pending_updates("r1", 10) == []
    assert await store.move_updates("r1", "r1~1", NOW + 6) == 0


async def test_deleting_the_run_deletes_its_updates(store: StateStore) -> None:
    await store.create_run(make_run("r1"))
    await store.put_update(_update("r1", "u1"))

    assert await store.delete_run("r1")

    assert await store.get_update("r1", "u1") is None
