"""BatchCall: concurrent calls share batches, each caller gets its own answer."""

from __future__ import annotations

import asyncio

import pytest

from durably._batch import BatchCall


async def test_a_lone_call_goes_out_alone() -> None:
    batches: list[list[int]] = []

    async def call(items: list[int]) -> list[int]:
        batches.append(items)
        return [i * 10 for i in items]

    batch: BatchCall[int, int] = BatchCall(call)
    assert await batch(1) == 10
    assert await batch(2) == 20
    assert batches == [[1], [2]]


async def test_calls_made_while_a_batch_is_in_flight_go_out_together() -> None:
    batches: list[list[int]] = []
    release = asyncio.Event()

    async def call(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) == 1:
            await release.wait()  # hold the first batch in flight
        return [-i for i in items]

    batch: BatchCall[int, int] = BatchCall(call, max_batch=4)
    first = asyncio.ensure_future(batch(0))
    await asyncio.sleep(0)  # the first batch leaves
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(batch(i)) for i in range(1, 7)]
    await asyncio.sleep(0)
    release.set()

    assert await first == 0
    assert [await r for r in rest] == [-1, -2, -3, -4, -5, -6]
    assert batches == [[0], [1, 2, 3, 4], [5, 6]]


async def test_a_failed_batch_fails_each_of_its_callers() -> None:
    calls = 0

    async def call(items: list[str]) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("connection lost")
        return items

    batch: BatchCall[str, str] = BatchCall(call)
    failed = await asyncio.gather(batch("a"), batch("b"), return_exceptions=True)
    assert [type(e) for e in failed] == [OSError, OSError]
    assert await batch("c") == "c"  # the next batch goes out as usual


async def test_a_short_answer_is_an_error_not_a_silent_mismatch() -> None:
    async def call(items: list[int]) -> list[int]:
        return items[:1]

    batch: BatchCall[int, int] = BatchCall(call)
    with pytest.raises(RuntimeError, match="1 answers for 2 calls"):
        await asyncio.gather(batch(1), batch(2))


async def test_idle_until_the_last_batch_has_answered() -> None:
    release = asyncio.Event()

    async def call(items: list[int]) -> list[int]:
        await release.wait()
        return items

    batch: BatchCall[int, int] = BatchCall(call)
    assert batch.idle
    pending = asyncio.ensure_future(batch(1))
    await asyncio.sleep(0)
    assert not batch.idle
    release.set()
    assert await pending == 1
    await batch.drain()
    assert batch.idle
