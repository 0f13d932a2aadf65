"""``StateStore.end_child_runs``: a child's ending and its parent's placeholder, one write.

Same fixtures as ``stores.runs``: ``store`` is an empty store,
``store_factory`` opens more store objects on its database. Every time is an
explicit integer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus
from durably.stores import ChildEnd, RunChanges, StateStore
from durably.stores.base import Resolution

if TYPE_CHECKING:
    from .. import StoreFactory

NOW = 1_700_000_000_000  # past 2**31: times must be 64-bit everywhere
LEASE = 30_000
OWNER = "instance-a"
PENDING = frozenset({RunStatus.PENDING})
LIVE = frozenset({RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED})
CANCEL = {"message": "cancelled", "code": "cancelled", "type": "RunCancelled"}


def _run(run_id: str, status: RunStatus = RunStatus.PENDING, **fields: Any) -> Run:
    return Run(
        run_id=run_id,
        workflow="wf",
        workflow_version="1",
        status=status,
        created_at=NOW,
        updated_at=NOW,
        **fields,
    )


async def _family(store: StateStore, children: int = 1) -> None:
    """A suspended parent ``p`` waiting (group ``g``) on running children
    ``c0``, ``c1``, … leased to OWNER, at seqs 0, 1, …"""
    await store.create_run(_run("p"))
    assert "p" in await store.start_turns(["p"], OWNER, NOW, NOW + LEASE, PENDING)
    placeholders = [
        Checkpoint(
            run_id="p",
            seq=i,
            name=f"child:c{i}",
            kind="child",
            status=CheckpointStatus.PENDING,
            input={"run_id": f"c{i}"},
            group="g",
        )
        for i in range(children)
    ]
    assert await store.save_checkpoints(placeholders, OWNER)
    assert await store.settle_run("p", OWNER, RunStatus.SUSPENDED, RunChanges(), NOW) == "settled"
    for i in range(children):
        await store.create_run(_run(f"c{i}", parent_id="p", parent_seq=i))
    ids = [f"c{i}" for i in range(children)]
    assert len(await store.start_turns(ids, OWNER, NOW, NOW + LEASE, PENDING)) == children


def _settle(i: int, output: Any, owner: str = OWNER) -> ChildEnd:
    return ChildEnd(
        f"c{i}",
        RunStatus.COMPLETED,
        RunChanges(output=output),
        Resolution("p", i, CheckpointStatus.COMPLETED, output=output),
        owner=owner,
    )


def _cancel(i: int, statuses: frozenset[RunStatus] = LIVE) -> ChildEnd:
    error = {"message": f"child run c{i} cancelled", "code": "cancelled", "type": "ChildFailed"}
    return ChildEnd(
        f"c{i}",
        RunStatus.CANCELLED,
        RunChanges(error=CANCEL),
        Resolution("p", i, CheckpointStatus.FAILED, error=error),
        statuses=statuses,
    )


async def test_end_child_runs_ends_the_child_and_settles_its_parent(store: StateStore) -> None:
    await _family(store, 2)

    answers = await store.end_child_runs([_settle(0, {"v": "é🎉"}), _cancel(1)], NOW + 5)

    assert answers == [(True, 1), (True, 0)]
    first, second = await store.get_run("c0"), await store.get_run("c1")
    assert first is not None and second is not None
    assert (first.status, first.output, first.locked_by) == (
        RunStatus.COMPLETED,
        {"v": "é🎉"},
        None,
    )
    assert (second.status, second.error, second.locked_by) == (RunStatus.CANCELLED, CANCEL, None)
    history = await store.load_checkpoints("p")
    assert (history[0].status, history[0].output) == (CheckpointStatus.COMPLETED, {"v": "é🎉"})
    assert history[1].status is CheckpointStatus.FAILED
    parent = await store.get_run("p")
    assert parent is not None and parent.wake_requested_at == NOW + 5


async def test_end_child_runs_writes_nothing_when_the_condition_fails(store: StateStore) -> None:
    await _family(store, 2)

    answers = await store.end_child_runs(
        [_settle(0, "lost", owner="someone-else"), _cancel(1, statuses=PENDING)], NOW + 5
    )

    assert answers == [(False, None), (False, None)]
    for run_id in ("c0", "c1"):
        child = await store.get_run(run_id)
        assert child is not None and child.status is RunStatus.RUNNING
    history = await store.load_checkpoints("p")
    assert [cp.status for cp in history.values()] == [CheckpointStatus.PENDING] * 2
    parent = await store.get_run("p")
    assert parent is not None and parent.wake_requested_at is None


async def test_end_child_runs_ends_a_child_named_twice_once(store: StateStore) -> None:
    await _family(store, 1)

    answers = await store.end_child_runs([_cancel(0), _settle(0, "second")], NOW + 5)

    assert answers == [(True, 0), (False, None)]
    child = await store.get_run("c0")
    assert child is not None and child.status is RunStatus.CANCELLED
    placeholder = await store.get_checkpoint("p", 0)
    assert placeholder is not None and placeholder.status is CheckpointStatus.FAILED


async def test_end_child_runs_answers_none_for_a_placeholder_settled_before(
    store: StateStore,
) -> None:
    await _family(store, 1)
    await store.resolve_checkpoints(
        [Resolution("p", 0, CheckpointStatus.COMPLETED, output="first")], NOW + 1
    )

    assert await store.end_child_runs([_settle(0, "second")], NOW + 5) == [(True, None)]
    placeholder = await store.get_checkpoint("p", 0)
    assert placeholder is not None and placeholder.output == "first"
    assert await store.end_child_runs([], NOW + 6) == []


async def test_a_cancel_racing_a_settle_leaves_the_parent_told_what_the_child_records(
    store_factory: StoreFactory,
) -> None:
    """Across connections: whichever ending wins, the parent's placeholder
    says exactly what the child's own row says."""
    settling, cancelling = await store_factory(), await store_factory()
    count = 20
    await _family(settling, count)

    async def settle(i: int) -> list[tuple[bool, int | None]]:
        return await settling.end_child_runs([_settle(i, i)], NOW + 5)

    async def cancel(i: int) -> list[tuple[bool, int | None]]:
        return await cancelling.end_child_runs([_cancel(i)], NOW + 5)

    results = await asyncio.gather(*(f(i) for i in range(count) for f in (settle, cancel)))

    assert all(
        won != lost
        for (won, _), (lost, _) in zip(
            (r[0] for r in results[0::2]), (r[0] for r in results[1::2]), strict=True
        )
    )
    history = await settling.load_checkpoints("p")
    for i in range(count):
        child = await settling.get_run(f"c{i}")
        assert child is not None
        told = history[i].status
        expected = (
            CheckpointStatus.COMPLETED
            if child.status is RunStatus.COMPLETED
            else CheckpointStatus.FAILED
        )
        assert told is expected, (i, child.status, told)
