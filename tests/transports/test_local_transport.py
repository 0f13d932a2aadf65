"""``local://``: what its in-memory queues promise beyond the transport contract."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable

from durably.transports import LocalTransport
from durably.wire import StepTask


async def test_a_task_whose_handler_raises_is_delivered_again() -> None:
    transport = LocalTransport()
    await transport.open()
    seen: list[int] = []
    again = asyncio.Event()

    async def on_task(task: StepTask) -> None:
        seen.append(task.seq)
        if len(seen) == 1:
            raise RuntimeError("the handler wrapper broke")
        again.set()

    try:
        await transport.serve(["g"], on_task, concurrency=1)
        await transport.dispatch([StepTask(run_id="r", seq=3, name="g", group="g")])
        await again.wait()
        assert seen == [3, 3]
    finally:
        await transport.close()


async def test_a_handler_raising_before_it_awaits_is_delivered_again() -> None:
    transport = LocalTransport()
    await transport.open()
    seen: list[int] = []
    again = asyncio.Event()

    def on_task(task: StepTask) -> Awaitable[None]:
        seen.append(task.seq)
        if len(seen) == 1:
            raise RuntimeError("raised before returning an awaitable")
        again.set()
        return asyncio.sleep(0)

    try:
        await transport.serve(["g"], on_task, concurrency=1)
        await transport.dispatch([StepTask(run_id="r", seq=4, name="g", group="g")])
        await again.wait()
        assert seen == [4, 4]
    finally:
        await transport.close()


async def test_handlers_run_at_most_concurrency_at_once_and_all_run() -> None:
    transport = LocalTransport()
    await transport.open()
    running, peak, done = 0, 0, 0
    finished = asyncio.Event()

    async def on_task(task: StepTask) -> None:
        nonlocal running, peak, done
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)
        running -= 1
        done += 1
        if done == 20:
            finished.set()

    try:
        await transport.serve(["g"], on_task, concurrency=3)
        await transport.dispatch(
            [StepTask(run_id="r", seq=seq, name="g", group="g") for seq in range(20)]
        )
        await finished.wait()
        assert peak == 3
        assert running == 0
    finally:
        await transport.close()


async def test_a_handler_raising_after_it_suspends_is_delivered_again() -> None:
    transport = LocalTransport()
    await transport.open()
    seen: list[int] = []
    again = asyncio.Event()

    async def on_task(task: StepTask) -> None:
        seen.append(task.seq)
        await asyncio.sleep(0)
        if len(seen) == 1:
            raise RuntimeError("the handler wrapper broke after an await")
        again.set()

    try:
        await transport.serve(["g"], on_task, concurrency=1)
        await transport.dispatch([StepTask(run_id="r", seq=5, name="g", group="g")])
        await again.wait()
        assert seen == [5, 5]
    finally:
        await transport.close()


async def test_handlers_that_end_without_suspending_all_run_in_priority_order() -> None:
    transport = LocalTransport()
    await transport.open()
    seen: list[int] = []
    finished = asyncio.Event()

    async def on_task(task: StepTask) -> None:
        seen.append(task.seq)  # no await: it ends where it starts
        if len(seen) == 20:
            finished.set()

    try:
        # Queued before anyone serves, so the order is the priority's alone.
        await transport.dispatch(
            [StepTask(run_id="r", seq=seq, name="g", group="g", priority=seq) for seq in range(20)]
        )
        await transport.serve(["g"], on_task, concurrency=1)
        await finished.wait()
        assert seen == list(reversed(range(20)))
    finally:
        await transport.close()


_SEEN: contextvars.ContextVar[str] = contextvars.ContextVar("_SEEN", default="unset")


async def test_a_handler_sets_context_variables_in_its_own_context() -> None:
    transport = LocalTransport()
    await transport.open()
    seen: list[str] = []
    finished = asyncio.Event()

    async def on_task(task: StepTask) -> None:
        seen.append(_SEEN.get())
        _SEEN.set(f"set by {task.seq}")  # never reset: must not reach the next handler
        if task.seq % 2:
            await asyncio.sleep(0)
            seen.append(_SEEN.get())
        if len(seen) == 6:
            finished.set()

    try:
        await transport.dispatch(
            [StepTask(run_id="r", seq=seq, name="g", group="g") for seq in range(4)]
        )
        await transport.serve(["g"], on_task, concurrency=4)
        await finished.wait()
        assert sorted(seen) == sorted(["unset"] * 4 + ["set by 1", "set by 3"])
    finally:
        await transport.close()


async def test_a_handler_raising_cancelled_before_it_suspends_leaves_the_server_serving() -> None:
    transport = LocalTransport()
    await transport.open()
    seen: list[int] = []
    finished = asyncio.Event()

    async def on_task(task: StepTask) -> None:
        seen.append(task.seq)
        if task.seq == 0:
            raise asyncio.CancelledError  # as its task was: dropped, not delivered again
        finished.set()

    try:
        await transport.dispatch([StepTask(run_id="r", seq=0, name="g", group="g")])
        await transport.serve(["g"], on_task, concurrency=1)
        await transport.dispatch([StepTask(run_id="r", seq=1, name="g", group="g")])
        await finished.wait()
        assert seen == [0, 1]
    finally:
        await transport.close()


async def test_a_handler_is_one_task_before_and_after_it_suspends() -> None:
    transport = LocalTransport()
    await transport.open()
    same: list[bool] = []
    finished = asyncio.Event()

    async def on_task(task: StepTask) -> None:
        before = asyncio.current_task()
        async with asyncio.timeout(60):  # bound to the task it was entered in
            await asyncio.sleep(0)
        same.append(asyncio.current_task() is before)
        finished.set()

    try:
        await transport.serve(["g"], on_task, concurrency=1)
        await transport.dispatch([StepTask(run_id="r", seq=1, name="g", group="g")])
        await finished.wait()
        assert same == [True]
    finally:
        await transport.close()
