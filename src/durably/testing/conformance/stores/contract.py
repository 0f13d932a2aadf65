"""The StateStore contract (``durably.stores.base``): runs, leases and turns,
the worker loop's sweeps, checkpoints and signals.

Each test gets ``store``, an open store on an empty database, and may ask
``store_factory`` for more store objects on the same database (separate
connections for SQLite and PostgreSQL, the same object for memory); see
:mod:`durably.testing.conformance`. Every time is an explicit integer.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

import pytest

from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus
from durably.stores import RunChanges, RunQuery, SettleResult, SignalWait, StateStore

if TYPE_CHECKING:
    from .. import StoreFactory

NOW = 1_700_000_000_000  # past 2**31: times must be 64-bit everywhere
LEASE = 30_000
OWNER = "instance-a"
OTHER = "instance-b"
ERROR = {"message": "timed out", "code": "signal_timeout", "type": "SignalTimeout"}

PENDING = frozenset({RunStatus.PENDING})
RUNNING = frozenset({RunStatus.RUNNING})
SUSPENDED = frozenset({RunStatus.SUSPENDED})

NESTED: dict[str, Any] = {
    "unicode": "héllo wörld — ✓ 日本語 עברית 🎉👩‍👩‍👧",
    "escapes": 'quote " backslash \\ newline \n tab \t bell \u0007',
    "numbers": [0, -1, 2**53 + 1, 2**70, 0.1, 1e300, -2.5],
    "flags": [True, False, None],
    "deep": {"a": [{"b": [[{"c": "🎉"}]]}], "empty": {}, "none": None, "list": []},
    "ключ": "значение",
}


def make_run(run_id: str, status: RunStatus = RunStatus.PENDING, **fields: Any) -> Run:
    fields.setdefault("created_at", NOW)
    fields.setdefault("updated_at", fields["created_at"])
    fields.setdefault("workflow", "wf")
    return Run(run_id=run_id, workflow_version="1", status=status, **fields)


def make_cp(
    run_id: str, seq: int, status: CheckpointStatus = CheckpointStatus.PENDING, **fields: Any
) -> Checkpoint:
    fields.setdefault("name", f"op-{seq}")
    fields.setdefault("kind", "local")
    return Checkpoint(run_id=run_id, seq=seq, status=status, **fields)


def signal_cp(run_id: str, seq: int, token: str, **fields: Any) -> Checkpoint:
    return make_cp(run_id, seq, name=f"signal:{token}", kind="signal", started_at=NOW, **fields)


async def leased(
    store: StateStore, run_id: str, owner: str = OWNER, now: int = NOW, **fields: Any
) -> Run:
    """Create a pending run and take its lease until ``now + LEASE``."""
    await store.create_run(make_run(run_id, **fields))
    run = await lease_one(store, run_id, owner, now, now + LEASE, PENDING)
    assert run is not None
    return run


async def lease_one(
    store: StateStore,
    run_id: str,
    owner: str,
    now: int,
    lease_until: int,
    statuses: frozenset[RunStatus],
) -> Run | None:
    """Lease one run the engine's way (``start_turns`` of one id); the run, or ``None``."""
    started = await store.start_turns([run_id], owner, now, lease_until, statuses)
    return started[run_id][0] if run_id in started else None


async def status_of(store: StateStore, run_id: str) -> RunStatus:
    run = await store.get_run(run_id)
    assert run is not None
    return run.status


async def checkpoint(store: StateStore, run_id: str, seq: int) -> Checkpoint:
    return (await store.load_checkpoints(run_id))[seq]


# -- runs ------------------------------------------------------------------------------


async def test_create_run_stores_the_run(store: StateStore) -> None:
    run = make_run("r1", input={"n": 1}, tags=["a"], priority=3)

    stored, created = await store.create_run(run)

    assert created is True
    assert stored == run
    assert await store.get_run("r1") == run


async def test_create_run_is_idempotent_by_id(store: StateStore) -> None:
    first = make_run("r1", workflow="first", input=1)
    await store.create_run(first)

    stored, created = await store.create_run(make_run("r1", workflow="second", input=2))

    assert created is False
    assert stored == first
    assert await store.get_run("r1") == first


async def test_racing_creates_converge_on_one_winner(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    candidates = [make_run("race", workflow=f"wf-{i}") for i in range(8)]

    results = await asyncio.gather(
        *(stores[i % 2].create_run(run) for i, run in enumerate(candidates))
    )

    assert [created for _, created in results].count(True) == 1
    winner = next(run for run, created in results if created)
    assert all(run == winner for run, _ in results)
    assert await stores[0].get_run("race") == winner


async def test_every_run_field_round_trips(store: StateStore) -> None:
    run = Run(
        run_id="run:ü:🎉",
        workflow="checkout",
        workflow_version="7",
        status=RunStatus.SUSPENDED,
        input=NESTED,
        output=[NESTED, "out"],
        error={"message": "boom ✗", "code": "E1", "type": "ValueError", "details": NESTED},
        namespace="billing",
        parent_id="parent:1",
        tags=["日本", 'he said "hi"', "b c", "🎉"],
        priority=-3,
        wake_at=NOW + 1,
        wake_requested_at=NOW + 2,
        locked_by="someone",
        locked_until=NOW + 3,
        recovery_attempts=2,
        deadline_at=NOW + 4,
        created_at=NOW + 5,
        updated_at=NOW + 6,
    )
    await store.create_run(run)

    assert await store.get_run(run.run_id) == run
    assert await store.get_runs([run.run_id]) == [run]
    for tag in run.tags:
        page = await store.list_runs(RunQuery(tag=tag))
        assert [r.run_id for r in page.runs] == [run.run_id]


async def test_get_run_of_an_unknown_id_is_none(store: StateStore) -> None:
    assert await store.get_run("nope") is None


async def test_get_runs_returns_only_existing_runs_once(store: StateStore) -> None:
    ids = [f"r{i:04d}" for i in range(620)]  # more than one SQL batch
    await asyncio.gather(*(store.create_run(make_run(i)) for i in ids))

    found = await store.get_runs([*ids, "missing", ids[0], ids[1]])

    assert sorted(r.run_id for r in found) == ids
    assert await store.get_runs([]) == []
    assert await store.get_runs(["missing"]) == []


async def _listing_fixture(store: StateStore) -> None:
    runs = [
        make_run("r1", workflow="alpha", tags=["x"], created_at=NOW + 1),
        make_run(
            "r2",
            RunStatus.SUSPENDED,
            workflow="beta",
            namespace="billing",
            tags=["x", "y"],
            parent_id="r1",
            created_at=NOW + 2,
        ),
        make_run(
            "r3",
            RunStatus.COMPLETED,
            workflow="alpha",
            namespace="billing",
            parent_id="r1",
            created_at=NOW + 3,
        ),
        make_run("r4", workflow="beta", tags=["y"], created_at=NOW + 4),
        make_run("r5", RunStatus.FAILED, workflow="gamma", tags=["xy"], created_at=NOW + 5),
    ]
    for run in runs:
        await store.create_run(run)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param(RunQuery(), ["r5", "r4", "r3", "r2", "r1"], id="all"),
        pytest.param(RunQuery(status=RunStatus.PENDING), ["r4", "r1"], id="status"),
        pytest.param(RunQuery(workflow="alpha"), ["r3", "r1"], id="workflow"),
        pytest.param(RunQuery(tag="x"), ["r2", "r1"], id="tag"),
        pytest.param(RunQuery(tag="nope"), [], id="unknown-tag"),
        pytest.param(RunQuery(namespace="billing"), ["r3", "r2"], id="namespace"),
        pytest.param(RunQuery(parent_id="r1"), ["r3", "r2"], id="parent"),
        pytest.param(
            RunQuery(workflow="beta", tag="y", namespace="default"), ["r4"], id="combined"
        ),
        pytest.param(RunQuery(limit=2), ["r5", "r4"], id="limit"),
    ],
)
async def test_list_runs_filters_newest_first(
    store: StateStore, query: RunQuery, expected: list[str]
) -> None:
    await _listing_fixture(store)

    page = await store.list_runs(query)

    assert [r.run_id for r in page.runs] == expected


async def test_list_runs_pages_through_equal_creation_times(store: StateStore) -> None:
    ids = [f"run-{i}" for i in range(7)]
    for run_id in ids:
        await store.create_run(make_run(run_id))  # all share created_at

    seen: list[list[str]] = []
    cursor: str | None = None
    while True:
        page = await store.list_runs(RunQuery(limit=3, cursor=cursor))
        seen.append([r.run_id for r in page.runs])
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
        # a run created between pages does not shift the pages still to come
        await store.create_run(make_run(f"new-{len(seen)}", created_at=NOW + 100))

    assert seen == [
        ["run-6", "run-5", "run-4"],
        ["run-3", "run-2", "run-1"],
        ["run-0"],
    ]


async def test_list_runs_cursor_keeps_the_filter_and_ends_exactly(store: StateStore) -> None:
    for i in range(6):
        await store.create_run(make_run(f"p{i}", created_at=NOW + i // 2))
        await store.create_run(make_run(f"s{i}", RunStatus.SUSPENDED, created_at=NOW + i))

    first = await store.list_runs(RunQuery(status=RunStatus.PENDING, limit=3))
    second = await store.list_runs(
        RunQuery(status=RunStatus.PENDING, limit=3, cursor=first.next_cursor)
    )

    assert [r.run_id for r in first.runs] == ["p5", "p4", "p3"]
    assert [r.run_id for r in second.runs] == ["p2", "p1", "p0"]
    assert second.next_cursor is None


async def test_delete_run_removes_its_history_and_waiters(store: StateStore) -> None:
    await leased(store, "r1")
    await store.save_checkpoint(make_cp("r1", 0), OWNER)
    await store.wait_signal(signal_cp("r1", 1, "tok"), "tok", OWNER, NOW)
    await store.create_run(make_run("r2"))

    assert await store.delete_run("r1") is True

    assert await store.get_run("r1") is None
    assert await store.load_checkpoints("r1") == {}
    assert await store.send_signal("tok", "late", NOW) is None  # no waiter left: buffered
    assert await store.delete_run("r1") is False
    assert await store.get_run("r2") is not None


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


# -- the worker loop -------------------------------------------------------------------


async def test_list_pending_orders_by_priority_then_age(store: StateStore) -> None:
    await store.create_run(make_run("low-new", priority=0, created_at=NOW + 3))
    await store.create_run(make_run("high-new", priority=5, created_at=NOW + 5))
    await store.create_run(make_run("low-old", priority=0, created_at=NOW + 1))
    await store.create_run(make_run("high-old", priority=5, created_at=NOW + 2))
    await store.create_run(make_run("negative", priority=-1, created_at=NOW))
    await store.create_run(make_run("asleep", RunStatus.SUSPENDED, priority=99))

    assert await store.list_pending(NOW, 10) == [
        "high-old",
        "high-new",
        "low-old",
        "low-new",
        "negative",
    ]
    assert await store.list_pending(NOW, 2) == ["high-old", "high-new"]


async def test_list_orphans_lists_expired_running_runs(store: StateStore) -> None:
    await store.create_run(make_run("o1", RunStatus.RUNNING, locked_by="x", locked_until=NOW - 1))
    await store.create_run(make_run("o2", RunStatus.RUNNING, locked_by="x", locked_until=NOW - 9))
    await store.create_run(make_run("live", RunStatus.RUNNING, locked_by="x", locked_until=NOW))
    await store.create_run(
        make_run("asleep", RunStatus.SUSPENDED, locked_by="x", locked_until=NOW - 9)
    )

    assert sorted(await store.list_orphans(NOW, 10)) == ["o1", "o2"]
    limited = await store.list_orphans(NOW, 1)
    assert len(limited) == 1
    assert limited[0] in {"o1", "o2"}


async def test_recover_orphans_counts_and_requeues(store: StateStore) -> None:
    await leased(store, "r1")
    later = NOW + LEASE + 1

    assert await store.recover_orphans(["r1"], later, max_attempts=3) == {"r1": RunStatus.PENDING}

    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.recovery_attempts, run.locked_by, run.locked_until) == (
        RunStatus.PENDING,
        1,
        None,
        None,
    )
    assert await store.recover_orphans(["r1"], later, max_attempts=3) == {}  # not an orphan now
    assert await store.list_orphans(later, 10) == []


async def test_recover_orphans_gives_up_past_max_attempts(store: StateStore) -> None:
    await leased(store, "r1", recovery_attempts=3)
    await store.wait_signal(signal_cp("r1", 0, "tok"), "tok", OWNER, NOW)

    recovered = await store.recover_orphans(["r1"], NOW + LEASE + 1, max_attempts=3)

    assert recovered == {"r1": RunStatus.DEAD}
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.recovery_attempts, run.locked_by) == (RunStatus.DEAD, 4, None)
    assert run.error is not None
    assert run.error["code"] == "max_recovery_attempts"
    assert await store.send_signal("tok", 1, NOW) is None  # a dead run waits for nothing


async def test_recover_orphans_refuses_a_live_lease(store: StateStore) -> None:
    await leased(store, "r1")
    await store.create_run(make_run("pending"))

    assert await store.recover_orphans(["r1", "pending"], NOW + LEASE, max_attempts=3) == {}
    assert await store.recover_orphans(["missing"], NOW, max_attempts=3) == {}
    assert await store.recover_orphans([], NOW, max_attempts=3) == {}
    run = await store.get_run("r1")
    assert run is not None
    assert (run.status, run.locked_by, run.recovery_attempts) == (RunStatus.RUNNING, OWNER, 0)


async def test_recover_orphans_decides_run_by_run(store: StateStore) -> None:
    """One batch mixing every case: each run gets exactly what a recovery of
    it alone would do, and only the runs recovered are reported."""
    later = NOW + LEASE + 1
    await leased(store, "orphan")
    await leased(store, "exhausted", recovery_attempts=2)
    await leased(store, "live", now=later)  # its lease runs until later + LEASE
    await store.create_run(make_run("pending"))
    await store.create_run(make_run("done", RunStatus.COMPLETED))
    await store.wait_signal(signal_cp("exhausted", 0, "tok-x"), "tok-x", OWNER, NOW)
    await store.wait_signal(signal_cp("orphan", 0, "tok-o"), "tok-o", OWNER, NOW)
    ids = ["orphan", "live", "exhausted", "pending", "missing", "done", "orphan"]

    recovered = await store.recover_orphans(ids, later, max_attempts=2)

    assert recovered == {"orphan": RunStatus.PENDING, "exhausted": RunStatus.DEAD}
    expected = {
        "orphan": (RunStatus.PENDING, 1, None),
        "exhausted": (RunStatus.DEAD, 3, None),
        "live": (RunStatus.RUNNING, 0, OWNER),
        "pending": (RunStatus.PENDING, 0, None),
        "done": (RunStatus.COMPLETED, 0, None),
    }
    for run_id, (status, attempts, owner) in expected.items():
        run = await store.get_run(run_id)
        assert run is not None
        assert (run.status, run.recovery_attempts, run.locked_by) == (status, attempts, owner)
    orphan = await store.get_run("orphan")
    assert orphan is not None and orphan.error is None
    assert await store.send_signal("tok-x", 1, later) is None  # the dead run's wait is gone
    assert await store.send_signal("tok-o", 1, later) == "orphan"  # a pending run still waits


async def test_recover_orphans_leaves_what_another_instance_recovered_first(
    store_factory: StoreFactory,
) -> None:
    """Both instances listed the same orphans; the other one recovered "o2"
    and already leased it again before our batch ran."""
    ours, theirs = await store_factory(), await store_factory()
    for run_id in ("o1", "o2", "o3"):
        await leased(ours, run_id)
    later = NOW + LEASE + 1
    listed = await ours.list_orphans(later, 10)
    assert sorted(listed) == ["o1", "o2", "o3"]

    assert await theirs.recover_orphans(["o2"], later, max_attempts=3) == {"o2": RunStatus.PENDING}
    assert await lease_one(theirs, "o2", OTHER, later, later + LEASE, PENDING) is not None
    recovered = await ours.recover_orphans(listed, later, max_attempts=3)

    assert recovered == {"o1": RunStatus.PENDING, "o3": RunStatus.PENDING}
    o2 = await ours.get_run("o2")
    assert o2 is not None
    assert (o2.status, o2.locked_by, o2.recovery_attempts) == (RunStatus.RUNNING, OTHER, 1)


async def test_racing_recoveries_count_each_orphan_once(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    ids = [f"o{i}" for i in range(40)]
    for run_id in ids:
        await leased(stores[0], run_id)
    later = NOW + LEASE + 1
    orders = [random.sample(ids, len(ids)) for _ in range(6)]

    results = await asyncio.gather(
        *(stores[i % 2].recover_orphans(order, later, 3) for i, order in enumerate(orders))
    )

    won = [run_id for result in results for run_id in result]
    assert sorted(won) == sorted(ids)  # every orphan recovered, none twice
    for run_id in ids:
        run = await stores[1].get_run(run_id)
        assert run is not None
        assert (run.status, run.recovery_attempts) == (RunStatus.PENDING, 1)


async def test_list_due_orders_most_overdue_first(store: StateStore) -> None:
    suspended = RunStatus.SUSPENDED
    await store.create_run(make_run("timer-100", suspended, wake_at=NOW - 100))
    await store.create_run(make_run("timer-now", suspended, wake_at=NOW))
    await store.create_run(make_run("timer-future", suspended, wake_at=NOW + 1))
    await store.create_run(make_run("stamp-50", suspended, wake_requested_at=NOW - 50))
    await store.create_run(
        make_run("stamp-200", suspended, wake_at=NOW + 1000, wake_requested_at=NOW - 200)
    )
    await store.create_run(make_run("no-timer", suspended))
    await store.create_run(make_run("pending", wake_at=NOW - 500))
    await store.create_run(
        make_run("running", RunStatus.RUNNING, wake_at=NOW - 500, wake_requested_at=NOW - 500)
    )

    assert await store.list_due(NOW, 100) == ["stamp-200", "timer-100", "stamp-50", "timer-now"]
    assert await store.list_due(NOW, 2) == ["stamp-200", "timer-100"]


async def test_list_due_ranks_a_run_by_the_reasons_that_are_due(store: StateStore) -> None:
    # a stamp from a clock running ahead; the run's own timer is not due yet
    await store.create_run(
        make_run("stamped", RunStatus.SUSPENDED, wake_at=NOW + 50, wake_requested_at=NOW + 90)
    )
    await store.create_run(make_run("timer", RunStatus.SUSPENDED, wake_requested_at=NOW + 70))

    assert await store.list_due(NOW, 10) == ["timer", "stamped"]


async def test_claim_due_batch_claims_once(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    await stores[0].create_run(make_run("r1", RunStatus.SUSPENDED, wake_at=NOW - 1))

    claims = await asyncio.gather(
        *(stores[i % 2].claim_due_batch(["r1"], NOW, NOW + LEASE) for i in range(6))
    )

    assert sorted(claims) == [[]] * 5 + [["r1"]]
    run = await stores[0].get_run("r1")
    assert run is not None
    assert (run.status, run.wake_at) == (RunStatus.SUSPENDED, NOW + LEASE)
    assert await stores[0].claim_due_batch(["r1"], NOW + 1, NOW + 2 * LEASE) == []
    assert await stores[0].list_due(NOW + 1, 10) == []
    assert await stores[0].claim_due_batch(["r1"], NOW + LEASE, NOW + 2 * LEASE) == ["r1"]


async def test_claim_due_batch_takes_a_stamped_run_and_clears_the_stamp(
    store: StateStore,
) -> None:
    await store.create_run(make_run("r1", RunStatus.SUSPENDED, wake_requested_at=NOW - 3))

    assert await store.claim_due_batch(["r1"], NOW, NOW + LEASE) == ["r1"]

    run = await store.get_run("r1")
    assert run is not None
    assert (run.wake_at, run.wake_requested_at) == (NOW + LEASE, None)
    assert await store.list_due(NOW, 10) == []


async def test_claim_due_batch_refuses_leased_or_not_due_runs(store: StateStore) -> None:
    await store.create_run(
        make_run(
            "leased", RunStatus.SUSPENDED, wake_at=NOW - 1, locked_by="x", locked_until=NOW + 10
        )
    )
    await store.create_run(make_run("future", RunStatus.SUSPENDED, wake_at=NOW + 1))
    await store.create_run(make_run("pending", wake_at=NOW - 1))

    assert await store.claim_due_batch(["leased", "future", "pending"], NOW, NOW + LEASE) == []
    assert await store.claim_due_batch(["missing"], NOW, NOW + LEASE) == []
    assert await store.claim_due_batch([], NOW, NOW + LEASE) == []
    assert await store.claim_due_batch(["leased"], NOW + 11, NOW + LEASE) == ["leased"]


async def test_claim_due_batch_decides_run_by_run(store: StateStore) -> None:
    """One batch mixing every case claims exactly the runs due and free."""
    suspended = RunStatus.SUSPENDED
    await store.create_run(make_run("timer", suspended, wake_at=NOW - 5))
    await store.create_run(make_run("stamped", suspended, wake_at=NOW + 99, wake_requested_at=NOW))
    await store.create_run(make_run("future", suspended, wake_at=NOW + 1, wake_requested_at=None))
    await store.create_run(
        make_run("leased", suspended, wake_at=NOW - 5, locked_by="x", locked_until=NOW)
    )
    await store.create_run(make_run("pending", wake_at=NOW - 5))
    ids = ["future", "timer", "leased", "missing", "stamped", "pending", "timer"]

    claimed = await store.claim_due_batch(ids, NOW, NOW + LEASE)

    assert sorted(claimed) == ["stamped", "timer"]
    for run_id, wake_at in {
        "timer": NOW + LEASE,
        "stamped": NOW + LEASE,
        "future": NOW + 1,
        "leased": NOW - 5,
        "pending": NOW - 5,
    }.items():
        run = await store.get_run(run_id)
        assert run is not None
        assert (run.wake_at, run.wake_requested_at) == (wake_at, None)
    assert await store.list_due(NOW, 10) == ["leased"]  # due, but its lease is live


async def test_claim_due_batch_leaves_what_another_instance_claimed_first(
    store_factory: StoreFactory,
) -> None:
    """Both instances loaded the same due page; the other one claimed "r2"
    before our batch ran."""
    ours, theirs = await store_factory(), await store_factory()
    for run_id in ("r1", "r2", "r3"):
        await ours.create_run(make_run(run_id, RunStatus.SUSPENDED, wake_at=NOW - 1))
    page = await ours.list_due(NOW, 10)
    assert page == ["r1", "r2", "r3"]

    assert await theirs.claim_due_batch(["r2"], NOW, NOW + LEASE) == ["r2"]
    claimed = await ours.claim_due_batch(page, NOW, NOW + LEASE)

    assert sorted(claimed) == ["r1", "r3"]
    r2 = await ours.get_run("r2")
    assert r2 is not None
    assert r2.wake_at == NOW + LEASE


async def test_racing_batch_claims_claim_each_run_once(store_factory: StoreFactory) -> None:
    stores = [await store_factory(), await store_factory()]
    ids = [f"r{i}" for i in range(40)]
    for run_id in ids:
        await stores[0].create_run(make_run(run_id, RunStatus.SUSPENDED, wake_at=NOW - 1))
    orders = [random.sample(ids, len(ids)) for _ in range(6)]

    results = await asyncio.gather(
        *(stores[i % 2].claim_due_batch(order, NOW, NOW + LEASE) for i, order in enumerate(orders))
    )

    won = [run_id for result in results for run_id in result]
    assert sorted(won) == sorted(ids)  # every due run claimed, none twice
    assert await stores[1].list_due(NOW, 100) == []


async def test_list_expired_lists_live_runs_past_their_deadline(store: StateStore) -> None:
    await store.create_run(make_run("past", deadline_at=NOW - 1))
    await store.create_run(make_run("now", RunStatus.SUSPENDED, deadline_at=NOW))
    await store.create_run(make_run("future", RunStatus.RUNNING, deadline_at=NOW + 1))
    await store.create_run(make_run("finished", RunStatus.COMPLETED, deadline_at=NOW - 100))
    await store.create_run(make_run("none"))

    assert sorted(await store.list_expired(NOW, 10)) == ["now", "past"]
    limited = await store.list_expired(NOW, 1)
    assert len(limited) == 1
    assert limited[0] in {"now", "past"}


async def _park(
    store: StateStore, run_id: str, wake_at: int | None, *cps: Checkpoint, **fields: Any
) -> None:
    """A run whose turn saved ``cps`` and suspended with ``wake_at``, at NOW."""
    await leased(store, run_id, **fields)
    for cp in cps:
        assert await store.save_checkpoint(cp, OWNER)
    settled = await store.settle_run(
        run_id, OWNER, RunStatus.SUSPENDED, RunChanges(wake_at=wake_at), NOW
    )
    assert settled is SettleResult.SETTLED


async def test_list_stalled_finds_the_stranded_signature(store: StateStore) -> None:
    hour = 3_600_000
    before = NOW + hour  # stalled_after is an hour, and an hour passed
    out: dict[str, Any] = {"kind": "step", "started_at": NOW, "dispatched_at": NOW}
    # stranded: waits without a deadline, whatever the reconcile fallback wake
    await _park(store, "forgotten", None, signal_cp("forgotten", 0, "t0"))
    await _park(store, "reconciled", NOW + 300_000, signal_cp("reconciled", 0, "t1"))
    event_wait = make_cp("unheard", 1, kind="event", started_at=NOW)
    done = make_cp("unheard", 0, CheckpointStatus.COMPLETED, started_at=NOW, finished_at=NOW)
    await _park(store, "unheard", NOW + 300_000, done, event_wait)
    await _park(store, "silent", NOW + 300_000, make_cp("silent", 0, **out))
    # healthy long work
    sleep: dict[str, Any] = {"kind": "sleep", "started_at": NOW, "wake_at": NOW + 30 * 24 * hour}
    await _park(store, "sleeps", NOW + 30 * 24 * hour, make_cp("sleeps", 0, **sleep))
    await _park(
        store, "bounded", NOW + 2 * hour, signal_cp("bounded", 0, "t2", wake_at=NOW + 2 * hour)
    )
    both = (signal_cp("both", 0, "t3"), make_cp("both", 1, **sleep))
    await _park(store, "both", NOW + 30 * 24 * hour, *both)
    await _park(store, "parent", None, make_cp("parent", 0, kind="child", started_at=NOW))
    await _park(store, "beating", NOW + 300_000, make_cp("beating", 0, **out))
    assert await store.record_heartbeat("beating", 0, before + 1, None)
    await store.create_run(make_run("queued"))
    await leased(store, "turning")
    # progressed since: a wait that began after ``before``, a step finished then
    await _park(store, "fresh", None, make_cp("fresh", 0, kind="signal", started_at=before))
    step_done: dict[str, Any] = {"started_at": NOW, "finished_at": before + 5}
    recent = make_cp("recent", 0, CheckpointStatus.COMPLETED, **step_done)
    await _park(store, "recent", None, recent, signal_cp("recent", 1, "t5"))
    # elsewhere
    await _park(store, "other-pool", None, signal_cp("other-pool", 0, "t6"), namespace="b")

    found = await store.list_stalled(before, 100, namespace="default")

    assert sorted(found) == ["forgotten", "reconciled", "silent", "unheard"]
    assert "other-pool" in await store.list_stalled(before, 100)
    assert await store.list_stalled(before, 2, namespace="default") == found[:2]
    assert await store.list_stalled(NOW, 100) == []  # an hour has not passed for anyone


# -- checkpoints -----------------------------------------------------------------------


async def test_checkpoints_round_trip_by_seq(store: StateStore) -> None:
    await leased(store, "r1")
    await leased(store, "other")
    saved = {
        0: make_cp("r1", 0, CheckpointStatus.COMPLETED, input=NESTED, output=NESTED, attempts=2),
        1: make_cp("r1", 1, CheckpointStatus.FAILED, error={"message": "✗", "details": NESTED}),
        2: make_cp("r1", 2, kind="sleep", wake_at=NOW + 10, started_at=NOW),
        -2: make_cp("r1", -2, CheckpointStatus.RUNNING, name="compensate", started_at=NOW),
        3: make_cp("r1", 3, CheckpointStatus.COMPLETED, output=None, finished_at=NOW + 1),
    }
    for cp in saved.values():
        assert await store.save_checkpoint(cp, OWNER) is True
    await store.save_checkpoint(make_cp("other", 0), OWNER)

    assert await store.load_checkpoints("r1") == saved
    assert list(await store.load_checkpoints("other")) == [0]
    assert await store.load_checkpoints("missing") == {}


async def test_save_checkpoint_is_fenced_by_the_lease(store: StateStore) -> None:
    await leased(store, "r1")

    assert await store.save_checkpoint(make_cp("r1", 0), OTHER) is False
    assert await store.save_checkpoint(make_cp("missing", 0), OWNER) is False
    assert await store.load_checkpoints("r1") == {}
    assert await store.load_checkpoints("missing") == {}


async def test_save_checkpoint_upserts_but_never_replaces_completed(store: StateStore) -> None:
    await leased(store, "r1")
    running = make_cp("r1", 0, CheckpointStatus.RUNNING, started_at=NOW)
    done = make_cp("r1", 0, CheckpointStatus.COMPLETED, output={"v": 1}, finished_at=NOW + 1)

    assert await store.save_checkpoint(make_cp("r1", 0), OWNER) is True
    assert await store.save_checkpoint(running, OWNER) is True
    assert await checkpoint(store, "r1", 0) == running
    assert await store.save_checkpoint(done, OWNER) is True
    assert await store.save_checkpoint(make_cp("r1", 0, CheckpointStatus.RUNNING), OWNER)
    assert await store.save_checkpoint(
        make_cp("r1", 0, CheckpointStatus.COMPLETED, output={"v": 2}), OWNER
    )

    assert await checkpoint(store, "r1", 0) == done


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


# -- lifecycle -------------------------------------------------------------------------


async def test_stores_on_one_database_share_state(store_factory: StoreFactory) -> None:
    # two stores opening a fresh database at once both end up on the same schema
    first, second = await store_factory(opened=False), await store_factory(opened=False)
    await asyncio.gather(first.open(), second.open())
    await first.open()  # idempotent

    await leased(first, "r1")
    await first.save_checkpoint(make_cp("r1", 0, output=NESTED), OWNER)

    run = await second.get_run("r1")
    assert run is not None
    assert run.locked_by == OWNER
    assert (await second.load_checkpoints("r1"))[0].output == NESTED
    assert await second.renew_lease("r1", OWNER, NOW + 2 * LEASE) is True
    assert isinstance(first.url, str)
    assert isinstance(first, StateStore)


async def test_a_store_reopened_after_close_keeps_its_data(store: StateStore) -> None:
    await leased(store, "r1")
    await store.close()
    await store.close()  # idempotent

    await store.open()

    run = await store.get_run("r1")
    assert run is not None
    assert run.locked_by == OWNER


# -- claims filtered by the workflows an engine registers (rolling deploys) ------------

OLD_RELEASE = frozenset({("wf", "1"), ("other", "1")})
"""What an instance of the older release registers: ``wf`` at version 1 only."""


async def _two_releases(store: StateStore, status: RunStatus, **fields: Any) -> None:
    """``v1`` (of ``wf`` version 1), ``v2`` (``wf`` version 2), ``new`` (a
    workflow only the newer release has), all in ``status``."""
    await store.create_run(make_run("v1", status, **fields))
    await store.create_run(make_run("v2", status, **fields).replace(workflow_version="2"))
    await store.create_run(make_run("new", status, workflow="added", **fields))


async def test_list_pending_takes_only_the_given_workflows(store: StateStore) -> None:
    await _two_releases(store, RunStatus.PENDING)

    assert await store.list_pending(NOW, 10, workflows=OLD_RELEASE) == ["v1"]
    assert sorted(await store.list_pending(NOW, 10)) == ["new", "v1", "v2"]
    assert await store.list_pending(NOW, 10, workflows=frozenset()) == []


async def test_list_orphans_takes_only_the_given_workflows(store: StateStore) -> None:
    await _two_releases(store, RunStatus.RUNNING, locked_by="x", locked_until=NOW - 1)

    assert await store.list_orphans(NOW, 10, workflows=OLD_RELEASE) == ["v1"]
    assert sorted(await store.list_orphans(NOW, 10)) == ["new", "v1", "v2"]


async def test_list_due_takes_only_the_given_workflows(store: StateStore) -> None:
    await _two_releases(store, RunStatus.SUSPENDED, wake_at=NOW - 1)
    await store.create_run(
        make_run("stamped-new", RunStatus.SUSPENDED, workflow="added", wake_requested_at=NOW)
    )
    await store.create_run(make_run("stamped-v1", RunStatus.SUSPENDED, wake_requested_at=NOW))

    assert sorted(await store.list_due(NOW, 10, workflows=OLD_RELEASE)) == ["stamped-v1", "v1"]
    assert len(await store.list_due(NOW, 10)) == 5


async def test_start_turns_leaves_runs_outside_the_workflows_untouched(store: StateStore) -> None:
    await _two_releases(store, RunStatus.PENDING, wake_requested_at=NOW - 5)
    before = {run.run_id: run for run in await store.get_runs(["v1", "v2", "new"])}

    started = await store.start_turns(
        ["v1", "v2", "new"], OWNER, NOW, NOW + LEASE, PENDING, workflows=OLD_RELEASE
    )

    assert sorted(started) == ["v1"]
    for run_id in ("v2", "new"):
        assert await store.get_run(run_id) == before[run_id]  # no lease, no stamp cleared
    assert sorted(await store.start_turns(["v2", "new"], OTHER, NOW, NOW + LEASE, PENDING)) == [
        "new",
        "v2",
    ]


async def test_list_unclaimed_lists_old_runs_outside_the_workflows(store: StateStore) -> None:
    await _two_releases(store, RunStatus.PENDING, updated_at=NOW - 10)
    await store.create_run(make_run("fresh", RunStatus.PENDING, workflow="added", updated_at=NOW))
    await store.create_run(make_run("due", RunStatus.SUSPENDED, workflow="added", wake_at=NOW - 20))
    await store.create_run(
        make_run("stamped", RunStatus.SUSPENDED, workflow="added", wake_requested_at=NOW - 30)
    )
    await store.create_run(
        make_run("asleep", RunStatus.SUSPENDED, workflow="added", wake_at=NOW + 10)
    )
    await store.create_run(
        make_run("orphan", RunStatus.RUNNING, workflow="added", locked_until=NOW - 99)
    )

    unclaimed = await store.list_unclaimed(NOW, 10, workflows=OLD_RELEASE)

    assert unclaimed[:2] == ["stamped", "due"]  # oldest first
    assert sorted(unclaimed) == ["due", "new", "stamped", "v2"]
    assert len(await store.list_unclaimed(NOW, 2, workflows=OLD_RELEASE)) == 2
    assert await store.list_unclaimed(NOW, 10, workflows=OLD_RELEASE, namespace="x") == []


async def test_list_blocked_lists_blocked_runs_of_the_workflows(store: StateStore) -> None:
    await _two_releases(store, RunStatus.BLOCKED)
    await store.create_run(make_run("pending", RunStatus.PENDING))
    await store.create_run(make_run("urgent", RunStatus.BLOCKED, priority=5, created_at=NOW + 1))

    assert await store.list_blocked(10, workflows=OLD_RELEASE) == ["urgent", "v1"]
    newer = frozenset({("wf", "1"), ("wf", "2"), ("added", "1")})
    assert sorted(await store.list_blocked(10, workflows=newer)) == ["new", "urgent", "v1", "v2"]
    assert await store.list_blocked(1, workflows=newer) == ["urgent"]
    assert await store.list_blocked(10, workflows=frozenset()) == []


async def test_racing_create_runs_in_opposite_orders_create_each_run_once(
    store_factory: StoreFactory,
) -> None:
    """Two instances creating the same new runs (a fan-out replayed on two
    engines), listed in opposite orders: each run is created by exactly one of
    them, and neither is aborted as a deadlock on the other's new keys."""
    first, second = await store_factory(), await store_factory()
    for round_ in range(4):
        runs = [make_run(f"fan-{round_}-{n:03}") for n in range(200)]

        a, b = await asyncio.gather(first.create_runs(runs), second.create_runs(runs[::-1]))

        assert sorted(a + b) == sorted(run.run_id for run in runs)
