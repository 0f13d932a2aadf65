"""The StateStore contract for remote workflow decisions (``DecisionStore``):
the awaited task id, the one conditional write that applies a decision, and
the re-drive time a run heartbeat pushes back.

Same fixtures as every ``stores`` module; see :mod:`durably.testing.conformance`.
"""

from __future__ import annotations

import asyncio

from durably.model import CheckpointStatus, RunStatus
from durably.stores import RunChanges, SettleResult, StateStore
from durably.stores.base import Resolution

from ._helpers import LEASE, NOW, OTHER, OWNER, checkpoint, leased, make_cp, status_of


async def _awaiting(store: StateStore, run_id: str, task_id: str, wake_at: int = NOW + 100) -> None:
    """A leased run that records ``task_id`` and suspends (a remote turn sent)."""
    await leased(store, run_id)
    assert await store.mark_awaiting(run_id, OWNER, task_id) is True
    settled = await store.settle_run(
        run_id, OWNER, RunStatus.SUSPENDED, RunChanges(wake_at=wake_at), NOW
    )
    assert settled is SettleResult.SETTLED


async def test_marking_the_awaited_turn_needs_the_lease(store: StateStore) -> None:
    await leased(store, "r1")
    assert await store.mark_awaiting("r1", OTHER, "t1") is False
    assert await store.mark_awaiting("r1", OWNER, "t1") is True
    assert await store.mark_awaiting("missing", OWNER, "t1") is False


async def test_a_decision_for_the_awaited_turn_leases_and_writes_once(store: StateStore) -> None:
    await _awaiting(store, "r1", "t1")
    cps = [make_cp("r1", 0, CheckpointStatus.COMPLETED, output=1), make_cp("r1", 1)]
    run = await store.take_decision("r1", "t1", OWNER, NOW + LEASE, NOW + 1, cps)
    assert run is not None
    assert run.status is RunStatus.RUNNING and run.locked_by == OWNER
    assert run.wake_at is None
    assert (await checkpoint(store, "r1", 0)).output == 1
    # the same decision again (a duplicate delivery) finds nothing to match
    assert await store.take_decision("r1", "t1", OTHER, NOW + LEASE, NOW + 2, cps) is None
    assert (await store.get_run("r1")).locked_by == OWNER  # type: ignore[union-attr]


async def test_a_stale_task_id_or_a_leased_run_changes_nothing(store: StateStore) -> None:
    await _awaiting(store, "r1", "t2")
    cps = [make_cp("r1", 0, CheckpointStatus.COMPLETED, output="stale")]
    assert await store.take_decision("r1", "t1", OWNER, NOW + LEASE, NOW, cps) is None
    assert await store.load_checkpoints("r1") == {}
    assert await status_of(store, "r1") is RunStatus.SUSPENDED
    # a turn under way (the run leased again) makes the awaited decision wait
    await leased(store, "r2")
    assert await store.mark_awaiting("r2", OWNER, "t1") is True
    assert await store.take_decision("r2", "t1", OTHER, NOW + LEASE, NOW, []) is None
    assert await store.take_decision("missing", "t1", OWNER, NOW + LEASE, NOW, []) is None


async def test_a_decision_keeps_the_checkpoints_a_seq_has(store: StateStore) -> None:
    await leased(store, "r1")
    await store.save_checkpoints(
        [make_cp("r1", 0, CheckpointStatus.COMPLETED, output="first")], OWNER
    )
    assert await store.mark_awaiting("r1", OWNER, "t1") is True
    await store.settle_run("r1", OWNER, RunStatus.SUSPENDED, RunChanges(), NOW)
    cps = [make_cp("r1", 0, output="again"), make_cp("r1", 1, output="new")]
    assert await store.take_decision("r1", "t1", OWNER, NOW + LEASE, NOW, cps) is not None
    assert (await checkpoint(store, "r1", 0)).output == "first"
    assert (await checkpoint(store, "r1", 1)).output == "new"


async def test_two_instances_racing_for_one_decision_one_wins(store: StateStore) -> None:
    await _awaiting(store, "r1", "t1")
    won = await asyncio.gather(
        *(
            store.take_decision("r1", "t1", owner, NOW + LEASE, NOW, [make_cp("r1", 0)])
            for owner in (OWNER, OTHER, OWNER, OTHER)
        )
    )
    assert sum(run is not None for run in won) == 1


async def test_a_run_beat_pushes_the_re_drive_back_never_forward(store: StateStore) -> None:
    await _awaiting(store, "r1", "t1", wake_at=NOW + 100)
    assert await store.extend_decision_wait("r1", NOW + 500, NOW) is True
    assert (await store.get_run("r1")).wake_at == NOW + 500  # type: ignore[union-attr]
    assert await store.extend_decision_wait("r1", NOW + 200, NOW) is True
    assert (await store.get_run("r1")).wake_at == NOW + 500  # type: ignore[union-attr]
    # once the decision is taken, beats no longer move the run's wake
    await store.take_decision("r1", "t1", OWNER, NOW + LEASE, NOW, [])
    await store.settle_run("r1", OWNER, RunStatus.SUSPENDED, RunChanges(wake_at=NOW + 50), NOW)
    assert await store.extend_decision_wait("r1", NOW + 900, NOW) is False
    assert (await store.get_run("r1")).wake_at == NOW + 50  # type: ignore[union-attr]


async def test_marking_calls_sent_never_undoes_a_result(store: StateStore) -> None:
    await leased(store, "r1")
    await store.save_checkpoints(
        [
            make_cp("r1", 0, kind="step"),
            make_cp("r1", 1, kind="step"),
            make_cp("r1", 2, kind="step"),
        ],
        OWNER,
    )
    # seq 1's result came back before the stamp
    await store.resolve_checkpoints(
        [Resolution("r1", 1, CheckpointStatus.FAILED, error={"message": "fast failure"})], NOW
    )
    await store.mark_dispatched("r1", [0, 1], NOW + 5)
    await store.mark_dispatched("r1", [0], NOW + 9)  # stamped already: kept
    cps = await store.load_checkpoints("r1")
    assert cps[0].dispatched_at == NOW + 5 and cps[0].status is CheckpointStatus.PENDING
    assert cps[1].status is CheckpointStatus.FAILED and cps[1].dispatched_at is None
    assert cps[2].dispatched_at is None
