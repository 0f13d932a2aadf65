"""The StateStore contract for the worker loop's sweeps (``SweepStore``):
pending, orphans, due, expired, stalled, and claims filtered by the workflows
an engine registers.

Same fixtures as every ``stores`` module: ``store`` is an open store on an
empty database, ``store_factory`` makes more store objects on the same
database; see :mod:`durably.testing.conformance`. Every time is an explicit
integer.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

from durably.model import Checkpoint, CheckpointStatus, RunStatus
from durably.stores import RunChanges, SettleResult, StateStore

from ._helpers import (
    LEASE,
    NOW,
    OTHER,
    OWNER,
    PENDING,
    lease_one,
    leased,
    make_cp,
    make_run,
    signal_cp,
)

if TYPE_CHECKING:
    from .. import StoreFactory


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


async def test_next_wake_at_is_the_earliest_timer_after_the_given_time(
    store: StateStore,
) -> None:
    assert await store.next_wake_at(NOW) is None
    suspended = RunStatus.SUSPENDED
    await store.create_run(make_run("due", suspended, wake_at=NOW - 100))
    await store.create_run(make_run("at-now", suspended, wake_at=NOW))
    await store.create_run(make_run("no-timer", suspended, wake_requested_at=NOW + 1))
    await store.create_run(make_run("pending", wake_at=NOW + 2))
    await store.create_run(make_run("running", RunStatus.RUNNING, wake_at=NOW + 3))
    await store.create_run(make_run("blocked", RunStatus.BLOCKED, wake_at=NOW + 4))
    # Timers at or before ``after`` were the poll's: only later ones count.
    assert await store.next_wake_at(NOW) is None

    await store.create_run(make_run("later", suspended, wake_at=NOW + 500))
    await store.create_run(make_run("soon", suspended, wake_at=NOW + 50))
    await store.create_run(
        make_run("leased", suspended, wake_at=NOW + 20, locked_by="x", locked_until=NOW + 20)
    )

    assert await store.next_wake_at(NOW) == NOW + 20
    assert await store.next_wake_at(NOW + 20) == NOW + 50
    assert await store.next_wake_at(NOW + 499) == NOW + 500
    assert await store.next_wake_at(NOW + 500) is None
    assert await store.next_wake_at(NOW - 1000) == NOW - 100


async def test_next_wake_at_follows_claims(store: StateStore) -> None:
    """A claimed timer's wake moves to the claim's lease end, so an instance
    that lost the claim next looks when that lease runs out."""
    await store.create_run(make_run("r1", RunStatus.SUSPENDED, wake_at=NOW - 1))
    assert await store.next_wake_at(NOW) is None

    assert await store.claim_due_batch(["r1"], NOW, NOW + LEASE) == ["r1"]

    assert await store.next_wake_at(NOW) == NOW + LEASE


async def test_next_wake_at_takes_only_the_given_workflows_and_namespace(
    store: StateStore,
) -> None:
    await store.create_run(make_run("v1", RunStatus.SUSPENDED, wake_at=NOW + 30))
    await store.create_run(
        make_run("v2", RunStatus.SUSPENDED, wake_at=NOW + 10).replace(workflow_version="2")
    )
    await store.create_run(make_run("new", RunStatus.SUSPENDED, workflow="added", wake_at=NOW + 20))
    await store.create_run(
        make_run("elsewhere", RunStatus.SUSPENDED, workflow="added", wake_at=NOW + 5, namespace="b")
    )

    assert await store.next_wake_at(NOW) == NOW + 5
    assert await store.next_wake_at(NOW, workflows=OLD_RELEASE) == NOW + 30
    assert await store.next_wake_at(NOW, workflows=frozenset()) is None
    assert await store.next_wake_at(NOW, namespace="b") == NOW + 5
    assert await store.next_wake_at(NOW, namespace="b", workflows=OLD_RELEASE) is None
    assert await store.next_wake_at(NOW, namespace="default") == NOW + 10


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
