"""RunExecutor's lent slots: an execution that only waits lends its slot to
the next waiting id and takes one back, ahead of the ids waiting, before it
works again; at most ``limit`` executions work at once. Counts and orders only."""

from __future__ import annotations

import asyncio

import pytest

from durably._executor import RunExecutor

pytestmark = pytest.mark.timeout(30)


class Scripted:
    """Executions that wait for their own gates, and record what they did."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.log: list[str] = []
        self.executor: RunExecutor | None = None

    def gate(self, run_id: str) -> asyncio.Event:
        return self.gates.setdefault(run_id, asyncio.Event())

    async def handler(self, run_id: str, wake: bool) -> None:
        assert self.executor is not None
        self.log.append(f"start {run_id}")
        if run_id.startswith("hold"):
            assert self.executor.lend(run_id)
            assert not self.executor.lend(run_id)  # lent already
            await self.gate(run_id).wait()
            claim = self.executor.reclaim(run_id)
            if claim is not None:
                self.log.append(f"wait {run_id}")
                await claim
            self.log.append(f"back {run_id}")
        await self.gate(f"end {run_id}").wait()
        self.log.append(f"end {run_id}")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lent_slot_runs_a_waiting_id_and_is_taken_back_first() -> None:
    script = Scripted()
    executor = script.executor = RunExecutor(script.handler, 1)
    executor.submit("hold")
    executor.submit("a")
    executor.submit("b")
    await settle()
    # "hold" lent its slot: "a" works in it, "b" waits.
    assert script.log == ["start hold", "start a"]
    assert (executor.working, executor.lent, executor.waiting) == (1, 1, 1)
    script.gate("hold").set()
    await settle()
    assert script.log[-1] == "wait hold" and executor.reclaiming == 1
    script.gate("end a").set()
    await settle()
    # The slot "a" gave back went to "hold", not to the waiting "b".
    assert script.log[2:] == ["wait hold", "end a", "back hold"]
    assert (executor.working, executor.lent, executor.reclaiming, executor.waiting) == (1, 0, 0, 1)
    script.gate("end hold").set()
    script.gate("end b").set()
    await executor.join()
    assert script.log[-3:] == ["end hold", "start b", "end b"]
    assert (executor.busy, executor.working, executor.lent) == (0, 0, 0)


async def test_a_slot_taken_back_at_once_when_one_is_free() -> None:
    script = Scripted()
    executor = script.executor = RunExecutor(script.handler, 2)
    executor.submit("hold")
    await settle()
    assert (executor.working, executor.lent) == (0, 1)
    script.gate("hold").set()
    script.gate("end hold").set()
    await executor.join()
    assert script.log == ["start hold", "back hold", "end hold"]


async def test_an_execution_ending_lent_frees_its_claim() -> None:
    """An execution cancelled while it waits to take a slot back ends lent:
    its claim is dropped, and the slot count is whole again."""
    executor = RunExecutor(lambda run_id, wake: asyncio.sleep(0), 1)
    claims: list[asyncio.Future[None] | None] = []
    started = asyncio.Event()
    go = asyncio.Event()
    gate = asyncio.Event()

    async def handler(run_id: str, wake: bool) -> None:
        if run_id == "hold":
            assert executor.lend(run_id)
            started.set()
            await go.wait()
            claims.append(executor.reclaim(run_id))
            await asyncio.Event().wait()  # cancelled below
        await gate.wait()

    executor._handler = handler
    executor.submit("hold")
    await started.wait()
    executor.submit("a")
    await settle()
    go.set()
    await settle()
    assert executor.working == 1 and executor.reclaiming == 1
    claim = claims[0]
    assert claim is not None
    claim.cancel()
    for task in list(executor._tasks):
        if task.get_name() == "durably-run:hold":
            task.cancel()
    await settle()
    assert (executor.lent, executor.working) == (0, 1)
    gate.set()
    await executor.join()
    assert (executor.busy, executor.lent, executor.reclaiming) == (0, 0, 0)


async def test_a_second_execution_of_the_run_ending_leaves_the_claim_whole() -> None:
    """A wake for a run whose turn holds starts a second execution of the same
    id in the lent slot (it finds the run leased and ends). Its end must not
    drop the holding execution's lent mark nor its claim: that claim was left
    unresolved, and the held turn waited forever under a kept lease (seen with
    the run queue's ``MAX_HELD`` at the executor's limit, db:// N=1000)."""
    executor = RunExecutor(lambda run_id, wake: asyncio.sleep(0), 1)
    calls = 0
    started, go = asyncio.Event(), asyncio.Event()
    first_end, second_end = asyncio.Event(), asyncio.Event()
    claims: list[asyncio.Future[None] | None] = []
    log: list[str] = []

    async def handler(run_id: str, wake: bool) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            assert executor.lend(run_id)
            started.set()
            await go.wait()
            claim = executor.reclaim(run_id)
            claims.append(claim)
            if claim is not None:
                await claim
            log.append("back")
            await first_end.wait()
        else:
            assert executor.executing(run_id)
            await second_end.wait()
            log.append("second ends")

    executor._handler = handler
    executor.submit("r")
    await started.wait()
    executor.submit("r", wake=True)  # a wake mid-turn: a second execution, in the lent slot
    await settle()
    assert (executor.busy, executor.working) == (2, 1)
    go.set()
    await settle()
    assert claims[0] is not None and executor.reclaiming == 1  # the slot is the second's
    second_end.set()
    await settle()
    assert log == ["second ends", "back"]
    assert executor.executing("r") and (executor.busy, executor.working, executor.lent) == (1, 1, 0)
    first_end.set()
    await executor.join()
    assert (executor.busy, executor.lent, executor.reclaiming) == (0, 0, 0)
    assert not executor.executing("r")
