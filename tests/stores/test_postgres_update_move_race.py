"""An update sent while its run hands its inbox on, on PostgreSQL (READ COMMITTED).

A run that continues as new moves its unanswered updates to the next link and
answers each ``moved``. A caller may put an update in the old link at that very
moment (it read the link as live). Each statement of the move's transaction
sees the rows committed before it started, so the update must be either moved
(copied to the next link and answered ``moved``) or left unanswered in the old
link (the caller's wait hands it on once the link has ended) — never answered
``moved`` without being in the next link, where its caller would then find
nothing ("run ... no longer exists").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from durably.stores.base import UpdateRecord
from durably.stores.postgres import PostgresStore
from durably.testing.conformance.stores.steps import NOW

pytestmark = pytest.mark.timeout(60)

_STATEMENTS = frozenset({"execute", "executemany", "fetch", "fetchrow", "fetchval"})


class _AfterEachStatement:
    """A connection that runs ``hook`` after each statement it carries."""

    def __init__(self, conn: Any, hook: Callable[[], Awaitable[None]]) -> None:
        self._conn = conn
        self._hook = hook

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._conn, name)
        if name not in _STATEMENTS:
            return attribute

        async def statement(*args: Any, **kwargs: Any) -> Any:
            result = await attribute(*args, **kwargs)
            await self._hook()
            return result

        return statement


async def test_an_update_put_while_its_run_moves_the_inbox_is_never_lost(
    postgres_url: str,
) -> None:
    store = PostgresStore(postgres_url)
    await store.open()
    try:
        await store.put_update(UpdateRecord("r1", "u1", "add", 1, NOW))
        real = store._db.connection
        sent: list[str] = []
        hooked = False

        async def a_caller_sends() -> None:
            # On another connection, committed at once, as a caller's send:
            # between the move's statements (or after its only one).
            uid = f"late{len(sent)}"
            sent.append(uid)
            await store.put_update(UpdateRecord("r1", uid, "add", 2, NOW + 1))

        @asynccontextmanager
        async def first_one_interleaved() -> AsyncIterator[Any]:
            # Only the move's own connection (the first taken) carries the
            # hook; the caller's put inside it takes an ordinary one.
            nonlocal hooked
            async with real() as conn:
                if hooked:
                    yield conn
                    return
                hooked = True
                yield _AfterEachStatement(conn, a_caller_sends)

        store._db.connection = first_one_interleaved  # type: ignore[method-assign]
        try:
            moved = await store.move_updates("r1", "r1~1", NOW + 5)
        finally:
            store._db.connection = real  # type: ignore[method-assign]

        assert sent, "no update was put during the move"
        first = await store.get_update("r1~1", "u1")
        assert first is not None and first.answer is None
        for uid in ["u1", *sent]:
            old = await store.get_update("r1", uid)
            assert old is not None
            if old.answer is None:
                continue  # still waiting in the old link: handed on after it ends
            assert old.answer == {"outcome": "moved", "run_id": "r1~1"}
            there = await store.get_update("r1~1", uid)
            assert there is not None, f"{uid} answered moved but not in the next link"
        waiting_there = {r.update_id for r in await store.pending_updates("r1~1", 10)}
        answered_moved = {
            uid
            for uid in ["u1", *sent]
            if (record := await store.get_update("r1", uid)) is not None and record.answer
        }
        assert waiting_there == answered_moved
        assert moved == len(answered_moved)
    finally:
        await store.close()
