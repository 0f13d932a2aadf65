"""The message-queue transactions of the SQL stores, proven on each store that has them.

``OutboxStore.save_checkpoint_sending`` (a dispatched step's task pushed in
the transaction that writes its checkpoint) and
``ResultSettlingStore.claim_and_resolve`` (step results taken off the queue
in the transaction that settles them): a batch of one, a batch of many, and
two store objects racing. A store without a message queue (memory) skips.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from durably._queue import Message, OutboxStore, OutMessage, ResultSettlingStore
from durably.model import RunStatus
from durably.stores import StateStore
from durably.stores.base import Resolution

from .steps import (
    COMPLETED,
    ERROR,
    FAILED,
    NOW,
    OWNER,
    _leased,
    _make_cp,
    dispatched_cp,
    lease_to,
    parked,
    wake_of,
)

if TYPE_CHECKING:
    from .. import StoreFactory

TOPIC = "tasks:g"
RESULTS = "results"


def _outbox(store: StateStore) -> OutboxStore:
    if not isinstance(store, OutboxStore):
        pytest.skip(f"{type(store).__name__} keeps no message queue")
    return store


def _settling(store: StateStore) -> ResultSettlingStore:
    if not isinstance(store, ResultSettlingStore):
        pytest.skip(f"{type(store).__name__} keeps no message queue")
    return store


async def _ready(store: Any) -> None:
    """The queue's table exists (the db transport's open makes it)."""
    await store.messages().depth([])


async def _two_stores_with_leased_runs(
    store_factory: StoreFactory, count: int
) -> tuple[Any, Any, list[str]]:
    """Two store objects on one database (skipped without a queue) and
    ``count`` runs leased by :data:`OWNER`, for the racing writers' tests."""
    a, b = await store_factory(), await store_factory()
    _outbox(a)
    await _ready(a)
    runs = [f"race-{n:02}" for n in range(count)]
    for run_id in runs:
        await _leased(a, run_id)
    return a, b, runs


async def _bodies(store: Any, topic: str) -> list[str]:
    """The bodies queued in ``topic``, in claim order (claimed for good)."""
    claimed = await store.messages().claim([topic], "reader", 10_000, 60_000, NOW * 2)
    return [m.body for m in claimed]


def _decode(messages: list[Message]) -> tuple[list[Message], list[Resolution]]:
    """Each result message's body is ``run_id:seq``: complete that step."""
    resolutions = []
    for m in messages:
        run_id, seq = m.body.rsplit(":", 1)
        resolutions.append(Resolution(run_id, int(seq), COMPLETED, output=m.body))
    return messages, resolutions


async def test_a_checkpoint_sent_alone_writes_both(store: StateStore) -> None:
    outbox = _outbox(store)
    await _ready(store)
    await _leased(store, "r1")

    held = await outbox.save_checkpoint_sending(
        dispatched_cp("r1", 1), OWNER, [OutMessage(TOPIC, "task-1")]
    )

    assert held is True
    assert (await store.load_checkpoints("r1"))[1].dispatched_at == NOW + 1
    assert await _bodies(store, TOPIC) == ["task-1"]


async def test_a_checkpoint_whose_lease_is_lost_sends_nothing(store: StateStore) -> None:
    outbox = _outbox(store)
    await _ready(store)
    await _leased(store, "r1", owner="someone-else")

    held = await outbox.save_checkpoint_sending(
        dispatched_cp("r1", 1), OWNER, [OutMessage(TOPIC, "task-1")]
    )

    assert held is False
    assert await store.load_checkpoints("r1") == {}
    assert await store.messages().depth() == {}  # type: ignore[attr-defined]


async def test_many_checkpoints_sent_together_write_each_with_its_tasks(
    store: StateStore,
) -> None:
    """Concurrent turns' writes (batched together by the store): each held
    checkpoint goes out with its tasks in order; the one whose lease is lost
    sends nothing, and plain writes in the same batch are unaffected."""
    outbox = _outbox(store)
    await _ready(store)
    runs = [f"run-{n:02}" for n in range(20)]
    for run_id in runs:
        await _leased(store, run_id)
    await _leased(store, "lost", owner="someone-else")

    writes = [
        outbox.save_checkpoint_sending(
            dispatched_cp(run_id, 1),
            OWNER,
            [OutMessage(TOPIC, f"{run_id}:a"), OutMessage(TOPIC, f"{run_id}:b")],
        )
        for run_id in runs
    ]
    writes.append(
        outbox.save_checkpoint_sending(dispatched_cp("lost", 1), OWNER, [OutMessage(TOPIC, "x")])
    )
    plain = store.save_checkpoint(_make_cp("run-00", 0, COMPLETED, output=0), OWNER)
    held = await asyncio.gather(*writes, plain)

    assert held == [True] * 20 + [False, True]
    bodies = await _bodies(store, TOPIC)
    assert sorted(bodies) == sorted(f"{r}:{x}" for r in runs for x in "ab")
    for run_id in runs:  # a run's own tasks in the order given
        assert bodies.index(f"{run_id}:a") < bodies.index(f"{run_id}:b")
        assert (await store.load_checkpoints(run_id))[1].dispatched_at == NOW + 1
    assert await store.load_checkpoints("lost") == {}


async def test_two_store_objects_sending_at_once_lose_nothing(
    store_factory: StoreFactory,
) -> None:
    a, b, runs = await _two_stores_with_leased_runs(store_factory, 30)

    held = await asyncio.gather(
        *(
            (a if n % 2 else b).save_checkpoint_sending(
                dispatched_cp(run_id, 1), OWNER, [OutMessage(TOPIC, run_id)]
            )
            for n, run_id in enumerate(runs)
        )
    )

    assert held == [True] * 30
    assert sorted(await _bodies(a, TOPIC)) == runs


async def _results(store: Any, *run_ids: str) -> None:
    """Park each run on a dispatched step 1 and queue its result."""
    for run_id in run_ids:
        await parked(store, _make_cp(run_id, 0, COMPLETED, output=0), dispatched_cp(run_id, 1))
    await store.messages().push([OutMessage(RESULTS, f"{run_id}:1") for run_id in run_ids])


async def test_one_result_taken_and_settled_in_one_transaction(store: StateStore) -> None:
    settling = _settling(store)
    await _ready(store)
    await _results(store, "r1")

    got = await settling.claim_and_resolve([RESULTS], 256, NOW, _decode, NOW + 50, lease_to())

    assert [m.body for m in got.messages] == ["r1:1"] == [m.body for m in got.decoded]
    assert got.answers == [0]
    assert set(got.leased) == {"r1"}
    run, history = got.leased["r1"]
    assert (run.status, run.locked_by) == (RunStatus.RUNNING, "settler")
    assert (history[1].status, history[1].output) == (COMPLETED, "r1:1")
    assert await store.messages().depth() == {}  # type: ignore[attr-defined]
    # nothing left: an empty batch settles nothing
    empty = await settling.claim_and_resolve([RESULTS], 256, NOW, _decode, NOW + 60, None)
    assert (empty.messages, empty.answers, empty.leased) == ([], [], {})


async def test_many_results_taken_in_batches_of_the_limit(store: StateStore) -> None:
    settling = _settling(store)
    await _ready(store)
    runs = [f"run-{n:02}" for n in range(25)]
    await _results(store, *runs)

    first = await settling.claim_and_resolve([RESULTS], 10, NOW, _decode, NOW + 50, None)
    rest = await settling.claim_and_resolve([RESULTS], 100, NOW, _decode, NOW + 50, None)

    assert [m.body for m in first.messages] == [f"{r}:1" for r in runs[:10]]  # oldest first
    assert [m.body for m in rest.messages] == [f"{r}:1" for r in runs[10:]]
    assert first.answers + rest.answers == [0] * 25
    assert first.leased == rest.leased == {}
    for run_id in runs:  # settled and woken (no lease asked for)
        assert (await store.load_checkpoints(run_id))[1].status is COMPLETED
        run = await store.get_run(run_id)
        assert run is not None and run.wake_requested_at == NOW + 50


async def test_a_failed_decode_takes_nothing(store: StateStore) -> None:
    settling = _settling(store)
    await _ready(store)
    await _results(store, "r1")

    def broken(messages: list[Message]) -> tuple[Any, list[Resolution]]:
        raise ValueError("undecodable")

    with pytest.raises(ValueError, match="undecodable"):
        await settling.claim_and_resolve([RESULTS], 256, NOW, broken, NOW + 50, lease_to())

    assert (await store.load_checkpoints("r1"))[1].status is not COMPLETED
    got = await settling.claim_and_resolve([RESULTS], 256, NOW, _decode, NOW + 50, None)
    assert [m.body for m in got.messages] == ["r1:1"]


async def test_a_message_claimed_by_a_live_consumer_is_not_taken(store: StateStore) -> None:
    """A plain claim (the fallback path) holds its messages for its lease."""
    settling = _settling(store)
    await _ready(store)
    await _results(store, "r1")
    claimed = await store.messages().claim([RESULTS], "other", 10, 30_000, NOW)  # type: ignore[attr-defined]

    got = await settling.claim_and_resolve([RESULTS], 256, NOW + 1, _decode, NOW + 50, None)
    assert len(claimed) == 1 and got.messages == []
    late = await settling.claim_and_resolve([RESULTS], 256, NOW + 30_001, _decode, NOW + 50, None)
    assert [m.body for m in late.messages] == ["r1:1"] and late.messages[0].deliveries == 2


async def test_two_consumers_racing_take_each_result_once(
    store_factory: StoreFactory,
) -> None:
    a, b = await store_factory(), await store_factory()
    _settling(a)
    await _ready(a)
    runs = [f"race-{n:02}" for n in range(60)]
    await _results(a, *runs)

    async def drain(store: Any, owner: str) -> list[tuple[list[Message], list[int | None]]]:
        batches: list[tuple[list[Message], list[int | None]]] = []
        while True:
            got = await store.claim_and_resolve(
                [RESULTS], 7, NOW, _decode, NOW + 50, lease_to(owner)
            )
            if not got.messages:
                return batches
            batches.append((got.messages, got.answers))

    took_a, took_b = await asyncio.gather(drain(a, "a"), drain(b, "b"))

    bodies = [m.body for batch, _ in took_a + took_b for m in batch]
    assert sorted(bodies) == [f"{r}:1" for r in runs]  # every result once
    answers = [x for _, batch in took_a + took_b for x in batch]
    assert answers == [0] * 60  # each settled by whoever took it
    for run_id in runs:
        run = await a.get_run(run_id)
        assert run is not None and run.status is RunStatus.RUNNING
        assert run.locked_by in ("a", "b")


async def test_served_tasks_are_deleted_with_the_results_they_settle(
    store: StateStore,
) -> None:
    """The results of tasks served by the settling process itself are settled
    with the deletion of those tasks (``delete``), in the same transaction,
    and only those tasks go: the queue's own results are still taken."""
    settling = _settling(store)
    await _ready(store)
    await _results(store, "queued")
    await parked(store, _make_cp("served", 0, COMPLETED, output=0), dispatched_cp("served", 1))
    await store.messages().push(  # type: ignore[attr-defined]
        [OutMessage(TOPIC, "served-task"), OutMessage(TOPIC, "other-task")]
    )
    tasks = await store.messages().claim([TOPIC], "worker", 1, 30_000, NOW)  # type: ignore[attr-defined]
    assert [m.body for m in tasks] == ["served-task"]

    def with_served(messages: list[Message]) -> tuple[list[Message], list[Resolution]]:
        taken, resolutions = _decode(messages)
        return taken, [Resolution("served", 1, COMPLETED, output="here"), *resolutions]

    got = await settling.claim_and_resolve(
        [RESULTS], 256, NOW, with_served, NOW + 50, None, delete=[tasks[0].id]
    )

    assert [m.body for m in got.messages] == ["queued:1"]  # the deleted task is not "taken"
    assert got.answers == [0, 0]
    assert (await store.load_checkpoints("served"))[1].output == "here"
    assert await _bodies(store, TOPIC) == ["other-task"]
    assert await store.messages().depth([RESULTS]) == {}  # type: ignore[attr-defined]


# Text a batch must carry through unchanged, whatever form the store sends it in.
ODD = 'q"uote \\back\\slash\nnew line \u00e9\u20ac\U0001f389 \\u0000 [1,{"a":null}]'


async def test_a_batch_settles_odd_values_exactly_and_each_position_once(
    store: StateStore,
) -> None:
    """One batch: values with quotes, backslashes, escapes and non-ASCII land
    as given; a position named twice is settled by its first entry; a result
    for a run another instance cancelled meanwhile settles its checkpoint but
    neither wakes nor leases the run; a failure settles with its error and
    events."""
    settling = _settling(store)
    await _ready(store)
    await _results(store, "odd", "twice", "cancelled", "failing")
    cancelled = await store.update_run_if(
        "cancelled",
        frozenset({RunStatus.SUSPENDED}),
        {"status": RunStatus.CANCELLED},
        NOW + 2,
    )
    assert cancelled
    events = [{"kind": "log", "text": ODD}]

    def decode(messages: list[Message]) -> tuple[list[Message], list[Resolution]]:
        out: list[Resolution] = []
        for m in sorted(messages, key=lambda m: m.body):
            run_id = m.body.rsplit(":", 1)[0]
            if run_id == "failing":
                error = {"message": ODD, "code": "E", "type": "ValueError"}
                out.append(Resolution(run_id, 1, FAILED, error=error, events=events))
            elif run_id == "twice":
                out.append(Resolution(run_id, 1, COMPLETED, output={"first": ODD}))
                out.append(Resolution(run_id, 1, COMPLETED, output="second"))
            else:
                out.append(Resolution(run_id, 1, COMPLETED, output=[ODD, "\x00"]))
        return messages, out

    got = await settling.claim_and_resolve([RESULTS], 256, NOW, decode, NOW + 50, lease_to())

    # sorted bodies: cancelled, failing, odd, twice (twice), the second a no-op
    assert got.answers == [0, 0, 0, 0, None]
    assert set(got.leased) == {"failing", "odd", "twice"}
    assert got.leased["odd"][1][1].output == [ODD, "\x00"]
    assert got.leased["twice"][1][1].output == {"first": ODD}
    failed = got.leased["failing"][1][1]
    assert (failed.status, failed.error, failed.events) == (
        FAILED,
        {"message": ODD, "code": "E", "type": "ValueError"},
        events,
    )
    run = await store.get_run("cancelled")
    assert run is not None
    assert (run.status, run.locked_by, run.wake_requested_at) == (RunStatus.CANCELLED, None, None)
    cp = (await store.load_checkpoints("cancelled"))[1]
    assert (cp.status, cp.output, cp.finished_at) == (COMPLETED, [ODD, "\x00"], NOW + 50)


async def test_tasks_with_odd_bodies_go_out_as_given(store: StateStore) -> None:
    """Task bodies and priorities pass through a batched send unchanged, a
    born claimed one beside free ones."""
    outbox = _outbox(store)
    await _ready(store)
    runs = ["t1", "t2"]
    for run_id in runs:
        await _leased(store, run_id)

    sent = await asyncio.gather(
        outbox.save_checkpoint_sending(
            dispatched_cp("t1", 1),
            OWNER,
            [OutMessage(TOPIC, ODD, priority=-3), OutMessage(TOPIC, ODD + "é", priority=7)],
        ),
        outbox.save_checkpoint_claiming(dispatched_cp("t2", 1), OWNER, [_born(ODD + "!")]),
    )

    assert sent[0] is True and sent[1] is not None and len(sent[1]) == 1
    claimed = await store.messages().claim([TOPIC], "reader", 10, 60_000, NOW)  # type: ignore[attr-defined]
    assert [(m.body, m.priority) for m in claimed] == [(ODD + "é", 7), (ODD, -3)]
    late = await store.messages().claim([TOPIC], "reader", 10, 60_000, NOW + 30_001)  # type: ignore[attr-defined]
    assert [(m.id, m.body) for m in late] == [(sent[1][0], ODD + "!")]


async def _served(store: Any, *run_ids: str) -> list[int]:
    """Park each run on a dispatched step 1 whose task a worker holds: the
    ids of those tasks, in ``run_ids`` order."""
    for run_id in run_ids:
        await parked(store, _make_cp(run_id, 0, COMPLETED, output=0), dispatched_cp(run_id, 1))
    queue = store.messages()
    await queue.push([OutMessage(TOPIC, f"task-{run_id}") for run_id in run_ids])
    tasks = await queue.claim([TOPIC], "worker", len(run_ids), 30_000, NOW)
    by_body = {m.body: m.id for m in tasks}
    return [by_body[f"task-{run_id}"] for run_id in run_ids]


def _settle_served(*run_ids: str) -> Any:
    """A decode that is given no message and settles the served ``run_ids``."""

    def decode(messages: list[Message]) -> tuple[list[Message], list[Resolution]]:
        assert messages == []
        return messages, [Resolution(r, 1, COMPLETED, output=f"{r}!") for r in run_ids]

    return decode


async def test_a_settle_taking_nothing_deletes_its_served_tasks_and_leaves_the_queue(
    store: StateStore,
) -> None:
    """``limit`` 0: the served tasks go and their results settle, in one
    transaction, and no queued result is taken: a batch of one, then of many
    with its woken runs leased, then deletes with nothing to settle."""
    settling = _settling(store)
    await _ready(store)
    await _results(store, "queued")
    [one] = await _served(store, "s0")
    many = [f"s{n}" for n in range(1, 6)]
    ids = await _served(store, *many)
    spare = await _served(store, "spare")

    got = await settling.claim_and_resolve(
        [RESULTS], 0, NOW, _settle_served("s0"), NOW + 50, None, delete=[one]
    )
    assert (got.messages, got.answers, got.leased) == ([], [0], {})
    assert (await store.load_checkpoints("s0"))[1].output == "s0!"
    run = await store.get_run("s0")
    assert run is not None and run.wake_requested_at == NOW + 50

    got = await settling.claim_and_resolve(
        [RESULTS], 0, NOW, _settle_served(*many), NOW + 60, lease_to(), delete=ids
    )
    assert (got.messages, got.answers) == ([], [0] * 5)
    assert set(got.leased) == set(many)
    for run_id in many:
        assert got.leased[run_id][1][1].output == f"{run_id}!"

    got = await settling.claim_and_resolve(
        [RESULTS], 0, NOW, _settle_served(), NOW + 70, None, delete=spare
    )
    assert (got.messages, got.answers) == ([], [])
    depth = await store.messages().depth()  # type: ignore[attr-defined]
    assert depth == {RESULTS: 1}  # every served task gone, the queued result kept
    got = await settling.claim_and_resolve([RESULTS], 256, NOW, _decode, NOW + 80, None)
    assert [m.body for m in got.messages] == ["queued:1"]


async def test_settles_taking_nothing_race_a_consumer_without_losing_anything(
    store_factory: StoreFactory,
) -> None:
    """Two store objects settling served results with ``limit`` 0 while a
    third takes the queued ones: every result settled once, every served task
    deleted, no queued result lost."""
    a, b, c = await store_factory(), await store_factory(), await store_factory()
    _settling(a)
    await _ready(a)
    queued = [f"q{n:02}" for n in range(30)]
    await _results(a, *queued)
    mine = {s: [f"{k}-{n:02}" for n in range(10)] for s, k in ((a, "a"), (b, "b"))}
    tasks = {s: await _served(a, *runs) for s, runs in mine.items()}

    async def settle_served(store: Any) -> list[int | None]:
        answers: list[int | None] = []
        for run_id, task_id in zip(mine[store], tasks[store], strict=True):
            got = await store.claim_and_resolve(
                [RESULTS], 0, NOW, _settle_served(run_id), NOW + 50, lease_to(), delete=[task_id]
            )
            assert got.messages == []
            answers += got.answers
        return answers

    async def take(store: Any) -> list[str]:
        bodies: list[str] = []
        while True:
            got = await store.claim_and_resolve([RESULTS], 4, NOW, _decode, NOW + 50, None)
            if not got.messages:
                return bodies
            bodies += [m.body for m in got.messages]

    settled_a, settled_b, taken = await asyncio.gather(settle_served(a), settle_served(b), take(c))

    assert settled_a == settled_b == [0] * 10
    assert sorted(taken) == [f"{r}:1" for r in queued]
    assert await a.messages().depth() == {}  # type: ignore[attr-defined]
    for run_id in [*mine[a], *mine[b]]:
        assert (await a.load_checkpoints(run_id))[1].output == f"{run_id}!"


async def _held_served(
    store: Any, run_id: str, *, group: str | None = None, two: bool = False
) -> list[int]:
    """A run whose turn holds across its pending dispatched step 1 (and 2,
    with ``two`` or a ``group``, both then in it), its lease :data:`OWNER`'s
    until ``NOW + LEASE``, their tasks held by a worker: their message ids."""
    await _leased(store, run_id)
    steps = [dispatched_cp(run_id, 1, group=group)]
    if two or group is not None:
        steps.append(dispatched_cp(run_id, 2, group=group))
    assert await store.save_checkpoints([_make_cp(run_id, 0, COMPLETED), *steps], OWNER)
    queue = store.messages()
    await queue.push([OutMessage(TOPIC, f"task-{run_id}-{cp.seq}") for cp in steps])
    tasks = await queue.claim([TOPIC], "worker", len(steps), 30_000, NOW)
    return sorted(m.id for m in tasks)


def _settle_given(*resolutions: Resolution) -> Any:
    """A decode that is given no message and settles ``resolutions``."""

    def decode(messages: list[Message]) -> tuple[list[Message], list[Resolution]]:
        assert messages == []
        return messages, list(resolutions)

    return decode


async def test_served_results_of_held_turns_stamp_a_wake_only_where_the_holder_lost_it(
    store: StateStore,
) -> None:
    """``Resolution.held_by`` on a settle taking nothing (``limit`` 0): a run
    whose holder still holds its lease is neither stamped nor leased (its
    held turn takes the result itself); one whose lease ran out, or whose
    entries name different holders, is stamped; one a parallel group still
    waits on is not woken at all, and the last of a group wakes as a single
    step does; a run no turn holds is leased by the settle as before. A
    batch of one, then a batch of many."""
    settling = _settling(store)
    await _ready(store)
    one = await _held_served(store, "held-one")
    got = await settling.claim_and_resolve(
        [RESULTS],
        0,
        NOW,
        _settle_given(Resolution("held-one", 1, COMPLETED, output=1, held_by=OWNER)),
        NOW + 50,
        lease_to(),
        delete=one,
    )
    assert (got.messages, got.answers, got.leased) == ([], [0], {})
    assert await wake_of(store, "held-one") is None
    assert (await store.load_checkpoints("held-one"))[1].output == 1

    tasks: list[int] = []
    for run_id in ("held", "other", "late"):
        tasks += await _held_served(store, run_id)
    tasks += await _held_served(store, "mixed", two=True)
    tasks += await _held_served(store, "group", group="g")
    tasks += await _held_served(store, "group-last", group="g")
    [free] = await _served(store, "free")
    done_group = await settling.claim_and_resolve(
        [RESULTS],
        0,
        NOW,
        _settle_given(Resolution("group-last", 1, COMPLETED, output=1, held_by=OWNER)),
        NOW + 50,
        None,
        delete=[],
    )
    assert done_group.answers == [1]  # its sibling still pending
    assert await store.release_run("late", OWNER, NOW + 55)  # its holder let go
    at = NOW + 60
    got = await settling.claim_and_resolve(
        [RESULTS],
        0,
        NOW,
        _settle_given(
            Resolution("held", 1, COMPLETED, output="h", held_by=OWNER),
            Resolution("other", 1, COMPLETED, output="o", held_by="instance-b"),
            Resolution("mixed", 1, COMPLETED, output="m", held_by=OWNER),
            Resolution("mixed", 2, FAILED, error=ERROR),
            Resolution("late", 1, COMPLETED, output="l", held_by=OWNER),
            Resolution("group", 1, COMPLETED, output="g1", held_by=OWNER),
            Resolution("group-last", 2, COMPLETED, output="g2", held_by=OWNER),
            Resolution("free", 1, COMPLETED, output="f"),
        ),
        at,
        lease_to(),
        delete=[*tasks, free],
    )
    assert got.messages == []
    assert got.answers == [0, 0, 0, 0, 0, 1, 0, 0]
    assert set(got.leased) - {"late"} == {"free"}
    assert await wake_of(store, "held") is None
    assert await wake_of(store, "other") == at
    assert await wake_of(store, "mixed") == at
    # Its holder let go: the settle leases it, or stamps its wake for whoever polls.
    assert "late" in got.leased or await wake_of(store, "late") == at
    assert await wake_of(store, "group") is None  # a sibling is still pending
    assert await wake_of(store, "group-last") is None  # the last of its group, held
    for run_id, output in (("held", "h"), ("other", "o"), ("late", "l"), ("free", "f")):
        assert (await store.load_checkpoints(run_id))[1].output == output
    assert await store.messages().depth([TOPIC]) == {}  # type: ignore[attr-defined]


async def test_settles_of_held_turns_results_racing_stamp_and_settle_each_once(
    store_factory: StoreFactory,
) -> None:
    """Two store objects settle served results of held turns with ``limit`` 0
    at once, the holder of half of the runs having lost its leases: each
    result settled once, each run without a live holder stamped, no other."""
    a, b = await store_factory(), await store_factory()
    _settling(a)
    await _ready(a)
    runs = {s: [f"{k}-{n:02}" for n in range(12)] for s, k in ((a, "a"), (b, "b"))}
    tasks = {s: {r: await _held_served(a, r) for r in rs} for s, rs in runs.items()}
    at = NOW + 100
    lost = {r for rs in runs.values() for r in rs[::2]}
    for run_id in lost:  # their holder let go
        assert await a.release_run(run_id, OWNER, NOW + 1)

    async def settle(store: Any) -> list[int | None]:
        answers: list[int | None] = []
        for run_id in runs[store]:
            got = await store.claim_and_resolve(
                [RESULTS],
                0,
                NOW,
                _settle_given(Resolution(run_id, 1, COMPLETED, output=run_id, held_by=OWNER)),
                at,
                lease_to(limit=0),
                delete=tasks[store][run_id],
            )
            answers += got.answers
        return answers

    assert list(await asyncio.gather(settle(a), settle(b))) == [[0] * 12, [0] * 12]
    for run_id in [*runs[a], *runs[b]]:
        assert (await a.load_checkpoints(run_id))[1].output == run_id
        assert await wake_of(a, run_id) == (at if run_id in lost else None)
    assert await a.messages().depth() == {}  # type: ignore[attr-defined]


async def test_a_failed_settle_keeps_the_served_tasks(store: StateStore) -> None:
    settling = _settling(store)
    await _ready(store)
    await store.messages().push([OutMessage(TOPIC, "served-task")])  # type: ignore[attr-defined]
    tasks = await store.messages().claim([TOPIC], "worker", 1, 30_000, NOW)  # type: ignore[attr-defined]

    def broken(messages: list[Message]) -> tuple[Any, list[Resolution]]:
        raise ValueError("undecodable")

    with pytest.raises(ValueError, match="undecodable"):
        await settling.claim_and_resolve(
            [RESULTS], 256, NOW, broken, NOW + 50, None, delete=[tasks[0].id]
        )
    assert await store.messages().depth([TOPIC]) == {TOPIC: 1}  # type: ignore[attr-defined]


def _born(body: str, owner: str = "server", until: int = NOW + 30_000) -> OutMessage:
    """A task pushed born claimed by ``owner`` until ``until``."""
    return OutMessage(TOPIC, body, claimed_by=owner, claimed_until=until)


async def test_a_task_born_claimed_is_held_by_its_owner_until_its_lease(
    store: StateStore,
) -> None:
    """``save_checkpoint_claiming``: the born claimed task's id comes back;
    nobody else claims it before its lease ends, and after it anybody does
    (its second delivery); the free task next to it is claimable at once."""
    outbox = _outbox(store)
    await _ready(store)
    await _leased(store, "r1")

    ids = await outbox.save_checkpoint_claiming(
        dispatched_cp("r1", 1), OWNER, [OutMessage(TOPIC, "free"), _born("born")]
    )

    assert ids is not None and len(ids) == 1
    queue = store.messages()  # type: ignore[attr-defined]
    early = await queue.claim([TOPIC], "other", 10, 30_000, NOW + 29_999)
    assert [m.body for m in early] == ["free"]
    late = await queue.claim([TOPIC], "other", 10, 30_000, NOW + 30_001)
    assert [(m.id, m.body, m.deliveries) for m in late] == [(ids[0], "born", 2)]
    assert (await store.load_checkpoints("r1"))[1].dispatched_at == NOW + 1


async def test_a_born_claimed_task_can_be_extended_acked_and_handed_back_by_its_owner(
    store: StateStore,
) -> None:
    outbox = _outbox(store)
    await _ready(store)
    await _leased(store, "r1")
    queue = store.messages()  # type: ignore[attr-defined]

    ids = await outbox.save_checkpoint_claiming(
        dispatched_cp("r1", 1), OWNER, [_born("a"), _born("b")]
    )

    assert ids is not None and len(ids) == 2
    assert await queue.extend(ids, "server", 60_000, NOW + 1) == ids
    assert await queue.extend(ids, "other", 60_000, NOW + 1) == []
    await queue.ack([ids[0]])
    await queue.release([ids[1]], "server")
    again = await queue.claim([TOPIC], "other", 10, 30_000, NOW + 2)
    assert [(m.id, m.body) for m in again] == [(ids[1], "b")]


async def test_a_born_claimed_task_whose_lease_is_lost_is_not_written(
    store: StateStore,
) -> None:
    outbox = _outbox(store)
    await _ready(store)
    await _leased(store, "r1", owner="someone-else")

    ids = await outbox.save_checkpoint_claiming(dispatched_cp("r1", 1), OWNER, [_born("born")])

    assert ids is None
    assert await store.load_checkpoints("r1") == {}
    assert await store.messages().depth() == {}  # type: ignore[attr-defined]


async def test_many_born_claimed_writes_together_each_hear_their_own_ids(
    store: StateStore,
) -> None:
    """Concurrent turns' writes batched together: each writer gets the ids of
    its own born claimed tasks (in its order), the lost one gets ``None``."""
    outbox = _outbox(store)
    await _ready(store)
    runs = [f"run-{n:02}" for n in range(20)]
    for run_id in runs:
        await _leased(store, run_id)
    await _leased(store, "lost", owner="someone-else")

    writes = [
        outbox.save_checkpoint_claiming(
            dispatched_cp(run_id, 1),
            OWNER,
            [_born(f"{run_id}:a"), OutMessage(TOPIC, f"{run_id}:free"), _born(f"{run_id}:b")]
            if n % 2
            else [OutMessage(TOPIC, f"{run_id}:free")],
        )
        for n, run_id in enumerate(runs)
    ]
    writes.append(outbox.save_checkpoint_claiming(dispatched_cp("lost", 1), OWNER, [_born("x")]))
    answers = await asyncio.gather(*writes)

    assert answers[-1] is None
    free = await store.messages().claim([TOPIC], "reader", 1_000, 60_000, NOW)  # type: ignore[attr-defined]
    assert sorted(m.body for m in free) == sorted(f"{r}:free" for r in runs)
    born = await store.messages().claim([TOPIC], "reader", 1_000, 30_000, NOW + 30_001)  # type: ignore[attr-defined]
    body_of = {m.id: m.body for m in born}
    for n, (run_id, ids) in enumerate(zip(runs, answers[:-1], strict=True)):
        expected = [f"{run_id}:a", f"{run_id}:b"] if n % 2 else []
        assert ids is not None and [body_of[i] for i in ids] == expected
    assert len(body_of) == 20


async def test_two_store_objects_writing_born_claimed_tasks_at_once_get_distinct_ids(
    store_factory: StoreFactory,
) -> None:
    a, b, runs = await _two_stores_with_leased_runs(store_factory, 30)

    answers = await asyncio.gather(
        *(
            (a if n % 2 else b).save_checkpoint_claiming(
                dispatched_cp(run_id, 1), OWNER, [_born(run_id)]
            )
            for n, run_id in enumerate(runs)
        )
    )

    born = await a.messages().claim([TOPIC], "reader", 100, 30_000, NOW + 30_001)
    body_of = {m.id: m.body for m in born}
    assert [body_of[ids[0]] for ids in answers] == runs
