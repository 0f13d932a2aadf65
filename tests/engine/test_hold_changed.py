"""``LiveStep.changed``: ``asyncio.Event``'s flag for the one waiter a
dispatched step has (its turn), without an ``Event``'s cost per step."""

from __future__ import annotations

import asyncio

from durably.steps._holds import Changed


async def test_a_set_flag_is_seen_at_once_and_a_cleared_one_is_waited_for() -> None:
    changed = Changed()
    assert not changed.is_set()
    changed.set()
    assert changed.is_set()
    assert await changed.wait() is True  # no suspension: already set
    changed.clear()
    waiting = asyncio.ensure_future(changed.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    changed.set()
    assert await waiting is True
    changed.set()  # set again while set: nothing to wake, no error
    assert changed.is_set()


async def test_a_cancelled_wait_leaves_the_next_wait_working() -> None:
    changed = Changed()
    first = asyncio.ensure_future(changed.wait())
    await asyncio.sleep(0)
    first.cancel()
    # The next wait starts before the cancelled one has unwound (as a step
    # with a timeout does, cancelling its wait and waiting again at once).
    second = asyncio.ensure_future(changed.wait())
    await asyncio.sleep(0)
    await asyncio.gather(first, return_exceptions=True)
    assert first.cancelled()
    changed.set()
    assert await asyncio.wait_for(second, 5) is True


async def test_a_set_between_clear_and_wait_is_not_lost() -> None:
    changed = Changed()
    changed.clear()
    asyncio.get_running_loop().call_soon(changed.set)
    assert await asyncio.wait_for(changed.wait(), 5) is True
