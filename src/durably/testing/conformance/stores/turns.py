"""The StateStore contract for leases and turns (``TurnStore``, with
``RunStore.update_run_if`` and ``request_wake``): start, continue, renew,
settle, release.

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
from durably.stores import RunChanges, RunQuery, SettleResult, SignalWait, StateStore

from ._helpers import (
    ERROR,
    LEASE,
    NESTED,
    NOW,
    OTHER,
    OWNER,
    PENDING,
    RUNNING,
    SUSPENDED,
    lease_one,
    leased,
    make_cp,
    make_run,
    signal_cp,
    status_of,
)

if TYPE_CHECKING:
    from .. import StoreFactory


# -- leases and turns ------------------------------------------------------------------


async def test_start_turns_leases_and_clears_wake_fields(store: StateStore) -> None:
    await store.create_run(
        make_run("r1", RunStatus.SUSPENDED, wake_at=NOW - 10, wake_requested_at=NOW - 5)
    )

    run = await lease_one(store, "r1", OWNER, NOW, NOW + LEASE, SUSPENDED)

    assert run is not None
    assert (run.status, run.locked_by, run.locked_until) == (
        RunStatus.RUNNING,
        OWNER,
        NOW + LEASE,
    )
    assert (run.wake_at, run.wake_requested_at, run.updated_at) == (None, None, NOW)
    assert await store.get_run("r1") == run


async def test_start_turns_refuses_other_statuses(store: StateStore) -> None:
    await store.create_run(make_run("r1"))
    await store.create_run(make_run("done", RunStatus.COMPLETED))

    assert await lease_one(store, "r1", OWNER, NOW, NOW + LEASE, SUSPENDED) is None
    assert await lease_one(store, "done", OWNER, NOW, NOW + LEASE, PENDING) is None
    assert await lease_one(store, "missing", OWNER, NOW, NOW + LEASE, PENDING) is None
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.locked_by) == (RunStatus.PENDING, None)


async def test_start_turns_refuses_a_held_lease(store: StateStore) -> None:
    await leased(store, "r1")

    # the lease holds until and including its last millisecond
    assert await lease_one(store, "r1", OTHER, NOW + LEASE, NOW + 2 * LEASE, RUNNING) is None
    run = await store.get_run("r1")
    assert run is not None
    assert (run.locked_by, run.locked_until) == (OWNER, NOW + LEASE)


async def test_start_turns_takes_an_expired_lease_and_fences_the_old_owner(
    store: StateStore,
) -> None:
    await leased(store, "r1")
    later = NOW + LEASE + 1

    run = await lease_one(store, "r1", OTHER, later, later + LEASE, RUNNING)

    assert run is not None
    assert (run.locked_by, run.locked_until) == (OTHER, later + LEASE)
    assert await store.renew_lease("r1", OWNER, later + LEASE) is False
    assert await store.save_checkpoint(make_cp("r1", 0), OWNER) is False


async def test_a_lease_without_an_expiry_counts_as_expired(store: StateStore) -> None:
    await store.create_run(make_run("r1", RunStatus.RUNNING, locked_by=OWNER))
    await store.create_run(make_run("r2", RunStatus.SUSPENDED, locked_by=OWNER, wake_at=NOW))

    assert await store.list_orphans(NOW, 10) == ["r1"]
    assert await store.claim_due_batch(["r2"], NOW, NOW + LEASE) == ["r2"]
    run = await lease_one(store, "r1", OTHER, NOW, NOW + LEASE, RUNNING)
    assert run is not None
    assert run.locked_by == OTHER


async def test_racing_acquires_have_exactly_one_winner(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    await stores[0].create_run(make_run("r1"))

    results = await asyncio.gather(
        *(lease_one(stores[i % 2], "r1", f"owner-{i}", NOW, NOW + LEASE, PENDING) for i in range(8))
    )

    winners = [run for run in results if run is not None]
    assert len(winners) == 1
    stored = await stores[1].get_run("r1")
    assert stored is not None
    assert stored.locked_by == winners[0].locked_by


WAKEABLE = frozenset({RunStatus.PENDING, RunStatus.SUSPENDED})


async def test_start_turns_leases_each_free_run_with_its_history(store: StateStore) -> None:
    suspended = RunStatus.SUSPENDED
    await store.create_run(make_run("pending"))
    await store.create_run(make_run("asleep", suspended, wake_at=NOW - 1, wake_requested_at=NOW))
    await store.create_run(make_run("expired", suspended, locked_by=OTHER, locked_until=NOW - 1))
    await store.create_run(make_run("held", suspended, locked_by=OTHER, locked_until=NOW))
    await store.create_run(make_run("running", RunStatus.RUNNING, locked_until=NOW - 1))
    await store.create_run(make_run("done", RunStatus.COMPLETED))
    await leased(store, "asleep-history", now=NOW - 2 * LEASE)
    await store.save_checkpoint(make_cp("asleep-history", 0, CheckpointStatus.COMPLETED), OWNER)
    await store.save_checkpoint(make_cp("asleep-history", 1), OWNER)
    changes = RunChanges(wake_at=NOW - 5)
    await store.settle_run("asleep-history", OWNER, suspended, changes, NOW - 2 * LEASE)
    ids = ["held", "pending", "missing", "asleep", "done", "asleep-history", "running"]

    turns = await store.start_turns([*ids, "expired", "pending"], OWNER, NOW, NOW + LEASE, WAKEABLE)

    assert sorted(turns) == ["asleep", "asleep-history", "expired", "pending"]
    for run_id, (run, history) in turns.items():
        assert (run.run_id, run.status, run.locked_by, run.locked_until) == (
            run_id,
            RunStatus.RUNNING,
            OWNER,
            NOW + LEASE,
        )
        assert (run.wake_at, run.wake_requested_at) == (None, None)
        assert list(history) == ([0, 1] if run_id == "asleep-history" else [])
    assert turns["asleep-history"][1][0].status is CheckpointStatus.COMPLETED
    assert turns["asleep-history"][1][1].status is CheckpointStatus.PENDING
    for run_id, status, owner in [
        ("held", suspended, OTHER),
        ("running", RunStatus.RUNNING, None),
        ("done", RunStatus.COMPLETED, None),
    ]:
        found = await store.get_run(run_id)
        assert found is not None
        assert (found.status, found.locked_by) == (status, owner)
    assert await store.start_turns([], OWNER, NOW, NOW + LEASE, WAKEABLE) == {}


async def test_start_turns_leaves_what_another_instance_leased_first(
    store_factory: StoreFactory,
) -> None:
    ours, theirs = await store_factory(), await store_factory()
    for run_id in ("r1", "r2", "r3"):
        await ours.create_run(make_run(run_id))

    assert await lease_one(theirs, "r2", OTHER, NOW, NOW + LEASE, PENDING) is not None
    turns = await ours.start_turns(["r1", "r2", "r3"], OWNER, NOW, NOW + LEASE, WAKEABLE)

    assert sorted(turns) == ["r1", "r3"]
    r2 = await ours.get_run("r2")
    assert r2 is not None and r2.locked_by == OTHER
    assert await theirs.renew_lease("r2", OTHER, NOW + 2 * LEASE) is True  # not fenced


async def test_racing_start_turns_lease_each_run_once(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    ids = [f"r{i}" for i in range(40)]
    for run_id in ids:
        await stores[0].create_run(make_run(run_id))
    orders = [random.sample(ids, len(ids)) for _ in range(6)]

    results = await asyncio.gather(
        *(
            stores[i % 2].start_turns(order, f"owner-{i}", NOW, NOW + LEASE, WAKEABLE)
            for i, order in enumerate(orders)
        )
    )

    won = {run_id: f"owner-{i}" for i, result in enumerate(results) for run_id in result}
    assert sum(len(result) for result in results) == len(ids)  # each run leased once
    assert sorted(won) == sorted(ids)
    for run_id, owner in won.items():
        run = await stores[1].get_run(run_id)
        assert run is not None
        assert (run.status, run.locked_by) == (RunStatus.RUNNING, owner)


async def test_continue_turn_clears_the_stamp_and_extends_the_lease(store: StateStore) -> None:
    await leased(store, "r1")
    assert await store.request_wake("r1", NOW + 1) is True

    assert await store.continue_turn("r1", OTHER, NOW + 2 * LEASE) is None
    run = await store.continue_turn("r1", OWNER, NOW + 2 * LEASE)

    assert run is not None
    assert (run.status, run.locked_by, run.locked_until) == (
        RunStatus.RUNNING,
        OWNER,
        NOW + 2 * LEASE,
    )
    assert run.wake_requested_at is None
    assert await store.release_run("r1", OWNER, NOW + 2)
    assert await store.continue_turn("r1", OWNER, NOW + 3 * LEASE) is None


async def test_renew_lease_extends_only_the_owners_lease(store: StateStore) -> None:
    await leased(store, "r1")

    assert await store.renew_lease("r1", OTHER, NOW + 9 * LEASE) is False
    assert await store.renew_lease("r1", OWNER, NOW + 2 * LEASE) is True
    assert await store.renew_lease("missing", OWNER, NOW + 2 * LEASE) is False
    run = await store.get_run("r1")
    assert run is not None
    assert (run.locked_by, run.locked_until) == (OWNER, NOW + 2 * LEASE)


async def test_renew_lease_fails_once_the_run_is_cancelled(store: StateStore) -> None:
    await leased(store, "r1")

    cancelled = await store.update_run_if(
        "r1", RUNNING, {"status": RunStatus.CANCELLED.value}, NOW + 1
    )

    assert cancelled is True
    assert await store.renew_lease("r1", OWNER, NOW + 2 * LEASE) is False
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.locked_by, run.locked_until) == (RunStatus.CANCELLED, None, None)


async def test_renew_lease_fails_after_release(store: StateStore) -> None:
    await leased(store, "r1")
    assert await store.release_run("r1", OWNER, NOW + 1) is True

    assert await store.renew_lease("r1", OWNER, NOW + 2 * LEASE) is False


async def test_settle_run_writes_the_outcome_and_releases(store: StateStore) -> None:
    await leased(store, "r1")

    result = await store.settle_run(
        "r1", OWNER, RunStatus.SUSPENDED, RunChanges(output=NESTED, wake_at=NOW + 500), NOW + 7
    )

    assert result is SettleResult.SETTLED
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.output, run.wake_at, run.updated_at) == (
        RunStatus.SUSPENDED,
        NESTED,
        NOW + 500,
        NOW + 7,
    )
    assert (run.locked_by, run.locked_until) == (None, None)
    assert await store.renew_lease("r1", OWNER, NOW + LEASE) is False


async def test_settle_run_failed_stores_the_error(store: StateStore) -> None:
    await leased(store, "r1")
    error = {"message": "boom", "code": None, "type": "RuntimeError", "details": NESTED}

    result = await store.settle_run("r1", OWNER, RunStatus.FAILED, RunChanges(error=error), NOW)

    assert result is SettleResult.SETTLED
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.error, run.output) == (RunStatus.FAILED, error, None)


async def test_settle_run_refuses_to_suspend_while_a_wake_is_requested(store: StateStore) -> None:
    await leased(store, "r1")
    await store.request_wake("r1", NOW + 1)

    result = await store.settle_run(
        "r1", OWNER, RunStatus.SUSPENDED, RunChanges(wake_at=NOW + 900), NOW + 2
    )

    assert result is SettleResult.WAKE_REQUESTED
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.locked_by, run.wake_at) == (RunStatus.RUNNING, OWNER, None)
    assert await store.renew_lease("r1", OWNER, NOW + 2 * LEASE) is True


async def test_settle_run_terminal_ignores_the_wake_stamp(store: StateStore) -> None:
    await leased(store, "r1")
    await store.request_wake("r1", NOW + 1)

    result = await store.settle_run(
        "r1", OWNER, RunStatus.COMPLETED, RunChanges(output="done"), NOW + 2
    )

    assert result is SettleResult.SETTLED
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.output, run.locked_by) == (RunStatus.COMPLETED, "done", None)


@pytest.mark.parametrize("status", [RunStatus.SUSPENDED, RunStatus.COMPLETED])
async def test_settle_run_is_lost_without_the_lease(store: StateStore, status: RunStatus) -> None:
    await leased(store, "held")
    await leased(store, "released")
    await store.release_run("released", OWNER, NOW + 1)

    assert await store.settle_run("held", OTHER, status, RunChanges(), NOW) is SettleResult.LOST
    assert await store.settle_run("released", OWNER, status, RunChanges(), NOW) is SettleResult.LOST
    assert await store.settle_run("missing", OWNER, status, RunChanges(), NOW) is SettleResult.LOST
    assert await status_of(store, "held") is RunStatus.RUNNING
    assert await status_of(store, "released") is RunStatus.PENDING


async def test_settle_run_terminal_deletes_waiters_suspend_keeps_them(store: StateStore) -> None:
    for run_id in ("ends", "sleeps"):
        await leased(store, run_id)
        wait = await store.wait_signal(signal_cp(run_id, 0, run_id), run_id, OWNER, NOW)
        assert wait == SignalWait(False)

    ended = await store.settle_run("ends", OWNER, RunStatus.CANCELLED, RunChanges(), NOW)
    slept = await store.settle_run("sleeps", OWNER, RunStatus.SUSPENDED, RunChanges(), NOW)
    assert (ended, slept) == (SettleResult.SETTLED, SettleResult.SETTLED)

    assert await store.send_signal("ends", 1, NOW) is None
    assert await store.list_buffered_signals("ends") == [1]
    assert await store.send_signal("sleeps", 2, NOW) == "sleeps"


async def test_release_run_hands_the_run_back_and_fences(store: StateStore) -> None:
    await leased(store, "r1")

    assert await store.release_run("r1", OTHER, NOW + 1) is False
    assert await store.release_run("r1", OWNER, NOW + 1) is True

    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.locked_by, run.locked_until, run.updated_at) == (
        RunStatus.PENDING,
        None,
        None,
        NOW + 1,
    )
    assert await store.save_checkpoint(make_cp("r1", 0), OWNER) is False
    assert await store.release_run("r1", OWNER, NOW + 2) is False
    assert await store.list_pending(NOW + 2, 10) == ["r1"]


async def test_request_wake_stamps_live_runs_only(store: StateStore) -> None:
    await store.create_run(make_run("pending"))
    await store.create_run(make_run("suspended", RunStatus.SUSPENDED))
    await leased(store, "running")
    for status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD):
        await store.create_run(make_run(status.value, status))

    for run_id in ("pending", "suspended", "running"):
        assert await store.request_wake(run_id, NOW + 3) is True
        run = await store.get_run(run_id)
        assert run is not None
        assert run.wake_requested_at == NOW + 3
    for status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD):
        assert await store.request_wake(status.value, NOW + 3) is False
        run = await store.get_run(status.value)
        assert run is not None
        assert run.wake_requested_at is None
    assert await store.request_wake("missing", NOW) is False


async def test_update_run_if_applies_changes_under_the_expected_status(
    store: StateStore,
) -> None:
    await store.create_run(make_run("r1", RunStatus.SUSPENDED, tags=["old"]))

    changed = await store.update_run_if(
        "r1",
        SUSPENDED,
        {
            "status": RunStatus.BLOCKED.value,
            "output": NESTED,
            "error": {"message": "e"},
            "input": [1, "ü"],
            "tags": ["new", "ü"],
            "priority": 9,
            "wake_at": NOW + 50,
            "deadline_at": NOW + 60,
        },
        NOW + 1,
    )

    assert changed is True
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.output, run.error, run.input) == (
        RunStatus.BLOCKED,
        NESTED,
        {"message": "e"},
        [1, "ü"],
    )
    assert (run.tags, run.priority, run.wake_at, run.deadline_at, run.updated_at) == (
        ["new", "ü"],
        9,
        NOW + 50,
        NOW + 60,
        NOW + 1,
    )
    assert [r.run_id for r in (await store.list_runs(RunQuery(tag="ü"))).runs] == ["r1"]
    assert (await store.list_runs(RunQuery(tag="old"))).runs == []


async def test_update_run_if_refuses_a_stale_status(store: StateStore) -> None:
    await store.create_run(make_run("r1", RunStatus.SUSPENDED, wake_at=NOW))

    assert await store.update_run_if("r1", PENDING, {"wake_at": NOW + 5}, NOW + 1) is False
    assert await store.update_run_if("missing", PENDING, {"wake_at": 1}, NOW) is False

    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.wake_at, run.updated_at) == (RunStatus.SUSPENDED, NOW, NOW)


async def test_update_run_if_with_no_changes_touches_the_run(store: StateStore) -> None:
    await store.create_run(make_run("r1"))

    assert await store.update_run_if("r1", PENDING, {}, NOW + 4) is True

    run = await store.get_run("r1")
    assert run is not None
    assert run.updated_at == NOW + 4


async def test_update_run_if_rejects_columns_it_may_not_set(store: StateStore) -> None:
    await store.create_run(make_run("r1"))

    for column in ("id", "run_id", "created_at", "nonsense"):
        with pytest.raises(ValueError, match="cannot update"):
            await store.update_run_if("r1", PENDING, {column: "x"}, NOW + 1)

    assert await store.get_run("r1") == make_run("r1")


async def test_update_run_if_terminal_clears_the_lease_and_waiters(store: StateStore) -> None:
    await leased(store, "r1")
    await store.wait_signal(signal_cp("r1", 0, "tok"), "tok", OWNER, NOW)

    changed = await store.update_run_if(
        "r1", RUNNING, {"status": RunStatus.CANCELLED.value, "error": ERROR}, NOW + 1
    )

    assert changed is True
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.error, run.locked_by, run.locked_until) == (
        RunStatus.CANCELLED,
        ERROR,
        None,
        None,
    )
    assert await store.send_signal("tok", "x", NOW + 2) is None
    assert await store.settle_run("r1", OWNER, RunStatus.COMPLETED, RunChanges(), NOW + 3) is (
        SettleResult.LOST
    )
