"""``durably.testing.eventually``: the first truthy answer, or a failure naming what it awaited."""

from __future__ import annotations

import asyncio

import pytest

from durably.testing import eventually


async def test_returns_the_first_truthy_answer_of_a_sync_predicate() -> None:
    answers = iter([None, [], ["ready"]])
    assert await eventually(lambda: next(answers), what="an answer") == ["ready"]


async def test_awaits_an_async_predicate_while_something_else_runs() -> None:
    seen: list[int] = []

    async def producer() -> None:
        for n in range(3):
            await asyncio.sleep(0.01)
            seen.append(n)

    async def three() -> bool:
        return len(seen) == 3

    task = asyncio.create_task(producer())
    assert await eventually(three, what="three items") is True
    await task


async def test_a_timeout_names_what_and_the_last_value_seen() -> None:
    items: list[int] = []

    def pending() -> list[int]:
        items.append(len(items))
        return [n for n in items if n < 0]

    with pytest.raises(AssertionError, match=r"0.05s waiting for a negative item; last saw \[\]$"):
        await eventually(pending, what="a negative item", timeout=0.05)
    assert len(items) > 1  # it polled


async def test_a_failed_assertion_means_not_yet_and_is_reported() -> None:
    status = "running"

    def done() -> bool:
        assert status == "done", f"status is {status}"
        return True

    with pytest.raises(AssertionError, match=r"waiting for the run; last check failed: status is"):
        await eventually(done, what="the run", timeout=0.05)


async def test_a_false_answer_adds_nothing_and_other_errors_propagate_at_once() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the condition$"):
        await eventually(lambda: False, timeout=0.02)

    def broken() -> bool:
        raise KeyError("x")

    with pytest.raises(KeyError):
        await eventually(broken, timeout=60)
