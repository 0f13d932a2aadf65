"""The StateStore primitives of dispatched steps, proven against every store.

Checkpoint fields of dispatched steps, heartbeats, batched resolution and the
flow-control queues (``try_admit`` / ``release_slots``). Same fixtures as
``stores.runs``: ``store`` is an empty store, ``store_factory`` opens
more store objects on its database. Every time is an explicit integer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

import pytest

from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus
from durably.stores import RunChanges, SettleResult, StateStore
from durably.stores.base import (
    Admission,
    BeatRecord,
    HistoryTail,
    QueueState,
    Resolution,
    TurnLease,
)

if TYPE_CHECKING:
    from .. import StoreFactory

NOW = 1_700_000_000_000  # past 2**31: times must be 64-bit everywhere
LEASE = 30_000
OWNER = "instance-a"
PENDING = frozenset({RunStatus.PENDING})
COMPLETED = CheckpointStatus.COMPLETED
FAILED = CheckpointStatus.FAILED
ERROR = {"message": "boom", "code": "E", "type": "ValueError"}
PROGRESS: dict[str, Any] = {"done": 3, "of": 10, "note": "héllo 🎉", "deep": [{"a": None}]}
EVENTS: list[dict[str, Any]] = [
    {"at": NOW + 1, "level": "info", "message": "héllo 🎉", "data": {"n": 1, "deep": [None]}},
    {"at": NOW + 2, "level": "info", "message": "fetch", "name": "fetch", "status": "ok"},
    {"at": NOW + 3, "level": "error", "message": "retrying", "data": {"big": 2**53}},
]


def _make_run(run_id: str, status: RunStatus = RunStatus.PENDING, **fields: Any) -> Run:
    fields.setdefault("created_at", NOW)
    fields.setdefault("updated_at", fields["created_at"])
    return Run(run_id=run_id, workflow="wf", workflow_version="1", status=status, **fields)


def _make_cp(
    run_id: str, seq: int, status: CheckpointStatus = CheckpointStatus.PENDING, **fields: Any
) -> Checkpoint:
    fields.setdefault("name", f"step-{seq}")
    fields.setdefault("kind", "step")
    return Checkpoint(run_id=run_id, seq=seq, status=status, **fields)


async def _leased(store: StateStore, run_id: str, owner: str = OWNER) -> Run:
    """Create a pending run and take its lease."""
    await store.create_run(_make_run(run_id))
    started = await store.start_turns([run_id], owner, NOW, NOW + LEASE, PENDING)
    assert run_id in started
    return started[run_id][0]


async def suspended(store: StateStore, *run_ids: str) -> None:
    """Create suspended, unleased runs (what a run parked on a dispatched step looks like)."""
    for run_id in run_ids:
        await store.create_run(_make_run(run_id, RunStatus.SUSPENDED))


async def wake_of(store: StateStore, run_id: str) -> int | None:
    run = await store.get_run(run_id)
    assert run is not None
    return run.wake_requested_at


async def saved(store: StateStore, *checkpoints: Checkpoint) -> None:
    """Lease the run of ``checkpoints`` (one run), save them, hand the run back."""
    run_id = checkpoints[0].run_id
    await _leased(store, run_id)
    assert await store.save_checkpoints(list(checkpoints), OWNER)
    assert await store.release_run(run_id, OWNER, NOW)


def ask(
    step_id: str,
    *,
    queue: str = "q",
    concurrency: int | None = None,
    rate_limit: int | None = None,
    rate_period_ms: int = 1000,
    priority: int = 0,
    fairness_key: str | None = None,
    retry_ms: int = 1000,
) -> Admission:
    """An admission request for ``step_id`` (``<run_id>:<seq>``)."""
    return Admission(
        queue=queue,
        step_id=step_id,
        run_id=step_id.rsplit(":", 1)[0],
        concurrency=concurrency,
        rate_limit=rate_limit,
        rate_period_ms=rate_period_ms,
        priority=priority,
        fairness_key=fairness_key,
        retry_ms=retry_ms,
    )


# -- the dispatched-step fields ----------------------------------------------------------


def dispatched_cp(run_id: str, seq: int, **fields: Any) -> Checkpoint:
    fields.setdefault("dispatched_at", NOW + 1)
    fields.setdefault("redispatches", 2)
    fields.setdefault("queue", "emails ✉")
    fields.setdefault("last_heartbeat_at", NOW + 3)
    fields.setdefault("progress", PROGRESS)
    return _make_cp(run_id, seq, input={"to": "a@b"}, attempts=1, started_at=NOW, **fields)


async def test_dispatch_fields_round_trip_through_every_write_and_read(store: StateStore) -> None:
    await _leased(store, "r1")
    one = dispatched_cp("r1", 0)
    many = [dispatched_cp("r1", 1, queue=None, progress=[1, "two"]), dispatched_cp("r1", 2)]
    bare = _make_cp("r1", 3)

    assert await store.save_checkpoint(one, OWNER)
    assert await store.save_checkpoints([*many, bare], OWNER)

    history = await store.load_checkpoints("r1")
    assert history == {0: one, 1: many[0], 2: many[1], 3: bare}
    assert history[3].redispatches == 0
    assert history[3].dispatched_at is None
    assert history[3].queue is None
    assert history[3].progress is None
    assert await store.get_checkpoint("r1", 0) == one
    assert await store.get_checkpoint("r1", 2) == many[1]
    # the start of a turn reads them too
    assert await store.release_run("r1", OWNER, NOW)
    turns = await store.start_turns(["r1"], OWNER, NOW + 5, NOW + LEASE, PENDING)
    assert turns["r1"][1] == history


async def test_get_checkpoint_of_an_unknown_position_is_none(store: StateStore) -> None:
    await saved(store, _make_cp("r1", 0))

    assert await store.get_checkpoint("r1", 1) is None
    assert await store.get_checkpoint("nope", 0) is None


async def test_a_save_never_replaces_a_completed_dispatched_step(store: StateStore) -> None:
    await _leased(store, "r1")
    done = dispatched_cp("r1", 0, status=COMPLETED, output="sent", finished_at=NOW + 9)
    assert await store.save_checkpoint(done, OWNER)

    stale = dispatched_cp("r1", 0, dispatched_at=NOW + 50, redispatches=7, queue="other")
    await store.save_checkpoint(stale, OWNER)
    await store.save_checkpoints([stale], OWNER)

    assert await store.get_checkpoint("r1", 0) == done


async def test_a_save_keeps_a_heartbeat_recorded_meanwhile(store: StateStore) -> None:
    await _leased(store, "r1")
    assert await store.save_checkpoint(dispatched_cp("r1", 0, last_heartbeat_at=None), OWNER)
    assert await store.record_heartbeat("r1", 0, NOW + 10, {"step": 1})

    # the owner saves its copy from before the beat: the beat survives
    again = dispatched_cp("r1", 0, redispatches=3, last_heartbeat_at=None, progress=None)
    assert await store.save_checkpoint(again, OWNER)
    found = await store.get_checkpoint("r1", 0)
    assert found is not None
    assert (found.redispatches, found.last_heartbeat_at, found.progress) == (
        3,
        NOW + 10,
        {"step": 1},
    )

    # a newer heartbeat or progress in the save wins
    newer = dispatched_cp("r1", 0, last_heartbeat_at=NOW + 20, progress={"step": 2})
    assert await store.save_checkpoints([newer], OWNER)
    assert await store.get_checkpoint("r1", 0) == newer


# -- heartbeats ---------------------------------------------------------------------------


async def test_record_heartbeat_keeps_the_latest_beat(store: StateStore) -> None:
    await saved(store, _make_cp("r1", 0))

    assert await store.record_heartbeat("r1", 0, NOW + 50, PROGRESS)
    found = await store.get_checkpoint("r1", 0)
    assert found is not None
    assert (found.last_heartbeat_at, found.progress) == (NOW + 50, PROGRESS)

    # an older beat arriving late does not move the time back
    assert await store.record_heartbeat("r1", 0, NOW + 30, None)
    found = await store.get_checkpoint("r1", 0)
    assert found is not None
    assert (found.last_heartbeat_at, found.progress) == (NOW + 50, PROGRESS)

    # a beat without progress keeps the stored progress; one with replaces it
    assert await store.record_heartbeat("r1", 0, NOW + 60, None)
    assert await store.record_heartbeat("r1", 0, NOW + 70, [1, 2])
    found = await store.get_checkpoint("r1", 0)
    assert found is not None
    assert (found.last_heartbeat_at, found.progress) == (NOW + 70, [1, 2])
    assert found.status is CheckpointStatus.PENDING


async def test_record_heartbeat_needs_a_pending_checkpoint(store: StateStore) -> None:
    await saved(
        store,
        _make_cp("r1", 0, COMPLETED, output=1),
        _make_cp("r1", 1, FAILED, error=ERROR),
        _make_cp("r1", 2, CheckpointStatus.RUNNING),
    )

    for seq in (0, 1, 2, 3):
        assert await store.record_heartbeat("r1", seq, NOW + 5, {"x": 1}) is False
    assert await store.record_heartbeat("missing", 0, NOW + 5, None) is False
    history = await store.load_checkpoints("r1")
    assert all(cp.last_heartbeat_at is None and cp.progress is None for cp in history.values())


async def test_record_heartbeats_of_one_beat_is_record_heartbeat(store: StateStore) -> None:
    await saved(store, _make_cp("r1", 0))

    assert await store.record_heartbeats([BeatRecord("r1", 0, NOW + 50, PROGRESS)]) == [True]
    assert await store.record_heartbeats([BeatRecord("r1", 0, NOW + 30, None)]) == [True]
    found = await store.get_checkpoint("r1", 0)
    assert found is not None
    assert (found.last_heartbeat_at, found.progress) == (NOW + 50, PROGRESS)
    assert await store.record_heartbeats([BeatRecord("r1", 9, NOW, None)]) == [False]
    assert await store.record_heartbeats([]) == []


async def test_record_heartbeats_writes_a_batch_in_one_call(store: StateStore) -> None:
    """Many steps of many runs; settled and missing ones answer ``False``; the
    same step twice in a batch ends as the two beats in order would."""
    await saved(store, _make_cp("r1", 0), _make_cp("r1", 1), _make_cp("r1", 2, COMPLETED))
    await saved(store, _make_cp("r2", 0))
    await saved(store, *(_make_cp("r3", seq) for seq in range(40)))

    beats = [
        BeatRecord("r1", 0, NOW + 10, {"n": 1}),
        BeatRecord("r1", 1, NOW + 11, None),
        BeatRecord("r1", 2, NOW + 12, {"settled": True}),
        BeatRecord("missing", 0, NOW + 13, None),
        BeatRecord("r2", 0, NOW + 20, {"first": 1}),
        BeatRecord("r1", 0, NOW + 5, None),  # older, no progress: changes nothing
        BeatRecord("r2", 0, NOW + 19, {"second": 2}),  # older time, newer progress
        *(BeatRecord("r3", seq, NOW + seq, [seq]) for seq in range(40)),
    ]
    answers = await store.record_heartbeats(beats)

    assert answers == [True, True, False, False, True, True, True, *([True] * 40)]
    history = await store.load_checkpoints("r1")
    assert (history[0].last_heartbeat_at, history[0].progress) == (NOW + 10, {"n": 1})
    assert (history[1].last_heartbeat_at, history[1].progress) == (NOW + 11, None)
    assert (history[2].last_heartbeat_at, history[2].progress) == (None, None)
    r2 = await store.get_checkpoint("r2", 0)
    assert r2 is not None
    assert (r2.last_heartbeat_at, r2.progress) == (NOW + 20, {"second": 2})
    r3 = await store.load_checkpoints("r3")
    assert [(cp.last_heartbeat_at, cp.progress) for cp in r3.values()] == [
        (NOW + seq, [seq]) for seq in range(40)
    ]


async def test_record_heartbeats_loses_only_a_hostile_beat(store: StateStore) -> None:
    """A beat the store cannot take (an id with a NUL, which PostgreSQL text
    refuses) answers ``False`` and the rest of its batch is written."""
    await saved(store, _make_cp("r1", 0), _make_cp("r1", 1))

    answers = await store.record_heartbeats(
        [
            BeatRecord("r1", 0, NOW + 10, {"ok": 0}),
            BeatRecord("bad\x00id", 0, NOW + 10, None),
            BeatRecord("r1", 1, NOW + 11, {"ok": 1}),
        ]
    )

    assert answers == [True, False, True]
    history = await store.load_checkpoints("r1")
    assert [(cp.last_heartbeat_at, cp.progress) for cp in history.values()] == [
        (NOW + 10, {"ok": 0}),
        (NOW + 11, {"ok": 1}),
    ]


async def test_racing_heartbeat_batches_results_and_writes_never_deadlock(
    store_factory: StoreFactory,
) -> None:
    """Beats of many steps recorded by two store objects at once, in opposite
    orders, while a third settles the results of half of them and the owner
    saves new checkpoints on the same runs: nothing fails, the latest beat
    of each pending step stays, the settled steps keep none written after."""
    owner, a, b = await store_factory(), await store_factory(), await store_factory()
    runs = [f"beat-{n:03}" for n in range(30)]
    for run_id in runs:
        await owner.create_run(_make_run(run_id))
    assert len(await owner.start_turns(runs, OWNER, NOW, NOW + LEASE, PENDING)) == 30
    assert await owner.save_checkpoints([_make_cp(r, seq) for r in runs for seq in (1, 2)], OWNER)

    for round_ in range(4):
        at = NOW + 100 * round_
        forward = [BeatRecord(r, seq, at + seq, None) for r in runs for seq in (1, 2)]
        backward = [
            BeatRecord(r, seq, at + seq + 1, {"r": round_})
            for r, seq in reversed([(beat.run_id, beat.seq) for beat in forward])
        ]
        settling = runs[round_ * 5 : round_ * 5 + 5]
        outcome = await asyncio.gather(
            a.record_heartbeats(forward),
            b.record_heartbeats(backward),
            owner.resolve_checkpoints([Resolution(r, 1, COMPLETED) for r in settling], at),
            owner.save_checkpoints([_make_cp(r, 3 + round_) for r in reversed(runs)], OWNER),
        )
        assert len(outcome[0]) == len(outcome[1]) == 60

    for run_id in runs[20:]:
        history = await owner.load_checkpoints(run_id)
        assert history[1].last_heartbeat_at == NOW + 300 + 2
        assert history[1].progress == {"r": 3}
        assert history[2].last_heartbeat_at == NOW + 300 + 3


# -- resolving in batches ------------------------------------------------------------------


async def test_resolve_checkpoints_settles_a_batch_in_order(store: StateStore) -> None:
    await saved(
        store,
        *(_make_cp("r1", seq, group="g") for seq in (1, 2, 3)),
        _make_cp("r1", 4, COMPLETED, output="kept"),
        _make_cp("r1", 5, FAILED, error=ERROR),
        _make_cp("r1", 6),
    )
    await store.update_run_if("r1", PENDING, {"status": RunStatus.SUSPENDED}, NOW)

    answers = await store.resolve_checkpoints(
        [
            Resolution("r1", 1, COMPLETED, output={"n": 1}),
            Resolution("r1", 4, COMPLETED, output="replaced?"),
            Resolution("r1", 9, COMPLETED, output="missing"),
            Resolution("r1", 2, COMPLETED, output={"n": 2}),
            Resolution("r1", 1, FAILED, error=ERROR),
            Resolution("r1", 5, COMPLETED, output="replaced?"),
            Resolution("nope", 0, COMPLETED),
        ],
        NOW + 10,
    )

    assert answers == [2, None, None, 1, None, None, None]
    assert await wake_of(store, "r1") is None  # the group is not done, nothing failed
    history = await store.load_checkpoints("r1")
    assert (history[1].status, history[1].output, history[1].finished_at) == (
        COMPLETED,
        {"n": 1},
        NOW + 10,
    )
    assert (history[2].status, history[2].output) == (COMPLETED, {"n": 2})
    assert history[3].status is CheckpointStatus.PENDING
    assert (history[4].output, history[5].status) == ("kept", FAILED)

    assert await store.resolve_checkpoints([Resolution("r1", 3, COMPLETED, output=3)], NOW + 20)
    assert await wake_of(store, "r1") == NOW + 20
    assert await store.resolve_checkpoints([], NOW + 30) == []


async def test_a_result_for_a_held_turn_stamps_no_wake_while_its_owner_holds_the_lease(
    store: StateStore,
) -> None:
    """``Resolution.held_by``: the turn holding the run takes the result
    itself, so no wake is stamped, but only while that owner holds the
    lease; any other entry waking the run still stamps it."""
    for run_id in ("held", "other", "expired", "mixed", "leasing"):
        await _leased(store, run_id)
        cps = [_make_cp(run_id, 1), _make_cp(run_id, 2)]
        assert await store.save_checkpoints(cps, OWNER)
    at = NOW + 10
    answers = await store.resolve_checkpoints(
        [
            Resolution("held", 1, COMPLETED, output=1, held_by=OWNER),
            Resolution("other", 1, COMPLETED, output=1, held_by="instance-b"),
            Resolution("mixed", 1, COMPLETED, output=1, held_by=OWNER),
            Resolution("mixed", 2, FAILED, error=ERROR),
        ],
        at,
    )
    assert answers == [0, 0, 0, 0]
    assert await wake_of(store, "held") is None
    assert await wake_of(store, "other") == at
    assert await wake_of(store, "mixed") == at
    held = await store.get_checkpoint("held", 1)
    assert held is not None and (held.status, held.output) == (COMPLETED, 1)
    # A lease that ran out protects nothing: whoever leases the run next must see it.
    late = NOW + LEASE + 1
    assert await store.resolve_checkpoints(
        [Resolution("expired", 1, COMPLETED, held_by=OWNER)], late
    ) == [0]
    assert await wake_of(store, "expired") == late
    # resolve_and_lease cannot lease a held run, and stamps it no more.
    lease = TurnLease(OWNER, NOW + LEASE * 2, frozenset({RunStatus.SUSPENDED}), 10)
    answers, leased = await store.resolve_and_lease(
        [Resolution("leasing", 2, COMPLETED, held_by=OWNER)], at, lease
    )
    assert answers == [0] and leased == {}
    assert await wake_of(store, "leasing") is None


async def test_resolve_checkpoints_wakes_each_run_that_must_move_on(store: StateStore) -> None:
    await saved(store, _make_cp("done", 1, group="g"), _make_cp("done", 2, group="g"))
    await saved(store, _make_cp("failed", 1, group="g"), _make_cp("failed", 2, group="g"))
    await saved(store, _make_cp("waiting", 1, group="g"), _make_cp("waiting", 2, group="g"))
    await saved(store, _make_cp("single", 1))

    answers = await store.resolve_checkpoints(
        [
            Resolution("done", 2, COMPLETED, output=2),
            Resolution("failed", 1, FAILED, error=ERROR),
            Resolution("waiting", 1, COMPLETED),
            Resolution("done", 1, COMPLETED, output=1),
            Resolution("single", 1, COMPLETED, output="s"),
        ],
        NOW + 7,
    )

    assert answers == [1, 1, 1, 0, 0]
    assert await wake_of(store, "done") == NOW + 7
    assert await wake_of(store, "failed") == NOW + 7
    assert await wake_of(store, "waiting") is None
    assert await wake_of(store, "single") == NOW + 7
    failed = await store.get_checkpoint("failed", 1)
    assert failed is not None
    assert (failed.status, failed.error) == (FAILED, ERROR)


# -- resolving and leasing the woken runs in one transaction --------------------------------

WAKEABLE = frozenset({RunStatus.PENDING, RunStatus.SUSPENDED})


def lease_to(owner: str = "settler", limit: int = 100, **fields: Any) -> TurnLease:
    return TurnLease(owner, NOW + 50 + LEASE, WAKEABLE, limit, **fields)


async def parked(store: StateStore, *checkpoints: Checkpoint) -> None:
    """Save ``checkpoints`` (one run) under a turn that then suspends."""
    run_id = checkpoints[0].run_id
    await _leased(store, run_id)
    assert await store.save_checkpoints(list(checkpoints), OWNER)
    settled = await store.settle_run(run_id, OWNER, RunStatus.SUSPENDED, RunChanges(), NOW + 1)
    assert settled is SettleResult.SETTLED


async def test_resolve_and_lease_of_one_result_leases_its_run(store: StateStore) -> None:
    await parked(store, _make_cp("r1", 0, COMPLETED, output="a"), dispatched_cp("r1", 1))

    answers, leased = await store.resolve_and_lease(
        [Resolution("r1", 1, COMPLETED, output={"n": 1})], NOW + 50, lease_to()
    )

    assert answers == [0]
    assert set(leased) == {"r1"}
    run, history = leased["r1"]
    assert (run.status, run.locked_by, run.locked_until) == (
        RunStatus.RUNNING,
        "settler",
        NOW + 50 + LEASE,
    )
    assert run.wake_requested_at is None  # its turn starts now: no stamp
    assert [(cp.status, cp.output) for cp in history.values()] == [
        (COMPLETED, "a"),
        (COMPLETED, {"n": 1}),
    ]
    assert history == await store.load_checkpoints("r1")
    stored = await store.get_run("r1")
    assert stored is not None
    assert (stored.status, stored.locked_by, stored.wake_requested_at) == (
        RunStatus.RUNNING,
        "settler",
        None,
    )
    # the same result again: nothing to settle, nobody leased
    assert await store.resolve_and_lease(
        [Resolution("r1", 1, COMPLETED, output="late")], NOW + 60, lease_to("other")
    ) == ([None], {})


async def test_resolve_and_lease_leases_only_what_start_turns_would(
    store: StateStore,
) -> None:
    """A batch over many runs: each woken run that is free, of a listed
    workflow and within the limit is leased (in id order); every other woken
    run is stamped as resolve_checkpoints would; runs not woken are untouched."""
    for n in range(4):  # a-0 .. a-3: free and woken; the limit takes three
        await parked(store, _make_cp(f"a-{n}", 1))
    await parked(store, _make_cp("group", 1, group="g"), _make_cp("group", 2, group="g"))
    await _leased(store, "busy")  # its turn runs elsewhere
    assert await store.save_checkpoints([_make_cp("busy", 1)], OWNER)
    await parked(store, _make_cp("ended", 1))
    await store.update_run_if("ended", frozenset(RunStatus), {"status": RunStatus.CANCELLED}, NOW)
    await store.create_run(_make_run("other-wf").replace(workflow="elsewhere"))
    await store.start_turns(["other-wf"], OWNER, NOW, NOW + LEASE, PENDING)
    assert await store.save_checkpoints([_make_cp("other-wf", 1)], OWNER)
    await store.settle_run("other-wf", OWNER, RunStatus.SUSPENDED, RunChanges(), NOW + 1)

    answers, leased = await store.resolve_and_lease(
        [
            Resolution("a-3", 1, COMPLETED, output=3),
            Resolution("group", 1, COMPLETED, output="one of two"),
            Resolution("busy", 1, FAILED, error=ERROR),
            Resolution("a-1", 1, COMPLETED, output=1),
            Resolution("ended", 1, COMPLETED),
            Resolution("a-0", 1, COMPLETED, output=0),
            Resolution("other-wf", 1, COMPLETED),
            Resolution("a-2", 1, COMPLETED, output=2),
            Resolution("a-1", 1, COMPLETED, output="twice"),
        ],
        NOW + 50,
        lease_to(limit=3, workflows=frozenset({("wf", "1")})),
    )

    assert answers == [0, 1, 0, 0, 0, 0, 0, 0, None]
    # woken: a-0..a-3, busy, other-wf (ended is terminal); the three first
    # in id order are considered and taken
    assert sorted(leased) == ["a-0", "a-1", "a-2"]
    assert [leased[r][1][1].output for r in ("a-0", "a-1", "a-2")] == [0, 1, 2]
    for run_id in ("a-0", "a-1", "a-2"):  # leased, so not stamped too
        run = await store.get_run(run_id)
        assert run is not None and (run.locked_by, run.wake_requested_at) == ("settler", None)
    for run_id in ("a-3", "busy", "other-wf"):  # stamped, not leased
        assert await wake_of(store, run_id) == NOW + 50
    a3 = await store.get_run("a-3")
    assert a3 is not None and a3.status is RunStatus.SUSPENDED
    busy = await store.get_run("busy")
    assert busy is not None and busy.locked_by == OWNER
    assert await wake_of(store, "group") is None
    group = await store.get_run("group")
    assert group is not None and group.status is RunStatus.SUSPENDED
    ended = await store.get_run("ended")
    assert ended is not None
    assert (ended.status, ended.wake_requested_at, ended.locked_by) == (
        RunStatus.CANCELLED,
        None,
        None,
    )


async def test_resolve_and_lease_with_no_room_only_stamps(store: StateStore) -> None:
    await parked(store, _make_cp("r1", 1))

    answers, leased = await store.resolve_and_lease(
        [Resolution("r1", 1, COMPLETED)], NOW + 50, lease_to(limit=0)
    )

    assert (answers, leased) == ([0], {})
    assert await wake_of(store, "r1") == NOW + 50


async def test_racing_resolve_and_lease_lease_each_run_once(
    store_factory: StoreFactory,
) -> None:
    """The same results delivered to two instances at once (at-least-once
    delivery): each step is settled once and each run leased by one of them."""
    a, b = await store_factory(), await store_factory()
    runs = [f"race-{n:02}" for n in range(30)]
    for run_id in runs:
        await parked(a, _make_cp(run_id, 1), _make_cp(run_id, 2, group="g"))
    batch = [Resolution(r, 1, COMPLETED, output=r) for r in runs]

    (answers_a, leased_a), (answers_b, leased_b) = await asyncio.gather(
        a.resolve_and_lease(batch, NOW + 50, lease_to("a")),
        b.resolve_and_lease(list(reversed(batch)), NOW + 50, lease_to("b")),
    )

    settled = [x is not None for x in answers_a] + [x is not None for x in answers_b]
    assert settled.count(True) == 30
    assert not set(leased_a) & set(leased_b)
    assert sorted([*leased_a, *leased_b]) == runs
    for run_id in runs:
        owner = "a" if run_id in leased_a else "b"
        run = await a.get_run(run_id)
        assert run is not None and (run.status, run.locked_by) == (RunStatus.RUNNING, owner)


async def test_resolve_and_lease_beside_the_owners_writes_never_deadlocks(
    store_factory: StoreFactory,
) -> None:
    """As the resolve_checkpoints race: results settled and runs leased by one
    instance while another's turns write and settle the same runs."""
    owner, receiver = await store_factory(), await store_factory()
    for round_ in range(4):
        firsts = [f"l{round_}-a-{n:03}" for n in range(30)]
        lasts = [f"l{round_}-b-{n:03}" for n in range(30)]
        for run_id in firsts + lasts:
            await owner.create_run(_make_run(run_id))
        assert len(await owner.start_turns(firsts + lasts, OWNER, NOW, NOW + LEASE, PENDING)) == 60
        assert await owner.save_checkpoints([_make_cp(r, 1) for r in firsts + lasts], OWNER)
        writes = [owner.save_checkpoint(_make_cp(r, 2), OWNER) for r in reversed(lasts)]
        settles = [
            owner.settle_run(r, OWNER, RunStatus.SUSPENDED, RunChanges(), NOW + 1)
            for r in reversed(firsts)
        ]
        resolved = receiver.resolve_and_lease(
            [Resolution(r, 1, COMPLETED, output=r) for r in firsts + lasts],
            NOW + 2,
            lease_to("receiver"),
        )

        (answers, leased), written, _ = await asyncio.gather(
            resolved, asyncio.gather(*writes), asyncio.gather(*settles)
        )

        assert answers == [0] * 60
        assert set(leased) <= set(firsts)  # only a suspended run can be taken
        assert all(written)
        for run_id in firsts:
            run = await owner.get_run(run_id)
            assert run is not None
            # either leased by the receiver, or its owner's settle saw the stamp
            assert run_id in leased or run.locked_by == OWNER


# -- the events a result carries -----------------------------------------------------------


async def test_resolve_checkpoints_stores_the_events_of_the_result(store: StateStore) -> None:
    await saved(store, dispatched_cp("r1", 0), _make_cp("r1", 1), _make_cp("r1", 2))
    await store.update_run_if("r1", PENDING, {"status": RunStatus.SUSPENDED}, NOW)

    answers = await store.resolve_checkpoints(
        [
            Resolution("r1", 0, COMPLETED, output="sent", events=EVENTS),
            Resolution("r1", 1, FAILED, error=ERROR, events=EVENTS[1:]),
            Resolution("r1", 2, COMPLETED, output=2),
            Resolution("r1", 0, COMPLETED, output="again", events=[]),  # already settled
        ],
        NOW + 10,
    )

    assert answers == [0, 0, 0, None]
    history = await store.load_checkpoints("r1")
    assert [history[seq].events for seq in (0, 1, 2)] == [EVENTS, EVENTS[1:], None]
    assert (history[0].output, history[0].progress) == ("sent", PROGRESS)
    assert await store.get_checkpoint("r1", 0) == history[0]
    assert await store.get_checkpoint("r1", 1) == history[1]
    turns = await store.start_turns(["r1"], OWNER, NOW + 20, NOW + LEASE, frozenset(RunStatus))
    assert turns["r1"][1] == history


async def test_a_save_never_writes_or_wipes_the_stored_events(store: StateStore) -> None:
    """Only a resolve writes ``events``: the turn saving the step again (a
    retry's new attempt) keeps those of the attempt that settled it."""
    await saved(store, dispatched_cp("r1", 0), _make_cp("r1", 1))
    assert await store.resolve_checkpoints(
        [
            Resolution("r1", 0, FAILED, error=ERROR, events=EVENTS),
            Resolution("r1", 1, COMPLETED, output=1, events=EVENTS[:1]),
        ],
        NOW + 10,
    ) == [0, 0]
    await _leased(store, "r2")
    assert await store.start_turns(["r1"], OWNER, NOW, NOW + LEASE, frozenset(RunStatus))

    retry = dispatched_cp("r1", 0, dispatched_at=NOW + 20, redispatches=0)
    assert await store.save_checkpoint(retry, OWNER)
    found = await store.get_checkpoint("r1", 0)
    assert found is not None
    assert (found.status, found.redispatches, found.events) == (
        CheckpointStatus.PENDING,
        0,
        EVENTS,
    )
    assert await store.save_checkpoints([retry], OWNER)
    assert await store.save_checkpoint(_make_cp("r1", 1, COMPLETED, output="stale"), OWNER)
    assert (await store.load_checkpoints("r1"))[0].events == EVENTS
    assert (await store.get_checkpoint("r1", 1)) == _make_cp(
        "r1", 1, COMPLETED, output=1, finished_at=NOW + 10, events=EVENTS[:1]
    )

    # events on a saved checkpoint are not written: a new row has none
    assert await store.save_checkpoint(_make_cp("r2", 0, events=EVENTS), OWNER)
    assert await store.save_checkpoints([_make_cp("r2", 1, events=EVENTS)], OWNER)
    assert [cp.events for cp in (await store.load_checkpoints("r2")).values()] == [None, None]

    # the next attempt's result replaces them, even with none
    assert await store.resolve_checkpoints(
        [Resolution("r1", 0, COMPLETED, output="ok", events=EVENTS[2:])], NOW + 30
    ) == [0]
    assert (await store.load_checkpoints("r1"))[0].events == EVENTS[2:]
    assert await store.save_checkpoint(_make_cp("r2", 2), OWNER)
    assert await store.resolve_checkpoints([Resolution("r2", 2, COMPLETED, "x")], NOW + 31) == [0]
    found = await store.get_checkpoint("r2", 2)
    assert found is not None and found.events is None


# -- flow control -------------------------------------------------------------------------


async def test_try_admit_caps_concurrency(store: StateStore) -> None:
    assert await store.try_admit(ask("a:1", concurrency=2), NOW) is None
    assert await store.try_admit(ask("b:1", concurrency=2), NOW + 1) is None

    assert await store.try_admit(ask("c:1", concurrency=2, retry_ms=250), NOW + 2) == NOW + 252
    assert await store.try_admit(ask("c:1", concurrency=2, retry_ms=250), NOW + 300) == NOW + 550
    # another queue is counted apart
    assert await store.try_admit(ask("c:1", queue="other", concurrency=2), NOW + 3) is None


async def test_list_queues_shows_held_slots_and_waiters(store: StateStore) -> None:
    assert await store.list_queues() == []
    await store.try_admit(ask("a:1", concurrency=2), NOW)
    await store.try_admit(ask("b:1", concurrency=2), NOW + 1)
    await store.try_admit(ask("c:1", concurrency=2), NOW + 2)
    await store.try_admit(ask("d:1", concurrency=2), NOW + 3)
    await store.try_admit(ask("e:1", queue="free"), NOW + 4)
    await store.try_admit(ask("gone:1", queue="idle"), NOW + 5)
    await store.release_slots("gone", NOW + 6)  # a released slot is kept, not held

    queues = await store.list_queues()

    assert queues == [
        QueueState("free", held=1, waiting=0, oldest_wait_at=None),
        QueueState("q", held=2, waiting=2, oldest_wait_at=NOW + 2),
    ]


async def test_count_flow_waiters_counts_refused_steps_by_queue(store: StateStore) -> None:
    await suspended(store, "a", "b", "c", "d")
    assert await store.count_flow_waiters() == {}
    assert await store.try_admit(ask("a:1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("b:1", concurrency=1), NOW + 1) is not None
    assert await store.try_admit(ask("c:1", concurrency=1), NOW + 2) is not None
    assert await store.try_admit(ask("d:1", queue="other", concurrency=1), NOW + 3) is None
    assert await store.count_flow_waiters() == {"q": 2}


async def test_try_admit_is_idempotent_for_a_step_holding_a_slot(store: StateStore) -> None:
    assert await store.try_admit(ask("a:1", concurrency=2), NOW) is None

    for at in (NOW + 1, NOW + 2):
        assert await store.try_admit(ask("a:1", concurrency=2), at) is None

    # the re-asks took no further slot
    assert await store.try_admit(ask("b:1", concurrency=2), NOW + 3) is None
    assert await store.try_admit(ask("c:1", concurrency=2), NOW + 4) == NOW + 1004


async def test_unlimited_queues_admit_everyone(store: StateStore) -> None:
    for n in range(5):
        assert await store.try_admit(ask(f"r{n}:1"), NOW) is None


async def test_try_admit_takes_higher_priority_first(store: StateStore) -> None:
    await suspended(store, "h", "low", "high")
    assert await store.try_admit(ask("h:1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("low:1", concurrency=1, priority=0), NOW + 1) == NOW + 1001
    assert await store.try_admit(ask("high:1", concurrency=1, priority=5), NOW + 2) == NOW + 1002

    assert await store.release_slots("h", NOW + 3) == 1

    assert await wake_of(store, "high") == NOW + 3  # the first in line is told
    assert await wake_of(store, "low") is None
    # the older but less urgent waiter asking first is still refused
    assert await store.try_admit(ask("low:1", concurrency=1, priority=0), NOW + 4) == NOW + 1004
    assert await store.try_admit(ask("high:1", concurrency=1, priority=5), NOW + 5) is None
    assert await store.try_admit(ask("low:1", concurrency=1, priority=0), NOW + 6) == NOW + 1006


@pytest.mark.parametrize("explicit", [True, False], ids=["fairness-key", "run-id"])
async def test_try_admit_favours_the_key_holding_fewest_slots(
    store: StateStore, explicit: bool
) -> None:
    """``a`` already holds a slot, so ``b``'s newer waiter goes before ``a``'s older one.
    Without a fairness key, the run id is the key."""
    await suspended(store, "a", "b", "x")

    def key(name: str) -> str | None:
        return f"key-{name}" if explicit else None

    def request(step_id: str) -> Admission:
        return ask(step_id, concurrency=2, fairness_key=key(step_id[0]))

    assert await store.try_admit(request("a:1"), NOW) is None
    assert await store.try_admit(request("x:1"), NOW + 1) is None
    assert await store.try_admit(request("a:2"), NOW + 2) == NOW + 1002
    assert await store.try_admit(request("b:1"), NOW + 3) == NOW + 1003

    await store.release_slots("x", NOW + 4)

    assert await wake_of(store, "b") == NOW + 4
    assert await store.try_admit(request("a:2"), NOW + 5) == NOW + 1005
    assert await store.try_admit(request("b:1"), NOW + 6) is None


async def test_try_admit_limits_the_rate_over_the_period(store: StateStore) -> None:
    def request(step_id: str) -> Admission:
        return ask(step_id, rate_limit=2, rate_period_ms=1000, retry_ms=100)

    assert await store.try_admit(request("a:1"), NOW) is None
    assert await store.try_admit(request("b:1"), NOW + 10) is None
    assert await store.try_admit(request("c:1"), NOW + 20) == NOW + 120
    # released slots still count: the limit is on admissions, not on holders
    await store.release_slots("a", NOW + 30)
    await store.release_slots("b", NOW + 30)
    assert await store.try_admit(request("c:1"), NOW + 40) == NOW + 140
    assert await store.try_admit(request("c:1"), NOW + 999) == NOW + 1099

    # a:1's admission left the window
    assert await store.try_admit(request("c:1"), NOW + 1000) is None
    assert await store.try_admit(request("d:1"), NOW + 1001) == NOW + 1101
    assert await store.try_admit(request("d:1"), NOW + 1010) is None  # b:1's left too


async def test_try_admit_takes_the_tighter_of_concurrency_and_rate(store: StateStore) -> None:
    def request(step_id: str) -> Admission:
        return ask(step_id, concurrency=1, rate_limit=5, rate_period_ms=1000)

    assert await store.try_admit(request("a:1"), NOW) is None
    assert await store.try_admit(request("b:1"), NOW + 1) == NOW + 1001
    await store.release_slots("a", NOW + 2)
    assert await store.try_admit(request("b:1"), NOW + 3) is None


async def test_waiters_not_seen_for_three_retries_are_dropped(store: StateStore) -> None:
    await suspended(store, "h", "gone", "fresh")
    assert await store.try_admit(ask("h:1", concurrency=1), NOW) is None
    stale = ask("gone:1", concurrency=1, priority=9, retry_ms=100)
    fresh = ask("fresh:1", concurrency=1, retry_ms=100)
    assert await store.try_admit(stale, NOW) == NOW + 100
    await store.release_slots("h", NOW + 50)

    # still within 3 * retry_ms: the urgent waiter keeps its place
    assert await store.try_admit(fresh, NOW + 200) == NOW + 300
    # past it, the waiter is gone and the next in line gets the slot
    assert await store.try_admit(fresh, NOW + 301) is None
    # coming back, the dropped step queues anew behind the slot holder
    assert await store.try_admit(stale, NOW + 302) == NOW + 402


async def test_settling_a_step_frees_its_slot_and_wakes_the_next(store: StateStore) -> None:
    await saved(store, _make_cp("holder", 1, queue="q"), _make_cp("holder", 2, queue="q"))
    await saved(store, _make_cp("urgent", 1, queue="q"))
    await suspended(store, "early")
    assert await store.try_admit(ask("holder:1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("early:1", concurrency=1), NOW + 1) == NOW + 1001
    assert await store.try_admit(ask("urgent:1", concurrency=1, priority=1), NOW + 2) == NOW + 1002

    answers = await store.resolve_checkpoints(
        [Resolution("holder", 1, COMPLETED, output="ok")], NOW + 5
    )

    assert answers == [0]
    assert await wake_of(store, "urgent") == NOW + 5
    assert await wake_of(store, "early") is None
    assert await store.try_admit(ask("urgent:1", concurrency=1, priority=1), NOW + 6) is None
    assert await store.try_admit(ask("early:1", concurrency=1), NOW + 7) == NOW + 1007

    # a failed step frees its slot too (holder:2 never held one: nothing to free)
    await store.resolve_checkpoints([Resolution("holder", 2, FAILED, error=ERROR)], NOW + 8)
    assert await store.try_admit(ask("early:1", concurrency=1), NOW + 9) == NOW + 1009
    await store.resolve_checkpoints([Resolution("urgent", 1, FAILED, error=ERROR)], NOW + 11)
    assert await wake_of(store, "early") == NOW + 11
    assert await store.try_admit(ask("early:1", concurrency=1), NOW + 12) is None


async def test_release_slots_frees_a_finished_runs_slots_and_waits(store: StateStore) -> None:
    await suspended(store, "r", "z", "w1", "w3")
    assert await store.try_admit(ask("r:1", queue="q1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("r:2", queue="q2", concurrency=1), NOW) is None
    assert await store.try_admit(ask("w1:1", queue="q1", concurrency=1), NOW + 1) == NOW + 1001
    assert await store.try_admit(ask("z:1", queue="q3", concurrency=1), NOW) is None
    r_waits = ask("r:3", queue="q3", concurrency=1, priority=9)
    assert await store.try_admit(r_waits, NOW + 1) == NOW + 1001
    assert await store.try_admit(ask("w3:1", queue="q3", concurrency=1), NOW + 2) == NOW + 1002

    assert await store.release_slots("r", NOW + 5) == 2

    assert await wake_of(store, "w1") == NOW + 5
    assert await store.try_admit(ask("w1:1", queue="q1", concurrency=1), NOW + 6) is None
    assert await store.try_admit(ask("x:2", queue="q2", concurrency=1), NOW + 6) is None
    # r's waiter in q3 is gone: once z is done, w3 is next
    assert await store.release_slots("z", NOW + 7) == 1
    assert await wake_of(store, "w3") == NOW + 7
    assert await store.try_admit(ask("w3:1", queue="q3", concurrency=1), NOW + 8) is None
    # nothing left to free
    assert await store.release_slots("r", NOW + 9) == 0
    assert await store.release_slots("unknown", NOW + 9) == 0


async def test_a_waiter_takes_its_place_in_line_from_enqueued_at(store: StateStore) -> None:
    await suspended(store, "holder", "late", "early")
    assert await store.try_admit(ask("holder:1", concurrency=1), NOW) is None
    late = dataclasses.replace(ask("late:1", concurrency=1), enqueued_at=NOW - 5)
    early = dataclasses.replace(ask("early:1", concurrency=1), enqueued_at=NOW - 10)
    assert await store.try_admit(late, NOW + 1) == NOW + 1001
    assert await store.try_admit(early, NOW + 2) == NOW + 1002  # asked later, but older

    assert await store.release_slots("holder", NOW + 3) == 1
    assert await wake_of(store, "early") == NOW + 3
    assert await store.try_admit(late, NOW + 4) == NOW + 1004
    assert await store.try_admit(early, NOW + 5) is None


async def test_a_slot_held_by_a_run_that_ended_is_free(store: StateStore) -> None:
    """A process that dies between a run's terminal write and freeing its slots
    must not hold the queue's capacity forever (a singleton key blocked for good)."""
    await suspended(store, "next")
    await store.create_run(_make_run("gone", RunStatus.PENDING))
    assert await store.try_admit(ask("gone:1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("next:1", concurrency=1), NOW + 1) == NOW + 1001

    assert await store.update_run_if(
        "gone", frozenset({RunStatus.PENDING}), {"status": "completed"}, NOW + 2
    )

    assert await store.try_admit(ask("next:1", concurrency=1), NOW + 3) is None
    # the live holder still counts
    assert await store.try_admit(ask("third:1", concurrency=1), NOW + 4) == NOW + 1004


async def test_an_ask_that_finds_room_for_a_waiter_ahead_wakes_it(store: StateStore) -> None:
    """The room a dead process left (a run ended without freeing its slot) is
    found by whoever asks next: if that is not the first in line, the first is
    woken, or it would sleep its whole ``retry_ms`` with the slot free."""
    await suspended(store, "first", "second")
    await store.create_run(_make_run("gone", RunStatus.PENDING))
    assert await store.try_admit(ask("gone:1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("first:1", concurrency=1), NOW + 1) == NOW + 1001
    assert await store.update_run_if(
        "gone", frozenset({RunStatus.PENDING}), {"status": "completed"}, NOW + 2
    )
    assert await wake_of(store, "first") is None

    assert await store.try_admit(ask("second:1", concurrency=1), NOW + 3) == NOW + 1003

    assert await wake_of(store, "first") == NOW + 3
    assert await wake_of(store, "second") is None
    assert await store.try_admit(ask("first:1", concurrency=1), NOW + 4) is None


async def test_wakes_spare_runs_that_ended(store: StateStore) -> None:
    await suspended(store, "h")
    await store.create_run(_make_run("ended", RunStatus.CANCELLED))
    assert await store.try_admit(ask("h:1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("ended:1", concurrency=1), NOW + 1) == NOW + 1001

    assert await store.release_slots("h", NOW + 2) == 1

    assert await wake_of(store, "ended") is None


async def test_deleting_a_run_frees_its_slots(store: StateStore) -> None:
    await store.create_run(_make_run("h"))
    assert await store.try_admit(ask("h:1", concurrency=1), NOW) is None
    assert await store.try_admit(ask("h:2", concurrency=1), NOW) == NOW + 1000

    assert await store.delete_run("h")

    assert await store.try_admit(ask("w:1", concurrency=1), NOW + 1) is None


async def test_results_settled_while_the_owner_writes_the_same_runs_never_deadlock(
    store_factory: StoreFactory,
) -> None:
    """Two engines on one store: one settles step results (locking each run it
    touches) while the runs' owner commits its turns' writes on the same runs,
    the checkpoints and the settles naming the runs in the opposite order.
    Every multi-run write must lock runs in one global order, or the database
    aborts one of them as a deadlock."""
    owner, receiver = await store_factory(), await store_factory()

    for round_ in range(6):
        firsts = [f"r{round_}-a-{n:03}" for n in range(40)]
        lasts = [f"r{round_}-b-{n:03}" for n in range(40)]
        for run_id in firsts + lasts:
            await owner.create_run(_make_run(run_id))
        started = await owner.start_turns(firsts + lasts, OWNER, NOW, NOW + LEASE, PENDING)
        assert len(started) == 80
        assert all(
            await asyncio.gather(
                *(owner.save_checkpoint(_make_cp(r, 1), OWNER) for r in firsts + lasts)
            )
        )
        # the owner: a new step on each run it names last, a suspend of each it names first
        writes = [owner.save_checkpoint(_make_cp(r, 2), OWNER) for r in reversed(lasts)]
        settles = [
            owner.settle_run(r, OWNER, RunStatus.SUSPENDED, RunChanges(), NOW + 1)
            for r in reversed(firsts)
        ]
        # the other engine: the results of the steps of all of them
        resolved = receiver.resolve_checkpoints(
            [Resolution(r, 1, COMPLETED, output=r) for r in firsts + lasts], NOW + 2
        )

        outcome = await asyncio.gather(resolved, *writes, *settles)

        assert outcome[0] == [0] * 80
        assert all(outcome[1 : 1 + len(writes)])
        assert set(outcome[1 + len(writes) :]) <= {
            SettleResult.SETTLED,
            SettleResult.WAKE_REQUESTED,
        }


@pytest.mark.parametrize("limit", ["concurrency", "rate_limit"])
async def test_racing_admissions_across_store_objects_respect_the_limit(
    store_factory: StoreFactory, limit: str
) -> None:
    stores = [await store_factory(), await store_factory()]

    def request(n: int) -> Admission:
        if limit == "concurrency":
            return ask(f"run-{n}:1", concurrency=3)
        return ask(f"run-{n}:1", rate_limit=3)

    answers = await asyncio.gather(*(stores[n % 2].try_admit(request(n), NOW) for n in range(20)))

    assert answers.count(None) == 3
    assert all(a == NOW + 1000 for a in answers if a is not None)
    admitted = [n for n, a in enumerate(answers) if a is None]
    # whoever asks again agrees: the admitted keep their slots, the others wait
    again = [await stores[0].try_admit(request(n), NOW + 1) for n in range(20)]
    assert [n for n, a in enumerate(again) if a is None] == admitted


# -- histories read from a position (a kept turn's ``read_from``) ----------------------


async def _with_history(store: StateStore, run_id: str) -> None:
    """A suspended run whose history holds an undo (-1), two completed
    positions, a pending one and a completed one after it."""
    await parked(
        store,
        _make_cp(run_id, -1, COMPLETED, kind="undo", output="undone"),
        _make_cp(run_id, 0, COMPLETED, output="zero"),
        _make_cp(run_id, 1, COMPLETED, output="one"),
        dispatched_cp(run_id, 2),
        _make_cp(run_id, 3, COMPLETED, output="three"),
    )


def _froms(**positions: int) -> Any:
    return lambda run_id: positions.get(run_id.replace("-", "_"), 0)


async def test_start_turns_reads_each_run_from_its_position(store: StateStore) -> None:
    """A batch of many: each run's history is read from the position
    ``read_from`` gives it, its negative positions included; ``0`` (or a
    run it does not know) reads everything, as a plain history."""
    for run_id in ("all", "mid", "end", "one"):
        await _with_history(store, run_id)
    everything = await store.load_checkpoints("all")

    leased = await store.start_turns(
        ["all", "mid", "end"], OWNER, NOW, NOW + LEASE, WAKEABLE, read_from=_froms(mid=2, end=9)
    )

    whole, mid, end = (leased[r][1] for r in ("all", "mid", "end"))
    assert not isinstance(whole, HistoryTail)
    assert whole == everything and list(whole) == [-1, 0, 1, 2, 3]
    assert isinstance(mid, HistoryTail) and mid.since == 2
    assert list(mid) == [-1, 2, 3]
    assert mid[2] == dataclasses.replace(everything[2], run_id="mid")
    assert mid[-1].output == "undone" and mid[3].output == "three"
    assert isinstance(end, HistoryTail) and (end.since, list(end)) == (9, [-1])
    # a batch of one
    one = await store.start_turns(
        ["one"], OWNER, NOW, NOW + LEASE, WAKEABLE, read_from=_froms(one=1)
    )
    assert list(one["one"][1]) == [-1, 1, 2, 3]


async def test_a_history_read_from_a_position_sees_what_changed_above_it(
    store_factory: StoreFactory,
) -> None:
    """Another instance's turn changed the run since: what it wrote at or
    above the position is read; below it, nothing is read (the caller holds
    those positions, settled ones a store never rewrites). Racing lease
    calls lease the run once."""
    ours, theirs = await store_factory(), await store_factory()
    await _with_history(ours, "r1")
    assert "r1" in await theirs.start_turns(["r1"], "instance-b", NOW, NOW + LEASE, WAKEABLE)
    assert await theirs.save_checkpoints(
        [_make_cp("r1", 2, COMPLETED, output="two"), _make_cp("r1", 4), _make_cp("r1", -2)],
        "instance-b",
    )
    await theirs.settle_run("r1", "instance-b", RunStatus.SUSPENDED, RunChanges(), NOW + 2)

    results = await asyncio.gather(
        *(
            store.start_turns(["r1"], owner, NOW + 3, NOW + LEASE, WAKEABLE, read_from=_froms(r1=2))
            for store, owner in ((ours, OWNER), (theirs, "instance-b"), (ours, "third"))
        )
    )

    histories = [got["r1"][1] for got in results if got]
    assert len(histories) == 1
    assert list(histories[0]) == [-2, -1, 2, 3, 4]
    assert (histories[0][2].status, histories[0][2].output) == (COMPLETED, "two")
    # from above the change at 2: that position is not read
    assert list(await ours.load_checkpoints("r1", 3)) == [-2, -1, 3, 4]


async def test_load_checkpoints_reads_from_a_position(store: StateStore) -> None:
    await _with_history(store, "r1")

    assert list(await store.load_checkpoints("r1")) == [-1, 0, 1, 2, 3]
    assert list(await store.load_checkpoints("r1", 0)) == [-1, 0, 1, 2, 3]
    tail = await store.load_checkpoints("r1", 3)
    assert isinstance(tail, HistoryTail) and (tail.since, list(tail)) == (3, [-1, 3])
    assert tail[3] == (await store.load_checkpoints("r1"))[3]


async def test_resolve_and_lease_reads_each_woken_run_from_its_position(
    store: StateStore,
) -> None:
    """Of one result and of many: each run leased is read from its position."""
    for run_id in ("a", "b", "c"):
        await _with_history(store, run_id)

    _, one = await store.resolve_and_lease(
        [Resolution("a", 2, COMPLETED, output="two")],
        NOW + 50,
        lease_to(read_from=_froms(a=2)),
    )
    assert isinstance(one["a"][1], HistoryTail)
    assert [(s, cp.status) for s, cp in one["a"][1].items()] == [
        (-1, COMPLETED),
        (2, COMPLETED),
        (3, COMPLETED),
    ]
    assert one["a"][1][2].output == "two"

    _, many = await store.resolve_and_lease(
        [Resolution(r, 2, COMPLETED, output=r) for r in ("c", "b")],
        NOW + 50,
        lease_to(read_from=_froms(c=3)),
    )
    assert list(many["b"][1]) == [-1, 0, 1, 2, 3] and not isinstance(many["b"][1], HistoryTail)
    assert list(many["c"][1]) == [-1, 3]
