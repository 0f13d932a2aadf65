"""The kinds of notice a store's channel carries, as ``<kind>:<argument>``.

PostgreSQL sends them with ``NOTIFY`` (so every process on the database hears
them); SQLite's message queue tells the listeners of this process only. The
values are on the wire between processes of different versions: never rename one.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["StoreNotice"]


class StoreNotice(StrEnum):
    """What a notice on a store's channel announces; its argument follows the colon."""

    PENDING = "pending"
    """A new pending run (argument: its id), or ``""``: new runs exist."""
    SETTLED = "settled"
    """A turn's outcome was written (argument: the run id)."""
    WAKE = "wake"
    """A run was asked to take a turn (argument: the run id)."""
    ENDED = "ended"
    """A run was ended from outside its turn, e.g. cancelled (argument: the run id)."""
    MESSAGE = "message"
    """Messages were pushed to a queue topic (argument: the topic)."""
    CANCEL = "cancel"
    """The ``db`` transport's cancel notice for step handlers (argument: the run id)."""
    EVENT = "event"
    """A lifecycle event another engine published (argument: the event as compact JSON)."""
