"""Group commit for PostgreSQL: the writes of many concurrent turns, one transaction.

Every step writes a checkpoint and every turn ends with a settle. Issued one
by one from hundreds of concurrent runs, each costs a round trip and a
commit on a pooled connection. Here they queue up while the previous batch
commits; each batch then costs one transaction with one multi-row statement
per kind (checkpoints before settles, since a settle releases the lease the
checkpoints are fenced by). A lone write still goes out at once, with one
exception: a step's result is queued without its turn waiting for it, and the
turn's next write (its settle, or the next step's) usually follows within a
few turns of the event loop, so a batch holding only results waits that long
for it rather than committing alone and making the next write wait a whole
batch. Callers hear back as soon as the batch commits, before its connection
goes back to the pool.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from .._logs import engine_logger
from .._notices import StoreNotice
from .._queue import OutMessage
from ..model import TERMINAL_STATUSES, RunStatus
from ._pg_sql import CP_PARAMS, CP_UPSERT_TAIL, RUNNING, notice_argument, only_checked
from ._rows import CP_COLUMNS, is_row_error
from .base import SettleResult

__all__ = ["PgWriteBatcher"]

_log = engine_logger("durably.stores.postgres")

# A settle is announced (NOTIFY) only for a run watched from another process
# (``watch_runs``; the row lock orders the two, so a watch either comes first
# and the settle announces, or reads the settled row). Every NOTIFY wakes each
# listening backend of the database, and the run's own process (the usual
# waiter) has the outcome handed over in memory.
#
# One statement for a whole batch. Every part sees the same snapshot, so the
# checkpoints are fenced by the leases as they were before the settles in the
# same batch release them; FOR SHARE makes a concurrent takeover wait and
# re-checks the lease against the row it committed.
#
# Lock order: ``locked`` takes every run the batch writes ($11), in id order,
# before any other part locks a row: the gate ``(SELECT n FROM locked) >= 0``
# is a one-time filter evaluated before ``held`` or ``settled`` lock theirs.
# Otherwise the batch (checkpoints' runs, then settles' runs, each in join
# order) and another engine settling step results on the same runs
# (resolve_checkpoints, in id order) each hold a run the other waits for, and
# PostgreSQL aborts one as a deadlock. One mode for all (the settles' UPDATE
# mode) so no run's lock is upgraded while others are held.
#
# The checkpoints go as one JSON parameter (a row each, see ``_cp_json``), not
# nineteen arrays: asyncpg checks every array element against abstract base
# classes as it encodes it (~57 Python calls per checkpoint, ~8% of a
# dispatched step's client CPU in a cProfile), one ``json.dumps`` of the rows
# is a C call. Through ``unnest(ARRAY(...))`` for the planner's row guess (see
# ``_pg_settle``).
_BATCH = f"""
    WITH locked AS (
        SELECT count(*) AS n FROM (
            SELECT 1 FROM durably_runs WHERE id = ANY($11::text[]) ORDER BY id
            FOR NO KEY UPDATE
        ) AS runs
    ), v AS (
        SELECT e->>0 AS run_id, (e->>1)::integer AS seq, e->>2 AS name, e->>3 AS kind,
            e->>4 AS status, e->>5 AS input, e->>6 AS output, e->>7 AS error,
            (e->>8)::integer AS attempts, (e->>9)::bigint AS wake_at,
            (e->>10)::bigint AS started_at, (e->>11)::bigint AS finished_at,
            e->>12 AS parallel_group, (e->>13)::bigint AS dispatched_at,
            (e->>14)::integer AS redispatches, e->>15 AS queue,
            (e->>16)::bigint AS last_heartbeat_at, e->>17 AS progress, e->>18 AS owner
        FROM unnest(ARRAY(SELECT json_array_elements($1::json))) AS e
    ), held AS (
        SELECT v.* FROM v JOIN durably_runs r ON r.id = v.run_id AND r.locked_by = v.owner
        WHERE (SELECT n FROM locked) >= 0
        FOR SHARE OF r
    ), saved AS (
        INSERT INTO durably_checkpoints ({CP_COLUMNS})
        SELECT {CP_COLUMNS} FROM held
        {CP_UPSERT_TAIL}
    ), s AS (
        SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                             $7::bigint[], $8::bigint[], $9::boolean[])
            AS s(id, owner, status, output, error, wake_at, now, terminal)
    ), settled AS (
        UPDATE durably_runs r SET status = s.status, output = s.output, error = s.error,
            wake_at = s.wake_at, locked_by = NULL, locked_until = NULL, updated_at = s.now
        FROM s
        WHERE r.id = s.id AND {only_checked("r.status = 'running'")} AND r.locked_by = s.owner
            AND (s.terminal OR r.wake_requested_at IS NULL) AND (SELECT n FROM locked) >= 0
        RETURNING r.id, s.terminal, r.watched
    ), cleared AS (
        DELETE FROM durably_signal_waiters
        WHERE run_id IN (SELECT id FROM settled WHERE terminal)
    ), cleared_events AS (
        DELETE FROM durably_event_waiters
        WHERE run_id IN (SELECT id FROM settled WHERE terminal)
    )
    SELECT run_id AS id, seq, NULL::boolean AS notified FROM held
    UNION ALL
    SELECT id, NULL,
        CASE WHEN watched
            THEN pg_notify($10, '{StoreNotice.SETTLED}:' || {notice_argument("id")}) END IS NULL
    FROM settled
"""

_BATCH_SENDING = (
    _BATCH.replace(
        """
    SELECT run_id AS id, seq, NULL::boolean AS notified FROM held""",
        """
    , pushed AS (
        INSERT INTO durably_messages (topic, body, priority, available_at, created_at,
                                      claimed_by, claimed_until, deliveries)
        SELECT m.e->>2, m.e->>3, (m.e->>4)::integer, 0, $13::bigint, m.e->>5,
            (m.e->>6)::bigint, CASE WHEN m.e->>5 IS NULL THEN 0 ELSE 1 END
        FROM json_array_elements($12::json) WITH ORDINALITY AS m(e, n)
        JOIN held h ON h.run_id = m.e->>0 AND h.seq = (m.e->>1)::integer
        ORDER BY m.n
        RETURNING id, topic, claimed_by
    )
    SELECT run_id AS id, seq, NULL::boolean AS notified, NULL::bigint AS message FROM held""",
    ).replace(
        """IS NULL
    FROM settled""",
        """IS NULL, NULL
    FROM settled""",
    )
    + f"""
    UNION ALL
    SELECT NULL, NULL,
        pg_notify($10, '{StoreNotice.MESSAGE}:' || {notice_argument("t.topic")}) IS NULL, NULL
    FROM (SELECT DISTINCT topic FROM pushed WHERE claimed_by IS NULL) AS t
    UNION ALL
    SELECT NULL, NULL, NULL, id FROM pushed WHERE claimed_by IS NOT NULL
"""
)
"""_BATCH that also pushes the tasks of the dispatched steps it writes (the
``db`` transport's messages, OutboxStore): a task goes in only with its
checkpoint (joined on ``held``, so a lost lease sends nothing), in the order
given, and its topic is notified at commit as a push would. A task born
claimed (``claimed_by``) notifies nobody; its id comes back in ``message``
(ids follow the insert's order, ``m.n``)."""


# The latency path: a lone run's last result and its terminal settle. Plain
# parameters instead of one array per column, and the settle's own lease check
# fences the checkpoint (a terminal settle succeeds exactly when the lease is
# held), so there is nothing to lock first. Same effect as _BATCH for this case.
# The waiters are deleted by the run's id, gated on the settle (an index probe;
# a semi-join on ``settled`` measured ~0.03 ms slower per statement).
_FINAL_SETTLE = f"""
    WITH settled AS (
        UPDATE durably_runs SET status = $20::text, output = $21::text, error = $22::text,
            wake_at = $23::bigint, locked_by = NULL, locked_until = NULL,
            updated_at = $24::bigint
        WHERE id = $1::text AND {RUNNING} AND locked_by = $19::text
        RETURNING id, watched
    ), saved AS (
        INSERT INTO durably_checkpoints ({CP_COLUMNS})
        SELECT {CP_PARAMS}
        FROM settled
        {CP_UPSERT_TAIL}
    )"""
_FINAL_ANSWER = f"""
    SELECT CASE WHEN watched
        THEN pg_notify($25, '{StoreNotice.SETTLED}:' || {notice_argument("id")}) END IS NULL
    FROM settled
"""
_FINAL = f"""{_FINAL_SETTLE}, cleared AS (
        DELETE FROM durably_signal_waiters
        WHERE run_id = $1::text AND EXISTS (SELECT 1 FROM settled)
    ), cleared_events AS (
        DELETE FROM durably_event_waiters
        WHERE run_id = $1::text AND EXISTS (SELECT 1 FROM settled)
    ){_FINAL_ANSWER}"""
# The same for a run whose settling turn knows it holds no waiters (a first turn
# that waited on nothing: ``RunChanges.waiters``). Not naming the waiter tables
# spares the statement opening and locking them and their indexes: ~0.03 ms of
# its ~0.4 ms round trip (bench/RESULTS.md, 2026-12-02).
_FINAL_NO_WAITERS = f"{_FINAL_SETTLE}{_FINAL_ANSWER}"

_STILL_HELD = f"""
    SELECT r.id FROM durably_runs r
    JOIN unnest($1::text[], $2::text[]) AS v(id, owner) ON r.id = v.id
    WHERE {only_checked("r.status = 'running'")} AND r.locked_by = v.owner
"""

Acquire = Callable[[], AbstractAsyncContextManager[Any]]

# Loop turns a batch of nothing but step results waits for its turn's next
# write; each is a bare ``sleep(0)``, so an idle loop loses microseconds.
# ``completed`` results are queued while the turn moves on, and so is the
# ``running`` record of a step started under a fresh lease, which its result
# then supersedes within the batch. Not ``failed``: a turn awaits those
# before it can queue anything else.
_LINGER = 6
_RESULTS = frozenset({"completed", "running"})

Born = asyncio.Future[list[int] | None]
"""Answers a writer whose messages are born claimed: their ids once written,
``None`` if its lease was lost (nothing written), or the write's error."""

_Outbox = dict[tuple[str, int], list[tuple[OutMessage, Born | None]]]
"""Messages to push, by the (run id, seq) of the checkpoint they go out with;
a born claimed one with its writer's :data:`Born`."""


class PgWriteBatcher:
    """Queues fenced checkpoint upserts and settles; commits them in batches."""

    def __init__(self, acquire: Acquire, channel: str) -> None:
        self._acquire = acquire
        self._channel = channel
        self._checkpoints: dict[
            tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]
        ] = {}
        self._settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]] = []
        # Messages to push with the checkpoint of their position (OutboxStore).
        self._outbox: _Outbox = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        # The batch task waits a few loop turns for more than step results
        # (``_LINGER``): meanwhile a turn's settle may write the batch itself.
        self._lingering = False
        # A batch a settling turn writes in its own task (see ``settle``); the
        # batch task writes nothing until it is done (one batch at a time).
        self._inline: asyncio.Future[None] | None = None

    def save_checkpoint(
        self,
        params: tuple[Any, ...],
        owner: str,
        messages: list[OutMessage] | None = None,
        born: Born | None = None,
    ) -> asyncio.Future[bool]:
        """Queue a fenced upsert (``params`` as the store's checkpoint tuple);
        ``messages`` go into the queue in its transaction if it is written,
        and ``born`` hears the ids of those born claimed, once it is (before
        the answer)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue(params, owner, messages, born, future)
        return future

    def save_checkpoint_claiming(
        self, params: tuple[Any, ...], owner: str, messages: list[OutMessage], born: Born
    ) -> None:
        """:meth:`save_checkpoint` whose only answer is ``born`` (see :data:`Born`):
        one future per write where a writer chained two more on a bool answer
        (each a loop hop before the turn that waits on it resumed)."""
        self._queue(params, owner, messages, born, None)

    def _queue(
        self,
        params: tuple[Any, ...],
        owner: str,
        messages: list[OutMessage] | None,
        born: Born | None,
        future: asyncio.Future[bool] | None,
    ) -> None:
        key = (params[0], params[1])
        if messages:
            # Kept if a later write of the position supersedes this one: the
            # caller heard nothing yet, so both are one write to it.
            self._outbox.setdefault(key, []).extend(
                (m, born if m.claimed_by is not None else None) for m in messages
            )
        # A later write of the same position within one batch supersedes the
        # earlier one (a multi-row upsert may touch each row once).
        waiting = self._checkpoints.pop(key, None)
        futures = waiting[1] if waiting else []
        if future is not None:
            futures.append(future)
        self._checkpoints[key] = ((*params, owner), futures)
        self._kick()

    def settle(self, params: tuple[Any, ...]) -> Awaitable[SettleResult]:
        """Queue a settle: ``(id, owner, status, output, error, wake_at, now, terminal,
        waiters)`` (see :func:`settle_params`).

        When the batch task is only lingering over this run's own step results
        (the usual end of a turn), the settling turn writes the batch in its
        own task instead: the statement goes out in this loop turn, not the
        task's next, and the answer wakes the turn directly, not the task
        which then wakes the turn."""
        future: asyncio.Future[SettleResult] = asyncio.get_running_loop().create_future()
        self._settles.append((params, future))
        self._kick()
        if self._may_write_here(params[0]):
            return self._settle_here(future)
        return future

    def _may_write_here(self, run_id: str) -> bool:
        """Whether a settle of ``run_id`` may write the queued batch in its own
        task: the batch task is lingering (no batch in flight), nobody else
        does so now, and every queued write is that run's (a caller cancelled
        mid-statement fails only its own run's writes)."""
        return (
            self._lingering
            and self._inline is None
            and len(self._settles) == 1
            and not self._outbox
            and all(key[0] == run_id for key in self._checkpoints)
        )

    async def _settle_here(self, future: asyncio.Future[SettleResult]) -> SettleResult:
        settles = self._settles
        if not (settles and settles[0][1] is future and self._may_write_here(settles[0][0][0])):
            return await future  # the batch task took it meanwhile
        checkpoints, self._checkpoints = self._checkpoints, {}
        self._settles = []
        inline = self._inline = asyncio.get_running_loop().create_future()
        try:
            await self._write_batch(checkpoints, settles, {})
        except BaseException:
            # Cancelled mid-statement: only this run's writes were in it, and
            # none of them is known to be written.
            for _, futures in checkpoints.values():
                for waiting in futures:
                    waiting.cancel()
            future.cancel()
            raise
        finally:
            self._inline = None
            if not inline.done():
                inline.set_result(None)
            if not self._checkpoints and not self._settles and not self._lingering:
                self._idle.set()
        return await future

    async def close(self) -> None:
        """Commit what is queued, then stop."""
        task, self._task = self._task, None
        if task is None:
            return
        await self._idle.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def _kick(self) -> None:
        self._idle.clear()
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._lingering = True
            try:
                for _ in range(_LINGER):
                    if not self._only_results():
                        break
                    await asyncio.sleep(0)
            finally:
                self._lingering = False
            while self._inline is not None:
                await self._inline  # a settling turn writes its run's batch
            self._wakeup.clear()
            checkpoints, self._checkpoints = self._checkpoints, {}
            settles, self._settles = self._settles, []
            outbox, self._outbox = self._outbox, {}
            if not checkpoints and not settles:
                self._idle.set()
                continue
            await self._write_batch(checkpoints, settles, outbox)
            if not self._checkpoints and not self._settles:
                self._idle.set()

    async def _write_batch(
        self,
        checkpoints: dict[tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]],
        settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]],
        outbox: _Outbox,
    ) -> None:
        """Write one batch and answer its callers, one by one if a row undid it."""
        error = await self._commit(checkpoints, settles, outbox)
        if error is not None:
            if len(checkpoints) + len(settles) > 1 and is_row_error(error):
                # One row the database refused undid the whole batch: write
                # each again alone so only that row's owner hears of it.
                _log.warning(
                    "a batch of %d writes failed (%s); writing them one by one",
                    len(checkpoints) + len(settles),
                    error,
                )
                await self._one_by_one(checkpoints, settles, outbox)
            else:
                _log.warning(
                    "a batch of %d writes failed: %s", len(checkpoints) + len(settles), error
                )
                _fail_all(checkpoints, settles, error, outbox)

    async def _commit(
        self,
        checkpoints: dict[tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]],
        settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]],
        outbox: _Outbox,
    ) -> Exception | None:
        """Write one batch and answer its callers; the error that undid it, if any."""
        delivered = False
        try:
            async with self._acquire() as conn:
                held, settled, born = await self._write(conn, checkpoints, settles, outbox)
                # Committed: answer now, not after the connection's release.
                # Settles first: a settle's turn hands its run's outcome to the
                # caller waiting on it, so it goes first in the loop's queue
                # (ahead of the callbacks collecting the checkpoint writes).
                for (_, settle_future), result in zip(settles, settled, strict=True):
                    _resolve(settle_future, result)
                for key, entries in outbox.items():
                    for _, writer in entries:
                        if writer is not None:
                            _resolve(writer, born.get(writer, []) if key in held else None)
                for key, (_, futures) in checkpoints.items():
                    for future in futures:
                        _resolve(future, key in held)
                delivered = True
        except Exception as exc:
            if not delivered:
                return exc
            _log.warning("releasing a connection after a batch failed: %s", exc)
        return None

    async def _one_by_one(
        self,
        checkpoints: dict[tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]],
        settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]],
        outbox: _Outbox,
    ) -> None:
        """Write each checkpoint, then each settle, in a transaction of its own.

        A run whose checkpoint failed does not settle: its turn hears of the
        failure and the run keeps the state its history supports.
        """
        broken: dict[str, Exception] = {}
        for key, entry in checkpoints.items():
            sending = {key: outbox[key]} if key in outbox else {}
            error = await self._commit({key: entry}, [], sending)
            if error is not None:
                _fail_all({key: entry}, [], error, sending)
                broken.setdefault(key[0], error)
        for settle in settles:
            run_error = broken.get(settle[0][0])
            if run_error is not None:
                _fail(settle[1], run_error)
                continue
            error = await self._commit({}, [settle], {})
            if error is not None:
                _fail(settle[1], error)

    def _only_results(self) -> bool:
        """Only step results are queued: no settle, no checkpoint a turn
        must see committed before it can queue its next write."""
        if self._settles or not self._checkpoints:
            return False
        # A checkpoint sending its step's task is usually the last write of
        # its turn (which parks on it): its settle commits with it.
        return all(
            row[4] in _RESULTS or key in self._outbox for key, (row, _) in self._checkpoints.items()
        )

    async def _write(
        self,
        conn: Any,
        checkpoints: dict[tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]],
        settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]],
        outbox: _Outbox,
    ) -> tuple[set[tuple[str, int]], list[SettleResult], dict[Born, list[int]]]:
        cp_rows = [row for row, _ in checkpoints.values()]
        if len(cp_rows) == 1 and len(settles) == 1 and not outbox:
            row, settle = cp_rows[0], settles[0][0]
            # (run_id, owner) of the checkpoint and the settle; a terminal settle
            if (row[0], row[18]) == (settle[0], settle[1]) and settle[7]:
                final = _FINAL if settle[8] else _FINAL_NO_WAITERS
                done = await conn.fetchval(final, *row, *settle[2:7], self._channel)
                if done is None:
                    return set(), [SettleResult.LOST], {}
                return {(row[0], row[1])}, [SettleResult.SETTLED], {}
        # A run settles once per turn, and a turn awaits its settle; should one
        # appear twice anyway, only its first settle goes in the statement.
        first: dict[str, tuple[Any, ...]] = {}
        for params, _ in settles:
            first.setdefault(params[0], params)
        settle_rows = [params[:8] for params in first.values()]
        runs = list({row[0] for row in cp_rows} | first.keys())
        args: list[Any] = [_cp_json(cp_rows), *_columns(settle_rows, 8), self._channel, runs]
        sent = [(key, m, writer) for key, entries in outbox.items() for m, writer in entries]
        if outbox:
            # One JSON parameter, not seven arrays: asyncpg checks each array
            # element against abstract base classes as it encodes it, which
            # costs more client CPU than one json.dumps of the rows.
            tasks = [
                (key[0], key[1], m.topic, m.body, int(m.priority), m.claimed_by, m.claimed_until)
                for key, m, _ in sent
            ]
            args += [
                json.dumps(tasks, ensure_ascii=False, separators=(",", ":")),
                int(time.time() * 1000),
            ]
        rows = await conn.fetch(_BATCH_SENDING if outbox else _BATCH, *args)
        held = {(row["id"], row["seq"]) for row in rows if row["seq"] is not None}
        born: dict[Born, list[int]] = {}
        if any(writer is not None for _, _, writer in sent):
            # In insert order (m.n): the born rows of the held checkpoints, in order.
            ids = iter(sorted(row["message"] for row in rows if row["message"] is not None))
            for key, _, writer in sent:
                if writer is not None and key in held:
                    born.setdefault(writer, []).append(next(ids))
        done = {row["id"] for row in rows if row["seq"] is None and row["id"] is not None}
        missed = [p for p in settle_rows if p[0] not in done]
        still_held: set[str] = set()
        if missed:
            found = await conn.fetch(_STILL_HELD, [p[0] for p in missed], [p[1] for p in missed])
            still_held = {row["id"] for row in found}
        results: list[SettleResult] = []
        for params, _ in settles:
            run_id = params[0]
            if run_id in done and first[run_id] is params:
                results.append(SettleResult.SETTLED)
            elif run_id in still_held and not params[7]:
                results.append(SettleResult.WAKE_REQUESTED)
            else:
                results.append(SettleResult.LOST)
        return held, results, born


def _cp_json(rows: list[tuple[Any, ...]]) -> str:
    """The ``$1`` of :data:`_BATCH`: the checkpoint rows (the store's
    checkpoint tuple and the owner) as one JSON array of arrays."""
    return json.dumps(rows, ensure_ascii=False, separators=(",", ":"))


def _columns(rows: list[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows to the per-column arrays ``unnest`` takes."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(column) for column in zip(*rows, strict=True)]


def settle_params(
    run_id: str,
    owner: str,
    status: RunStatus,
    output: str | None,
    error: str | None,
    wake_at: int | None,
    now: int,
    *,
    waiters: bool = True,
) -> tuple[Any, ...]:
    """The tuple :meth:`PgWriteBatcher.settle` takes; ``waiters=False``: the run
    holds no signal or event waiters (``RunChanges.waiters``)."""
    terminal = status in TERMINAL_STATUSES
    return (run_id, owner, status.value, output, error, wake_at, now, terminal, waiters)


def _fail_all(
    checkpoints: dict[tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]],
    settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]],
    exc: BaseException,
    outbox: _Outbox | None = None,
) -> None:
    for _, futures in checkpoints.values():
        for future in futures:
            _fail(future, exc)
    for entries in (outbox or {}).values():
        for _, writer in entries:
            if writer is not None:
                _fail(writer, exc)
    for _, settle_future in settles:
        _fail(settle_future, exc)


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
