"""The StateStore contract for signals (``WaitStore``): waiters, the buffer,
cancels, races.

Same fixtures as every ``stores`` module: ``store`` is an open store on an
empty database, ``store_factory`` makes more store objects on the same
database; see :mod:`durably.testing.conformance`. Every time is an explicit
integer.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

import pytest

from durably.model import CheckpointStatus, RunStatus
from durably.stores import RunChanges, SettleResult, SignalWait, StateStore

from ._helpers import (
    ERROR,
    NESTED,
    NOW,
    OTHER,
    OWNER,
    checkpoint,
    leased,
    signal_cp,
)

if TYPE_CHECKING:
    from .. import StoreFactory


# -- signals ---------------------------------------------------------------------------


async def test_wait_signal_registers_a_waiter_that_a_signal_completes(store: StateStore) -> None:
    await leased(store, "r1")
    cp = signal_cp("r1", 0, "tok", wake_at=NOW + 100)

    assert await store.wait_signal(cp, "tok", OWNER, NOW) == SignalWait(False)
    assert await checkpoint(store, "r1", 0) == cp

    assert await store.send_signal("tok", NESTED, NOW + 5) == "r1"

    done = await checkpoint(store, "r1", 0)
    assert (done.status, done.output, done.finished_at) == (
        CheckpointStatus.COMPLETED,
        NESTED,
        NOW + 5,
    )
    assert (done.name, done.kind, done.wake_at) == ("signal:tok", "signal", NOW + 100)
    assert await store.list_buffered_signals("tok") == []
    # the waiter was removed: the next signal is buffered
    assert await store.send_signal("tok", "second", NOW + 6) is None
    assert await store.list_buffered_signals("tok") == ["second"]
    assert (await checkpoint(store, "r1", 0)).output == NESTED


async def test_signals_sent_first_are_buffered_and_consumed_fifo(store: StateStore) -> None:
    await leased(store, "r1")
    payloads = [None, {"n": 1}, "three", NESTED]
    for i, payload in enumerate(payloads):
        assert await store.send_signal("tok", payload, NOW + i) is None
    await store.send_signal("other-token", "not mine", NOW)

    assert await store.list_buffered_signals("tok") == payloads
    received = [
        await store.wait_signal(signal_cp("r1", seq, "tok"), "tok", OWNER, NOW + 10 + seq)
        for seq in range(len(payloads))
    ]

    assert received == [SignalWait(True, p) for p in payloads]
    for seq, payload in enumerate(payloads):
        cp = await checkpoint(store, "r1", seq)
        assert (cp.status, cp.output, cp.finished_at) == (
            CheckpointStatus.COMPLETED,
            payload,
            NOW + 10 + seq,
        )
    assert await store.list_buffered_signals("tok") == []
    assert await store.list_buffered_signals("other-token") == ["not mine"]
    assert await store.list_buffered_signals("never-used") == []


async def test_expire_buffered_deletes_old_signals_and_events_only(store: StateStore) -> None:
    for i in range(3):
        await store.send_signal("stray", f"old-{i}", NOW + i)
        await store.publish_event("nobody.listens", {"old": i}, NOW + i)
    await store.send_signal("stray", "new", NOW + 100)
    await store.publish_event("nobody.listens", {"new": 1}, NOW + 100)

    # bounded per call, oldest first
    assert await store.expire_buffered(NOW + 50, 2) == 2
    assert await store.expire_buffered(NOW + 50, 100) == 4
    assert await store.expire_buffered(NOW + 50, 100) == 0

    assert await store.list_buffered_signals("stray") == ["new"]
    assert await store.list_buffered_events("nobody.listens") == [{"new": 1}]


async def test_wait_signal_is_fenced(store: StateStore) -> None:
    await leased(store, "r1")
    await store.send_signal("tok", "kept", NOW)

    assert await store.wait_signal(signal_cp("r1", 0, "tok"), "tok", OTHER, NOW) is None
    assert await store.wait_signal(signal_cp("r1", 0, "idle"), "idle", OTHER, NOW) is None

    assert await store.list_buffered_signals("tok") == ["kept"]
    assert await store.load_checkpoints("r1") == {}
    assert await store.send_signal("idle", "x", NOW) is None  # no waiter was registered


async def test_several_waiters_on_a_token_are_served_oldest_first(store: StateStore) -> None:
    for run_id in ("first", "second", "third"):
        await leased(store, run_id)
    await store.wait_signal(signal_cp("first", 0, "tok"), "tok", OWNER, NOW)
    await store.wait_signal(signal_cp("second", 3, "tok"), "tok", OWNER, NOW + 1)
    await store.wait_signal(signal_cp("third", 1, "tok"), "tok", OWNER, NOW + 2)
    # registered again (a replay), the first wait keeps its place in line
    await store.wait_signal(signal_cp("first", 0, "tok"), "tok", OWNER, NOW + 3)

    sent = [await store.send_signal("tok", f"m{i}", NOW + 10 + i) for i in range(3)]

    assert sent == ["first", "second", "third"]
    assert (await checkpoint(store, "first", 0)).output == "m0"
    assert (await checkpoint(store, "second", 3)).output == "m1"
    assert (await checkpoint(store, "third", 1)).output == "m2"
    assert await store.send_signal("tok", "late", NOW + 20) is None  # nobody left: buffered
    assert await store.list_buffered_signals("tok") == ["late"]


async def test_a_waiter_that_leaves_keeps_the_others_in_line(store: StateStore) -> None:
    for run_id in ("a", "b", "c", "d"):
        await leased(store, run_id)
        await store.wait_signal(signal_cp(run_id, 0, "tok"), "tok", OWNER, NOW)

    assert await store.cancel_signal_wait("b", 0, "tok", ERROR, NOW + 1) is None  # timed out
    ended = await store.settle_run("c", OWNER, RunStatus.CANCELLED, RunChanges(), NOW + 1)
    assert ended is SettleResult.SETTLED

    assert await store.send_signal("tok", 1, NOW + 2) == "a"
    assert await store.send_signal("tok", 2, NOW + 3) == "d"
    assert await store.send_signal("tok", 3, NOW + 4) is None
    assert (await checkpoint(store, "b", 0)).status is CheckpointStatus.FAILED
    assert await store.list_buffered_signals("tok") == [3]


async def test_racing_signals_serve_each_waiter_once(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    waiters, extra = 24, 6
    for n in range(waiters):
        await leased(stores[0], f"w{n}")
        await stores[n % 2].wait_signal(signal_cp(f"w{n}", 0, "tok"), "tok", OWNER, NOW + n)

    sent = await asyncio.gather(
        *(stores[i % 2].send_signal("tok", i, NOW + 100) for i in range(waiters + extra))
    )

    served = [run_id for run_id in sent if run_id is not None]
    assert sorted(served) == sorted(f"w{n}" for n in range(waiters))  # each waiter once
    payloads = [(await checkpoint(stores[0], f"w{n}", 0)).output for n in range(waiters)]
    buffered = await stores[0].list_buffered_signals("tok")
    # each signal exactly once: delivered or buffered
    assert sorted(payloads + buffered) == list(range(waiters + extra))
    assert len(buffered) == extra


async def test_cancel_signal_wait_times_out_the_wait(store: StateStore) -> None:
    await leased(store, "r1")
    await store.wait_signal(signal_cp("r1", 0, "tok"), "tok", OWNER, NOW)

    assert await store.cancel_signal_wait("r1", 0, "tok", ERROR, NOW + 10) is None

    cp = await checkpoint(store, "r1", 0)
    assert (cp.status, cp.error, cp.finished_at) == (CheckpointStatus.FAILED, ERROR, NOW + 10)
    assert await store.send_signal("tok", "late", NOW + 11) is None
    assert await store.list_buffered_signals("tok") == ["late"]
    assert (await checkpoint(store, "r1", 0)).status is CheckpointStatus.FAILED


async def test_cancel_signal_wait_reports_a_signal_that_won(store: StateStore) -> None:
    await leased(store, "r1")
    await store.wait_signal(signal_cp("r1", 0, "tok"), "tok", OWNER, NOW)
    await store.send_signal("tok", NESTED, NOW + 5)

    won = await store.cancel_signal_wait("r1", 0, "tok", ERROR, NOW + 10)

    assert won is not None
    assert (won.status, won.output, won.seq, won.run_id) == (
        CheckpointStatus.COMPLETED,
        NESTED,
        0,
        "r1",
    )
    assert await checkpoint(store, "r1", 0) == won
    assert await store.list_buffered_signals("tok") == []


async def test_cancel_signal_wait_spares_the_waiter_that_replaced_it(store: StateStore) -> None:
    await leased(store, "a")
    await leased(store, "b")
    await store.wait_signal(signal_cp("a", 0, "tok"), "tok", OWNER, NOW)
    await store.wait_signal(signal_cp("b", 0, "tok"), "tok", OWNER, NOW + 1)

    # a's wait times out after b took the token over: b's waiter stays
    assert await store.cancel_signal_wait("a", 0, "tok", ERROR, NOW + 10) is None

    assert (await checkpoint(store, "a", 0)).status is CheckpointStatus.FAILED
    assert (await checkpoint(store, "b", 0)).status is CheckpointStatus.PENDING
    assert await store.send_signal("tok", "for b", NOW + 11) == "b"
    assert (await checkpoint(store, "b", 0)).output == "for b"
    assert (await checkpoint(store, "a", 0)).status is CheckpointStatus.FAILED


async def test_a_repeated_cancel_spares_a_newer_waiter(store: StateStore) -> None:
    await leased(store, "a")
    await leased(store, "b")
    await store.wait_signal(signal_cp("a", 0, "tok"), "tok", OWNER, NOW)
    assert await store.cancel_signal_wait("a", 0, "tok", ERROR, NOW + 1) is None
    # the token is registered again, by a later wait of the same run and by another run
    await store.wait_signal(signal_cp("a", 1, "tok"), "tok", OWNER, NOW + 2)

    # a timeout sweep that retries the first cancel must not remove the new waiter
    assert await store.cancel_signal_wait("a", 0, "tok", ERROR, NOW + 3) is None
    assert await store.send_signal("tok", "to a:1", NOW + 4) == "a"
    assert (await checkpoint(store, "a", 1)).output == "to a:1"

    await store.wait_signal(signal_cp("b", 0, "tok"), "tok", OWNER, NOW + 5)
    assert await store.cancel_signal_wait("a", 0, "tok", ERROR, NOW + 6) is None
    assert await store.cancel_signal_wait("a", 1, "tok", ERROR, NOW + 6) is not None
    assert await store.send_signal("tok", "to b", NOW + 7) == "b"
    assert (await checkpoint(store, "a", 0)).status is CheckpointStatus.FAILED


async def test_signals_round_trip_unicode_tokens_and_payloads(store: StateStore) -> None:
    token = "approve:注文:🎉:'\";--"
    await leased(store, "r:é")
    await store.send_signal(token, NESTED, NOW)

    got = await store.wait_signal(signal_cp("r:é", 0, token), token, OWNER, NOW)
    assert got == SignalWait(True, NESTED)
    assert (await checkpoint(store, "r:é", 0)).output == NESTED

    registered = await store.wait_signal(signal_cp("r:é", 1, token), token, OWNER, NOW)
    assert registered == SignalWait(False)
    assert await store.send_signal(token, [NESTED, "ü"], NOW + 1) == "r:é"
    assert (await checkpoint(store, "r:é", 1)).output == [NESTED, "ü"]


async def _race_signals(
    waiters: list[StateStore], senders: list[StateStore], tokens: int, seed: int
) -> None:
    """Wait and send on ``tokens`` distinct tokens at once, in a shuffled order,
    then check that each signal reached its run exactly once."""
    rng = random.Random(seed)
    store = waiters[0]
    run_ids = [f"race-{seed}-{i}" for i in range(tokens)]
    for run_id in run_ids:
        await leased(store, run_id)

    async def wait(i: int) -> SignalWait | None:
        await asyncio.sleep(rng.random() / 1000)
        token = f"tok-{seed}-{i}"
        cp = signal_cp(run_ids[i], 0, token)
        return await waiters[i % len(waiters)].wait_signal(cp, token, OWNER, NOW)

    async def send(i: int) -> str | None:
        await asyncio.sleep(rng.random() / 1000)
        return await senders[i % len(senders)].send_signal(
            f"tok-{seed}-{i}", {"for": run_ids[i], "i": i}, NOW
        )

    calls: list[tuple[str, int]] = [(kind, i) for i in range(tokens) for kind in ("w", "s")]
    rng.shuffle(calls)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(wait(i) if kind == "w" else send(i) for kind, i in calls)), 60
    )
    waited = {i: out for (kind, i), out in zip(calls, outcomes, strict=True) if kind == "w"}
    sent = {i: out for (kind, i), out in zip(calls, outcomes, strict=True) if kind == "s"}

    for i, run_id in enumerate(run_ids):
        payload = {"for": run_id, "i": i}
        wait_result = waited[i]
        assert isinstance(wait_result, SignalWait)
        if wait_result.delivered:  # buffered first, then consumed by the wait
            assert wait_result.payload == payload
            assert sent[i] is None
        else:  # registered first, then completed by the send
            assert sent[i] == run_id
        cp = await checkpoint(store, run_id, 0)
        assert (cp.status, cp.output) == (CheckpointStatus.COMPLETED, payload)
        assert await store.list_buffered_signals(f"tok-{seed}-{i}") == []
        assert await store.send_signal(f"tok-{seed}-{i}", "probe", NOW) is None  # no waiter left


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_racing_waits_and_sends_lose_no_signal(store: StateStore, seed: int) -> None:
    await _race_signals([store], [store], tokens=40, seed=seed)


@pytest.mark.parametrize("seed", [4, 5])
async def test_racing_waits_and_sends_across_store_objects_lose_no_signal(
    store_factory: StoreFactory, seed: int
) -> None:
    one, two = await store_factory(), await store_factory()
    await _race_signals([one, two], [two, one], tokens=40, seed=seed)


async def test_concurrent_sends_to_one_token_are_each_consumed_once(
    store_factory: StoreFactory,
) -> None:
    one, two = await store_factory(), await store_factory()
    await leased(one, "r1")

    await asyncio.gather(*((one, two)[i % 2].send_signal("tok", i, NOW) for i in range(20)))
    got = await asyncio.gather(
        *(
            (one, two)[seq % 2].wait_signal(signal_cp("r1", seq, "tok"), "tok", OWNER, NOW)
            for seq in range(20)
        )
    )

    assert sorted(w.payload for w in got if w is not None and w.delivered) == list(range(20))
    assert await one.list_buffered_signals("tok") == []
