"""The StateStore contract for checkpoints (``CheckpointStore``): round trips
and the lease fence.

Same fixtures as every ``stores`` module: ``store`` is an open store on an
empty database, ``store_factory`` makes more store objects on the same
database; see :mod:`durably.testing.conformance`. Every time is an explicit
integer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from durably.model import Checkpoint, CheckpointStatus
from durably.stores import StateStore

from ._helpers import (
    NESTED,
    NOW,
    OTHER,
    OWNER,
    checkpoint,
    leased,
    make_cp,
)

if TYPE_CHECKING:
    pass


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


_ODD = 'q"uote \\back\\slash\nline é€🎉 \\u0000 [1,{"a":null}] \'single\' ,{}'


def _every_column(run_id: str, seq: int) -> Checkpoint:
    """A checkpoint with every column the stores write set, text columns odd."""
    return make_cp(
        run_id,
        seq,
        CheckpointStatus.PENDING,
        name=f"{_ODD}-{seq}",
        kind="step",
        input={"text": _ODD, "nested": NESTED},
        output=[_ODD],
        error={"message": _ODD},
        attempts=3 + seq,
        wake_at=NOW + 2**40,
        started_at=NOW + seq,
        finished_at=NOW + 2 * seq,
        group=_ODD,
        dispatched_at=NOW + 7,
        redispatches=2,
        last_heartbeat_at=NOW + 9,
        progress={"done": 0.5, "note": _ODD},
    )


async def test_checkpoints_written_together_keep_every_column(store: StateStore) -> None:
    """A batch of many (concurrent writes of several runs; stores that group
    commit write them in one statement), a batch of one, and a write the lease
    refuses among them: each column round trips as written."""
    for run_id in ("a", "b", "c"):
        await leased(store, run_id)
    await leased(store, "theirs", owner=OTHER)
    many = [_every_column(run_id, seq) for run_id in ("a", "b", "c") for seq in (1, 2)]
    written = await asyncio.gather(
        *(store.save_checkpoint(cp, OWNER) for cp in many),
        store.save_checkpoint(_every_column("theirs", 1), OWNER),
    )
    assert written == [True] * len(many) + [False]
    assert await store.save_checkpoint(_every_column("a", 3), OWNER) is True

    assert await store.load_checkpoints("a") == {
        1: many[0],
        2: many[1],
        3: _every_column("a", 3),
    }
    assert await store.load_checkpoints("b") == {1: many[2], 2: many[3]}
    assert await store.load_checkpoints("c") == {1: many[4], 2: many[5]}
    assert await store.load_checkpoints("theirs") == {}


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
