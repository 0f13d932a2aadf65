"""Singletons: at most ``limit`` live runs of a workflow per key, across the fleet.

A run of a singleton workflow asks for a slot before each turn's body runs, in
a flow-control queue of its own key (``singleton:<workflow>:<key>``), the same
store-held slots that cap dispatched steps: atomic across processes, freed when
the run ends, and the next waiter is woken at once. A run refused a slot stays
``suspended`` without executing anything and asks again. Waiters are admitted
oldest first, by when they first asked (their first turn, which follows the
order they were created in, as ``engine.start`` puts each run in line as it
creates it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._names import MAX_NAME_LENGTH, check_name
from .errors import SchemaValidationError
from .model import TERMINAL_STATUSES, Run, RunStatus
from .stores.base import Admission, FlowStore, RunQuery, RunStore

__all__ = ["SINGLETON_RETRY_MS", "Singleton", "count_live", "join_line", "singleton_tag"]

SINGLETON_RETRY_MS = 30_000
"""How often a queued run asks again if nobody wakes it; a waiter unseen for three
of these (every engine down) loses its place."""

_log = logging.getLogger("durably")

KeyFn = Callable[[Any], Any]


def singleton_tag(workflow: str, key: str) -> str:
    """The tag a singleton run carries, for counting the live runs of a key."""
    return f"singleton:{workflow}:{key}"


@dataclass(frozen=True, slots=True)
class Singleton:
    """A workflow's ``singleton=``, ``limit=`` and ``max_queue=``."""

    key_fn: KeyFn
    limit: int = 1
    max_queue: int | None = None

    @classmethod
    def build(cls, key_fn: KeyFn | None, limit: int, max_queue: int | None) -> Singleton | None:
        """Validate the registration's options; ``None`` without ``singleton=``."""
        if key_fn is None:
            if limit != 1 or max_queue is not None:
                raise ValueError("limit= and max_queue= need singleton= (the key function)")
            return None
        if not callable(key_fn):
            raise TypeError("singleton= must be a function of the run's input returning its key")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError("limit must be an int >= 1")
        if max_queue is not None and (
            isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0
        ):
            raise ValueError("max_queue must be an int >= 0 (or None: unbounded)")
        return cls(key_fn, limit, max_queue)

    def key(self, workflow: str, value: Any) -> str:
        """The key of a run with input ``value`` (``SchemaValidationError`` if unusable)."""
        try:
            key = self.key_fn(value)
        except Exception as exc:
            raise SchemaValidationError(
                f"workflow {workflow!r}: the singleton key function raised {exc!r}"
            ) from exc
        if isinstance(key, int | float) and not isinstance(key, bool):
            key = str(key)
        if not isinstance(key, str) or not key:
            raise SchemaValidationError(
                f"workflow {workflow!r}: the singleton key must be a non-empty string, not {key!r}"
            )
        check_name(key, "singleton key")
        if len(singleton_tag(workflow, key)) > MAX_NAME_LENGTH:
            raise SchemaValidationError(
                f"workflow {workflow!r}: singleton key {key[:40]!r}… is too long"
            )
        return key

    def admission(self, workflow: str, key: str, run_id: str, created_at: int) -> Admission:
        """The request for one of the key's ``limit`` slots, in line by creation."""
        return Admission(
            queue=singleton_tag(workflow, key),
            step_id=f"{run_id}:singleton",
            run_id=run_id,
            concurrency=self.limit,
            rate_limit=None,
            # One fairness key for every run: the oldest waiter goes first.
            fairness_key="",
            retry_ms=SINGLETON_RETRY_MS,
            enqueued_at=created_at,
        )


_LIVE = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED)


async def count_live(store: RunStore, workflow: str, tag: str, bound: int) -> int:
    """How many runs tagged ``tag`` have not ended, counted up to ``bound``.

    Not atomic with the insert that follows: starts racing from several
    processes may each see room for one more, so ``max_queue`` can be
    exceeded by the number of concurrent starters; ``limit`` never is.
    """
    page = await store.list_runs(RunQuery(statuses=_LIVE, workflow=workflow, tag=tag, limit=bound))
    return len(page.runs)


async def join_line(
    store: FlowStore, singleton: Singleton, workflow: str, key: str, run: Run, now: int
) -> None:
    """Put a run ``engine.start`` just created in its key's line (or give it
    the free slot) before the start returns.

    Its first turn asks again (idempotent: a run keeps its slot or its place,
    which is by creation time), but that turn races the turns of runs started
    after it: without this, a later run whose turn asked first took the slot
    ahead of an earlier one. A run that already ended (an idempotent start of
    it) is not put in line: it would hold the head of the line for nothing.
    """
    if run.status in TERMINAL_STATUSES:
        return
    try:
        await store.try_admit(singleton.admission(workflow, key, run.run_id, run.created_at), now)
    except Exception as exc:
        # The run exists and its first turn asks anyway: failing the start
        # here would tell the caller it was not made when it was.
        _log.warning("could not put run %s in line for %s now (%s)", run.run_id, key, exc)
