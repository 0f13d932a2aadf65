"""Bounds on the ids, tokens, names and tags a caller hands the engine.

Every store keeps them as text keys, and PostgreSQL carries run ids in NOTIFY
payloads (at most 8,000 bytes) and in btree index entries (about 2.7 KB): a
longer id fails there, or, in a batch, fails the writes of every other run in
it. A name with a NUL character cannot be stored by PostgreSQL at all, and one
that is not valid Unicode (a lone surrogate) by no SQL driver. So each is
checked where it enters the API, with an error naming the field, and all
three stores behave alike.
"""

from __future__ import annotations

from ._codec import check_text
from .errors import UnstorableValue

__all__ = ["MAX_NAME_LENGTH", "check_name", "check_names", "check_priority", "check_token"]

MAX_NAME_LENGTH = 255
"""The most characters a run id, signal token, event name, workflow or step
name, schedule name, namespace, queue or tag may have."""


def check_name(value: str, field: str) -> None:
    """Raise :class:`~durably.errors.UnstorableValue` naming ``field`` unless
    ``value`` is a string every store can keep as a key (callers check for
    emptiness themselves, with their own message)."""
    if not isinstance(value, str):
        raise UnstorableValue(field, f"must be a string, not {type(value).__name__}")
    if len(value) > MAX_NAME_LENGTH:
        raise UnstorableValue(
            field, f"is {len(value)} characters long; the most allowed is {MAX_NAME_LENGTH}"
        )
    if "\x00" in value:
        raise UnstorableValue(field, "contains a NUL character, which no store can keep")
    if not value.isascii():
        try:
            check_text(value, field)
        except UnstorableValue as exc:
            raise UnstorableValue(field, exc.problem) from None


def check_token(token: str) -> None:
    """Refuse a signal token that no wait could have: empty, or one no store can key on."""
    if not isinstance(token, str) or not token:
        raise ValueError("a signal token must be a non-empty string")
    check_name(token, "signal token")


PRIORITY_RANGE = range(-(2**31), 2**31)
"""Priorities are 32-bit signed integers (PostgreSQL's ``INTEGER``)."""


def check_priority(value: int | None, field: str = "priority") -> None:
    """Raise :class:`~durably.errors.UnstorableValue` unless ``value`` (an
    int, or ``None``) fits the stores' 32-bit priority column."""
    if value is not None and value not in PRIORITY_RANGE:
        raise UnstorableValue(
            field,
            f"{value} is out of range; priorities are 32-bit "
            f"({PRIORITY_RANGE.start} to {PRIORITY_RANGE.stop - 1})",
        )


def check_names(values: list[str], field: str) -> None:
    """:func:`check_name` for each of ``values`` (tags, say)."""
    for value in values:
        check_name(value, field)
