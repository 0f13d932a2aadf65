"""PostgreSQL's shared start statements: concurrent ``create_run`` calls go out
as one multi-row insert, and one row the database refuses fails only its own
caller. (Idempotence, duplicates and racing instances are in the store
conformance suite, which runs on this store too.)"""

from __future__ import annotations

import asyncio

from durably.model import Run, RunStatus
from durably.stores.postgres import PostgresStore
from durably.testing import eventually

NOW = 1_700_000_000_000


def _run(run_id: str, status: RunStatus = RunStatus.PENDING, **fields: object) -> Run:
    return Run(
        run_id=run_id,
        workflow="wf",
        workflow_version="1",
        status=status,
        created_at=NOW,
        updated_at=NOW,
        **fields,  # type: ignore[arg-type]
    )


def _batch_sizes(store: PostgresStore) -> list[int]:
    """Record the size of each batch the store's start batcher sends (a spy:
    the real statements still run)."""
    sizes: list[int] = []
    batch = store._starts._batch  # pyright: ignore[reportPrivateUsage]
    call = batch._call  # pyright: ignore[reportPrivateUsage]

    async def spy(runs: list[Run]) -> list[object]:
        sizes.append(len(runs))
        return await call(runs)

    batch._call = spy  # type: ignore[assignment]  # pyright: ignore[reportPrivateUsage]
    return sizes


def _alone(store: PostgresStore) -> list[str]:
    """Record the ids of the starts inserted by a single-row statement (a spy)."""
    ids: list[str] = []
    starts = store._starts  # pyright: ignore[reportPrivateUsage]
    create_one = starts._create_one  # pyright: ignore[reportPrivateUsage]

    async def spy(run: Run) -> tuple[Run, bool]:
        ids.append(run.run_id)
        return await create_one(run)

    starts._create_one = spy  # pyright: ignore[reportPrivateUsage]
    return ids


async def test_concurrent_starts_share_statements_and_a_lone_one_goes_alone(
    postgres_store: PostgresStore,
) -> None:
    sizes = _batch_sizes(postgres_store)
    alone = _alone(postgres_store)
    assert await postgres_store.create_run(_run("alone")) == (_run("alone"), True)
    assert (alone, sizes) == (["alone"], [])

    runs = [_run(f"r{n:04}") for n in range(1200)]
    results = await asyncio.gather(*(postgres_store.create_run(run) for run in runs))

    assert results == [(run, True) for run in runs]
    # The first went out at once; the rest queued meanwhile: a few statements, not 1,199.
    assert alone == ["alone", "r0000"]
    assert sum(sizes) == 1199 and max(sizes) == 500 and len(sizes) <= 5
    assert sorted(r.run_id for r in await postgres_store.get_runs([r.run_id for r in runs])) == [
        r.run_id for r in runs
    ]


async def test_a_row_the_database_refuses_fails_only_its_own_start(
    postgres_store: PostgresStore,
) -> None:
    sizes = _batch_sizes(postgres_store)
    good = [_run(f"ok-{n:02}") for n in range(40)]
    # jsonb takes no NUL; an integer column no value past 32 bits.
    nul_tag = _run("bad-tag", tags=["a\x00b"])
    huge = _run("bad-priority", priority=2**40)
    # The same id twice: the refused first start, then one that goes in.
    twice = [_run("twice", tags=["\x00"]), _run("twice")]
    calls = [*good[:20], nul_tag, twice[0], *good[20:], huge, twice[1]]

    results = await asyncio.gather(
        *(postgres_store.create_run(run) for run in calls), return_exceptions=True
    )

    assert isinstance(results[21], Exception) and results[-1] == (twice[1], True)
    answers = dict(zip((run.run_id for run in calls), results, strict=True))
    answers.pop("twice")
    assert isinstance(answers.pop("bad-tag"), Exception)
    assert isinstance(answers.pop("bad-priority"), Exception)
    assert answers == {run.run_id: (run, True) for run in good}
    assert max(sizes) > 2  # the refused rows were in a shared batch
    assert await postgres_store.get_run("bad-tag") is None
    assert await postgres_store.get_run("bad-priority") is None
    assert len(await postgres_store.get_runs([run.run_id for run in good])) == len(good)


async def test_a_shared_insert_announces_each_pending_run_by_id(
    postgres_store: PostgresStore,
) -> None:
    """As a lone start does: a listener here knows its own starts by id, and
    a run leased to its creator or suspended is nobody else's business."""
    heard: list[tuple[str, str]] = []
    unlisten = await postgres_store.listen(lambda kind, argument: heard.append((kind, argument)))
    try:
        pending = [_run(f"p{n}") for n in range(30)]
        others = [
            _run("mine", RunStatus.RUNNING, locked_by="me", locked_until=NOW + 1),
            _run("later", RunStatus.SUSPENDED, wake_at=NOW + 1),
        ]
        await asyncio.gather(*(postgres_store.create_run(run) for run in [*pending, *others]))
        await postgres_store.create_run(_run("marker"))

        # Notices arrive in commit order: once the last one is here, all are.
        await eventually(lambda: ("pending", "marker") in heard, what="the last notice")
    finally:
        unlisten()

    announced = {argument for kind, argument in heard if kind == "pending"}
    assert announced == {run.run_id for run in pending} | {"marker"}


async def test_repeated_and_existing_ids_in_a_batch_are_answered_by_the_batch(
    postgres_store: PostgresStore,
) -> None:
    """Their callers hear the stored run from the batch's own read, not from
    a statement each."""
    await postgres_store.create_run(_run("old", input="first"))
    alone = _alone(postgres_store)
    calls = [
        _run("lead"),
        *(_run(f"n{n}") for n in range(20)),
        *(_run("dup", input=n) for n in range(4)),
        _run("old", input="second"),
    ]

    results = await asyncio.gather(*(postgres_store.create_run(run) for run in calls))

    # The lead went out alone; one shared insert and its read-back answered the rest.
    assert alone == ["lead"]
    dups = [stored for run, (stored, _) in zip(calls, results, strict=True) if run.run_id == "dup"]
    assert [
        created for run, (_, created) in zip(calls, results, strict=True) if run.run_id == "dup"
    ].count(True) == 1
    assert all(stored == dups[0] for stored in dups)
    assert results[-1][1] is False and results[-1][0].input == "first"


async def test_a_refused_start_fails_alone_in_a_batch_of_one_id(
    postgres_store: PostgresStore,
) -> None:
    """A batch holding a single id, started twice: the refused first start
    fails; the second, which PostgreSQL takes, creates the run."""
    sizes = _batch_sizes(postgres_store)
    bad, good = _run("twice", tags=["\x00"]), _run("twice")

    results = await asyncio.gather(
        postgres_store.create_run(_run("lead")),  # in flight while the two queue together
        postgres_store.create_run(bad),
        postgres_store.create_run(good),
        return_exceptions=True,
    )

    assert sizes == [2]
    assert isinstance(results[1], Exception)
    assert results[2] == (good, True)
