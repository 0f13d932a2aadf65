"""The StateStore contract for runs (``RunStore``): create, read, list and
delete.

Same fixtures as every ``stores`` module: ``store`` is an open store on an
empty database, ``store_factory`` makes more store objects on the same
database; see :mod:`durably.testing.conformance`. Every time is an explicit
integer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from durably.model import Run, RunStatus
from durably.stores import RunChanges, RunQuery, RunStatusStore, SettleResult, StateStore

from ._helpers import (
    NESTED,
    NOW,
    OWNER,
    leased,
    make_cp,
    make_run,
    signal_cp,
)

if TYPE_CHECKING:
    from .. import StoreFactory


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


async def test_concurrent_creates_each_get_their_own_answer(store: StateStore) -> None:
    """Many starts at once (which a store may share statements between): a
    new id is created with the caller's run; an id that existed, or that
    another create in the same burst took first, returns the stored run."""
    for n in range(5):
        await store.create_run(make_run(f"old-{n}", workflow="old"))
    fresh = [make_run(f"new-{n:03}", input={"n": n}) for n in range(200)]
    leased_run = make_run("leased", RunStatus.RUNNING, locked_by=OWNER, locked_until=NOW + 1)
    suspended = make_run("later", RunStatus.SUSPENDED, wake_at=NOW + 5)
    dups = [make_run("dup", workflow=f"wf-{n}") for n in range(5)]
    olds = [make_run(f"old-{n}", workflow="new") for n in range(5)]
    calls = [*fresh[:100], *dups[:3], leased_run, *olds, suspended, *fresh[100:], *dups[3:]]

    results = await asyncio.gather(*(store.create_run(run) for run in calls))

    answers = dict(zip(map(id, calls), results, strict=True))
    for run in [*fresh, leased_run, suspended]:
        assert answers[id(run)] == (run, True)
        assert await store.get_run(run.run_id) == run
    for run in olds:
        stored, created = answers[id(run)]
        assert created is False and stored.workflow == "old"
    dup_results = [answers[id(run)] for run in dups]
    assert [created for _, created in dup_results].count(True) == 1
    winner = next(run for run, created in dup_results if created)
    assert all(run == winner for run, _ in dup_results)
    assert await store.get_run("dup") == winner


async def test_concurrent_creates_of_the_same_ids_on_two_stores_converge(
    store_factory: StoreFactory,
) -> None:
    """Two instances each starting the same new ids at once, in opposite
    orders: every id is created exactly once, both hear the winner, and
    neither is aborted as a deadlock on the other's new keys."""
    first, second = await store_factory(), await store_factory()
    ids = [f"race-{n:03}" for n in range(150)]

    a, b = await asyncio.gather(
        asyncio.gather(*(first.create_run(make_run(i, workflow="a")) for i in ids)),
        asyncio.gather(*(second.create_run(make_run(i, workflow="b")) for i in ids[::-1])),
    )

    for (run_a, created_a), (run_b, created_b) in zip(a, b[::-1], strict=True):
        assert created_a != created_b
        assert run_a == run_b
        assert await first.get_run(run_a.run_id) == run_a


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
        trace_context="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    await store.create_run(run)

    assert await store.get_run(run.run_id) == run
    assert await store.get_runs([run.run_id]) == [run]
    for tag in run.tags:
        page = await store.list_runs(RunQuery(tag=tag))
        assert [r.run_id for r in page.runs] == [run.run_id]


async def test_trace_context_round_trips_through_a_bulk_insert(store: StateStore) -> None:
    runs = [make_run("t1"), make_run("t2")]
    runs[0].trace_context = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert sorted(await store.create_runs(runs)) == ["t1", "t2"]
    assert [r.trace_context for r in await store.get_runs(["t1", "t2"])] == [
        runs[0].trace_context,
        None,
    ]


async def test_count_pending_counts_by_namespace(store: StateStore) -> None:
    await store.create_run(make_run("p1"))
    await store.create_run(make_run("p2", namespace="other"))
    await store.create_run(make_run("s1", status=RunStatus.SUSPENDED))
    assert await store.count_pending() == 2
    assert await store.count_pending("other") == 1
    assert await store.count_pending("nowhere") == 0


async def test_get_run_of_an_unknown_id_is_none(store: StateStore) -> None:
    assert await store.get_run("nope") is None


async def test_get_runs_returns_only_existing_runs_once(store: StateStore) -> None:
    ids = [f"r{i:04d}" for i in range(620)]  # more than one SQL batch
    await asyncio.gather(*(store.create_run(make_run(i)) for i in ids))

    found = await store.get_runs([*ids, "missing", ids[0], ids[1]])

    assert sorted(r.run_id for r in found) == ids
    assert await store.get_runs([]) == []
    assert await store.get_runs(["missing"]) == []


async def test_watch_runs_reads_like_get_runs_and_changes_nothing(store: StateStore) -> None:
    ids = [f"w{i:04d}" for i in range(520)]  # more than one SQL batch
    await asyncio.gather(*(store.create_run(make_run(i)) for i in ids))
    await leased(store, "w-running")
    await store.create_run(make_run("w-done", RunStatus.COMPLETED, output=5))
    everything = [*ids, "w-running", "w-done"]
    before = {run.run_id: run for run in await store.get_runs(everything)}

    found = await store.watch_runs([*everything, "missing", ids[0], "w-done"])

    assert sorted(r.run_id for r in found) == sorted(everything)
    assert {r.run_id: r for r in found} == before
    again = await store.watch_runs(everything)  # a second watch: the same
    assert {r.run_id: r for r in again} == before
    assert {r.run_id: r for r in await store.get_runs(everything)} == before
    assert await store.watch_runs([]) == []
    assert await store.watch_runs(["missing"]) == []


@pytest.mark.parametrize("many", [1, 8], ids=["one", "many"])
async def test_watch_runs_racing_settles_reads_each_run_before_or_after_its_settle(
    store: StateStore, store_factory: StoreFactory, many: int
) -> None:
    """A watch and settles of the same runs from another store object, at
    once: each run is read either live or settled (never half-written), the
    settles all land, and a later read is the settled run."""
    settler = await store_factory()
    ids = [f"race{i}" for i in range(many)]
    for run_id in ids:
        await leased(settler, run_id)

    async def settle(run_id: str) -> SettleResult:
        return await settler.settle_run(
            run_id, OWNER, RunStatus.COMPLETED, RunChanges(output=run_id), NOW + 1
        )

    watching = asyncio.ensure_future(store.watch_runs(ids))
    results = await asyncio.gather(*map(settle, ids))
    watched = await watching

    assert results == [SettleResult.SETTLED] * many
    assert sorted(r.run_id for r in watched) == ids
    for run in watched:
        assert (run.status, run.output) in {
            (RunStatus.RUNNING, None),
            (RunStatus.COMPLETED, run.run_id),
        }
    for run in await store.watch_runs(ids):
        assert (run.status, run.output, run.locked_by) == (
            RunStatus.COMPLETED,
            run.run_id,
            None,
        )


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
        pytest.param(RunQuery(created_after=NOW + 2), ["r5", "r4", "r3", "r2"], id="after"),
        pytest.param(RunQuery(created_before=NOW + 2), ["r1"], id="before"),
        pytest.param(
            RunQuery(created_after=NOW + 2, created_before=NOW + 4), ["r3", "r2"], id="range"
        ),
        pytest.param(RunQuery(run_id_prefix="r"), ["r5", "r4", "r3", "r2", "r1"], id="prefix"),
        pytest.param(RunQuery(run_id_prefix="r3"), ["r3"], id="exact-prefix"),
        pytest.param(RunQuery(run_id_prefix="R"), [], id="prefix-case"),
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


async def test_list_runs_by_id_prefix_takes_wildcards_literally(store: StateStore) -> None:
    for run_id in ["a%b", "a_b", "axb", "a%", "ab", "b"]:
        await store.create_run(make_run(run_id))

    found = {r.run_id for r in (await store.list_runs(RunQuery(run_id_prefix="a%"))).runs}
    underscore = {r.run_id for r in (await store.list_runs(RunQuery(run_id_prefix="a_"))).runs}

    assert found == {"a%b", "a%"}
    assert underscore == {"a_b"}


async def test_list_runs_by_id_prefix_at_the_edges_of_unicode(store: StateStore) -> None:
    top = "\U0010ffff"
    ids = ["é", "é\U0010ffffx", "ê", f"z{top}", f"z{top}{top}", "z\ud7ff!", "z\ue000"]
    for run_id in ids:
        await store.create_run(make_run(run_id))

    async def found(prefix: str) -> set[str]:
        return {r.run_id for r in (await store.list_runs(RunQuery(run_id_prefix=prefix))).runs}

    assert await found("é") == {"é", "é\U0010ffffx"}
    assert await found(f"z{top}") == {f"z{top}", f"z{top}{top}"}
    assert await found(top) == set()
    assert await found("z\ud7ff") == {"z\ud7ff!"}


async def test_list_changed_returns_what_changed_oldest_change_first(store: StateStore) -> None:
    await store.create_run(make_run("old", updated_at=NOW))
    await store.create_run(make_run("b", created_at=NOW, updated_at=NOW + 20))
    await store.create_run(make_run("a", created_at=NOW + 5, updated_at=NOW + 10))
    await store.create_run(make_run("c", updated_at=NOW + 20))

    changed = await store.list_changed(NOW, 10)
    first_two = await store.list_changed(NOW, 2)

    assert [r.run_id for r in changed] == ["a", "b", "c"]
    assert [r.run_id for r in first_two] == ["a", "b"]
    assert await store.list_changed(NOW + 20, 10) == []


async def test_count_runs_per_status_under_the_other_filters(store: StateStore) -> None:
    await _listing_fixture(store)

    everything = await store.count_runs(RunQuery(status=RunStatus.FAILED, limit=1), 100)
    billing = await store.count_runs(RunQuery(namespace="billing"), 100)
    nothing = await store.count_runs(RunQuery(workflow="nope"), 100)
    in_range = await store.count_runs(RunQuery(created_after=NOW + 2, run_id_prefix="r"), 100)

    assert everything == {"pending": 2, "suspended": 1, "completed": 1, "failed": 1}
    assert billing == {"suspended": 1, "completed": 1}
    assert nothing == {}
    assert in_range == {"pending": 1, "suspended": 1, "completed": 1, "failed": 1}


async def test_count_runs_stops_each_count_at_the_cap(store: StateStore) -> None:
    for i in range(7):
        await store.create_run(make_run(f"p{i}"))
    for i in range(2):
        await store.create_run(make_run(f"f{i}", RunStatus.FAILED))

    counts = await store.count_runs(RunQuery(), 5)

    assert counts == {"pending": 5, "failed": 2}


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


async def test_get_run_statuses_reads_what_get_runs_reads(store: StateStore) -> None:
    """The optional status-only read (``RunStatusStore``): the same statuses
    as whole reads, over more than one SQL batch, unknown and repeated ids
    ignored."""
    if not isinstance(store, RunStatusStore):
        pytest.skip("this store reads runs whole only")
    ids = [f"st{i:04d}" for i in range(520)]
    await asyncio.gather(*(store.create_run(make_run(i)) for i in ids))
    await leased(store, "st-running")
    await store.create_run(make_run("st-done", RunStatus.COMPLETED, output=5))
    everything = [*ids, "st-running", "st-done"]

    found = await store.get_run_statuses([*everything, "missing", ids[0]])

    assert found == {run.run_id: run.status for run in await store.get_runs(everything)}
    assert found["st-running"] is RunStatus.RUNNING
    assert found["st-done"] is RunStatus.COMPLETED
    assert await store.get_run_statuses([]) == {}
    assert await store.get_run_statuses(["missing"]) == {}
    one = await store.get_run_statuses(["st-done"])
    assert one == {"st-done": RunStatus.COMPLETED}
    assert one["st-done"] is RunStatus.COMPLETED
