"""Group insert for PostgreSQL: concurrent starts, one statement.

A start is one new row. Issued one by one, thousands of starts gathered at
once cost a round trip and a commit each, on a pool of a few connections.
Here a lone start goes out at once, as its own statement; starts made while
it is in flight queue up and go out together as one multi-row
``INSERT … ON CONFLICT (id) DO NOTHING``, which commits them all at once.

Each caller still hears what ``create_run`` promises: its run and
``created=True`` when its row went in; otherwise the stored run (the one
another start already inserted, in this batch, an earlier one or another
process) and ``False``. One row the database refuses undoes the statement, so
the batch is then inserted row by row and only that row's caller hears of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from .._batch import BatchCall
from .._logs import engine_logger
from .._notices import StoreNotice
from ..model import Run
from ._pg_sql import RUNS_UNNEST, notice_argument
from ._rows import RUN_COLUMNS, is_row_error, run_from_row, run_params

__all__ = ["PgStartBatcher"]

_log = engine_logger("durably.stores.postgres")

# In id order (the caller sorts): two processes inserting overlapping new ids
# in different orders would each wait on the other's uncommitted key, and
# PostgreSQL would abort one as a deadlock. A pending run is announced by id,
# as a lone start announces it: the starting process recognises its own.
_INSERT_RUNS = f"""
    WITH ins AS (
        INSERT INTO durably_runs ({RUN_COLUMNS}) {RUNS_UNNEST}
        ON CONFLICT (id) DO NOTHING RETURNING id, status
    )
    SELECT id, CASE WHEN status = 'pending' THEN
        (SELECT pg_notify($23, '{StoreNotice.PENDING}:' || {notice_argument("id")})) IS NULL
    END AS notified
    FROM ins
"""

Connect = Callable[[], AbstractAsyncContextManager[Any]]
CreateOne = Callable[[Run], Awaitable[tuple[Run, bool]]]
_Answer = tuple[Run, bool] | Exception


class PgStartBatcher:
    """``await starts.create(run)``: ``create_run``'s answer, sharing statements."""

    def __init__(
        self,
        connection: Connect,
        channel: str,
        create_one: CreateOne,
        select_runs: str,
        max_batch: int = 500,
    ) -> None:
        """``create_one`` inserts a single run (the lone start's statement, and
        the fallback); ``select_runs`` reads runs by ``id = ANY($1)``."""
        self._connection = connection
        self._channel = channel
        self._create_one = create_one
        self._select_runs = select_runs
        self._batch: BatchCall[Run, _Answer] = BatchCall(self._insert, max_batch=max_batch)
        self._alone = False

    async def create(self, run: Run) -> tuple[Run, bool]:
        """Insert ``run`` unless its id exists (see ``RunStore.create_run``)."""
        if not self._alone and self._batch.idle:
            # The latency path: a start while nothing else is being inserted
            # goes out at once, without waiting for the batch task to be
            # scheduled; starts arriving meanwhile queue in the batch.
            self._alone = True
            try:
                return await self._create_one(run)
            finally:
                self._alone = False
        answer = await self._batch(run)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def drain(self) -> None:
        """Wait for the batch in flight (before the pool closes)."""
        await self._batch.drain()

    async def _insert(self, runs: list[Run]) -> list[_Answer]:
        if len(runs) == 1:
            # A batch of one is the single-row statement.
            return [await self._create_one(runs[0])]
        answers: list[_Answer | None] = [None] * len(runs)
        # The first start of each id is inserted; its duplicates in the same
        # batch (and any start whose id existed) read the stored run after.
        first: dict[str, tuple[int, tuple[Any, ...]]] = {}
        for index, run in enumerate(runs):
            if run.run_id in first:
                continue
            try:
                first[run.run_id] = (index, run_params(run))
            except Exception as exc:  # a value no column takes: this caller's alone
                answers[index] = exc
        rows = [params for _, params in sorted(first.values(), key=lambda e: e[1][0])]
        if rows:
            try:
                inserted, stored = await self._write(rows, runs)
            except Exception as exc:
                if not is_row_error(exc):
                    raise  # the store's fault (a lost connection): every caller's
                _log.warning(
                    "a batch of %d starts failed (%s); inserting them one by one", len(rows), exc
                )
                return await self._one_by_one(runs, answers)
            for index, run in enumerate(runs):
                if answers[index] is not None:
                    continue
                if run.run_id in inserted and first[run.run_id][0] == index:
                    answers[index] = (run, True)
                elif run.run_id in stored:
                    # A fresh object per caller: each may change the run it gets.
                    answers[index] = (run_from_row(stored[run.run_id]), False)
        # Left: an id that existed but was deleted before it could be read.
        for index, run in enumerate(runs):
            if answers[index] is None:
                answers[index] = await self._guarded_one(run)
        return [answer for answer in answers if answer is not None]

    async def _write(
        self, rows: list[tuple[Any, ...]], runs: list[Run]
    ) -> tuple[set[str], dict[str, Any]]:
        """Insert ``rows``; the ids inserted, and the stored rows of the others."""
        columns = [list(column) for column in zip(*rows, strict=True)]
        async with self._connection() as conn:
            inserted = {
                row["id"] for row in await conn.fetch(_INSERT_RUNS, *columns, self._channel)
            }
            # Read back every id some caller here did not insert: ids that
            # existed, and ids repeated in the batch (the repeats' callers).
            callers = Counter(run.run_id for run in runs)
            others = [i for i, count in callers.items() if count > 1 or i not in inserted]
            if not others:
                return inserted, {}
            # A statement of its own: it sees rows other transactions committed
            # while the insert waited on their keys, which the insert's
            # snapshot does not.
            found = await conn.fetch(self._select_runs, others)
        return inserted, {row[0]: row for row in found}

    async def _one_by_one(self, runs: list[Run], answers: list[_Answer | None]) -> list[_Answer]:
        results: list[_Answer] = []
        for run, answer in zip(runs, answers, strict=True):
            results.append(answer if answer is not None else await self._guarded_one(run))
        return results

    async def _guarded_one(self, run: Run) -> _Answer:
        try:
            return await self._create_one(run)
        except Exception as exc:
            return exc
