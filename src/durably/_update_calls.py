"""The caller's side of updates: send one to a run's inbox, wake the run, and
wait for its answer.

The answer is written by the run's turn (atomically with the history entry,
see :mod:`durably._ops.updates`) or, once the run has ended without taking
the update, here: ``ended``, or — when the run continued as new — the update
is handed to the next link (``moved``) and awaited there. A run writes every
answer it gives before its outcome, so an update still unanswered after its
run was *read* as ended never will be.

Waiting costs one poll per run being waited on per interval, for all of this
process's waiters together (the unanswered ids of that run, then one read per
update that left them); an answer given in this process skips the interval.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from . import _codec as codec
from ._aio import wait_event
from ._children import RunNotFound, continued_to
from ._names import check_name as check_key
from ._ops.updates import check_update_name
from .clock import Clock
from .model import TERMINAL_STATUSES, Run, UpdateResult
from .stores.base import UpdateRecord

__all__ = ["UpdateCalls", "check_update_id"]

# Seconds between polls for answers given in other processes, and between
# wakes re-sent to a run that still has not taken an awaited update (a wake
# lost to a crash must not strand the caller).
_POLL = 0.05
_REWAKE = 5.0
_PENDING_LIMIT = 100_000


class _Store(Protocol):
    async def get_run(self, run_id: str) -> Run | None: ...

    async def get_runs(self, run_ids: list[str]) -> list[Run]: ...

    async def put_update(self, record: UpdateRecord) -> UpdateRecord: ...

    async def get_update(self, run_id: str, update_id: str) -> UpdateRecord | None: ...

    async def pending_updates(self, run_id: str, limit: int) -> list[UpdateRecord]: ...

    async def answer_update(
        self, run_id: str, update_id: str, answer: dict[str, Any], now: int
    ) -> bool: ...


def check_update_id(update_id: Any) -> str:
    """``update_id`` (a fresh one for ``None``) if it is usable; ``ValueError`` otherwise."""
    if update_id is None:
        return uuid.uuid4().hex
    if not isinstance(update_id, str) or not update_id:
        raise ValueError("update_id must be a non-empty string")
    check_key(update_id, "update_id")
    return update_id


class UpdateCalls:
    """``engine.update`` and the waiters for update answers."""

    def __init__(self, store: _Store, clock: Clock, wake: Callable[[str], Awaitable[None]]) -> None:
        self._store = store
        self._clock = clock
        self._wake = wake
        self._waiting: dict[str, dict[str, list[asyncio.Future[UpdateRecord]]]] = {}
        self._woken: dict[str, float] = {}
        self._poke = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None

    async def send(
        self, run_id: str, name: str, payload: Any, update_id: str | None
    ) -> tuple[str, str]:
        """Put an update in the inbox of ``run_id`` — or of the last link of
        its continue-as-new chain — once per id, and wake that run; return
        the run and the update id. Checks everything before anything is written."""
        check_update_name(name)
        uid = check_update_id(update_id)
        data = codec.to_jsonable(payload, f"the payload of update {name!r}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id must be a non-empty string")
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        while (follow := continued_to(run)) is not None:
            # Continued as new: the chain's live link takes it (a retry of an
            # update the earlier link answered is found there by the wait).
            if (await self._store.get_update(run_id, uid)) is not None:
                break
            nxt = await self._store.get_run(follow)
            if nxt is None:
                break
            run_id, run = follow, nxt
        record = await self._store.put_update(
            UpdateRecord(run_id, uid, name, data, self._clock.now_ms())
        )
        if record.answer is None and run.status not in TERMINAL_STATUSES:
            await self._wake(run_id)
        return run_id, uid

    async def update(
        self,
        run_id: str,
        name: str,
        payload: Any,
        *,
        update_id: str | None = None,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Send an update and wait for its answer (see ``Engine.update``)."""
        run_id, uid = await self.send(run_id, name, payload, update_id)
        return await self.result(run_id, uid, timeout=timeout)

    async def result(
        self, run_id: str, update_id: str, *, timeout: float | None = None
    ) -> UpdateResult:
        """Wait for the answer to update ``update_id`` sent to ``run_id``
        (following it along a continue-as-new chain)."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    record = await self._answered(run_id, update_id)
                    answer = record.answer or {}
                    if answer.get("outcome") == "moved":
                        run_id = str(answer["run_id"])
                        continue
                    return UpdateResult(
                        update_id,
                        str(answer.get("outcome")),
                        answer.get("result"),
                        answer.get("reason"),
                        answer.get("error"),
                        run_id,
                    )
        except TimeoutError:
            raise TimeoutError(
                f"update {update_id!r} of run {run_id!r} was not answered in time; it stays "
                "in the run's inbox (send it again with the same update_id to wait again)"
            ) from None

    def answered(self, run_id: str, update_id: str) -> None:
        """A turn here answered an update: look now, not at the next interval."""
        if run_id in self._waiting:
            self._poke.set()

    async def close(self) -> None:
        """Stop polling (waiters still waiting time out on their own)."""
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)

    async def _answered(self, run_id: str, update_id: str) -> UpdateRecord:
        future: asyncio.Future[UpdateRecord] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(run_id, {}).setdefault(update_id, [])
        waiters.append(future)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        self._poke.set()
        try:
            return await future
        finally:
            waiters.remove(future)
            if not waiters:
                by_run = self._waiting.get(run_id, {})
                by_run.pop(update_id, None)
                if not by_run:
                    self._waiting.pop(run_id, None)
                    self._woken.pop(run_id, None)

    async def _poll(self) -> None:
        while self._waiting:
            await wait_event(self._poke, _POLL)
            self._poke.clear()
            try:
                await self._round()
            except Exception:
                continue  # the store is failing; the next round tries again

    async def _round(self) -> None:
        run_ids = list(self._waiting)
        runs: dict[str, Run] = {}
        for start in range(0, len(run_ids), 500):
            for found in await self._store.get_runs(run_ids[start : start + 500]):
                runs[found.run_id] = found
        loop = asyncio.get_running_loop()
        for run_id in run_ids:
            # The run is read before its inbox: an update still unanswered
            # after the run was read as ended will never be answered by it.
            run = runs.get(run_id)
            pending = {
                r.update_id for r in await self._store.pending_updates(run_id, _PENDING_LIMIT)
            }
            for update_id, futures in list(self._waiting.get(run_id, {}).items()):
                if update_id in pending:
                    if run is None or run.status in TERMINAL_STATUSES:
                        await self._after_end(run_id, run, update_id)
                    else:
                        continue
                record = await self._store.get_update(run_id, update_id)
                if record is None:
                    # Said apart: an update missing from a run that exists
                    # was lost on its way (a move that answered without
                    # copying it read as a deleted run and hid the bug).
                    reason = (
                        f"run {run_id!r} no longer exists"
                        if run is None
                        else f"update {update_id!r} is not in the inbox of run {run_id!r}"
                    )
                    record = UpdateRecord(
                        run_id, update_id, "", None, 0, {"outcome": "ended", "reason": reason}
                    )
                if record.answer is None:
                    continue
                for future in futures:
                    if not future.done():
                        future.set_result(record)
            awaited = self._waiting.get(run_id, {})
            if (
                run is not None
                and run.status not in TERMINAL_STATUSES
                and any(uid in pending for uid in awaited)
            ):
                now = loop.time()
                if now - self._woken.setdefault(run_id, now) >= _REWAKE:
                    self._woken[run_id] = now
                    await self._wake(run_id)

    async def _after_end(self, run_id: str, run: Run | None, update_id: str) -> None:
        """The run ended without taking the update: hand it on, or answer ``ended``."""
        now = self._clock.now_ms()
        follow = None if run is None else continued_to(run)
        if follow is not None:
            record = await self._store.get_update(run_id, update_id)
            if record is None or record.answer is not None:
                return
            await self._store.put_update(
                UpdateRecord(follow, update_id, record.name, record.payload, now)
            )
            if await self._store.answer_update(
                run_id, update_id, {"outcome": "moved", "run_id": follow}, now
            ):
                await self._wake(follow)
            return
        status = "deleted" if run is None else str(run.status)
        await self._store.answer_update(
            run_id,
            update_id,
            {"outcome": "ended", "reason": f"run {run_id!r} ended ({status}) before handling it"},
            now,
        )
