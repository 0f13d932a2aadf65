"""The run watcher behind ``wait_for_run``: a caller's cancel is never lost."""

from __future__ import annotations

import asyncio

import pytest

from durably._watch import RunWatcher
from durably.model import Run, RunResult, RunStatus

_DONE = frozenset({RunStatus.COMPLETED})


async def _no_runs(run_ids: list[str]) -> list[Run]:
    return []


async def test_a_cancel_landing_as_the_run_settles_cancels_the_waiter() -> None:
    # asyncio.wait_for on Python 3.11 would return the result here and drop
    # the cancel: a task cancelled to stop it would go on running.
    watcher = RunWatcher(_no_runs, interval=60.0)
    try:
        task = asyncio.create_task(watcher.wait_local("r", _DONE, timeout=30.0))
        await asyncio.sleep(0)  # the waiter is registered
        watcher.settled(RunResult("r", RunStatus.COMPLETED))
        task.cancel()  # in the same iteration, before the waiter resumes
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await watcher.close()


async def test_a_waiter_gets_the_outcome_or_times_out() -> None:
    watcher = RunWatcher(_no_runs, interval=60.0)
    try:
        with pytest.raises(TimeoutError, match="wait_for_run"):
            await watcher.wait_local("slow", _DONE, timeout=0.01)
        task = asyncio.create_task(watcher.wait_local("r", _DONE, timeout=30.0))
        await asyncio.sleep(0)
        watcher.settled(RunResult("r", RunStatus.COMPLETED, output=7))
        assert (await task).output == 7
    finally:
        await watcher.close()


class _Watches:
    """A store's ``get_runs``/``watch_runs`` pair, counting the marks."""

    def __init__(self) -> None:
        self.marked: list[list[str]] = []
        self.runs: dict[str, Run] = {}

    async def get_runs(self, run_ids: list[str]) -> list[Run]:
        return [self.runs[i] for i in run_ids if i in self.runs]

    async def watch_runs(self, run_ids: list[str]) -> list[Run]:
        self.marked.append(list(run_ids))
        return await self.get_runs(run_ids)


def _run(run_id: str, status: RunStatus) -> Run:
    return Run(run_id=run_id, workflow="wf", workflow_version="1", status=status)


async def test_a_local_waiter_marks_its_run_watched_once_it_is_put_aside() -> None:
    """A run executing here needs no announcement of its settles until it is
    suspended (its next turn may run anywhere): only then is it marked, once."""
    store = _Watches()
    watcher = RunWatcher(store.get_runs, interval=60.0, watch_runs=store.watch_runs)
    try:
        task = asyncio.create_task(watcher.wait_local("r", _DONE, timeout=30.0))
        await asyncio.sleep(0)
        watcher.settled(RunResult("r", RunStatus.RUNNING))
        assert store.marked == []
        store.runs["r"] = _run("r", RunStatus.SUSPENDED)
        watcher.settled(RunResult("r", RunStatus.SUSPENDED))
        watcher.settled(RunResult("r", RunStatus.SUSPENDED))
        for _ in range(5):
            await asyncio.sleep(0)
        assert store.marked == [["r"]]
        watcher.settled(RunResult("r", RunStatus.COMPLETED, output=1))
        assert (await task).output == 1
        # The mark's own read of a run that settled meanwhile resolves it too.
        store.runs["s"] = _run("s", RunStatus.COMPLETED)
        other = asyncio.create_task(watcher.wait_local("s", _DONE, timeout=30.0))
        await asyncio.sleep(0)
        watcher.settled(RunResult("s", RunStatus.SUSPENDED))
        assert (await other).status is RunStatus.COMPLETED
        assert store.marked == [["r"], ["s"]]
    finally:
        await watcher.close()


async def test_a_waiter_from_outside_is_read_through_the_mark_and_not_marked_again() -> None:
    store = _Watches()
    store.runs["r"] = _run("r", RunStatus.RUNNING)
    watcher = RunWatcher(store.get_runs, interval=60.0, watch_runs=store.watch_runs)
    try:
        run = await watcher.watch("r")
        assert run is not None and store.marked == [["r"]]
        assert await watcher.watch("missing") is None
        task = asyncio.create_task(watcher.wait(run, _DONE, timeout=30.0))
        await asyncio.sleep(0)
        watcher.settled(RunResult("r", RunStatus.SUSPENDED))
        watcher.settled(RunResult("r", RunStatus.COMPLETED, output=2))
        assert (await task).output == 2
        assert store.marked == [["r"], ["missing"]]
    finally:
        await watcher.close()


class _Statuses(_Watches):
    """A store that also answers statuses alone, counting whole-run reads."""

    def __init__(self) -> None:
        super().__init__()
        self.whole: list[str] = []  # read by the poll (the mark reads on its own)
        self.status_reads = 0
        self.polled_thrice = asyncio.Event()

    async def get_runs(self, run_ids: list[str]) -> list[Run]:
        self.whole.extend(run_ids)
        return await super().get_runs(run_ids)

    async def watch_runs(self, run_ids: list[str]) -> list[Run]:
        self.marked.append(list(run_ids))
        return [self.runs[i] for i in run_ids if i in self.runs]

    async def get_run_statuses(self, run_ids: list[str]) -> dict[str, RunStatus]:
        self.status_reads += 1
        if self.status_reads >= 3:
            self.polled_thrice.set()
        return {i: self.runs[i].status for i in run_ids if i in self.runs}


async def test_the_safety_net_reads_statuses_and_only_the_runs_a_waiter_wants() -> None:
    """The interval poll reads every waited run; reading each whole (input,
    output, error decoded) for 1,000 waiters, ten times a second, was ~10% of a
    dispatched step's CPU. It reads statuses, then whole only the runs whose
    status a waiter is waiting for."""
    store = _Statuses()
    ids = [f"r{i}" for i in range(50)]
    for run_id in ids:
        store.runs[run_id] = _run(run_id, RunStatus.RUNNING)
    store.runs["r7"] = _run("r7", RunStatus.SUSPENDED)  # put aside elsewhere
    watcher = RunWatcher(
        store.get_runs,
        interval=0.01,
        watch_runs=store.watch_runs,
        get_statuses=store.get_run_statuses,
    )
    try:
        waiting = [asyncio.create_task(watcher.wait_local(i, _DONE, timeout=30.0)) for i in ids]
        await asyncio.wait_for(store.polled_thrice.wait(), 30)  # a hang guard
        assert store.whole == []  # nothing a waiter wants: no run read whole
        assert store.marked == [["r7"]]  # put aside: marked, as a whole read would
        store.runs["r3"] = _run("r3", RunStatus.COMPLETED)
        assert (await waiting[3]).status is RunStatus.COMPLETED
        assert set(store.whole) == {"r3"}
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    finally:
        await watcher.close()


_SETTLED = frozenset({RunStatus.SUSPENDED, *_DONE})


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_read_of_a_run_driven_here_answers_no_waiter() -> None:
    # Woken here, not leased yet: the stored row is the settle from before the
    # wake, and handing it over made wait_for_run miss what the wake did.
    store = _Watches()
    store.runs["r"] = _run("r", RunStatus.SUSPENDED)
    watcher = RunWatcher(store.get_runs, interval=60.0)
    here = {"r"}
    watcher.runs_here = here.__contains__
    try:
        task = asyncio.create_task(watcher.wait_local("r", _SETTLED, timeout=30.0))
        await _turns()
        watcher.changed("r")  # a notice: the poll reads the row
        await _turns()
        assert not task.done(), "a read answered for a run whose turn is due here"
        watcher.settled(RunResult("r", RunStatus.SUSPENDED, output="after"))
        assert (await task).output == "after"
        here.clear()  # not driven here any more: a read is its only news
        later = asyncio.create_task(watcher.wait_local("r", _DONE, timeout=30.0))
        await _turns()
        store.runs["r"] = _run("r", RunStatus.COMPLETED)
        watcher.changed("r")
        assert (await later).status is RunStatus.COMPLETED
    finally:
        await watcher.close()


async def test_a_read_out_while_the_run_was_woken_here_answers_no_waiter() -> None:
    store = _Watches()
    store.runs["r"] = _run("r", RunStatus.SUSPENDED)
    release = asyncio.Event()

    async def slow_get_runs(run_ids: list[str]) -> list[Run]:
        runs = await store.get_runs(run_ids)  # read before the wake...
        await release.wait()  # ...answered after it
        return runs

    watcher = RunWatcher(slow_get_runs, interval=60.0)
    try:
        task = asyncio.create_task(watcher.wait_local("r", _SETTLED, timeout=30.0))
        await _turns()
        watcher.changed("r")
        await _turns()  # the read is out
        watcher.forget("r")  # the run is woken here (and its turn runs elsewhere)
        release.set()
        await _turns()
        assert not task.done(), "a read from before the wake answered the waiter"
        # The next read, asked after the wake, is current.
        store.runs["r"] = _run("r", RunStatus.COMPLETED)
        watcher.changed("r")
        assert (await task).status is RunStatus.COMPLETED
    finally:
        await watcher.close()


async def test_waits_begun_together_read_and_mark_their_runs_together() -> None:
    """A client waiting for a batch of runs it just started: their reads (and
    marks) go out in batches, not one statement per run."""
    store = _Watches()
    for n in range(50):
        store.runs[f"r{n}"] = _run(f"r{n}", RunStatus.RUNNING)
    watcher = RunWatcher(store.get_runs, interval=60.0, watch_runs=store.watch_runs)
    try:
        read = await asyncio.gather(*(watcher.watch(f"r{n}") for n in [*range(50), 7]))
        missing = await watcher.watch("missing")
    finally:
        await watcher.close()
    assert [run.run_id if run else None for run in read] == [f"r{n}" for n in [*range(50), 7]]
    assert missing is None
    assert len(store.marked) <= 3  # the first alone, the rest together, then "missing"
    assert sorted({i for batch in store.marked for i in batch}) == sorted(
        [*(f"r{n}" for n in range(50)), "missing"]
    )


async def test_the_safety_net_reads_no_run_that_runs_here() -> None:
    """Runs queued or executing in this process are answered by their own
    settles: the interval poll reads only the others (a thousand waits for
    runs executing here made each poll a read of a thousand statuses)."""
    store = _Statuses()
    ids = [f"r{i}" for i in range(20)]
    for run_id in ids:
        store.runs[run_id] = _run(run_id, RunStatus.RUNNING)
    asked: list[str] = []
    statuses = store.get_run_statuses

    async def reading(run_ids: list[str]) -> dict[str, RunStatus]:
        asked.extend(run_ids)
        return await statuses(run_ids)

    watcher = RunWatcher(
        store.get_runs, interval=0.01, watch_runs=store.watch_runs, get_statuses=reading
    )
    here = set(ids[:15])
    watcher.runs_here = here.__contains__
    try:
        waiting = [asyncio.create_task(watcher.wait_local(i, _DONE, timeout=30.0)) for i in ids]
        await asyncio.wait_for(store.polled_thrice.wait(), 30)  # a hang guard
        assert set(asked) == set(ids[15:])
        watcher.settled(RunResult("r3", RunStatus.COMPLETED, output=3))  # its own settle
        assert (await waiting[3]).output == 3
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    finally:
        await watcher.close()


async def test_the_safety_net_slows_to_its_announced_interval_once_settles_are_announced() -> None:
    """A store that announces the settles of watched runs (PostgreSQL's
    NOTIFY) leaves the net only lost announcements to catch: it reads at
    ``announced_interval``, not at ``interval`` (a thousand waits for runs
    queued in BullMQ made its reads ~5-10% of a dispatched step's CPU)."""
    quiet, polled = _Statuses(), _Statuses()
    ids = [f"r{i}" for i in range(10)]
    for store in (quiet, polled):
        for run_id in ids:
            store.runs[run_id] = _run(run_id, RunStatus.PENDING)
    announced = RunWatcher(
        quiet.get_runs,
        interval=0.001,
        watch_runs=quiet.watch_runs,
        get_statuses=quiet.get_run_statuses,
        announced_interval=3600.0,
    )
    announced.announced = True
    silent = RunWatcher(
        polled.get_runs,
        interval=0.001,
        watch_runs=polled.watch_runs,
        get_statuses=polled.get_run_statuses,
        announced_interval=3600.0,
    )
    waiting = [
        asyncio.create_task(watcher.wait_local(i, _DONE, timeout=30.0))
        for watcher in (announced, silent)
        for i in ids
    ]
    try:
        # The silent store's net reads three times meanwhile (a hang guard).
        await asyncio.wait_for(polled.polled_thrice.wait(), 30)
        assert quiet.status_reads == 0
        # A poke (a notice heard) still reads the poked run at once.
        announced.changed("r4")
        quiet.runs["r4"] = _run("r4", RunStatus.COMPLETED)
        assert (await waiting[4]).status is RunStatus.COMPLETED
        assert quiet.status_reads == 0
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await announced.close()
        await silent.close()
