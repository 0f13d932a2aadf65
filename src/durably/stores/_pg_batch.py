"""Group commit for PostgreSQL: the writes of many concurrent turns, one transaction.

Every step writes a checkpoint and every turn ends with a settle. Issued one
by one from hundreds of concurrent runs, each costs a round trip and a
commit on a pooled connection. Here they queue up while the previous batch
commits; each batch then costs one transaction with one multi-row statement
per kind (checkpoints before settles, since a settle releases the lease the
checkpoints are fenced by). A lone write still goes out at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from ..model import TERMINAL_STATUSES, RunStatus
from .base import SettleResult

__all__ = ["PgWriteBatcher"]

_log = logging.getLogger("durably.stores.postgres")

_CHECKPOINTS = """
    WITH v AS (
        SELECT * FROM unnest(
            $1::text[], $2::integer[], $3::text[], $4::text[], $5::text[], $6::text[],
            $7::text[], $8::text[], $9::integer[], $10::bigint[], $11::bigint[],
            $12::bigint[], $13::text[], $14::text[]
        ) AS v(run_id, seq, name, kind, status, input, output, error, attempts, wake_at,
               started_at, finished_at, parallel_group, owner)
    ), held AS (
        SELECT v.* FROM v JOIN durably_runs r ON r.id = v.run_id AND r.locked_by = v.owner
        FOR SHARE OF r
    ), saved AS (
        INSERT INTO durably_checkpoints (run_id, seq, name, kind, status, input, output, error,
            attempts, wake_at, started_at, finished_at, parallel_group)
        SELECT run_id, seq, name, kind, status, input, output, error, attempts, wake_at,
            started_at, finished_at, parallel_group FROM held
        ON CONFLICT (run_id, seq) DO UPDATE SET
            name = excluded.name, kind = excluded.kind, status = excluded.status,
            input = excluded.input, output = excluded.output, error = excluded.error,
            attempts = excluded.attempts, wake_at = excluded.wake_at,
            started_at = excluded.started_at, finished_at = excluded.finished_at,
            parallel_group = excluded.parallel_group
        WHERE durably_checkpoints.status <> 'completed'
    )
    SELECT run_id, seq FROM held
"""

_SETTLES = """
    UPDATE durably_runs r SET status = v.status, output = v.output, error = v.error,
        wake_at = v.wake_at, locked_by = NULL, locked_until = NULL, updated_at = v.now
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[],
                $7::bigint[], $8::boolean[])
        AS v(id, owner, status, output, error, wake_at, now, terminal)
    WHERE r.id = v.id AND r.status = 'running' AND r.locked_by = v.owner
        AND (v.terminal OR r.wake_requested_at IS NULL)
    RETURNING r.id
"""

_STILL_HELD = """
    SELECT r.id FROM durably_runs r
    JOIN unnest($1::text[], $2::text[]) AS v(id, owner) ON r.id = v.id
    WHERE r.status = 'running' AND r.locked_by = v.owner
"""

Acquire = Callable[[], AbstractAsyncContextManager[Any]]


class PgWriteBatcher:
    """Queues fenced checkpoint upserts and settles; commits them in batches."""

    def __init__(self, acquire: Acquire) -> None:
        self._acquire = acquire
        self._checkpoints: dict[
            tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]
        ] = {}
        self._settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def save_checkpoint(self, params: tuple[Any, ...], owner: str) -> asyncio.Future[bool]:
        """Queue a fenced upsert (``params`` as the store's checkpoint tuple)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        key = (params[0], params[1])
        # A later write of the same position within one batch supersedes the
        # earlier one (a multi-row upsert may touch each row once).
        waiting = self._checkpoints.pop(key, None)
        futures = [*waiting[1], future] if waiting else [future]
        self._checkpoints[key] = ((*params, owner), futures)
        self._kick()
        return future

    def settle(self, params: tuple[Any, ...]) -> asyncio.Future[SettleResult]:
        """Queue a settle: ``(id, owner, status, output, error, wake_at, now, terminal)``."""
        future: asyncio.Future[SettleResult] = asyncio.get_running_loop().create_future()
        self._settles.append((params, future))
        self._kick()
        return future

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
            self._wakeup.clear()
            checkpoints, self._checkpoints = self._checkpoints, {}
            settles, self._settles = self._settles, []
            if not checkpoints and not settles:
                self._idle.set()
                continue
            try:
                async with self._acquire() as conn, conn.transaction():
                    held = await self._write_checkpoints(conn, checkpoints)
                    settled = await self._write_settles(conn, settles)
            except Exception as exc:
                _log.warning(
                    "a batch of %d writes failed: %s", len(checkpoints) + len(settles), exc
                )
                for _, futures in checkpoints.values():
                    for future in futures:
                        _fail(future, exc)
                for _, settle_future in settles:
                    _fail(settle_future, exc)
                continue
            for key, (_, futures) in checkpoints.items():
                for future in futures:
                    _resolve(future, key in held)
            for (_, settle_future), result in zip(settles, settled, strict=True):
                _resolve(settle_future, result)
            if not self._checkpoints and not self._settles:
                self._idle.set()

    async def _write_checkpoints(
        self,
        conn: Any,
        checkpoints: dict[tuple[str, int], tuple[tuple[Any, ...], list[asyncio.Future[bool]]]],
    ) -> set[tuple[str, int]]:
        if not checkpoints:
            return set()
        columns = list(zip(*(row for row, _ in checkpoints.values()), strict=True))
        rows = await conn.fetch(_CHECKPOINTS, *[list(column) for column in columns])
        return {(row["run_id"], row["seq"]) for row in rows}

    async def _write_settles(
        self, conn: Any, settles: list[tuple[tuple[Any, ...], asyncio.Future[SettleResult]]]
    ) -> list[SettleResult]:
        if not settles:
            return []
        results: list[SettleResult] = []
        # One run never settles twice in one batch (a turn awaits its settle),
        # but keep the statement safe if it does: later entries go one by one.
        seen: set[str] = set()
        first = [p for p, _ in settles if not (p[0] in seen or seen.add(p[0]))]  # type: ignore[func-returns-value]
        columns = list(zip(*first, strict=True))
        rows = await conn.fetch(_SETTLES, *[list(column) for column in columns])
        done = {row["id"] for row in rows}
        missed = [p for p in first if p[0] not in done]
        held: set[str] = set()
        if missed:
            found = await conn.fetch(_STILL_HELD, [p[0] for p in missed], [p[1] for p in missed])
            held = {row["id"] for row in found}
        finished = [p[0] for p in first if p[0] in done and p[7]]
        if finished:
            await conn.execute(
                "DELETE FROM durably_signal_waiters WHERE run_id = ANY($1::text[])", finished
            )
        for params, _ in settles:
            run_id = params[0]
            if run_id in done:
                results.append(SettleResult.SETTLED)
            elif run_id in held and not params[7]:
                results.append(SettleResult.WAKE_REQUESTED)
            else:
                results.append(SettleResult.LOST)
        return results


def settle_params(
    run_id: str,
    owner: str,
    status: RunStatus,
    output: str | None,
    error: str | None,
    wake_at: int | None,
    now: int,
) -> tuple[Any, ...]:
    """The tuple :meth:`PgWriteBatcher.settle` takes."""
    return (run_id, owner, status.value, output, error, wake_at, now, status in TERMINAL_STATUSES)


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
