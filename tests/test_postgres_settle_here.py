"""A turn's settle writes its own run's batch in the settling task.

The batch task lingers a few loop turns over step results for the turn's next
write; when that is the settle and every queued write is the same run's, the
settling task writes the batch itself (the statement goes out a loop turn
sooner and its answer wakes the turn directly). Anything else, or a race with
the batch task, takes the batch task's path; one batch is in flight at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus
from durably.stores.base import RunChanges, SettleResult
from durably.stores.postgres import PostgresStore

NOW = 1_700_000_000_000
LEASE = 30_000
OWNER = "engine-a"


async def _leased_run(store: PostgresStore, run_id: str) -> None:
    run = Run(run_id, "w", "1", RunStatus.RUNNING, input=1, locked_by=OWNER)
    run.locked_until, run.created_at, run.updated_at = NOW + LEASE, NOW, NOW
    assert (await store.create_run(run))[1]


def _result(run_id: str, seq: int) -> Checkpoint:
    return Checkpoint(
        run_id, seq, "s", "local", CheckpointStatus.COMPLETED, output={"v": seq}, attempts=1
    )


def _writers(store: PostgresStore) -> list[asyncio.Task[Any] | None]:
    """The tasks each batch statement is written from, recorded as they go out."""
    batcher: Any = store._writes()
    writers: list[asyncio.Task[Any] | None] = []
    acquire = batcher._acquire

    def recording() -> Any:
        writers.append(asyncio.current_task())
        return acquire()

    batcher._acquire = recording
    return writers


async def _assert_completed(store: PostgresStore, run_id: str) -> None:
    run = await store.get_run(run_id)
    assert run is not None and run.status is RunStatus.COMPLETED and run.output == 7
    assert (await store.load_checkpoints(run_id))[1].output == {"v": 1}


async def test_a_settle_after_its_runs_results_writes_the_batch_in_its_own_task(
    postgres_store: PostgresStore,
) -> None:
    await _leased_run(postgres_store, "r")
    writers = _writers(postgres_store)
    saved = postgres_store.save_checkpoint(_result("r", 1), OWNER)
    await asyncio.sleep(0)  # the batch task lingers over the result
    assert (
        await postgres_store.settle_run(
            "r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
        )
        is SettleResult.SETTLED
    )
    assert saved.done() and await saved is True
    assert writers == [asyncio.current_task()]  # one statement, from the settling task
    await _assert_completed(postgres_store, "r")


async def test_a_settle_written_here_is_fenced_with_its_result(
    postgres_store: PostgresStore,
) -> None:
    await _leased_run(postgres_store, "r")
    assert await postgres_store.update_run_if(
        "r", frozenset({RunStatus.RUNNING}), {"locked_by": "engine-b"}, NOW
    )
    saved = postgres_store.save_checkpoint(_result("r", 1), OWNER)
    await asyncio.sleep(0)
    assert (
        await postgres_store.settle_run(
            "r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
        )
        is SettleResult.LOST
    )
    assert await saved is False
    assert await postgres_store.load_checkpoints("r") == {}


async def test_another_runs_queued_result_leaves_the_batch_to_the_batch_task(
    postgres_store: PostgresStore,
) -> None:
    for run_id in ("r", "other"):
        await _leased_run(postgres_store, run_id)
    writers = _writers(postgres_store)
    saves = [postgres_store.save_checkpoint(_result(run_id, 1), OWNER) for run_id in ("r", "other")]
    await asyncio.sleep(0)
    assert (
        await postgres_store.settle_run(
            "r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
        )
        is SettleResult.SETTLED
    )
    assert [await s for s in saves] == [True, True]
    assert writers and asyncio.current_task() not in writers
    await _assert_completed(postgres_store, "r")


async def test_a_settle_the_batch_task_took_first_is_answered_by_it(
    postgres_store: PostgresStore,
) -> None:
    """Started later (a task of its own), the settle finds the batch task wrote it."""
    await _leased_run(postgres_store, "r")
    writers = _writers(postgres_store)
    saved = postgres_store.save_checkpoint(_result("r", 1), OWNER)
    await asyncio.sleep(0)
    settling = asyncio.ensure_future(
        postgres_store.settle_run("r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1)
    )
    assert await settling is SettleResult.SETTLED
    assert await saved is True
    assert len(writers) == 1 and writers[0] is not settling
    await _assert_completed(postgres_store, "r")


async def test_writes_queued_meanwhile_wait_for_the_batch_written_here(
    postgres_store: PostgresStore,
) -> None:
    """One batch at a time: the batch task writes the next only after this one."""
    for run_id in ("r", "later"):
        await _leased_run(postgres_store, run_id)
    writers = _writers(postgres_store)
    in_flight: list[bool] = []

    async def later_run() -> list[Any]:
        batcher: Any = postgres_store._writes()
        in_flight.append(batcher._inline is not None)
        saved = postgres_store.save_checkpoint(_result("later", 1), OWNER)
        settled = postgres_store.settle_run(
            "later", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
        )
        return [await saved, await settled]

    saved = postgres_store.save_checkpoint(_result("r", 1), OWNER)
    await asyncio.sleep(0)
    later = asyncio.ensure_future(later_run())  # runs while the statement below is out
    assert (
        await postgres_store.settle_run(
            "r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
        )
        is SettleResult.SETTLED
    )
    assert await saved is True
    assert await later == [True, SettleResult.SETTLED]
    assert in_flight == [True]
    assert writers[0] is asyncio.current_task() and writers[1] is not writers[0]
    for run_id in ("r", "later"):
        await _assert_completed(postgres_store, run_id)


async def test_a_settling_task_cancelled_mid_statement_strands_no_other_write(
    postgres_store: PostgresStore,
) -> None:
    for run_id in ("r", "next"):
        await _leased_run(postgres_store, run_id)
    saved = postgres_store.save_checkpoint(_result("r", 1), OWNER)
    await asyncio.sleep(0)

    async def settle() -> Any:
        return await postgres_store.settle_run(
            "r", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
        )

    settling = asyncio.ensure_future(settle())
    # Started in the loop turn the batch task lingers in: it writes the batch itself.
    await asyncio.sleep(0)
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    with pytest.raises(asyncio.CancelledError):
        await saved
    # The batcher is not left waiting for the cancelled batch.
    nxt = postgres_store.save_checkpoint(_result("next", 1), OWNER)
    assert await asyncio.wait_for(nxt, 30) is True
    assert await asyncio.wait_for(
        postgres_store.settle_run(
            "next", OWNER, RunStatus.COMPLETED, RunChanges(output=7), NOW + 1
        ),
        30,
    ) in (SettleResult.SETTLED,)
    await _assert_completed(postgres_store, "next")
