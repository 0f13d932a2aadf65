"""State stores, chosen by URL: ``memory://``, ``sqlite:///path.db`` (the default),
``postgresql://…`` once its driver is installed."""

from __future__ import annotations

from .._urls import redact_url
from .base import (
    CheckpointStore,
    ChildEnd,
    EventDelivery,
    FlowStore,
    QueueState,
    RunChanges,
    RunPage,
    RunQuery,
    RunStatusStore,
    RunStore,
    ScheduleRecord,
    ScheduleStore,
    SettleResult,
    SignalWait,
    StateStore,
    StoreConnection,
    StoreInspector,
    SweepStore,
    TurnStore,
    WaitStore,
)
from .memory import MemoryStore
from .sqlite import SqliteStore

__all__ = [
    "CheckpointStore",
    "ChildEnd",
    "EventDelivery",
    "FlowStore",
    "MemoryStore",
    "QueueState",
    "RunChanges",
    "RunPage",
    "RunQuery",
    "RunStatusStore",
    "RunStore",
    "ScheduleRecord",
    "ScheduleStore",
    "SettleResult",
    "SignalWait",
    "SqliteStore",
    "StateStore",
    "StoreConnection",
    "StoreInspector",
    "SweepStore",
    "TurnStore",
    "WaitStore",
    "open_store",
]


def open_store(target: str | StateStore) -> StateStore:
    """A store for ``target``: a store object, a URL, or a path to a SQLite file."""
    if not isinstance(target, str):
        return target
    if target.startswith("memory:"):
        return MemoryStore(target)
    if target.startswith(("postgresql:", "postgres:")):
        try:
            from .postgres import PostgresStore  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise ValueError(
                "the PostgreSQL store needs asyncpg: pip install 'durably[postgres]'"
            ) from exc
        store: StateStore = PostgresStore(target)
        return store
    if target.startswith("sqlite:") or "://" not in target:
        return SqliteStore(target)
    raise ValueError(
        f"unknown store URL {redact_url(target)!r}; use memory://, sqlite:///path.db or postgresql://…"
    )
