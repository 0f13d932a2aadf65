"""The StateStore contract for events (``wait_event``, ``publish_event``,
``cancel_event_wait``, ``list_buffered_events``), proven against every store."""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

import pytest

from durably.model import Checkpoint, CheckpointStatus, RunStatus
from durably.stores import EventDelivery, RunChanges, SettleResult, SignalWait, StateStore
from durably.stores._match import canonical, matches

from ._helpers import ERROR, NESTED, NOW, OTHER, OWNER, checkpoint, leased, make_cp

if TYPE_CHECKING:
    from .. import StoreFactory


def event_cp(run_id: str, seq: int, name: str, **fields: Any) -> Checkpoint:
    return make_cp(run_id, seq, name=f"event:{name}", kind="event", started_at=NOW, **fields)


async def wait(
    store: StateStore,
    run_id: str,
    seq: int,
    name: str,
    match: dict[str, Any] | None = None,
    now: int = NOW,
    owner: str = OWNER,
) -> SignalWait | None:
    return await store.wait_event(event_cp(run_id, seq, name), name, match, owner, now)


# -- matching ---------------------------------------------------------------------------


def test_canonical_json_ignores_key_order_and_integral_floats() -> None:
    assert canonical({"b": [1, {"y": 2, "x": 1.0}], "a": "é"}) == canonical(
        {"a": "é", "b": [1.0, {"x": 1, "y": 2}]}
    )
    assert canonical(True) != canonical(1)
    assert canonical([1, 2]) != canonical([2, 1])
    assert canonical(0.5) == "0.5"


def test_match_compares_top_level_keys_by_json_equality() -> None:
    payload = {"order": 7, "customer": {"id": 1, "tier": "gold"}, "extra": [1]}
    assert matches(payload, None)
    assert matches(payload, {})
    assert matches(payload, {"order": 7})
    assert matches(payload, {"order": 7.0, "customer": {"tier": "gold", "id": 1}})
    assert not matches(payload, {"order": "7"})
    assert not matches(payload, {"customer": {"id": 1}})  # equality, not containment
    assert not matches(payload, {"missing": None})
    assert not matches("not an object", {"order": 7})
    assert matches("not an object", None)


# -- delivery ---------------------------------------------------------------------------


async def test_a_waiter_receives_a_published_event(store: StateStore) -> None:
    await leased(store, "r1")
    assert await wait(store, "r1", 0, "order.paid") == SignalWait(False)
    pending = await checkpoint(store, "r1", 0)
    assert (pending.status, pending.kind, pending.name) == (
        CheckpointStatus.PENDING,
        "event",
        "event:order.paid",
    )

    delivery = await store.publish_event("order.paid", NESTED, NOW + 5)

    assert delivery == EventDelivery(["r1"], 1)
    done = await checkpoint(store, "r1", 0)
    assert (done.status, done.output, done.finished_at) == (
        CheckpointStatus.COMPLETED,
        NESTED,
        NOW + 5,
    )
    # the waiter is gone: the next publish reaches nobody and is buffered
    assert await store.publish_event("order.paid", "again", NOW + 6) == EventDelivery(
        [], 0, buffered=True
    )
    assert await store.list_buffered_events("order.paid") == ["again"]


async def test_every_matching_waiter_receives_one_publish(store: StateStore) -> None:
    for run_id in ("a", "b", "c"):
        await leased(store, run_id)
    await wait(store, "a", 0, "deploy")
    await wait(store, "a", 1, "deploy")  # two waits of one run (a gather)
    await wait(store, "b", 4, "deploy", {"env": "prod"})
    await wait(store, "c", 0, "deploy", {"env": "staging"})

    delivery = await store.publish_event("deploy", {"env": "prod", "v": 3}, NOW + 1)

    assert sorted(delivery.run_ids) == ["a", "b"]
    assert delivery.recipients == 2
    assert not delivery.buffered
    for run_id, seq in (("a", 0), ("a", 1), ("b", 4)):
        assert (await checkpoint(store, run_id, seq)).output == {"env": "prod", "v": 3}
    assert (await checkpoint(store, "c", 0)).status is CheckpointStatus.PENDING
    assert await store.list_buffered_events("deploy") == []
    assert (await store.publish_event("deploy", {"env": "staging"}, NOW + 2)).run_ids == ["c"]


async def test_match_is_key_order_insensitive_in_nested_values(store: StateStore) -> None:
    await leased(store, "r1")
    match = {"customer": {"id": 7, "tags": ["a", {"x": 1, "y": 2}]}, "n": 1}
    await wait(store, "r1", 0, "signup", match)

    miss = await store.publish_event("signup", {"customer": {"id": 7}, "n": 1}, NOW, buffer=False)
    assert miss == EventDelivery([], 0)
    hit = await store.publish_event(
        "signup",
        {"n": 1.0, "other": True, "customer": {"tags": ["a", {"y": 2, "x": 1}], "id": 7}},
        NOW + 1,
    )
    assert hit.run_ids == ["r1"]


async def test_an_event_nobody_receives_is_buffered_once_for_the_first_matching_wait(
    store: StateStore,
) -> None:
    await leased(store, "r1")
    await leased(store, "r2")
    for i, payload in enumerate([{"id": 1}, {"id": 2, "n": "first"}, {"id": 2, "n": "second"}]):
        assert await store.publish_event("e", payload, NOW + i) == EventDelivery(
            [], 0, buffered=True
        )
    await store.publish_event("other", "not mine", NOW)

    got = await wait(store, "r1", 0, "e", {"id": 2}, NOW + 10)
    assert got == SignalWait(True, {"id": 2, "n": "first"})
    done = await checkpoint(store, "r1", 0)
    assert (done.status, done.output, done.finished_at) == (
        CheckpointStatus.COMPLETED,
        {"id": 2, "n": "first"},
        NOW + 10,
    )
    assert await store.list_buffered_events("e") == [{"id": 1}, {"id": 2, "n": "second"}]
    # an unmatched wait takes the oldest
    assert await wait(store, "r2", 0, "e", None) == SignalWait(True, {"id": 1})
    assert await wait(store, "r2", 1, "e", {"id": 3}) == SignalWait(False)
    assert await store.list_buffered_events("e") == [{"id": 2, "n": "second"}]
    assert await store.list_buffered_events("other") == ["not mine"]


async def test_buffered_events_are_matched_past_the_first_page(store: StateStore) -> None:
    await leased(store, "r1")
    for i in range(450):
        await store.publish_event("bulk", {"i": i}, NOW + i)

    assert await wait(store, "r1", 0, "bulk", {"i": 420}) == SignalWait(True, {"i": 420})
    assert len(await store.list_buffered_events("bulk")) == 449


async def test_buffer_false_drops_an_event_nobody_receives(store: StateStore) -> None:
    await leased(store, "r1")

    assert await store.publish_event("e", 1, NOW, buffer=False) == EventDelivery([], 0)

    assert await store.list_buffered_events("e") == []
    assert await wait(store, "r1", 0, "e") == SignalWait(False)


async def test_triggered_runs_count_as_recipients_and_prevent_buffering(store: StateStore) -> None:
    assert await store.publish_event("e", 1, NOW, triggered=2) == EventDelivery([], 2)
    assert await store.list_buffered_events("e") == []

    await leased(store, "r1")
    await wait(store, "r1", 0, "e")
    assert await store.publish_event("e", 2, NOW, triggered=1) == EventDelivery(["r1"], 2)


async def test_publish_with_an_id_is_idempotent(store: StateStore) -> None:
    await leased(store, "r1")
    await leased(store, "r2")
    await wait(store, "r1", 0, "e")

    first = await store.publish_event("e", "x", NOW, event_id="evt-1")
    assert first == EventDelivery(["r1"], 1)
    await wait(store, "r2", 0, "e")
    again = await store.publish_event("e", "x", NOW + 1, event_id="evt-1")
    assert again == EventDelivery([], 1, duplicate=True)
    assert (await checkpoint(store, "r2", 0)).status is CheckpointStatus.PENDING

    # a buffered publish is recorded too, and buffered once
    assert (await store.publish_event("f", "y", NOW, event_id="evt-2")).buffered
    assert await store.publish_event("f", "y", NOW, event_id="evt-2") == EventDelivery(
        [], 0, duplicate=True
    )
    assert await store.list_buffered_events("f") == ["y"]
    # ids are global: the same id on another name is a duplicate as well
    assert (await store.publish_event("g", "z", NOW, event_id="evt-2")).duplicate


async def test_wait_event_is_fenced(store: StateStore) -> None:
    await leased(store, "r1")
    await store.publish_event("e", "kept", NOW)

    assert await wait(store, "r1", 0, "e", owner=OTHER) is None
    assert await wait(store, "r1", 0, "idle", owner=OTHER) is None

    assert await store.list_buffered_events("e") == ["kept"]
    assert await store.load_checkpoints("r1") == {}
    assert (await store.publish_event("idle", 1, NOW)).buffered  # no waiter was registered


async def test_cancel_event_wait_times_out_exactly_that_wait(store: StateStore) -> None:
    await leased(store, "a")
    await leased(store, "b")
    await wait(store, "a", 0, "e")
    await wait(store, "a", 1, "e")
    await wait(store, "b", 0, "e")

    assert await store.cancel_event_wait("a", 0, "e", ERROR, NOW + 10) is None

    cp = await checkpoint(store, "a", 0)
    assert (cp.status, cp.error, cp.finished_at) == (CheckpointStatus.FAILED, ERROR, NOW + 10)
    delivery = await store.publish_event("e", "late", NOW + 11)
    assert sorted(delivery.run_ids) == ["a", "b"]
    assert (await checkpoint(store, "a", 1)).output == "late"
    assert (await checkpoint(store, "a", 0)).status is CheckpointStatus.FAILED
    assert await store.list_buffered_events("e") == []


async def test_cancel_event_wait_reports_an_event_that_won(store: StateStore) -> None:
    await leased(store, "r1")
    await wait(store, "r1", 0, "e")
    await store.publish_event("e", NESTED, NOW + 5)

    won = await store.cancel_event_wait("r1", 0, "e", ERROR, NOW + 10)

    assert won is not None
    assert (won.status, won.output, won.seq) == (CheckpointStatus.COMPLETED, NESTED, 0)
    assert await checkpoint(store, "r1", 0) == won


@pytest.mark.parametrize("end", ["settle", "update", "delete"])
async def test_waits_of_a_run_that_ended_receive_nothing(store: StateStore, end: str) -> None:
    await leased(store, "gone")
    await leased(store, "live")
    await wait(store, "gone", 0, "e")
    await wait(store, "live", 0, "e")
    if end == "settle":
        result = await store.settle_run(
            "gone", OWNER, RunStatus.CANCELLED, RunChanges(error=ERROR), NOW + 1
        )
        assert result is SettleResult.SETTLED
    elif end == "update":
        assert await store.update_run_if(
            "gone", frozenset({RunStatus.RUNNING}), {"status": "cancelled"}, NOW + 1
        )
    else:
        await store.settle_run("gone", OWNER, RunStatus.COMPLETED, RunChanges(), NOW + 1)
        assert await store.delete_run("gone")

    assert await store.publish_event("e", 1, NOW + 2) == EventDelivery(["live"], 1)
    assert await store.publish_event("e", 2, NOW + 3) == EventDelivery([], 0, buffered=True)


async def test_events_round_trip_unicode_names_and_payloads(store: StateStore) -> None:
    name = "commande.payée:注文:🎉:'\";--"
    await leased(store, "r:é")
    await store.publish_event(name, NESTED, NOW)

    assert await wait(store, "r:é", 0, name, {"ключ": "значение"}) == SignalWait(True, NESTED)
    assert await wait(store, "r:é", 1, name, {"unicode": NESTED["unicode"]}) == SignalWait(False)
    assert (await store.publish_event(name, [NESTED], NOW)).buffered  # a list matches no keys
    assert (await store.publish_event(name, NESTED, NOW)).run_ids == ["r:é"]
    assert (await checkpoint(store, "r:é", 1)).output == NESTED


# -- concurrency ------------------------------------------------------------------------


async def _race_events(stores: list[StateStore], names: int, seed: int) -> None:
    """Wait and publish on ``names`` distinct events at once, in a shuffled
    order over several store objects; every event reaches its run exactly once."""
    rng = random.Random(seed)
    store = stores[0]
    run_ids = [f"race-{seed}-{i}" for i in range(names)]
    for run_id in run_ids:
        await leased(store, run_id)

    async def waiter(i: int) -> SignalWait | None:
        await asyncio.sleep(rng.random() / 1000)
        match = {"for": run_ids[i]} if i % 2 else None
        return await wait(stores[i % len(stores)], run_ids[i], 0, f"ev-{seed}-{i}", match)

    async def publisher(i: int) -> EventDelivery:
        await asyncio.sleep(rng.random() / 1000)
        return await stores[(i + 1) % len(stores)].publish_event(
            f"ev-{seed}-{i}", {"for": run_ids[i], "i": i}, NOW
        )

    calls = [(kind, i) for i in range(names) for kind in ("w", "p")]
    rng.shuffle(calls)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(waiter(i) if kind == "w" else publisher(i) for kind, i in calls)), 60
    )
    waited = {i: out for (kind, i), out in zip(calls, outcomes, strict=True) if kind == "w"}
    published = {i: out for (kind, i), out in zip(calls, outcomes, strict=True) if kind == "p"}

    for i, run_id in enumerate(run_ids):
        payload = {"for": run_id, "i": i}
        got = waited[i]
        sent = published[i]
        assert isinstance(got, SignalWait)
        assert isinstance(sent, EventDelivery)
        if got.delivered:  # buffered first, then taken by the wait
            assert got.payload == payload
            assert sent.buffered and sent.run_ids == []
        else:  # registered first, then completed by the publish
            assert sent.run_ids == [run_id] and not sent.buffered
        cp = await checkpoint(store, run_id, 0)
        assert (cp.status, cp.output) == (CheckpointStatus.COMPLETED, payload)
        assert await store.list_buffered_events(f"ev-{seed}-{i}") == []


@pytest.mark.parametrize("seed", [1, 2])
async def test_racing_waits_and_publishes_lose_no_event(store: StateStore, seed: int) -> None:
    await _race_events([store], names=40, seed=seed)


@pytest.mark.parametrize("seed", [3, 4])
async def test_racing_waits_and_publishes_across_store_objects_lose_no_event(
    store_factory: StoreFactory, seed: int
) -> None:
    await _race_events([await store_factory(), await store_factory()], names=40, seed=seed)


async def test_many_waiters_and_publishers_on_one_name_each_get_one_event(
    store_factory: StoreFactory,
) -> None:
    """Twenty waits and twenty publishes on one name, interleaved over two
    store objects: each publish lands exactly once, in a wait or in the buffer,
    and no wait is left pending while a matching event sits in the buffer."""
    one, two = await store_factory(), await store_factory()
    for i in range(20):
        await leased(one, f"w{i}")
    rng = random.Random(7)

    async def waiter(i: int) -> SignalWait | None:
        await asyncio.sleep(rng.random() / 1000)
        return await wait((one, two)[i % 2], f"w{i}", 0, "hot")

    async def publisher(i: int) -> EventDelivery:
        await asyncio.sleep(rng.random() / 1000)
        return await (two, one)[i % 2].publish_event("hot", i, NOW)

    results = await asyncio.wait_for(
        asyncio.gather(*(waiter(i) for i in range(20)), *(publisher(i) for i in range(20))), 60
    )
    waits = [r for r in results[:20] if isinstance(r, SignalWait)]
    deliveries = [r for r in results[20:] if isinstance(r, EventDelivery)]

    taken_from_buffer = sorted(w.payload for w in waits if w.delivered)
    assert len(taken_from_buffer) == len(set(taken_from_buffer))
    buffered = await one.list_buffered_events("hot")
    pending = [
        i
        for i in range(20)
        if (await checkpoint(one, f"w{i}", 0)).status is CheckpointStatus.PENDING
    ]
    # never both a waiting run and a buffered event: one of them would be lost
    assert not (pending and buffered)
    delivered_to = sum(len(d.run_ids) for d in deliveries)
    assert delivered_to + len(taken_from_buffer) + len(pending) == 20
    assert len([d for d in deliveries if d.buffered]) == len(taken_from_buffer) + len(buffered)


async def test_racing_publishes_with_one_id_deliver_once(store_factory: StoreFactory) -> None:
    one, two = await store_factory(), await store_factory()
    await leased(one, "r1")
    await wait(one, "r1", 0, "e")

    results = await asyncio.gather(
        *((one, two)[i % 2].publish_event("e", i, NOW, event_id="same") for i in range(10))
    )

    fresh = [r for r in results if not r.duplicate]
    assert len(fresh) == 1
    assert fresh[0].run_ids == ["r1"]
    assert all(r.recipients == 1 for r in results)
    assert await one.list_buffered_events("e") == []
