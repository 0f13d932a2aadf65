"""Parse the durations the API accepts: seconds, ``timedelta`` or ``"30s"``-style strings."""

from __future__ import annotations

import re
from datetime import timedelta

__all__ = ["Duration", "to_ms"]

Duration = float | int | timedelta | str
"""A length of time: seconds as a number, a ``timedelta``, or a string such as
``"250ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"7d"``, ``"1w"`` or ``"1h30m"``."""

_UNITS_MS = {
    "ms": 1,
    "s": 1000,
    "sec": 1000,
    "m": 60_000,
    "min": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
    "w": 604_800_000,
}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|sec|min|s|m|h|d|w)")


MAX_DURATION_MS = 10_000 * 365 * 86_400_000
"""The longest duration accepted (10,000 years): added to a timestamp it still
fits the stores' 64-bit millisecond columns."""


def to_ms(value: Duration, *, name: str = "duration") -> int:
    """Return ``value`` in whole milliseconds; raise ``ValueError`` for bad input."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds, a timedelta or a string like '30s'")
    if isinstance(value, timedelta):
        ms = value.total_seconds() * 1000
    elif isinstance(value, int | float):
        ms = float(value) * 1000
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        pos, total = 0, 0.0
        for match in _PART.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNITS_MS[match.group(2)]
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(f"invalid {name} {value!r}; use e.g. '500ms', '30s', '5m', '2h', '7d'")
        ms = total
    else:
        raise ValueError(f"{name} must be a number of seconds, a timedelta or a string like '30s'")
    if ms != ms or ms < 0:  # NaN or negative
        raise ValueError(f"{name} must not be negative, got {value!r}")
    if ms > MAX_DURATION_MS:  # infinity, or past what a 64-bit timestamp column holds
        raise ValueError(f"{name} is too long, got {value!r}; at most 10,000 years")
    return round(ms)
